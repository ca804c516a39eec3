"""A new user's first starts of kvtierd (issue 39), each a real daemon process: what used to
mislead now says what is wrong and what to do, in one line (exit 2) or a warning at start.

* TLS without client authentication on a network listener is refused (a client holding only
  the CA certificate read the owner's blocks); with a tenants file it starts, and that client
  gets nothing.
* A TLS key that is not the certificate's is named as such (was: "cannot bind ...; choose
  another address").
* A checkout path long enough that run/kvtier.sock passes 107 bytes is one line naming the path,
  its length and the fix (was: a 34-line traceback from gRPC's bind).
* Settings that let more users in, a data channel remote clients cannot reach, a certificate
  no gRPC listener serves and a host tier rounded down are warned at start.
* A directory formatted for another --disk-bytes says how to get back, or to reformat.
* Ctrl-C while starting exits cleanly: no traceback, no socket left behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace
from redis_cluster import make_test_pki
from tests_helpers import serve_exits, serve_ready, wait_for

import kvtier
from kvtier_contract import errors

SMALL = ("--host-bytes", "8MiB", "--slab-bytes", "1MiB")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d)
    return d


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done  # no traceback, no log line
    return lines[0]


def tenants_file(path: Path, token: str) -> Path:
    path.write_text(
        f'[[tenant]]\nname = "team-a"\ntokens_sha256 = ["{hashlib.sha256(token.encode()).hexdigest()}"]\n'
    )
    return path


def test_tls_on_a_network_listener_without_client_authentication_is_refused(
    tmp_path: Path, pki: Path, daemon_factory: Any
) -> None:
    tls = ("--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"))
    for flags, field in (
        (("--listen", "0.0.0.0:0"), "listen"),
        (("--data-listen", "0.0.0.0:0"), "data_listen"),
    ):
        line = one_line(serve_exits(tmp_path / field, *SMALL, *tls, *flags))
        assert line.startswith(
            f"kvtierd serve: configuration error: {field}: 0.0.0.0:0 is not a loopback address "
            "and nothing authenticates its clients: every client that reaches it reads and writes "
            "every block"
        ), line
        assert "--tenants-file" in line and "--tls-require-client-cert" in line
        assert not (tmp_path / field / "kvtier.sock").exists()
    # with a tenants file it serves, and a client holding only the CA certificate gets nothing
    d = daemon_factory(
        *SMALL,
        *tls,
        "--listen",
        "0.0.0.0:0",
        "--data-listen",
        "0.0.0.0:0",
        "--tenants-file",
        str(tenants_file(tmp_path / "tenants.toml", "tok-a")),
    )
    address = "127.0.0.1:" + d.info["grpc"].rpartition(":")[2]
    ca = str(pki / "ca.crt")
    with kvtier.Client.connect(address, transport="tcp", tls_ca=ca, timeout_s=2, lazy=True) as c:
        with pytest.raises(errors.Unauthenticated):
            c.stats()
    with kvtier.Client.connect(address, transport="tcp", tls_ca=ca, token="tok-a") as c:
        ns = c.register(make_namespace(tenant="team-a"))
        keys = ns.block_keys(list(range(16)))
        assert ns.put(keys, [b"\x07" * ns.block_bytes]).stored == 1, c.counters.last_error


def test_a_tls_key_of_another_certificate_is_named_not_a_bind_failure(tmp_path: Path, pki: Path) -> None:
    line = one_line(
        serve_exits(
            tmp_path,
            *SMALL,
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            str(pki / "server.crt"),
            "--tls-key",
            str(pki / "client.key"),
        )
    )
    assert line == (
        f"kvtierd serve: configuration error: tls_key: {pki / 'client.key'} is not the key of the "
        f"certificate in {pki / 'server.crt'} (tls_cert): give the key that certificate was made "
        "with, or the certificate of this key (--tls-key)"
    ), line
    assert "cannot bind" not in line


def test_a_checkout_path_too_long_for_the_default_socket_is_one_line(tmp_path: Path) -> None:
    """`make serve` (``kvtierd serve`` in the checkout, the socket run/kvtier.sock under it)."""
    checkout = tmp_path / ("c" * max(1, 100 - len(str(tmp_path))))
    (checkout / "run").mkdir(parents=True)
    done = subprocess.run(
        [sys.executable, "-m", "kvtierd", "serve", "--metrics-port", "-1", *SMALL],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    socket = f"{checkout}/run/kvtier.sock"
    line = one_line(done)
    assert line.startswith(
        f"kvtierd serve: socket_path (--socket run/kvtier.sock): the Unix socket {socket} is "
        f"{len(socket)} bytes long, more than the 107 a Unix socket path may have: choose a "
        "shorter --socket"
    ), line
    assert "make serve SERVE_ARGS='--socket" in line and "shorter directory" in line
    assert os.listdir(checkout / "run") == []  # nothing made


def warnings_of(run: Path, *args: str) -> list[str]:
    """The WARNING lines of a daemon started with ``args`` (then stopped)."""
    _, text = serve_ready(run, *args, level="WARNING")
    return [
        line.split(" WARNING kvtierd: ", 1)[1] for line in text.splitlines() if " WARNING kvtierd: " in line
    ]


def test_settings_that_widen_access_or_do_less_than_they_seem_are_warned(tmp_path: Path, pki: Path) -> None:
    said = warnings_of(
        tmp_path / "a",
        "--socket-mode",
        "666",
        "--listen",
        "127.0.0.1:0",
        "--host-bytes",
        "10MB",  # 10^7 bytes: 9 slabs of 1 MiB
        "--slab-bytes",
        "1MiB",
    )
    starts = [w.split(" (")[0] for w in said]
    for setting in ("socket_mode 0666", "listen 127.0.0.1:0", "host_bytes 10000000"):
        assert setting in starts, said
    assert "the host tier holds 9.0 MiB, rounded down" in said[starts.index("host_bytes 10000000")]
    tls = ("--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"))
    tenants = ("--tenants-file", str(tenants_file(tmp_path / "tenants.toml", "tok-a")))
    said = warnings_of(tmp_path / "b", *SMALL, *tls, *tenants, "--listen", "0.0.0.0:0")
    assert any(w.startswith("listen 0.0.0.0:0 (--listen) reaches other hosts but the tcp data") for w in said)
    said = warnings_of(tmp_path / "c", *SMALL, *tls)  # no --listen
    assert any(
        w.startswith(f"tls_cert {pki / 'server.crt'} (--tls-cert) is set but there is no") for w in said
    )


def test_a_directory_formatted_for_another_size_says_how_to_go_back_or_reformat(tmp_path: Path) -> None:
    disk = tmp_path / "nvme"
    serve_ready(tmp_path / "a", *SMALL, "--disk-dir", str(disk), "--disk-bytes", "16MiB")
    line = one_line(serve_exits(tmp_path / "b", *SMALL, "--disk-dir", str(disk), "--disk-bytes", "32MiB"))
    assert line.startswith(
        f"kvtierd serve: disk_dir {disk} (--disk-dir) was formatted with 1 block file(s) of 16MiB "
        "(io_align 4096); this configuration makes block files of 32MiB"
    ), line
    assert "Start with --disk-bytes 16MiB as before" in line
    assert f"losing every block cached there: stop the daemon, remove the directory (rm -r {disk})" in line
    serve_ready(tmp_path / "c", *SMALL, "--disk-dir", str(disk), "--disk-bytes", "16MiB")  # as before
    subprocess.run(["rm", "-r", str(disk)], check=True)  # or reformatted, as the line says
    info, _ = serve_ready(tmp_path / "d", *SMALL, "--disk-dir", str(disk), "--disk-bytes", "32MiB")
    assert info["tiers"]["nvme"]["bytes"] == 32 << 20


def start(run: Path, *args: str) -> subprocess.Popen[str]:
    run.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtierd",
            "serve",
            "--socket",
            str(run / "k.sock"),
            "--metrics-port",
            "-1",
            *args,
        ],
        cwd=run,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, KVTIER_LOG_LEVEL="INFO"),
    )


def stopped_cleanly(proc: subprocess.Popen[str], run: Path) -> tuple[str, str]:
    """The process exited by itself, with no traceback and no socket file left; (its stdout,
    its stderr)."""
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert not (run / "k.sock").exists() and not (run / "k.sock.shm").exists()
    return out, err


def test_ctrl_c_right_away_exits_cleanly(tmp_path: Path) -> None:
    """SIGINT as soon as the daemon's modules load (its C extensions are being mapped)."""
    proc = start(tmp_path, *SMALL)

    def loading() -> bool:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        return "site-packages" in maps or proc.poll() is not None

    wait_for("the daemon's modules loading", loading)
    proc.send_signal(signal.SIGINT)
    stopped_cleanly(proc, tmp_path)


def test_a_signal_while_the_daemon_is_built_stops_it_before_anything_is_bound(tmp_path: Path) -> None:
    """SIGINT while the start is held in the middle of its build (its tenants file a FIFO that
    the test writes each time the daemon reads it: the CLI, the memory check, the build)."""
    fifo = tmp_path / "tenants.toml"
    os.mkfifo(fifo)
    body = tenants_file(tmp_path / "body.toml", "tok-a").read_text()
    reads = threading.Semaphore(0)

    proc = start(tmp_path / "run", *SMALL, "--tenants-file", str(fifo))

    def reading() -> bool:  # the daemon holds a descriptor of the FIFO
        fds = Path(f"/proc/{proc.pid}/fd")
        try:
            return any(os.readlink(fds / fd) == str(fifo) for fd in os.listdir(fds))
        except FileNotFoundError:  # a descriptor closed while listed, or the process gone
            return proc.poll() is None and reading()

    def writer() -> None:
        for _ in range(3):
            with open(fifo, "w") as f:  # returns once the daemon opens it to read
                wait_for("the daemon's descriptor of the FIFO", reading)  # its open completed
                f.write(body)
            wait_for("the daemon to close the FIFO", lambda: not reading())  # one body per read
            reads.release()

    threading.Thread(target=writer, daemon=True).start()
    for _ in range(2):  # the CLI's check, then the memory check of the start itself
        assert reads.acquire(timeout=60)
    proc.send_signal(signal.SIGINT)  # the build waits for its own read of the FIFO
    out, err = stopped_cleanly(proc, tmp_path / "run")
    assert proc.returncode == 0 and "kvtierd stopped before it was ready (signal 2 during start)" in err, err
    assert "KVTIERD_READY" not in out

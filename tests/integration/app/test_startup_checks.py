"""kvtierd's startup checks end to end, a real daemon process each time: a host tier far larger
than the memory available and a port in use are refused at once, in one line naming the setting,
its flag and the fix (exit 2), before the arena is reserved or any socket file is made; a port
taken after the checks is refused the same way, its socket files removed; the ready line names
every tier."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from tests_helpers import serve_exits, serve_ready

from kvtierd import app, preflight
from kvtierd.config import DaemonConfig
from kvtierd.preflight import StartupError


def serve(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvtierd serve`` (8 MiB host tier, TCP listeners on free ports) expected to exit."""
    return serve_exits(
        run,
        "--listen",
        "127.0.0.1:0",
        "--data-listen",
        "127.0.0.1:0",
        "--host-bytes",
        "8MiB",
        "--slab-bytes",
        "1MiB",
        *args,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done  # no traceback, no log line
    return lines[0]


def no_sockets(run: Path) -> None:
    assert not (run / "kvtier.sock").exists() and not (run / "kvtier.sock.shm").exists()


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no MemAvailable in /proc/meminfo")


@pytest.mark.parametrize("prefault", [True, False])
def test_host_bytes_far_above_the_available_memory_is_refused_at_once(tmp_path: Path, prefault: bool) -> None:
    huge = 8 * mem_available() >> 30 << 30  # whole GiB, eight times what there is
    t0 = time.monotonic()
    done = serve(
        tmp_path,
        "--host-bytes",
        f"{huge >> 30}GiB",
        "--slab-bytes",
        "64MiB",
        *(() if prefault else ("--no-prefault",)),
    )
    elapsed = time.monotonic() - t0
    line = one_line(done)
    assert (
        line.startswith("kvtierd serve: host_bytes ")
        and "(--host-bytes) exceeds the memory available" in line
    ), line
    assert "--allow-host-bytes-over-available" in line and "lower --host-bytes to at most" in line
    assert elapsed < 15, elapsed  # nothing allocated: no page of 8x the memory was touched
    no_sockets(tmp_path)


def test_the_override_starts_a_lazy_arena_above_the_available_memory_with_a_warning(tmp_path: Path) -> None:
    over = 2 * mem_available() >> 30 << 30  # --no-prefault: no page is allocated until used
    info, text = serve_ready(
        tmp_path,
        "--host-bytes",
        f"{over >> 30}GiB",
        "--no-prefault",
        "--allow-host-bytes-over-available",
        level="WARNING",
    )
    assert info["host_bytes"] == over
    assert "WARNING" in text and "starting anyway (allow_host_bytes_over_available)" in text


@pytest.mark.parametrize("setting", ["listen", "data_listen", "health_listen", "metrics_port"])
def test_a_port_in_use_is_one_line_naming_the_setting_before_any_socket_file(
    tmp_path: Path, held: int, setting: str
) -> None:
    flag = "--" + setting.replace("_", "-")
    value = str(held) if setting == "metrics_port" else f"127.0.0.1:{held}"
    t0 = time.monotonic()
    line = one_line(serve(tmp_path, flag, value))
    assert line.startswith(
        f"kvtierd serve: {setting} {value} ({flag}) is in use: another process "
        f"listens on 127.0.0.1:{held}; stop it, or choose another port"
    ), line
    assert time.monotonic() - t0 < 15
    no_sockets(tmp_path)


def test_a_port_taken_after_the_checks_is_refused_and_the_sockets_removed(
    tmp_path: Path, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check passed (skipped here), then another process took the port: the bind fails
    after the Unix sockets were made; they are removed, and the error is the same one line."""
    monkeypatch.setattr(preflight, "check_ports", lambda cfg: None)
    cfg = DaemonConfig.from_flat(
        host_bytes=8 << 20,
        slab_bytes=1 << 20,
        prefault=False,
        socket_path=str(tmp_path / "kvtier.sock"),
        metrics_port=held,
    )
    with pytest.raises(StartupError) as e:
        asyncio.run(app.serve_daemon(cfg))
    assert str(e.value).startswith(f"metrics_port {held} (--metrics-port) is in use: ")
    no_sockets(tmp_path)


def ready(run: Path, *args: str) -> tuple[dict[str, object], str]:
    """Start a daemon, read its KVTIERD_READY JSON and its INFO "kvtierd ready" log line, stop it."""
    info, text = serve_ready(run, "--host-bytes", "8MiB", "--slab-bytes", "1MiB", *args)
    logged = [x for x in text.splitlines() if "kvtierd ready: " in x]
    assert len(logged) == 1
    return info, logged[0]


def test_the_ready_line_names_every_tier(tmp_path: Path) -> None:
    info, logged = ready(tmp_path / "a")
    for key in ("boot_epoch", "pid", "unix", "shm", "host_bytes", "eviction_policy", "tenants"):
        assert key in info  # the keys tests and supervisors parse stay
    assert info["tiers"] == {
        "host": {
            "bytes": 8 << 20,
            "shared_arena_bytes": 8 << 20,
            "tenant_arenas": 0,
            "eviction_policy": "prefix",
        },
        "nvme": None,
        "cluster": None,
    }
    assert "host 8.0 MiB (prefix); nvme off; cluster off" in logged, logged

    disk = tmp_path / "nvme"
    info, logged = ready(tmp_path / "b", "--disk-dir", str(disk), "--disk-bytes", "16MiB")
    tiers = info["tiers"]
    assert isinstance(tiers, dict)
    assert tiers["nvme"] == {
        "directory": str(disk),
        "bytes": 16 << 20,
        "state": "serving",
        "reason": "",
        "recovered_blocks": 0,
        "write_policy": "write-back",
    }
    assert f"nvme {disk} serving (16.0 MiB, 0 blocks recovered)" in logged, logged

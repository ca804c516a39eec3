"""kvtierd.app.listeners' checks before anything is bound: TLS files that are not what their
setting says are named (gRPC itself only fails to bind: "cannot bind ...; choose another
address"), and a Unix socket path too long to bind is one line with the fix (issue 39)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from redis_cluster import make_test_pki

from kvtierd.app.listeners import (
    MAX_SOCKET_PATH_BYTES,
    check_socket_dirs,
    check_socket_paths,
    check_tls_files,
)
from kvtierd.config import DaemonConfig
from kvtierd.preflight import StartupError


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d)
    return d


def tls(pki: Path, cert: str, key: str, ca: str = "") -> DaemonConfig:
    extra = {"tls_client_ca": str(pki / ca), "tls_require_client_cert": True} if ca else {}
    return DaemonConfig.from_flat(
        listen="127.0.0.1:0", tls_cert=str(pki / cert), tls_key=str(pki / key), **extra
    )


def test_good_tls_files_pass(pki: Path) -> None:
    check_tls_files(tls(pki, "server.crt", "server.key"))
    check_tls_files(tls(pki, "server.crt", "server.key", "ca.crt"))
    check_tls_files(DaemonConfig())  # no TLS: nothing to read


def test_a_key_of_another_certificate_is_named_as_such(pki: Path) -> None:
    with pytest.raises(ValueError) as e:
        check_tls_files(tls(pki, "server.crt", "client.key"))
    assert str(e.value) == (
        f"tls_key: {pki / 'client.key'} is not the key of the certificate in "
        f"{pki / 'server.crt'} (tls_cert): give the key that certificate was made with, or the "
        "certificate of this key"
    )


@pytest.mark.parametrize(
    ("cert", "key", "ca", "says"),
    [
        ("server.key", "server.key", "", "tls_cert: {pki}/server.key holds no PEM certificate"),
        ("server.crt", "server.crt", "", "tls_key: {pki}/server.crt holds no unencrypted PEM private key"),
        (
            "server.crt",
            "server.key",
            "client.key",
            "tls_client_ca: {pki}/client.key holds no PEM certificate",
        ),
        ("server.crt", "missing.key", "", "tls_key: cannot read {pki}/missing.key"),
    ],
)
def test_a_file_that_is_not_what_its_setting_says_is_named(
    pki: Path, cert: str, key: str, ca: str, says: str
) -> None:
    with pytest.raises(ValueError) as e:
        check_tls_files(tls(pki, cert, key, ca))
    assert str(e.value).startswith(says.format(pki=pki)), str(e.value)


def test_a_socket_path_too_long_to_bind_is_one_line_naming_it(tmp_path: Path) -> None:
    """A checkout path of 88+ characters made ``run/kvtier.sock`` pass 107 bytes, and
    ``make serve`` died with a traceback from gRPC's bind."""
    deep = tmp_path / ("d" * max(1, MAX_SOCKET_PATH_BYTES - len(str(tmp_path)) - 10))
    cfg = DaemonConfig.from_flat(socket_path=str(deep / "kvtier.sock"))
    full = f"{deep}/kvtier.sock"
    with pytest.raises(StartupError) as e:
        check_socket_paths(cfg)  # the shm socket beside it: .shm, 4 bytes more
    size = len(full) + 4 if len(full) <= MAX_SOCKET_PATH_BYTES else len(full)
    assert str(e.value).startswith(
        f"socket_path (--socket {deep}/kvtier.sock): the Unix socket {full}"
        f"{'.shm' if len(full) <= MAX_SOCKET_PATH_BYTES else ''} is {size} bytes long, more than "
        f"the {MAX_SOCKET_PATH_BYTES} a Unix socket path may have: choose a shorter --socket"
    ), str(e.value)
    assert "start the daemon from a shorter directory" in str(e.value)
    assert not deep.exists()  # checked before anything is made
    check_socket_paths(DaemonConfig.from_flat(socket_path=str(tmp_path / "k.sock")))


def test_a_relative_socket_path_is_measured_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * max(1, MAX_SOCKET_PATH_BYTES - len(str(tmp_path)) - 10))
    deep.mkdir()
    monkeypatch.chdir(deep)  # `make serve` in a checkout with a long path: run/kvtier.sock
    with pytest.raises(StartupError, match=r"^socket_path \(--socket run/kvtier.sock\): the Unix socket "):
        check_socket_paths(DaemonConfig())
    assert os.listdir(deep) == []


def test_a_socket_directory_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    """The shm socket alone (no gRPC socket) is checked too, named by run_dir: a 0770
    directory is refused with the fix, the same directory with the sticky bit passes."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o770)
    cfg = DaemonConfig.from_flat(socket_path="", listen="127.0.0.1:0", run_dir=str(run))
    with pytest.raises(StartupError) as e:
        check_socket_dirs(cfg)
    assert str(e.value).startswith(
        f"run_dir {run}: the Unix socket {run}/kvtier.sock.shm: its directory {run} (mode 0770) "
        "is writable by its group without the sticky bit"
    ), str(e.value)
    assert f"run `chmod +t {run}`" in str(e.value)
    os.chmod(run, 0o1770)
    check_socket_dirs(cfg)
    check_socket_dirs(DaemonConfig.from_flat(socket_path=str(tmp_path / "k.sock")))  # 0700

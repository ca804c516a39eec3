"""The local default is private: the daemon ``make serve`` starts lets in only its own user.

Before, it listened on 127.0.0.1:50051 with no credential, and another local user read the
owner's cached blocks (and pre-stored keys whose later reads returned its bytes). Now the default
serves gRPC on the Unix socket only, created 0600, and the shm socket beside it likewise; a second
local user (made here with ``useradd``) is refused on both and finds nothing on 50051, while the
owner works as before.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace

import kvtier


@pytest.fixture
def other_user() -> Iterator[tuple[int, int]]:
    """A second local user (uid, gid) with a group of its own, removed after the test."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates a second local user with useradd")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if not useradd or not userdel:
        pytest.skip("useradd/userdel not installed: cannot create a second local user")
    name = f"kvt-{secrets.token_hex(4)}"
    made = subprocess.run(
        [useradd, "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd could not create a second local user: {made.stderr.strip()}")
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run([userdel, name], check=False, capture_output=True, timeout=60)


@pytest.fixture
def make_serve() -> Iterator[tuple[Path, dict[str, Any]]]:
    """``make serve`` in a fresh directory every user may traverse: ``mkdir -p run`` then
    ``kvtierd serve`` with the embedded defaults (only the tier is smaller and /metrics on a
    free port, so that tests may run side by side). (that directory, its READY line)"""
    base = Path(tempfile.mkdtemp(prefix="kvtier-private-", dir="/tmp"))
    base.chmod(0o755)
    (base / "run").mkdir(mode=0o755)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtierd",
            "serve",
            "--host-bytes",
            "64MiB",
            "--slab-bytes",
            "1MiB",
            "--metrics-port",
            "0",
        ],
        cwd=base,
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, KVTIER_LOG_LEVEL="WARNING"),
    )
    try:
        yield base, ready_line(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def ready_line(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.startswith("KVTIERD_READY "):
                return dict(json.loads(line.split(" ", 1)[1]))
            if not line:
                break
    raise AssertionError("kvtierd did not start")


def as_user(uid: int, gid: int, attempt: Callable[[], dict[str, str]]) -> dict[str, str]:
    """``attempt()`` run in a child process that has become ``uid``/``gid`` (no other group)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the socket module, then _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = attempt()
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            out = {"error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return dict(json.loads(b"".join(chunks)))


def connect(family: socket.AddressFamily, address: Any) -> str:
    """ "connected", or the errno name of the refusal."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect(address)
        except OSError as e:
            return errno.errorcode.get(e.errno or 0, repr(e))
        return "connected"


def test_another_local_user_cannot_reach_the_default_daemon(
    other_user: tuple[int, int], make_serve: tuple[Path, dict[str, Any]]
) -> None:
    base, info = make_serve
    grpc_sock, shm_sock = base / "run" / "kvtier.sock", Path(info["shm"])

    def attempt() -> dict[str, str]:
        return {
            "sees_socket": str(os.path.exists(grpc_sock)),  # the directory is not the bar
            "grpc_unix": connect(socket.AF_UNIX, str(grpc_sock)),
            "shm_unix": connect(socket.AF_UNIX, str(shm_sock)),
            "tcp_50051": connect(socket.AF_INET, ("127.0.0.1", 50051)),
        }

    assert as_user(*other_user, attempt) == {
        "sees_socket": "True",
        "grpc_unix": "EACCES",
        "shm_unix": "EACCES",
        "tcp_50051": "ECONNREFUSED",
    }
    assert info["unix"] == f"unix://{grpc_sock}" and "grpc" not in info  # no TCP gRPC at all
    for path in (grpc_sock, shm_sock):
        assert oct(path.stat().st_mode & 0o777) == oct(0o600), path

    # The owner: the README's snippet, as before.
    with kvtier.Client.connect(f"unix://{grpc_sock}", transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        data = [bytes([7]) * ns.block_bytes, bytes([9]) * ns.block_bytes]
        assert ns.put(keys, data).stored == 2
        assert [bytes(g) if g else None for g in ns.get(keys)] == data

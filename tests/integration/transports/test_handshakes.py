"""Handshakes on the shm socket prove the session, and no local user holds every slot (issue 26).

A real daemon and raw Unix sockets (what any local process can send):

* the arena handshake and the published-index handshake need the session's data secret, not
  just its id: the old id-only requests (``KVS1``, ``KVI1``), a wrong secret, another session's
  secret and an unknown session are refused alike, with no descriptor;
* the index handshake checks the peer's uid against the session's tenant, as the arena
  handshake does;
* one uid's half-open handshakes (more than the whole socket's cap) do not stop another uid's
  handshake: a second local user, made with ``useradd`` (skipped when not root), gets its
  arena at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import wait_for

from kvtier_contract import published_index as pi
from kvtier_contract import wire
from kvtier_contract.protoutil import namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

T = 5.0


def open_session(
    d: DaemonProcess, transport: int = pb.TRANSPORT_SHM, token: str | None = None, tenant: str | None = None
) -> tuple[Any, int]:
    """An OpenSessionReply (id and data secret) and a namespace registered for it."""
    md = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(d.grpc) as ch:
        stub = pb_grpc.KvtierStub(ch)
        opened = stub.OpenSession(
            pb.OpenSessionRequest(client_name="handshakes", lease_ttl_ms=60_000, transport=transport),
            timeout=T,
            metadata=md,
        )
        ns = make_namespace(tenant=tenant) if tenant else make_namespace()
        ns_id = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(spec=namespace_spec(ns), digest=ns.digest), timeout=T, metadata=md
        ).namespace_id
    return opened, int(ns_id)


def unknown(session_id: int) -> bytes:
    """The refusal of an unknown session: what a wrong secret or a foreign peer also gets."""
    return wire.SHM_REFUSED + f"session_id: unknown or expired session {session_id}".encode()


def exchange(path: str, request: bytes) -> tuple[bytes, int]:
    """Send one request on the shm socket: the reply, and how many descriptors came with it
    (closed here)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(T)
        s.connect(path)
        s.sendall(request)
        msg, fds, _, _ = socket.recv_fds(s, 4096, 4)
    for fd in fds:
        os.close(fd)
    return msg, len(fds)


def test_the_arena_handshake_needs_the_sessions_data_secret(daemon: DaemonProcess) -> None:
    opened, _ = open_session(daemon)
    other, _ = open_session(daemon)
    sid, path = opened.session_id, daemon.info["shm"]
    msg, fds = exchange(path, wire.SHM_REQUEST.pack(b"KVS1", sid))  # the id alone, as before
    assert (fds, msg[:4]) == (0, wire.SHM_REFUSED) and b"data secret" in msg, msg
    refusals = {
        exchange(path, wire.shm_request(magic, s, secret))
        for magic in (wire.SHM_MAGIC, wire.SHM_MAGIC_V3)  # every arena (KVS3) as the first (KVS2)
        for s, secret in (
            (sid, bytes(32)),
            (sid, other.data_secret),
            (sid, opened.data_secret[:31] + b"\0"),
            (999_999, opened.data_secret),
        )
    }
    assert {(m.replace(b"999999", str(sid).encode()), n) for m, n in refusals} == {(unknown(sid), 0)}
    msg, fds = exchange(path, wire.shm_request(wire.SHM_MAGIC, sid, opened.data_secret))
    assert (fds, msg[:4]) == (1, wire.SHM_MAGIC)
    msg, fds = exchange(path, wire.shm_request(wire.SHM_MAGIC_V3, sid, opened.data_secret))
    assert (fds, msg[:4]) == (1, wire.SHM_MAGIC_V3)  # a single-tenant daemon: the one arena


def test_the_index_handshake_needs_the_sessions_data_secret(daemon: DaemonProcess) -> None:
    opened, ns_id = open_session(daemon, pb.TRANSPORT_TCP)  # any transport reads the index
    other, _ = open_session(daemon, pb.TRANSPORT_TCP)
    sid, path = opened.session_id, daemon.info["shm"]
    msg, fds = exchange(path, b"KVI1" + sid.to_bytes(8, "little") + ns_id.to_bytes(8, "little"))
    assert (fds, msg[:4]) == (0, wire.SHM_REFUSED) and b"data secret" in msg, msg
    for secret in (bytes(32), other.data_secret):
        msg, fds = exchange(path, pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, sid, ns_id, secret))
        assert (fds, msg) == (0, unknown(sid))
    msg, fds = exchange(path, pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, sid, ns_id, opened.data_secret))
    assert (fds, msg[:4]) == (1, pi.INDEX_MAGIC)


TOKENS = {"pinned": "hs-pinned-1", "anyone": "hs-anyone-2"}


@pytest.fixture
def tenants(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    """Two tcp tenants: "pinned" acts only from uid 12345 (not this test's), "anyone" from any
    uid."""
    body = ""
    for name, token in TOKENS.items():
        body += (
            f'[[tenant]]\nname = "{name}"\ntransports = ["tcp"]\n'
            f'tokens_sha256 = ["{hashlib.sha256(token.encode()).hexdigest()}"]\n'
        )
        body += "unix_uids = [12345]\n\n" if name == "pinned" else "\n"
    (tmp_path / "tenants.toml").write_text(body)
    (tmp_path / "kvtierd.toml").write_text(f'tenants_file = "{tmp_path / "tenants.toml"}"\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(tmp_path / "kvtierd.toml"), "--host-bytes", "16MiB", "--slab-bytes", "1MiB"
    )
    return d


def test_the_index_handshake_checks_the_peers_uid(tenants: DaemonProcess) -> None:
    assert os.getuid() != 12345
    for tenant, handed in (("pinned", 0), ("anyone", 1)):
        opened, ns_id = open_session(tenants, pb.TRANSPORT_TCP, TOKENS[tenant], tenant)
        msg, fds = exchange(
            tenants.info["shm"],
            pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, opened.session_id, ns_id, opened.data_secret),
        )
        assert fds == handed, (tenant, msg)
        if not handed:  # as an unknown session: the peer learns nothing
            assert msg == unknown(opened.session_id)


# ---- handshake slots per peer uid ----------------------------------------------------------------

_AS_OTHER_UID = """
import socket, sys, time
path, sid, secret = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
t0 = time.monotonic()
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(10)
    s.connect(path)
    s.sendall(b"KVS2" + sid.to_bytes(8, "little") + secret)
    msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
print(len(fds), round(time.monotonic() - t0, 3), msg[:4].decode(errors="replace"))
"""


@pytest.fixture
def other_uid() -> Iterator[tuple[int, int]]:
    """A second local user (uid, gid), made for this test and removed after it."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a second local user")
    name = f"kvtier-hs-{os.getpid()}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        out = subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True)
        gid = subprocess.run(["id", "-g", name], check=True, capture_output=True, text=True)
        yield int(out.stdout), int(gid.stdout)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A run dir every local user may enter (pytest's tmp_path is the owner's only)."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-hs-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_one_uids_half_open_handshakes_do_not_lock_another_uid_out(
    daemon_factory: Any, other_uid: tuple[int, int], open_dir: Path
) -> None:
    (open_dir / "kvtierd.toml").write_text("handshake_timeout_s = 30.0\n")  # held throughout
    d: DaemonProcess = daemon_factory(
        "--config",
        str(open_dir / "kvtierd.toml"),
        "--host-bytes",
        "16MiB",
        "--slab-bytes",
        "1MiB",
        run_dir=open_dir / "d",
    )
    path = d.info["shm"]
    os.chmod(open_dir / "d", 0o755)
    os.chmod(path, 0o666)  # both users may connect: the slots per uid are what is tested
    held = []
    for _ in range(128 + 16):  # more than the whole socket's handshakes (128), none completed
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        held.append(s)
    try:
        wait_for("the extra handshakes refused", lambda: sum(map(_answered, held)) >= 16)
        opened, _ = open_session(d)
        uid, gid = other_uid
        t0 = time.monotonic()
        out = subprocess.run(
            [
                "/usr/bin/python3",
                "-I",
                "-c",
                _AS_OTHER_UID,
                path,
                str(opened.session_id),
                opened.data_secret.hex(),
            ],
            user=uid,
            group=gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=20,
            cwd="/",
        )
        assert out.returncode == 0, out.stderr
        fds, took, magic = out.stdout.split()
        assert (fds, magic) == ("1", "KVS2"), out.stdout  # its arena, handed at once
        assert float(took) < 2.0 and time.monotonic() - t0 < 10.0
        # this uid's beyond its share (shm_handshakes_per_uid, 16) were refused at once, long
        # before the handshake timeout; its first 16 still wait
        assert sum(map(_answered, held)) == len(held) - 16
    finally:
        for s in held:
            s.close()


def _answered(s: socket.socket) -> bool:
    """The daemon answered ``s`` (here: a refusal, then EOF) or closed it; never blocks."""
    s.setblocking(False)
    try:
        s.recv(4096)
        return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True

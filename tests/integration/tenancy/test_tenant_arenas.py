"""A client maps only its own tenant's memory (issue 11): per-tenant host arenas.

A daemon with tenants gives every tenant allowed shm or cuda_ipc an arena of its own: the only
memfd its sessions are handed, holding only its blocks, for the daemon's lifetime. Tested with a
real daemon and raw handshakes (what any local process of that tenant can do):

* scanning and overwriting everything a tenant can map finds and changes nothing of another
  tenant's blocks (shm or tcp tenants); the offsets a tenant is told are offsets in its mapping;
* a tenant filling its arena evicts only its own blocks;
* a session cannot move blocks of a namespace in another arena through its mapping (the
  operator's shm session on a tenant's namespace: FAILED_PRECONDITION; tcp works);
* a tenant added by a reload gets its arena; the host tier's capacity counts every arena.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace, shm_handshake

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

MiB = 1 << 20
TOKENS = {
    "team-a": "arena-a-1",
    "team-b": "arena-b-2",
    "team-t": "arena-t-3",
    "ops": "arena-ops-4",
    "team-e": "arena-e-5",
}
BLOCKS = 16  # per put; make_namespace's blocks are 16 KiB


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _tenants_file(path: Path, *, with_e: bool = False) -> Path:
    body = ""
    for name, token in TOKENS.items():
        if name == "team-e" and not with_e:
            continue
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{_digest(token)}"]\n'
        body += {
            "team-a": 'transports = ["shm", "tcp"]\narena_bytes = "8MiB"\n',
            "team-b": 'transports = ["shm", "tcp"]\n',  # tenant_arena_bytes: 4 MiB
            "team-t": 'transports = ["tcp"]\n',  # the shared arena
            "ops": "operator = true\n",
            "team-e": 'transports = ["shm"]\n',
        }[name] + "\n"
    path.write_text(body)
    return path


@pytest.fixture
def arenas(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(
        f'tenants_file = "{_tenants_file(tmp_path / "tenants.toml")}"\ntenant_arena_bytes = "4MiB"\n'
    )
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "16MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )
    return d


class Raw:
    """A raw stub with a tenant's token."""

    def __init__(self, d: DaemonProcess, tenant: str) -> None:
        self.d = d
        self.channel = grpc.insecure_channel(d.grpc)
        self.stub = pb_grpc.KvtierStub(self.channel)
        self.md = (("authorization", f"Bearer {TOKENS[tenant]}"),)

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=5, metadata=self.md)

    def open(self, transport: int) -> Any:
        return self(
            "OpenSession", pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=30_000, transport=transport)
        )

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def raw(arenas: DaemonProcess) -> Iterator[Any]:
    opened: list[Raw] = []

    def make(tenant: str) -> Raw:
        opened.append(Raw(arenas, tenant))
        return opened[-1]

    yield make
    for r in opened:
        r.close()


def client(d: DaemonProcess, tenant: str, transport: str) -> kvtier.Client:
    return kvtier.Client.connect(
        d.unix,
        transport=transport,  # type: ignore[arg-type]
        token=TOKENS[tenant],
    )


def blocks(tag: bytes, ns: Any, n: int = BLOCKS) -> list[bytes]:
    return [hashlib.shake_256(tag + b"%d" % i).digest(ns.block_bytes) for i in range(n)]


def put_some(
    d: DaemonProcess, tenant: str, transport: str, tag: bytes, first: int = 0
) -> tuple[kvtier.Client, Any, list[bytes], list[bytes]]:
    c = client(d, tenant, transport)
    ns = c.register(make_namespace(tenant=tenant))
    keys = ns.block_keys(list(range(first, first + 16 * BLOCKS)))
    data = blocks(tag + tenant.encode(), ns)
    assert ns.put(keys, data).stored == BLOCKS
    return c, ns, keys, data


def got(ns: Any, keys: list[bytes]) -> list[bytes | None]:
    return [bytes(g) if g is not None else None for g in ns.get(keys)]


def test_a_tenants_mapping_holds_only_its_own_blocks(arenas: DaemonProcess, raw: Any) -> None:
    b_shm, ns_b, keys_b, data_b = put_some(arenas, "team-b", "shm", b"victim-shm")
    t_tcp, ns_t, keys_t, data_t = put_some(arenas, "team-t", "tcp", b"victim-tcp")
    a_shm, ns_a, keys_a, data_a = put_some(arenas, "team-a", "shm", b"attacker-own")
    a = raw("team-a")
    reply = a.open(pb.TRANSPORT_SHM)
    assert reply.arena_bytes == 8 * MiB  # its own arena, not the daemon's 16 MiB shared one
    msg, fds = shm_handshake(arenas, reply.session_id, reply.data_secret)
    assert fds, msg
    try:
        assert os.fstat(fds[0]).st_size == 8 * MiB
        with mmap.mmap(fds[0], 8 * MiB, flags=mmap.MAP_SHARED) as mm:
            # the offsets it is told are offsets in its mapping: its own blocks are there
            load = a(
                "PrepareLoad",
                pb.PrepareLoadRequest(
                    session_id=reply.session_id,
                    namespace_id=ns_a.namespace_id,
                    keys=b"".join(keys_a),
                    transport=pb.TRANSPORT_SHM,
                ),
            )
            assert bytes(load.found) == b"\x01" * BLOCKS
            for off, want in zip(load.offsets, data_a, strict=True):
                assert mm[off : off + len(want)] == want
            a("CompleteLoad", pb.CompleteLoadRequest(session_id=reply.session_id, job_id=load.job_id))
            # nothing of another tenant's is in it, however it is scanned...
            for victim in data_b + data_t:
                assert mm.find(victim[:64]) == -1
            mm[:] = b"\xff" * len(mm)  # ...and overwriting all of it changes none of theirs
    finally:
        os.close(fds[0])
    assert got(ns_b, keys_b) == data_b
    assert got(ns_t, keys_t) == data_t
    with client(arenas, "team-b", "tcp") as b_tcp:
        assert got(b_tcp.register(make_namespace(tenant="team-b")), keys_b) == data_b
    for c in (a_shm, b_shm, t_tcp):
        c.close()


def test_a_tenant_filling_its_arena_evicts_only_its_own_blocks(arenas: DaemonProcess) -> None:
    b, ns_b, keys_b, data_b = put_some(arenas, "team-b", "shm", b"keep")
    with client(arenas, "team-a", "shm") as a:
        ns_a = a.register(make_namespace(tenant="team-a"))
        # 3 x its 8 MiB arena, in 256 KiB puts: each one fits by evicting team-a's oldest
        for r in range(3 * 8 * MiB // (BLOCKS * ns_a.block_bytes)):
            keys = ns_a.block_keys(list(range(r * 16 * BLOCKS, (r + 1) * 16 * BLOCKS)))
            assert ns_a.put(keys, blocks(b"hog%d" % r, ns_a)).stored == BLOCKS
        assert got(ns_a, keys)[-1] is not None
    assert got(ns_b, keys_b) == data_b  # every block of team-b's still a hit
    b.close()


def test_the_operator_moves_a_tenants_blocks_over_tcp_not_through_its_mapping(
    arenas: DaemonProcess, raw: Any
) -> None:
    b, ns_b, keys_b, data_b = put_some(arenas, "team-b", "shm", b"operated")
    ops = raw("ops")
    sid = ops.open(pb.TRANSPORT_SHM).session_id
    for rpc in ("PrepareLoad", "PrepareStore"):
        with pytest.raises(grpc.RpcError) as e:
            ops(
                rpc,
                getattr(pb, f"{rpc}Request")(
                    session_id=sid,
                    namespace_id=ns_b.namespace_id,
                    keys=b"".join(keys_b),
                    transport=pb.TRANSPORT_SHM,
                ),
            )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (e.value.details() or "").startswith("transport: ")
    with pytest.raises(grpc.RpcError) as e:
        ops(
            "Lookup",
            pb.LookupRequest(session_id=sid, namespace_id=ns_b.namespace_id, keys=b"".join(keys_b), pin=True),
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with client(arenas, "ops", "tcp") as o:
        assert got(o.register(make_namespace(tenant="team-b")), keys_b) == data_b
    st = ops("Stats", pb.StatsRequest())
    # the shared 16 MiB, team-a's 8, team-b's and the operator's 4 each (team-t has none)
    assert st.host_capacity_bytes == (16 + 8 + 4 + 4) * MiB
    assert st.writing_blocks == 0 and st.pinned_blocks == 0
    b.close()


def test_a_tenant_added_by_a_reload_gets_its_arena(arenas: DaemonProcess, tmp_path: Path, raw: Any) -> None:
    _tenants_file(tmp_path / "tenants.toml", with_e=True)
    assert arenas.proc is not None
    arenas.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            reply = raw("team-e").open(pb.TRANSPORT_SHM)
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert reply.arena_bytes == 4 * MiB
    msg, fds = shm_handshake(arenas, reply.session_id, reply.data_secret)
    assert fds, msg
    size = os.fstat(fds[0]).st_size
    os.close(fds[0])
    assert size == 4 * MiB
    e, ns_e, keys_e, data_e = put_some(arenas, "team-e", "shm", b"late")
    assert got(ns_e, keys_e) == data_e
    e.close()

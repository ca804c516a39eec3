"""What one client may do to the memory every client shares (issue 11's first findings).

* The arena memfd is sealed against shrinking and growing: a client's ``ftruncate`` fails with
  EPERM, and an engine attached before keeps loading (it used to die of SIGBUS).
* The arena fd is never handed to a session opened for tcp, and a job's transport must be its
  session's: a tcp session can no longer commit shm slots it never wrote (which read another
  namespace's stale bytes out of reused slots and poisoned its keys).
"""

from __future__ import annotations

import errno
import hashlib
import os
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace, shm_handshake
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc


def open_session(stub: Any, transport: int) -> int:
    return int(open_reply(stub, transport).session_id)


def open_reply(stub: Any, transport: int) -> Any:
    return stub.OpenSession(
        pb.OpenSessionRequest(client_name="isolation", lease_ttl_ms=30_000, transport=transport), timeout=5
    )


def serving(daemon: DaemonProcess) -> bool:
    with grpc.insecure_channel(daemon.grpc) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return bool(r.status == health_pb2.HealthCheckResponse.SERVING)


def test_a_clients_ftruncate_of_the_arena_fails_and_an_attached_engine_keeps_loading(
    daemon: DaemonProcess,
) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as engine:
        ns = engine.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 8)))
        data = [hashlib.shake_256(b"%d" % i).digest(ns.block_bytes) for i in range(8)]
        assert ns.put(keys, data).stored == 8
        with grpc.insecure_channel(daemon.grpc) as ch:
            stub = pb_grpc.KvtierStub(ch)
            opened = open_reply(stub, pb.TRANSPORT_SHM)
            msg, fds = shm_handshake(daemon, opened.session_id, opened.data_secret)
            assert fds, msg
            fd = fds[0]
            try:
                size = os.fstat(fd).st_size
                for new_size in (0, size // 2, size + 4096):
                    with pytest.raises(OSError) as e:
                        os.ftruncate(fd, new_size)
                    assert e.value.errno == errno.EPERM
                assert os.fstat(fd).st_size == size
            finally:
                os.close(fd)
        got = ns.get(keys)  # the engine attached before: no SIGBUS, the same bytes
        assert [bytes(g) if g else None for g in got] == data
    assert serving(daemon)


def test_the_arena_fd_is_never_handed_to_a_tcp_session(daemon: DaemonProcess) -> None:
    with grpc.insecure_channel(daemon.grpc) as ch:
        stub = pb_grpc.KvtierStub(ch)
        opened = open_reply(stub, pb.TRANSPORT_TCP)
        msg, fds = shm_handshake(daemon, opened.session_id, opened.data_secret)
        for fd in fds:
            os.close(fd)
        assert not fds
        assert b"tcp" in msg


@pytest.mark.parametrize("rpc", ["PrepareStore", "PrepareLoad"])
def test_an_shm_job_in_a_tcp_session_is_refused_and_changes_nothing(daemon: DaemonProcess, rpc: str) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as victim:
        ns = victim.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        with grpc.insecure_channel(daemon.grpc) as ch:
            stub = pb_grpc.KvtierStub(ch)
            sid = open_session(stub, pb.TRANSPORT_TCP)
            request_type = getattr(pb, f"{rpc}Request")
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, rpc)(
                    request_type(
                        session_id=sid,
                        namespace_id=ns.namespace_id,
                        keys=b"".join(keys),
                        transport=pb.TRANSPORT_SHM,
                    ),
                    timeout=5,
                )
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (e.value.details() or "").startswith("transport: ")
        # the victim's real put stores its bytes (nothing was reserved or committed)
        data = [b"\x07" * ns.block_bytes] * 4
        assert ns.put(keys, data).stored == 4
        assert [bytes(g) if g else None for g in ns.get(keys)] == data
        st = victim.stats()
        assert st["writing_blocks"] == 0 and st["pinned_blocks"] == 0

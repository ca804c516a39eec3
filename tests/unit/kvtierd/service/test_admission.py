"""Request admission of the service: at ``max_inflight`` handlers in progress a new request is
shed (RESOURCE_EXHAUSTED), except those that only release daemon state (completing a job,
renewing or closing a lease), which would otherwise keep pins and WRITING entries alive under
the very load that sheds them. The service's handlers are called as grpc does, with a fake
context; the cache is a host tier of 4 blocks."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvtier_contract.identity import Namespace
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.policies import make_policy
from kvtierd.service import NEVER_SHED, KvtierService
from kvtierd.sessions import SessionTable
from kvtierd.tiers import Arena, HostTier

BLOCK = 4096


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code


class Context:
    """What the handlers use of grpc.aio.ServicerContext."""

    def time_remaining(self) -> float | None:
        return None

    def peer(self) -> str:
        return "test"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def service() -> Any:
    arena = Arena(4 * BLOCK, prefault=False)
    host = HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
    cache = TieredCache(host, make_policy("lru", ghost_capacity=4), max_namespaces=2, policy_name="lru")
    sessions = SessionTable(
        max_sessions=4, default_ttl_s=10, min_ttl_s=1, max_ttl_s=10, on_release=cache.release_session
    )
    svc = KvtierService(
        cache, sessions, boot_epoch=1, max_batch_blocks=8, advertise=lambda: {}, max_inflight=1
    )
    yield svc
    arena.close()


def call(svc: KvtierService, method: str, request: Any) -> Any:
    """The reply, or the status code the request was aborted with."""

    async def run() -> Any:
        try:
            return await getattr(svc, method)(request, Context())
        except Aborted as e:
            return e.code

    return asyncio.run(run())


def test_at_max_inflight_work_is_shed_and_releases_are_served(service: KvtierService) -> None:
    ns = service.cache.register_namespace(
        Namespace(
            model_id="m",
            model_revision="r",
            tokenizer_digest="none",
            kv_dtype="float16",
            layout="contiguous",
            tokens_per_block=8,
            num_layers=1,
            num_kv_heads=1,
            head_dim=128,
        )
    )
    s = service.sessions.open("c", None, Transport.SHM)
    store, _, _ = service.cache.stores.reserve(s, ns, [key(1)], Transport.SHM)
    load_session = service.sessions.open("d", None, Transport.SHM)
    assert store is not None and service.cache.writing_blocks == 1
    service.inflight = service.max_inflight  # e.g. a PrepareLoad waiting on the disk
    shed = call(service, "Lookup", pb.LookupRequest(session_id=s.id, namespace_id=ns.id, keys=key(1)))
    assert shed == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Completing the store frees its reservation: WRITING -> READY, not left for the lease.
    done = call(service, "CompleteStore", pb.CompleteStoreRequest(session_id=s.id, job_id=store.id, ok=True))
    assert isinstance(done, pb.CompleteStoreReply) and done.committed == 1
    assert service.cache.writing_blocks == 0
    assert isinstance(call(service, "Heartbeat", pb.HeartbeatRequest(session_id=s.id)), pb.HeartbeatReply)
    assert isinstance(
        call(service, "CloseSession", pb.CloseSessionRequest(session_id=load_session.id)),
        pb.CloseSessionReply,
    )
    assert service.inflight == service.max_inflight  # releases are not counted in progress
    assert {"CompleteStore", "CompleteLoad", "Heartbeat", "CloseSession"} <= NEVER_SHED

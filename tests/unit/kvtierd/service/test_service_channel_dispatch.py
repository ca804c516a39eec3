"""kvtierd.service.gate.ChannelDispatch without sockets: a call is decoded and handed to the
handler of its name with a ChannelContext carrying the channel's tenant; one naming another
session is NOT_FOUND (counted) and never reaches a handler; an undecodable body reaches the
handler as Undecodable (the call gate answers it); an abort becomes the reply's status."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.gate import MAX_ERROR_BYTES, ChannelContext, ChannelDispatch, Undecodable
from kvtierd.tenancy import Tenancy


class FakeService:
    def __init__(self) -> None:
        self.tenancy = Tenancy(None)
        self.bad_frames = 0
        self.errors: list[tuple[str, str]] = []
        self.seen: list[tuple[Any, Any]] = []

    def count_error(self, method: str, code: str) -> None:
        self.errors.append((method, code))

    async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802 (the RPC's name)
        self.seen.append((request, context))
        return pb.HeartbeatReply(boot_epoch=7)

    async def Prefetch(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "x" * (2 * MAX_ERROR_BYTES))


def call(svc: FakeService, name: str, body: bytes) -> tuple[int, bytes]:
    return asyncio.run(ChannelDispatch(svc).call(5, "t", name, body, 2000))


def test_a_call_reaches_its_handler_with_the_channels_tenant() -> None:
    svc = FakeService()
    status, out = call(svc, "Heartbeat", pb.HeartbeatRequest(session_id=5).SerializeToString())
    assert status == 0 and pb.HeartbeatReply.FromString(out).boot_epoch == 7
    ((request, context),) = svc.seen
    assert request.session_id == 5 and type(context) is ChannelContext
    assert context.tenant == "t" and 0 < (context.time_remaining() or 0) <= 2.0


def test_another_sessions_call_is_not_found_and_counted() -> None:
    svc = FakeService()
    status, out = call(svc, "Heartbeat", pb.HeartbeatRequest(session_id=6).SerializeToString())
    assert status == grpc.StatusCode.NOT_FOUND.value[0] and b"session 6" in out
    assert svc.errors == [("Heartbeat", "NOT_FOUND")] and not svc.seen


def test_an_undecodable_body_reaches_the_handler_as_such() -> None:
    svc = FakeService()
    call(svc, "Heartbeat", b"\xff\xff\xff")
    assert type(svc.seen[0][0]) is Undecodable


def test_an_abort_is_the_replys_status_and_its_details_are_capped() -> None:
    svc = FakeService()
    status, out = call(svc, "Prefetch", pb.PrefetchRequest(session_id=5).SerializeToString())
    assert status == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert out == b"x" * MAX_ERROR_BYTES
    ChannelDispatch(svc).bad_frame()
    assert svc.bad_frames == 1

"""The control channel's dispatch: a call that arrived as a frame on a session's control
channel (framing and flow control: :mod:`kvtierd.transports.control`) is decoded, checked to
name the channel's own session, and served by the same handler, through the same call gate
(:mod:`kvtierd.service.gate`: admission, the deadline, error mapping, latency histograms, the
published indexes' flush), as a gRPC call, with a :class:`~kvtierd.service.gate.ChannelContext`:
the caller is the session's tenant. Its answer is (status code, reply or error bytes).

:class:`ChannelDispatch` implements the transports side's
:class:`~kvtierd.transports.control.ControlDispatcher`; kvtierd.app hands one to each channel.
Owns nothing (the counts it feeds are the service's); event-loop thread only.
"""

from __future__ import annotations

from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.gate import SERVICE, ChannelAbort, ChannelContext, Undecodable
from kvtierd.tenancy import Tenancy

MAX_ERROR_BYTES = 4096
_PARSE = {
    name: getattr(pb, SERVICE.methods_by_name[name].input_type.name).FromString
    for name in wire.CONTROL_METHODS
}


class Served(Protocol):
    """What a channel's calls reach of the service (kvtierd.service.KvtierService): its
    tenancy, its counts, and its handlers by method name."""

    tenancy: Tenancy
    bad_frames: int

    def count_error(self, method: str, code: str) -> None: ...


class ChannelDispatch:
    """Serves control-channel calls with ``service``'s handlers (see the module docstring)."""

    def __init__(self, service: Served) -> None:
        self._service = service

    @property
    def tenancy(self) -> Tenancy:
        """The daemon's one Tenancy (the channel counts its bytes and itself there)."""
        return self._service.tenancy

    def bad_frame(self) -> None:
        """A frame broke the protocol (the channel closes): counted for /metrics."""
        self._service.bad_frames += 1

    async def call(
        self, session_id: int, tenant: str | None, name: str, body: bytes, timeout_ms: int
    ) -> tuple[int, bytes]:
        """Serve one call of method ``name`` (one of ``wire.CONTROL_METHODS``) on a channel of
        session ``session_id`` (its tenant: ``tenant``): (status code, reply or error bytes)."""
        service = self._service
        request: Any
        try:
            request = _PARSE[name](body)
        except DecodeError as e:
            request = Undecodable(str(e) or "malformed protobuf")
        context = ChannelContext(tenant, timeout_ms / 1000 if timeout_ms else None)
        if type(request) is not Undecodable and getattr(request, "session_id", session_id) != session_id:
            # (as the handler says of another tenant's session: an id tells nothing)
            service.count_error(name, "NOT_FOUND")
            return (
                grpc.StatusCode.NOT_FOUND.value[0],
                f"unknown or expired session {request.session_id} (a control channel "
                "serves only its own session)".encode(),
            )
        try:
            reply = await getattr(service, name)(request, context)
        except ChannelAbort as e:
            return e.code.value[0], e.details.encode()[:MAX_ERROR_BYTES]
        return 0, reply.SerializeToString()

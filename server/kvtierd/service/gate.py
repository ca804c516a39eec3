"""The call gate: what every Kvtier call passes through before and after its handler, whether
it came over gRPC or a session's control channel (:class:`ChannelDispatch`, below).

In order: the caller is authenticated (a bearer token or a client certificate on gRPC; the
session's tenant, as the current tenants file has it, on a control channel); admission: at most
``max_inflight`` handlers in progress (those that wait: a store making room on NVMe, a load
promoting blocks, a CUDA copy), one more is answered RESOURCE_EXHAUSTED at once, except the RPCs
that only release daemon state (``NEVER_SHED``: completing a job, renewing or closing a lease,
releasing a CUDA buffer: cheap, never waiting, and shedding them would keep pins, reservations
and WRITING entries alive under load; they are always admitted and not counted); a request
whose deadline passed before its handler ran (it waited in the loop's queue; its client gave
up) is answered DEADLINE_EXCEEDED without doing the work; an undecodable body
(:class:`Undecodable`) is INVALID_ARGUMENT. Errors from :mod:`kvtier_contract.errors` become
gRPC statuses through the one table ``kvtier_contract.errors.GRPC_STATUS``; every call's latency
is observed per method, and ``after_rpc`` runs (the published indexes: the call's changes,
before its reply).

The control channel's side (framing and flow control: :mod:`kvtierd.transports.control`):
:class:`ChannelDispatch` implements the transports' :class:`~kvtierd.transports.control.
ControlDispatcher` (kvtierd.app hands one to each channel). A call that arrived as a frame is
decoded, checked to name the channel's own session, and served by the same handler, through
this same gate, as a gRPC call, with a :class:`ChannelContext`: the caller is the session's
tenant. Its answer is (status code, reply or error bytes). The channel itself and the bytes it
holds are admitted by the cache's admission (:class:`kvtierd.cache.admission.Admission`), which
the dispatch hands it.

Owns nothing: the counts and histograms it feeds are the service's (:class:`GateState`,
:class:`Served`), the channels' counts the cache's admission's. Event-loop thread only;
``CALLER`` / ``CREDENTIAL`` are context variables, one value per call.
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError

from kvtier_contract import wire
from kvtier_contract.errors import GRPC_STATUS, OVERLOADED, KvtierError, ResourceExhausted
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache.admission import Admission
from kvtierd.ratelog import RateLimitedLog
from kvtierd.stats import LatencyHistogram
from kvtierd.tenancy import NO_CREDENTIAL, Credential, Tenancy
from kvtierd.tenants import Tenant

SERVICE = pb.DESCRIPTOR.services_by_name["Kvtier"]
# Handlers that free pins, reservations or leases and never wait: admitted even at max_inflight.
NEVER_SHED = frozenset({"CompleteStore", "CompleteLoad", "Heartbeat", "CloseSession", "ReleaseCudaBuffer"})

CALLER: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("kvtier_caller", default=None)
"""The authenticated tenant of the RPC being served (None: single-tenant, or not an RPC)."""
CREDENTIAL: contextvars.ContextVar[Credential] = contextvars.ContextVar(
    "kvtier_credential", default=NO_CREDENTIAL
)
"""What proved that tenant (OpenSession records it on the session; a reload checks it again)."""


class Undecodable:
    """What a Kvtier request deserializer returns for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class ChannelAbort(Exception):
    """What ``ChannelContext.abort`` raises: the call's status, for the channel's reply."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ChannelContext:
    """The context of a call made on a session's control channel
    (:mod:`kvtierd.transports.control`) instead of gRPC: the caller is that session's tenant
    (as it is in the current tenants file: one a reload removed is no credential), the deadline
    is the frame's, and ``abort`` raises ChannelAbort. One per call; event-loop thread only."""

    __slots__ = ("tenant", "_deadline")

    def __init__(self, tenant: str | None, timeout_s: float | None) -> None:
        self.tenant = tenant
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    @staticmethod
    def peer() -> str:
        return "control-channel"

    @staticmethod
    async def abort(code: grpc.StatusCode, details: str) -> NoReturn:
        raise ChannelAbort(code, details)


class GateState(Protocol):
    """What the gate reads and feeds of the service (kvtierd.service.KvtierService)."""

    tenancy: Tenancy
    inflight: int
    max_inflight: int
    latency: dict[str, LatencyHistogram]
    bad_input_log: RateLimitedLog
    after_rpc: Callable[[], None]

    def count_error(self, method: str, code: str) -> None: ...


def rpc(fn: Callable[[Any, Any, Any], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Time the call and map kvtier errors to one gRPC status each; an undecodable request
    is INVALID_ARGUMENT before the handler runs."""
    name = fn.__name__
    request_type = SERVICE.methods_by_name[name].input_type.full_name
    admitted = 0 if name in NEVER_SHED else 1  # what the call counts in ``inflight``

    @functools.wraps(fn)
    async def wrapper(self: GateState, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        caller = await _authenticate(self, name, context)
        await _admit(self, name, context, admitted)
        self.inflight += admitted
        try:
            if type(request) is Undecodable:
                self.count_error(name, "INVALID_ARGUMENT")
                self.bad_input_log.warning(
                    "%s: undecodable request body from %s: %s", name, context.peer(), request.error
                )
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request could not be decoded as {request_type}: {request.error}",
                )
            return await fn(self, request, context)
        except KvtierError as e:
            code = getattr(grpc.StatusCode, GRPC_STATUS.get(type(e), "UNKNOWN"))
            self.count_error(name, code.name)
            if isinstance(e, ResourceExhausted) and e.quota is not None:
                self.tenancy.count_refusal(caller, e.quota)
            await context.abort(code, str(e))
        finally:
            self.inflight -= admitted
            self.after_rpc()  # (the published indexes: the call's changes, before its reply)
            self.latency.setdefault(name, LatencyHistogram()).observe(time.perf_counter() - t0)

    return wrapper


async def _authenticate(state: GateState, name: str, context: Any) -> Tenant | None:
    """Set ``CALLER`` and ``CREDENTIAL`` for the call (UNAUTHENTICATED when the daemon has
    tenants and the call proves none); the caller."""
    caller, cred = None, NO_CREDENTIAL
    tenancy = state.tenancy
    if tenancy.tenants is not None:
        if type(context) is ChannelContext:
            caller = tenancy.tenant(context.tenant)
        else:
            found = tenancy.authenticate(_bearer(context)) or tenancy.authenticate(None, _cert_names(context))
            if found is not None:
                caller, cred = found
        if caller is None:
            state.count_error(name, "UNAUTHENTICATED")
            if type(context) is ChannelContext:  # its tenant was removed by a reload
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"tenant {context.tenant!r} of this channel's session is "
                    "no longer in the daemon's tenants file",
                )
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "a credential is required: metadata 'authorization: Bearer "
                "<token>' with a token of the daemon's tenants file or of a "
                "Unix peer login, or a client certificate of a tenant (mTLS)",
            )
    CALLER.set(caller)
    CREDENTIAL.set(cred)
    return caller


async def _admit(state: GateState, name: str, context: Any, admitted: int) -> None:
    """RESOURCE_EXHAUSTED at ``max_inflight`` (for a call that counts), DEADLINE_EXCEEDED for a
    call whose deadline passed while it waited to be served."""
    if admitted and state.inflight >= state.max_inflight:
        state.count_error(name, "RESOURCE_EXHAUSTED")
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{OVERLOADED}: {state.inflight} requests in progress "
            f"(max_inflight_rpcs = {state.max_inflight}); retry later",
        )
    left = context.time_remaining()
    if left is not None and left <= 0:
        state.count_error(name, "DEADLINE_EXCEEDED")
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request could be served"
        )


def _bearer(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[7:].strip()
    return None


def _cert_names(context: Any) -> list[str]:
    """The verified client certificate's common name and DNS names (none without mTLS)."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001  (no transport security on this connection)
        return []
    names = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names += [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in auth.get(key, ())]
    return names


# -- the control channel's calls ----------------------------------------------------------------

MAX_ERROR_BYTES = 4096
_PARSE = {
    name: getattr(pb, SERVICE.methods_by_name[name].input_type.name).FromString
    for name in wire.CONTROL_METHODS
}


class Admitting(Protocol):
    """What holds the daemon's admission (kvtierd.cache.TieredCache)."""

    @property
    def admission(self) -> Admission: ...


class Served(Protocol):
    """What a channel's calls reach of the service (kvtierd.service.KvtierService): its
    cache (whose admission counts the channels), its counts, and its handlers by method name."""

    bad_frames: int

    @property
    def cache(self) -> Admitting: ...

    def count_error(self, method: str, code: str) -> None: ...


class ChannelDispatch:
    """Serves control-channel calls with ``service``'s handlers, through the gate (see the module
    docstring)."""

    def __init__(self, service: Served) -> None:
        self._service = service

    @property
    def admission(self) -> Admission:
        """The cache's admission (the channel counts itself and its bytes there)."""
        return self._service.cache.admission

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

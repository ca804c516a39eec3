"""gRPC service: translates proto messages to TieredCache / SessionTable calls and back.

Every request is validated (ids, key counts and lengths, transports) before anything touches the
index or memory; every reply carries the boot epoch. Errors from :mod:`kvtier_contract.errors` become gRPC
statuses through the one table ``kvtier_contract.errors.GRPC_STATUS``. Runs on the daemon's event loop.

Registration (:func:`add_to_server`) builds the Kvtier method handlers from the proto descriptor
instead of the generated ``add_KvtierServicer_to_server`` (which stays as generated), with lenient
request deserializers: a body that does not decode reaches the handler as :class:`Undecodable`
and is answered INVALID_ARGUMENT, counted per method in ``errors``, and logged at most once per
``BAD_INPUT_LOG_INTERVAL_S`` (left to grpc: UNKNOWN, uncounted, a traceback per request).

Admission (in ``_rpc``): at most ``max_inflight`` Kvtier handlers in progress (those that wait:
a store making room on NVMe, a load promoting blocks, a CUDA copy); one more is answered
RESOURCE_EXHAUSTED at once. The RPCs that only release daemon state (``NEVER_SHED``: completing
a job, renewing or closing a lease, releasing a CUDA buffer) are cheap and never wait, and shedding
them would keep pins, reservations and WRITING entries alive under load: they are always
admitted and not counted. A request whose deadline passed before its handler ran (it waited in
the loop's queue; its client gave up) is answered DEADLINE_EXCEEDED without doing the work.
Health and reflection are other services and never refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvtier_contract.digests import block_digests
from kvtier_contract.errors import (
    GRPC_STATUS,
    OVERLOADED,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from kvtier_contract.protoutil import namespace_from_spec, namespace_spec, split_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.cache import TieredCache
from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.cache import check_digest_count, check_origin
from kvtierd.cache.jobs import LoadJob, StoreJob
from kvtierd.cache.lookup import PREFETCH, SHARED, LookupOptions
from kvtierd.domain import StoreStatus, TierId, Transport
from kvtierd.index import Entry, NamespaceState
from kvtierd.ratelog import RateLimitedLog
from kvtierd.sessions import Session, SessionTable
from kvtierd.stats import COUNTER_FIELDS, Counters, LatencyHistogram
from kvtierd.tenancy import NO_CREDENTIAL, QUOTA_NAMES, Credential, Tenancy
from kvtierd.tenants import Tenant
from kvtierd.transports.cuda_ipc import CudaIpcTransport

log = logging.getLogger("kvtierd.service")
NO_OFFSET = (1 << 64) - 1  # a held hit whose host slot may change has no offset to read
BAD_INPUT_LOG_INTERVAL_S = 10.0  # at most one log line per this many seconds for bad bodies
_SERVICE = pb.DESCRIPTOR.services_by_name["Kvtier"]
# Handlers that free pins, reservations or leases and never wait: admitted even at max_inflight.
NEVER_SHED = frozenset({"CompleteStore", "CompleteLoad", "Heartbeat", "CloseSession",
                        "ReleaseCudaBuffer"})

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Undecodable:
    """What a Kvtier request deserializer returns for bytes that are not a valid message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _rpc(fn: Callable[[Any, Any, Any], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Time the call and map kvtier errors to one gRPC status each; an undecodable request
    is INVALID_ARGUMENT before the handler runs."""
    name = fn.__name__
    request_type = _SERVICE.methods_by_name[name].input_type.full_name
    admitted = 0 if name in NEVER_SHED else 1  # what the call counts in ``inflight``

    @functools.wraps(fn)
    async def wrapper(self: KvtierService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        caller, cred = None, NO_CREDENTIAL
        tenancy = self.tenancy
        if tenancy.tenants is not None:
            if type(context) is ChannelContext:
                caller = tenancy.tenant(context.tenant)
            else:
                found = tenancy.authenticate(_bearer(context)) or \
                    tenancy.authenticate(None, _cert_names(context))
                if found is not None:
                    caller, cred = found
            if caller is None:
                self.count_error(name, "UNAUTHENTICATED")
                if type(context) is ChannelContext:  # its tenant was removed by a reload
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                        f"tenant {context.tenant!r} of this channel's session is "
                                        "no longer in the daemon's tenants file")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "a credential is required: metadata 'authorization: Bearer "
                                    "<token>' with a token of the daemon's tenants file or of a "
                                    "Unix peer login, or a client certificate of a tenant (mTLS)")
        CALLER.set(caller)
        CREDENTIAL.set(cred)
        if admitted and self.inflight >= self.max_inflight:
            self.count_error(name, "RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{OVERLOADED}: {self.inflight} requests in progress "
                                f"(max_inflight_rpcs = {self.max_inflight}); retry later")
        left = context.time_remaining()
        if left is not None and left <= 0:
            self.count_error(name, "DEADLINE_EXCEEDED")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the deadline passed before the request could be served")
        self.inflight += admitted
        try:
            if type(request) is Undecodable:
                self.count_error(name, "INVALID_ARGUMENT")
                self.bad_input_log.warning("%s: undecodable request body from %s: %s", name,
                                           context.peer(), request.error)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request could not be decoded as {request_type}: "
                                    f"{request.error}")
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
        names += [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                  for v in auth.get(key, ())]
    return names


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(str(e) or "malformed protobuf")

    return deserialize


def add_to_server(service: KvtierService, server: grpc.aio.Server) -> None:
    """Register ``service``'s methods (all unary) with lenient request deserializers."""
    handlers = {}
    for m in _SERVICE.methods:
        assert not (m.client_streaming or m.server_streaming), m.full_name
        request, reply = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            getattr(service, m.name), request_deserializer=_lenient(request.FromString),
            response_serializer=reply.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)


CALLER: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("kvtier_caller",
                                                                       default=None)
"""The authenticated tenant of the RPC being served (None: single-tenant, or not an RPC)."""
CREDENTIAL: contextvars.ContextVar[Credential] = contextvars.ContextVar("kvtier_credential",
                                                                       default=NO_CREDENTIAL)
"""What proved that tenant (OpenSession records it on the session; a reload checks it again)."""

MAX_SLICES = 64  # namespaces per LookupSlices call (an engine's TP ranks)
_MAX_TALLY = 1 << 32  # blocks per namespace per heartbeat: far above any real rate
_COUNTER_CAP = (1 << 63) - 1  # counters fed by clients' tallies stop here (uint64 in Stats)


class KvtierService(pb_grpc.KvtierServicer):  # type: ignore[misc]
    """The control plane. Owns nothing but its latency histograms and error counts (per method
    and status); event-loop thread only."""

    def __init__(self, cache: TieredCache, sessions: SessionTable, *, boot_epoch: int,
                 max_batch_blocks: int, advertise: Callable[[], dict[str, Any]],
                 cuda: CudaIpcTransport | None = None, max_inflight: int = 1 << 30,
                 tenancy: Tenancy | None = None) -> None:
        self.cache = cache
        self.cuda = cuda  # the cuda_ipc transport; None when cuda_ipc = false
        self.sessions = sessions
        self.boot_epoch = boot_epoch
        self.max_batch = max_batch_blocks
        self.advertise = advertise  # shm socket path, data channel address, arena size
        self.started = time.monotonic()
        self.draining = False
        self.latency: dict[str, LatencyHistogram] = {}
        self.max_inflight = max_inflight  # handlers in progress before RESOURCE_EXHAUSTED
        self.inflight = 0
        self.after_rpc: Callable[[], None] = lambda: None
        """Run at the end of every RPC on the event loop (the daemon publishes index changes)."""
        self.errors: dict[tuple[str, str], int] = {}  # (method, status code name) -> count
        self.bad_frames = 0  # control-channel frames that broke the protocol (channel closed)
        self.bad_input_log = RateLimitedLog(log, BAD_INPUT_LOG_INTERVAL_S)
        self.tenancy = tenancy or Tenancy(None)
        """Who callers are and what their tenants may hold (the daemon's one Tenancy)."""
        self.verify_store = "client"
        """Who hashes an shm store (config ``verify_store``; set by the daemon)."""

    # -- tenancy: every id a caller names is checked against the caller's tenant ------------------

    @staticmethod
    def _scope() -> str | None:
        """The tenant whose objects this call may see (None: all of them)."""
        caller = CALLER.get()
        return None if caller is None or caller.operator else caller.name

    def _session(self, session_id: int) -> Session:
        return self.sessions.get(session_id, self._scope())

    def _namespace(self, namespace_id: int) -> NamespaceState:
        """The namespace, or NotFound; another tenant's is answered exactly as an absent one
        (the same message as ``TieredCache.namespace``)."""
        scope = self._scope()
        ns = self.cache.namespaces.get(namespace_id)
        if ns is None or (scope is not None and ns.spec.tenant != scope):
            raise NotFound(f"unknown namespace {namespace_id} (register it first)",
                           field="namespace_id")
        self.cache.used(ns)
        return ns

    def _visible(self) -> list[NamespaceState]:
        scope = self._scope()
        return [ns for ns in self.cache.namespaces.values()
                if scope is None or ns.spec.tenant == scope]

    def _quota(self, name: str) -> int | None:
        """The caller's tenant's quota ``name`` (kvtierd.tenancy: the file's, else the default)."""
        return self.tenancy.quota(CALLER.get(), name)

    def _check_jobs(self, s: Session) -> None:
        """Open-job quotas of the caller's tenant and of ``s`` (before a job is created)."""
        caller = CALLER.get()
        if caller is None:
            return
        self.tenancy.check(caller, "session_open_jobs", len(s.store_jobs) + len(s.load_jobs) + 1,
                           f"session {s.id}")
        if s.tenant is not None:
            self.tenancy.check(caller, "open_jobs", 1 + sum(
                len(o.store_jobs) + len(o.load_jobs) for o in self.sessions.of_tenant(s.tenant)),
                f"tenant {s.tenant}")

    def _check_pins(self, s: Session, job: LoadJob) -> None:
        """The ``pinned_bytes`` quota of the caller's tenant, counted after ``job`` pinned its
        blocks (a pinned lookup's hit is only known then): over it, the job is released at once
        (nothing stays pinned) and the call is RESOURCE_EXHAUSTED."""
        caller = CALLER.get()
        if caller is None or s.tenant is None or self._quota("pinned_bytes") is None:
            return
        pinned = 0
        for o in self.sessions.of_tenant(s.tenant):
            for job_id in o.load_jobs:
                j = self.cache.jobs.get(o.id, job_id, LoadJob)
                pinned += len(j.items) * j.ns.slot_bytes
        try:
            self.tenancy.check(caller, "pinned_bytes", pinned, f"tenant {s.tenant}")
        except ResourceExhausted:
            self.cache.abort_job(s, job)  # (no load counted: nothing moved)
            raise

    def count_error(self, method: str, code: str) -> None:
        key = (method, code)
        self.errors[key] = self.errors.get(key, 0) + 1

    @_rpc
    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context: Any) -> Any:
        spec = namespace_from_spec(request.spec)
        if request.digest and request.digest != spec.digest:
            raise InvalidArgument("differs from the daemon's digest of the same fields "
                                  "(client and daemon disagree on the hashing spec)", field="digest")
        caller = CALLER.get()
        if caller is not None:
            self._tenant_may_register(caller, spec)
        ns = self.cache.register_namespace(spec)
        return pb.RegisterNamespaceReply(boot_epoch=self.boot_epoch, namespace_id=ns.id,
                                         block_bytes=ns.block_bytes, digest=spec.digest)

    def _tenant_may_register(self, caller: Tenant, spec: Any) -> None:
        """A tenant registers only namespaces naming it (``spec.tenant``, part of the digest:
        two tenants never share a namespace, nor its blocks), within its quota."""
        if spec.tenant is None:
            raise InvalidArgument("required: this daemon has tenants (set it to your tenant's "
                                  "name)", field="spec.tenant")
        if spec.tenant != caller.name and not caller.operator:
            raise PermissionDenied(f"{spec.tenant!r} is not the tenant of this credential",
                                   field="spec.tenant")
        if spec.namespace_id not in self.cache.namespaces:
            self.tenancy.check(caller, "namespaces", 1 + sum(
                1 for ns in self.cache.namespaces.values() if ns.spec.tenant == spec.tenant),
                f"tenant {spec.tenant}")

    @_rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> Any:
        if self.draining:
            raise Unavailable("daemon is draining")
        if request.transport not in set(Transport) | {pb.TRANSPORT_UNSPECIFIED}:
            raise InvalidArgument(f"unsupported transport {request.transport}", field="transport")
        transport = self._transport(request.transport or pb.TRANSPORT_SHM)
        caller = CALLER.get()
        tenant = caller.name if caller is not None else None
        if caller is not None and transport.label not in caller.transports:
            raise PermissionDenied(f"tenant {caller.name} may not use {transport.label} "
                                   f"(allowed: {', '.join(sorted(caller.transports))})",
                                   field="transport")
        if caller is not None:
            self.tenancy.check(caller, "sessions", len(self.sessions.of_tenant(caller.name)) + 1)
        s = self.sessions.open(request.client_name, request.lease_ttl_ms / 1000.0, transport,
                               tenant, caller.max_lease_s if caller is not None else None,
                               CREDENTIAL.get())
        adv = self.advertise()
        pool = self.mapped_arena(s)
        return pb.OpenSessionReply(
            boot_epoch=self.boot_epoch, session_id=s.id, lease_ttl_ms=int(s.ttl_s * 1000),
            shm_socket=adv["shm_socket"], data_host=adv["data_host"], data_port=adv["data_port"],
            arena_bytes=self.cache.host.pool_bytes[pool] if pool is not None else 0,
            max_batch_blocks=self.max_batch,
            data_secret=s.data_secret, data_tls=adv.get("data_tls", False), lookup_slices=True,
            tier_figures=self._tier_figures())

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        if request.local_lookups:
            self._count_local_lookups(request.local_lookups)
        return pb.HeartbeatReply(boot_epoch=self.boot_epoch, lease_ttl_ms=int(s.ttl_s * 1000),
                                 tier_figures=self._tier_figures())

    def _tier_figures(self) -> list[pb.TierFigures]:
        """The cache's read figures per tier below the host tier, on the wire."""
        return [pb.TierFigures(tier=int(tier), latency_us=round(f.latency_s * 1e6),
                               bytes_per_s=round(f.bytes_per_s), age_ms=round(f.age_s * 1e3),
                               reads=f.reads)
                for tier, f in sorted(self.cache.read_figures().items())]

    def _count_local_lookups(self, tallies: Sequence[Any]) -> None:
        """Add clients' published-index lookups to their namespaces' counters: all checked
        first, so a bad tally changes nothing. Counters saturate (a client cannot wrap them)."""
        if len(tallies) > len(self._visible()):
            raise InvalidArgument(f"has {len(tallies)} entries for {len(self._visible())} "
                                  "namespaces", field="local_lookups")
        checked: dict[int, tuple[Any, Any]] = {}
        for i, t in enumerate(tallies):
            name = f"local_lookups[{i}]"
            if t.blocks_hit > t.blocks_requested or t.lookups > t.blocks_requested or \
                    t.blocks_requested > _MAX_TALLY:
                raise InvalidArgument("needs blocks_hit <= blocks_requested, lookups <= "
                                      f"blocks_requested <= {_MAX_TALLY}", field=name)
            ns = self.cache.namespaces.get(t.namespace_id)
            scope = self._scope()
            if ns is not None and scope is not None and ns.spec.tenant != scope:
                ns = None  # another tenant's: answered as an absent one
            if ns is None:  # (INVALID_ARGUMENT: NOT_FOUND would read as a forgotten session)
                raise InvalidArgument(f"no namespace {t.namespace_id} on this daemon",
                                      field=f"{name}.namespace_id")
            if ns.id in checked:
                raise InvalidArgument(f"namespace {ns.id} appears twice",
                                      field=f"{name}.namespace_id")
            checked[ns.id] = (ns, t)
        for ns, t in checked.values():
            c, tpb = ns.counters, ns.spec.tokens_per_block
            miss = t.blocks_requested - t.blocks_hit
            for field, n in (("lookups", t.lookups), ("local_lookups", t.lookups),
                             ("blocks_requested", t.blocks_requested),
                             ("blocks_hit_local", t.blocks_hit), ("blocks_missed", miss),
                             ("tokens_requested", t.blocks_requested * tpb),
                             ("tokens_hit", t.blocks_hit * tpb), ("tokens_missed", miss * tpb)):
                setattr(c, field, min(_COUNTER_CAP, getattr(c, field) + n))

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> Any:
        self.sessions.close(request.session_id, self._scope())
        return pb.CloseSessionReply(boot_epoch=self.boot_epoch)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        base = self._arena_base(s, ns) if request.pin else 0
        return (await self._lookup(s, ns, keys, request.pin, base,
                                   promote=not request.hold_only))[0]

    @_rpc
    async def LookupSlices(self, request: pb.LookupSlicesRequest, context: Any) -> Any:
        """Every argument is checked before anything is pinned; a failure after the first pin
        (a quota, the session gone) releases the pins taken so far, and so does a slice with
        no hit (the common prefix is empty: every slice's reply then has job_id 0). The loop
        yields between slices, so one big call (up to 64 slices) never holds the event loop for
        more than one slice's lookup (docs/benchmarks.md §21)."""
        s = self._session(request.session_id)
        ids = list(request.namespace_ids)
        if not 1 <= len(ids) <= MAX_SLICES:
            raise InvalidArgument(f"{len(ids)} namespaces: 1 to {MAX_SLICES} per call",
                                  field="namespace_ids")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a namespace appears twice", field="namespace_ids")
        if len(request.keys) != len(ids):
            raise InvalidArgument(f"{len(request.keys)} key chains for {len(ids)} namespaces "
                                  "(one per namespace)", field="keys")
        nss = [self._namespace(i) for i in ids]
        chains = [split_keys(k, self.max_batch) for k in request.keys]
        bases = [self._arena_base(s, ns) if request.pin else 0 for ns in nss]
        replies: list[Any] = []
        pinned: list[LoadJob] = []
        hit: int | None = None
        try:
            for n, (ns, keys, base) in enumerate(zip(nss, chains, bases, strict=True)):
                if n:  # other callers' RPCs run between slices: one slice at most delays them
                    await asyncio.sleep(0)
                    s = self._session(request.session_id)  # (closed meanwhile: NOT_FOUND)
                reply, job = await self._lookup(s, ns, keys if hit is None else keys[:hit],
                                                request.pin, base,
                                                promote=not request.hold_only)
                replies.append(reply)
                if job is not None:
                    pinned.append(job)
                hit = reply.hit_blocks if hit is None else min(hit, reply.hit_blocks)
                if not hit:
                    break
        except BaseException:
            for job in pinned:  # all or nothing
                self.cache.abort_job(s, job)
            raise
        if pinned and not hit:  # a slice holds none of it: nothing is loadable, nothing pinned
            for job in pinned:
                self.cache.abort_job(s, job)
            for reply in replies:
                reply.job_id = 0
                del reply.offsets[:]
        return pb.LookupSlicesReply(boot_epoch=self.boot_epoch, hit_blocks=hit or 0,
                                    slices=replies)

    async def _lookup(self, s: Session, ns: NamespaceState, keys: Sequence[bytes], pin: bool,
                      base: int, *, promote: bool = True) -> tuple[Any, LoadJob | None]:
        """One namespace's lookup (``base``: the session's arena start, for a pin's offsets):
        its reply, and the job holding its pins (``promote`` False: ``hold_only``)."""
        if pin:
            self._check_jobs(s)
            held = await self.cache.lookup(ns, keys, LookupOptions(pin=s, promote=promote,
                                                                   shared=True))
            job, tiers = held.job, held.tiers
            if job is None:
                return pb.LookupReply(boot_epoch=self.boot_epoch), None
            self._check_pins(s, job)
            n = len(job.items)
            # A hold keeps a block's last copy: its host slot only while it has no copy below.
            offsets = [e.offset - base if t == TierId.HOST and e.copies is None else NO_OFFSET
                       for e, t in zip(job.items.values(), tiers, strict=True)]
            return pb.LookupReply(boot_epoch=self.boot_epoch, hit_blocks=n, job_id=job.id,
                                  tiers=tiers, offsets=offsets), job
        found = await self.cache.lookup(ns, keys, SHARED)
        return pb.LookupReply(boot_epoch=self.boot_epoch, hit_blocks=found.hit,
                              tiers=found.tiers, durable=found.durable), None

    @_rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        found = await self.cache.lookup(ns, keys, PREFETCH)
        return pb.PrefetchReply(boot_epoch=self.boot_epoch, ready_blocks=found.hit,
                                promoting=found.promoting)

    def mapped_arena(self, session: Session) -> int | None:
        """The arena (pool) a session's client maps: the shared one on a single-tenant daemon,
        its tenant's own on a daemon with tenants (None: it has none, nothing is handed out)."""
        if self.tenancy.tenants is None:
            return 0
        pool = self.cache.arena_of(session.tenant)
        return pool or None

    def _arena_base(self, session: Session, ns: NamespaceState) -> int:
        """For a session whose client maps an arena: that arena's start, subtracted from the
        offsets it is told (so they are offsets in its mapping). A namespace whose blocks live
        in another arena (the operator acting on a tenant's, or one registered before its tenant
        had an arena) cannot be moved through that mapping: FAILED_PRECONDITION (use tcp)."""
        if session.transport is Transport.TCP:
            return 0
        pool = self.mapped_arena(session)
        if pool is None or ns.pool != pool:
            raise FailedPrecondition(
                f"namespace {ns.id} lives in a host arena this session does not map (open a "
                "tcp session for it)", field="transport")
        return self.cache.host.pool_bases[pool]

    def _job_transport(self, session: Session, value: int) -> Transport:
        """A job's transport: valid, and the one its session was opened for, or shm in a
        cuda_ipc session (a tcp session never commits slots it did not send: it has no mapping
        to write them through)."""
        transport = self._transport(value)
        # a cuda_ipc session maps the arena too (host buffers and CPU layouts move over it)
        if transport is not session.transport and not (
                transport is Transport.SHM and session.transport is Transport.CUDA_IPC):
            raise FailedPrecondition(
                f"{transport.label} job in a session opened for {session.transport.label} "
                "(open a session per transport)", field="transport")
        return transport

    def _transport(self, value: int) -> Transport:
        if value not in set(Transport):
            raise InvalidArgument(f"must be TRANSPORT_SHM, TRANSPORT_TCP or TRANSPORT_CUDA_IPC, "
                                  f"got {value}", field="transport")
        if value == Transport.CUDA_IPC and self.cuda is None:
            raise FailedPrecondition("cuda_ipc is disabled on this daemon (start it with "
                                     "cuda_ipc = true)", field="transport")
        return Transport(value)

    def _cuda(self) -> CudaIpcTransport:
        if self.cuda is None:
            raise FailedPrecondition("cuda_ipc is disabled on this daemon (start it with "
                                     "cuda_ipc = true)", field="transport")
        return self.cuda

    @_rpc
    async def RegisterCudaBuffer(self, request: pb.RegisterCudaBufferRequest, context: Any) -> Any:
        cuda = self._cuda()
        s = self._session(request.session_id)
        buffer_id = await cuda.register(s, request.device_uuid, request.ipc_handle,
                                        request.handle_offset, request.buffer_bytes)
        return pb.RegisterCudaBufferReply(boot_epoch=self.boot_epoch, buffer_id=buffer_id)

    @_rpc
    async def ReleaseCudaBuffer(self, request: pb.ReleaseCudaBufferRequest, context: Any) -> Any:
        cuda = self._cuda()
        cuda.release(self._session(request.session_id), request.buffer_id)
        return pb.ReleaseCudaBufferReply(boot_epoch=self.boot_epoch)

    @_rpc
    async def CudaCopy(self, request: pb.CudaCopyRequest, context: Any) -> Any:
        cuda = self._cuda()
        s = self._session(request.session_id)
        copies, nbytes = await cuda.copy(s, request.job_id, request.buffer_id,
                                         list(request.buffer_offsets))
        return pb.CudaCopyReply(boot_epoch=self.boot_epoch, copies=copies, bytes=nbytes)

    @_rpc
    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        token_ids, parent = list(request.token_ids), request.parent_key or None
        check_origin(ns, keys, token_ids, parent)  # before anything is evicted for the store
        transport = self._job_transport(s, request.transport)
        base = self._arena_base(s, ns)
        self._check_jobs(s)
        if self.draining:
            raise Unavailable("daemon is draining: stores are not admitted")
        self.cache.fit(ns, len(keys))  # the tenant's host_bytes (its coldest blocks go first)
        if self.cache.chain:
            await self.cache.make_room(ns, keys)
            # The wait may have outlived the lease: never attach a job to a released session;
            # and other stores of the tenant may have reserved meanwhile: check its quotas
            # again, with no await between the check and the reservation.
            s = self._session(request.session_id)
            self._check_jobs(s)
            self.cache.fit(ns, len(keys))
        job, status, offsets = self.cache.prepare_store(s, ns, keys, transport,
                                                        token_ids=token_ids, parent=parent)
        if base and job is not None:
            offsets = [o - base if st == StoreStatus.RESERVED else 0
                       for o, st in zip(offsets, status, strict=True)]
        return pb.PrepareStoreReply(boot_epoch=self.boot_epoch, job_id=job.id if job else 0,
                                    status=status, offsets=offsets)

    @_rpc
    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        digests = await self._store_digests(s, request)
        committed, aborted = self.cache.complete_store(s, request.job_id, request.ok,
                                                       list(request.item_ok), digests=digests)
        return pb.CompleteStoreReply(boot_epoch=self.boot_epoch, committed=committed,
                                     aborted=aborted)

    async def _store_digests(self, s: Session, request: pb.CompleteStoreRequest) -> list[int]:
        """The digest of each reserved key's block (docs/security.md "Bytes verified end to
        end"): an shm client's own (``verify_store = "client"``; a wrong one makes only its own
        tenant's block a miss at its next load), else hashed here from the slots, off the event
        loop (xxhash releases the GIL); a tcp job's were hashed as its bytes arrived. The
        client's count is checked first (INVALID_ARGUMENT, nothing changes)."""
        job = self.cache.jobs.get(s.id, request.job_id, StoreJob)
        self.cache.jobs.not_copying(job.id)
        given = list(request.digests)
        check_digest_count(given, job)
        if not self.cache.verify_bytes or not request.ok:
            return []
        if given and job.transport is Transport.SHM and self.verify_store == "client":
            return given
        items = sorted(job.items.items())
        out = [job.digests.get(i, 0) for i, _e in items]
        todo = [(n, e) for n, (i, e) in enumerate(items) if i not in job.digests and
                (not job.transport.daemon_moved or i in job.received)]
        if todo:
            nb, host = job.ns.block_bytes, self.cache.host
            views = [host.view(e.offset, nb) for _n, e in todo]
            hashed = await asyncio.get_running_loop().run_in_executor(None, block_digests, views)
            for (n, _e), d in zip(todo, hashed, strict=True):
                out[n] = d
        return out

    @_rpc
    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        """found[i] = 1: key i is pinned at offsets[i]. found[i] = 0 with tiers[i] = a storage
        tier: present there but not placed in the host tier this round (ask again after
        CompleteLoad); with tiers[i] = TIER_NONE: absent."""
        s = self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        transport = self._job_transport(s, request.transport)
        base = self._arena_base(s, ns)
        self._check_jobs(s)
        # never let the caller's deadline pass waiting on a slow tier (the caller would take
        # a live daemon for one that is away): answer by then with what the host tier holds
        answer_by = AnswerBy.for_deadline(context.time_remaining())
        job, deferred = await self.cache.prepare_load(s, ns, keys, transport,
                                                      host_only=request.host_only,
                                                      answer_by=answer_by)
        if job is not None:
            left = context.time_remaining()
            if left is not None and left <= 0:  # (the loop itself was late): pin nothing
                self.cache.abort_job(s, job)
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "the deadline passed before the load could be answered")
            self._check_pins(s, job)
        n = len(keys)
        found, offsets, tiers = bytearray(n), [0] * n, bytearray(n)
        for i, tier in deferred.items():
            tiers[i] = tier
        cut = answer_by is not None and answer_by.cut
        if job is None:
            return pb.PrepareLoadReply(boot_epoch=self.boot_epoch, found=bytes(found),
                                       offsets=offsets, tiers=bytes(tiers), deadline_cut=cut)
        for i, e in job.items.items():
            found[i], offsets[i], tiers[i] = 1, e.offset - base, pb.TIER_HOST
        digests: list[int] = []
        if self.cache.verify_bytes:  # 0: no digest known (the client checks nothing)
            digests = [0] * n
            for i, e in job.items.items():
                digests[i] = e.digest or 0
        return pb.PrepareLoadReply(boot_epoch=self.boot_epoch, job_id=job.id, found=bytes(found),
                                   offsets=offsets, tiers=bytes(tiers), digests=digests,
                                   deadline_cut=cut)

    @_rpc
    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        bad: list[Entry] = []
        claimed = self.cache.corrupt_claims(s, request.job_id, list(request.corrupt)) \
            if request.corrupt else []
        if claimed:  # rehashed off the loop (up to a whole job's bytes), the slots still pinned
            host = self.cache.host
            views = [host.view(e.offset, e.ns.block_bytes) for e in claimed]
            hashed = await asyncio.get_running_loop().run_in_executor(None, block_digests, views)
            self.cache.jobs.get(s.id, request.job_id, LoadJob)  # pinned all along, or NotFound
            bad = [e for e, d in zip(claimed, hashed, strict=True) if d != e.digest]
        self.cache.complete_load(s, request.job_id)
        dropped = self.cache.drop_corrupt(bad) if bad else 0
        if dropped:
            log.warning("%d block(s) of namespace %d failed verification at a load: dropped",
                        dropped, bad[0].ns.id)
        return pb.CompleteLoadReply(boot_epoch=self.boot_epoch, dropped=dropped)

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        return self.stats_reply()

    def stats_reply(self) -> pb.StatsReply:
        """Everything (the operator, a single-tenant daemon, /metrics), or, for a tenant, its
        own namespaces and totals over them, its sessions, and no per-tier detail."""
        c = self.cache
        host = c.host.stats()
        scope = self._scope()
        if scope is not None:
            visible = self._visible()
            total = Counters()
            for ns in visible:
                total.add(ns.counters)
            reply = pb.StatsReply(  # the capacity of the arena its blocks live in
                boot_epoch=self.boot_epoch, uptime_s=time.monotonic() - self.started,
                total=_counters(total),
                host_capacity_bytes=c.host.pool_bytes[c.arena_of(scope)],
                host_used_bytes=sum(ns.counters.resident_blocks * ns.slot_bytes
                                    for ns in visible),
                sessions=len(self.sessions.of_tenant(scope)))
            self._add_identities(reply, visible, [scope])
            return reply
        reply = pb.StatsReply(
            boot_epoch=self.boot_epoch, uptime_s=time.monotonic() - self.started,
            total=_counters(c.totals()), host_capacity_bytes=host["capacity_bytes"],
            host_used_bytes=host["used_bytes"], sessions=len(self.sessions),
            leases_expired=self.sessions.expired_total, tier_figures=self._tier_figures(),
            **c.figures())
        for link in c.chain:  # one storage tier today: NVMe
            reply.nvme.CopyFrom(pb.NvmeStats(enabled=True, write_policy=link.write_policy.name,
                                             flushes_in_flight=link.flushes_in_flight,
                                             **link.tier.stats()))
        if c.fleet is not None:
            fig = c.fleet.tier.stats()
            nodes = fig.pop("nodes")
            reply.cluster.CopyFrom(pb.ClusterStats(enabled=True, **fig))
            for n in nodes:
                reply.cluster.nodes.add(**n)
        if self.cuda is not None:
            reply.cuda_ipc.CopyFrom(pb.CudaIpcStats(**self.cuda.stats()))
        tenants = self.tenancy.tenants
        self._add_identities(reply, list(c.namespaces.values()),
                             sorted(tenants.by_name) if tenants is not None else [])
        return reply

    def _add_identities(self, reply: pb.StatsReply, namespaces: list[NamespaceState],
                        tenant_names: list[str]) -> None:
        """Each namespace (every identity field, the cache salt as ``salt_tag``'s tag, never
        itself, and the tenant holding it: a tenant of the tenants file, else "") and each
        tenant (sessions, namespaces, quotas and refusals)."""
        held: dict[str, int] = {}
        for ns in namespaces:
            tenant = ns.spec.tenant or ""
            tenant = tenant if self.tenancy.tenant(tenant) is not None else ""
            held[tenant] = held.get(tenant, 0) + 1
            spec = namespace_spec(ns.spec)
            if ns.spec.cache_salt is not None:  # an isolation secret (vLLM: per user)
                spec.cache_salt = salt_tag(ns.spec.cache_salt)
            reply.namespaces.add(namespace_id=ns.id, model_id=ns.spec.model_id,
                                 model_revision=ns.spec.model_revision,
                                 block_bytes=ns.block_bytes, counters=_counters(ns.counters),
                                 spec=spec, tenant=tenant)
        for name in tenant_names:
            t = self.tenancy.tenant(name)
            if t is None:
                continue
            ts = reply.tenants.add(name=name, operator=t.operator, namespaces=held.get(name, 0),
                                   sessions=len(self.sessions.of_tenant(name)))
            for quota in QUOTA_NAMES:
                limit = self.tenancy.quota(t, quota)
                ts.quotas.add(name=quota, limited=limit is not None, limit=limit or 0,
                              refusals=self.tenancy.refusals(name, quota))


def _counters(c: Counters) -> pb.Counters:
    return pb.Counters(**{f: getattr(c, f) for f in COUNTER_FIELDS})


_SALT_TAG_KEY = secrets.token_bytes(32)  # one per daemon process, never written anywhere


def salt_tag(salt: str) -> str:
    """What Stats shows for a cache salt: ``hmac:`` and 12 hex digits of its HMAC-SHA256 under
    a key of this daemon process. Equal salts get equal tags in one daemon's run (two salted
    namespaces can be told apart), and the tag neither reveals a salt nor confirms a guessed
    one (unlike a plain digest of a guessable salt); it changes when the daemon restarts."""
    return "hmac:" + hmac.new(_SALT_TAG_KEY, salt.encode(), hashlib.sha256).hexdigest()[:12]

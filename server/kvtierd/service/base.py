"""The service's state and the checks every handler family shares: the caller's scope (every
id a caller names is checked against the caller's tenant), its quotas on jobs and pins, the
transports a job may use and the arena offsets a session is told.

:class:`ServiceBase` owns nothing but its latency histograms and error counts (per method and
status), which the call gate (:mod:`kvtierd.service.gate`) feeds; the handler families
(:mod:`kvtierd.service.sessions`, ``lookups``, ``transfers``, ``cuda``, ``stats``) derive from
it and :class:`kvtierd.service.KvtierService` joins them. Event-loop thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.cache.jobs import LoadJob
from kvtierd.domain import Transport
from kvtierd.index import NamespaceState
from kvtierd.ratelog import RateLimitedLog
from kvtierd.service.gate import CALLER
from kvtierd.sessions import Session, SessionTable
from kvtierd.stats import LatencyHistogram
from kvtierd.tenancy import Tenancy
from kvtierd.transports.cuda_ipc import CudaIpcTransport

log = logging.getLogger("kvtierd.service")
BAD_INPUT_LOG_INTERVAL_S = 10.0  # at most one log line per this many seconds for bad bodies


class ServiceBase:
    """The control plane's state. Owns nothing but its latency histograms and error counts (per
    method and status); event-loop thread only."""

    def __init__(
        self,
        cache: TieredCache,
        sessions: SessionTable,
        *,
        boot_epoch: int,
        max_batch_blocks: int,
        advertise: Callable[[], dict[str, Any]],
        cuda: CudaIpcTransport | None = None,
        max_inflight: int = 1 << 30,
        tenancy: Tenancy | None = None,
    ) -> None:
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
            raise NotFound(f"unknown namespace {namespace_id} (register it first)", field="namespace_id")
        self.cache.used(ns)
        return ns

    def _visible(self) -> list[NamespaceState]:
        scope = self._scope()
        return [ns for ns in self.cache.namespaces.values() if scope is None or ns.spec.tenant == scope]

    def _quota(self, name: str) -> int | None:
        """The caller's tenant's quota ``name`` (kvtierd.tenancy: the file's, else the default)."""
        return self.tenancy.quota(CALLER.get(), name)

    def _check_jobs(self, s: Session) -> None:
        """Open-job quotas of the caller's tenant and of ``s`` (before a job is created)."""
        caller = CALLER.get()
        if caller is None:
            return
        self.tenancy.check(
            caller, "session_open_jobs", len(s.store_jobs) + len(s.load_jobs) + 1, f"session {s.id}"
        )
        if s.tenant is not None:
            self.tenancy.check(
                caller,
                "open_jobs",
                1 + sum(len(o.store_jobs) + len(o.load_jobs) for o in self.sessions.of_tenant(s.tenant)),
                f"tenant {s.tenant}",
            )

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

    def _tier_figures(self) -> list[pb.TierFigures]:
        """The cache's read figures per tier below the host tier, on the wire."""
        return [
            pb.TierFigures(
                tier=int(tier),
                latency_us=round(f.latency_s * 1e6),
                bytes_per_s=round(f.bytes_per_s),
                age_ms=round(f.age_s * 1e3),
                reads=f.reads,
            )
            for tier, f in sorted(self.cache.read_figures().items())
        ]

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
                "tcp session for it)",
                field="transport",
            )
        return self.cache.host.pool_bases[pool]

    def _job_transport(self, session: Session, value: int) -> Transport:
        """A job's transport: valid, and the one its session was opened for, or shm in a
        cuda_ipc session (a tcp session never commits slots it did not send: it has no mapping
        to write them through)."""
        transport = self._transport(value)
        # a cuda_ipc session maps the arena too (host buffers and CPU layouts move over it)
        if transport is not session.transport and not (
            transport is Transport.SHM and session.transport is Transport.CUDA_IPC
        ):
            raise FailedPrecondition(
                f"{transport.label} job in a session opened for {session.transport.label} "
                "(open a session per transport)",
                field="transport",
            )
        return transport

    def _transport(self, value: int) -> Transport:
        if value not in set(Transport):
            raise InvalidArgument(
                f"must be TRANSPORT_SHM, TRANSPORT_TCP or TRANSPORT_CUDA_IPC, got {value}", field="transport"
            )
        if value == Transport.CUDA_IPC and self.cuda is None:
            raise FailedPrecondition(
                "cuda_ipc is disabled on this daemon (start it with cuda_ipc = true)", field="transport"
            )
        return Transport(value)

    def _cuda(self) -> CudaIpcTransport:
        if self.cuda is None:
            raise FailedPrecondition(
                "cuda_ipc is disabled on this daemon (start it with cuda_ipc = true)", field="transport"
            )
        return self.cuda

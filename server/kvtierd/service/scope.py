"""What every handler family checks a call against, and the settings they share.

* :class:`Scope`: the caller's scope (every id a caller names is checked against the caller's
  tenant: sessions, namespaces), the transports a job may use and the arena offsets a session
  is told; the quotas a caller's tenant can exhaust are the cache's admission's
  (kvtierd.cache.admission);
* :class:`ServiceSettings`: the boot epoch, the batch bound, what OpenSession advertises, and
  the daemon's switches the handlers read (draining, who hashes an shm store).

The handler families (:mod:`kvtierd.service.sessions`, ``lookups``, ``transfers``, ``cuda``,
``stats``) are each handed these; :class:`kvtierd.service.KvtierService` builds them and
delegates each RPC to its family. Event-loop thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.wire import SHM_MAX_ARENAS
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.index import NamespaceState
from kvtierd.service.gate import CALLER
from kvtierd.sessions import Session, SessionTable
from kvtierd.tenancy import Tenancy
from kvtierd.tenants import Tenant
from kvtierd.transports.cuda_ipc import CudaIpcTransport


@dataclass
class ServiceSettings:
    """The control plane's settings and switches, shared by the handler families. Owned by
    :class:`~kvtierd.service.KvtierService`; the daemon sets ``draining`` and ``verify_store``.
    Event-loop thread only."""

    boot_epoch: int
    max_batch: int
    advertise: Callable[[], dict[str, Any]]  # shm socket path, data channel address, arena size
    started: float = field(default_factory=time.monotonic)
    draining: bool = False
    verify_store: str = "client"
    """Who hashes an shm store (config ``verify_store``; set by the daemon)."""


class Scope:
    """The checks every handler shares (see the module docstring). Owns nothing: it reads the
    cache's namespaces, the session table and the cuda_ipc transport it is handed; event-loop
    thread only (``CALLER`` is the call's context variable)."""

    def __init__(
        self, cache: TieredCache, sessions: SessionTable, tenancy: Tenancy, cuda: CudaIpcTransport | None
    ) -> None:
        self.cache = cache
        self.sessions = sessions
        self.tenancy = tenancy
        self.cuda = cuda  # the cuda_ipc transport; None when cuda_ipc = false

    # -- tenancy: every id a caller names is checked against the caller's tenant ------------------

    @staticmethod
    def caller() -> Tenant | None:
        """The authenticated tenant of the call (None: single-tenant, or not an RPC)."""
        return CALLER.get()

    @staticmethod
    def scope() -> str | None:
        """The tenant whose objects this call may see (None: all of them)."""
        caller = CALLER.get()
        return None if caller is None or caller.operator else caller.name

    def session(self, session_id: int) -> Session:
        return self.sessions.get(session_id, self.scope())

    def namespace(self, namespace_id: int) -> NamespaceState:
        """The namespace, or NotFound; another tenant's is answered exactly as an absent one
        (the same message as ``TieredCache.namespace``)."""
        ns = self.cache.namespaces.get(namespace_id)
        if ns is None or not self.sees(ns):
            raise NotFound(f"unknown namespace {namespace_id} (register it first)", field="namespace_id")
        self.cache.used(ns)
        return ns

    def sees(self, ns: NamespaceState) -> bool:
        """Whether the call may use ``ns``: its tenant's, a group's it is a member of, or any
        (the operator, a single-tenant daemon)."""
        scope = self.scope()
        return scope is None or self.tenancy.may_see(scope, ns.spec.owner)

    def visible(self) -> list[NamespaceState]:
        return [ns for ns in self.cache.namespaces.values() if self.sees(ns)]

    def tier_figures(self) -> list[pb.TierFigures]:
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
        """The arena (pool) a session's client maps and writes: the shared one on a
        single-tenant daemon, its tenant's own on a daemon with tenants (None: it has none,
        nothing is handed out)."""
        if self.tenancy.tenants is None:
            return 0
        pool = self.cache.arena_of(session.tenant, False)
        return pool or None

    def session_arenas(self, session: Session, groups: bool = True) -> tuple[int, ...] | None:
        """Every arena a session's client maps, in the order its offsets count them: its own
        (:meth:`mapped_arena`), then (``groups``: a client that maps them, KVS3) the arena of
        each group its tenant reads (by name, at most ``SHM_MAX_ARENAS - 1``), read-only.
        Fixed at the first call (its first shm handshake): a group joined later is not in it
        (its jobs on that group are FAILED_PRECONDITION; the engines key that group's prefixes
        in their own scope, ``Client.reaches_group``); one left keeps its mapping (a mapping
        cannot be taken back) but no call of it names the group's namespaces."""
        if session.arenas is None:
            own = self.mapped_arena(session)
            if own is None:
                return None
            tenants = self.tenancy.tenants
            names = sorted(tenants.groups_of(session.tenant or "")) if tenants and groups else []
            pools = [p for p in (self.cache.arena_of(g, True) for g in names) if p and p != own]
            session.arenas = (own, *pools[: SHM_MAX_ARENAS - 1])
        return session.arenas

    def arena_base(self, session: Session, ns: NamespaceState) -> int:
        """For a session whose client maps arenas: what is subtracted from an offset of ``ns``'s
        arena to make it one in that session's mapping (its arenas one after another). A
        namespace whose blocks live in an arena it does not map (the operator acting on a
        tenant's, one registered before its tenant had an arena, a group's not in its mapping)
        cannot be moved through it: FAILED_PRECONDITION (use tcp)."""
        if session.transport is Transport.TCP:
            return 0
        own = self.mapped_arena(session)
        layout = session.arenas or ((own,) if own is not None else ())
        if ns.pool not in layout:
            raise FailedPrecondition(
                f"namespace {ns.id} lives in a host arena this session does not map (open a "
                "tcp session for it)",
                field="transport",
            )
        host = self.cache.host
        before = sum(host.pool_bytes[p] for p in layout[: layout.index(ns.pool)])
        return host.pool_bases[ns.pool] - before

    def staging_arena(self, session: Session, ns: NamespaceState) -> int | None:
        """The arena (pool) ``session``'s stores into ``ns`` are staged in: its own, when it
        maps ``ns``'s arena read-only (a group's), so the daemon copies them over at their
        commit; None: they are written in place."""
        layout = session.arenas
        if session.transport is Transport.TCP or layout is None or ns.pool == layout[0]:
            return None
        return layout[0]

    def job_transport(self, session: Session, value: int) -> Transport:
        """A job's transport: valid, and the one its session was opened for, or shm in a
        cuda_ipc session (a tcp session never commits slots it did not send: it has no mapping
        to write them through)."""
        transport = self.transport(value)
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

    def transport(self, value: int) -> Transport:
        if value not in set(Transport):
            raise InvalidArgument(
                f"must be TRANSPORT_SHM, TRANSPORT_TCP or TRANSPORT_CUDA_IPC, got {value}", field="transport"
            )
        if value == Transport.CUDA_IPC and self.cuda is None:
            raise FailedPrecondition(
                "cuda_ipc is disabled on this daemon (start it with cuda_ipc = true)", field="transport"
            )
        return Transport(value)

    def cuda_transport(self) -> CudaIpcTransport:
        if self.cuda is None:
            raise FailedPrecondition(
                "cuda_ipc is disabled on this daemon (start it with cuda_ipc = true)", field="transport"
            )
        return self.cuda

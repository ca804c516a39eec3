"""TieredCache: the sole writer of the block index; decides where bytes go.

It answers with plain data (job ids, arena offsets) and never touches payload bytes: transports
move them (the client itself over shm, the data channel over tcp, the daemon's copier over
cuda_ipc) and report completion; storage tiers move them between the host tier and themselves
when the chain's links ask (kvtierd.cache.chain).

Primitives (event-loop thread only; no locks). Each either fully succeeds or changes nothing:

* ``register_namespace(spec)`` -> NamespaceState (idempotent; id derived from the digest, so it
  is the same across daemon restarts and never names another namespace).
* ``lookup(ns, keys, options)``, ``prepare_load`` / ``complete_load``, ``load_queued`` /
  ``load_sent``: the read half of this class, written in kvtierd.cache.reads.
* ``prepare_store`` -> per key RESERVED (entry WRITING) / ALREADY_PRESENT / REJECTED;
  ``complete_store(ok)`` -> WRITING entries become READY, or are freed: the store half of this
  class, written in kvtierd.cache.stores.
* ``release_session`` aborts a session's stores and releases its pins (close or lease expiry).
  A load job still sending keeps its pins until its last ``load_sent`` (kvtierd.cache.reads).

Parts (one component, one writer): :class:`~kvtierd.cache.residency.HostResidency` (host slots,
eviction, limbo), :class:`~kvtierd.cache.chain.TierLink` per storage tier (copies, demotion,
promotion), :class:`~kvtierd.cache.fleet.SharedLink` for the shared tier (imports, exports),
:class:`~kvtierd.cache.jobs.JobTable` (jobs and the data plane's view of them).

This module holds the lifecycle of namespaces, sessions and the tiers' attachment; the two
halves of the index's writes are written beside it: kvtierd.cache.reads (lookups, holds, loads)
and kvtierd.cache.stores (quota fit, two-phase stores, corrupt claims).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtier_contract.identity import Namespace
from kvtierd.cache.chain import TierLink
from kvtierd.cache.fleet import SharedLink
from kvtierd.cache.jobs import Job, JobTable, LoadJob, StoreJob
from kvtierd.cache.read_figures import ReadFigure
from kvtierd.cache.reads import Reads
from kvtierd.cache.residency import HostResidency
from kvtierd.cache.stores import Stores
from kvtierd.domain import TierId
from kvtierd.index import Entry, NamespaceState
from kvtierd.policies import EvictionPolicy, WritePolicy
from kvtierd.sessions import Session
from kvtierd.stats import Counters
from kvtierd.tiers import HostTier, Recovered, SharedTier, StorageTier


class TieredCache(Reads, Stores):
    """Owns the index (entries of every namespace), the jobs, the host residency and the chain
    of storage tiers below it.

    Concurrency: event-loop thread only, no locks. Data-plane servers on the same loop reach
    jobs through ``jobs`` (where bytes go); they never change the index.
    """

    def __init__(
        self,
        host: HostTier,
        policy: EvictionPolicy[Entry],
        *,
        max_namespaces: int,
        policy_name: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        arena_of: Callable[[str | None], int] = lambda _tenant: 0,
    ) -> None:
        self.host = host
        # the host arena (pool) of a tenant's blocks, fixed for a namespace when registered
        self.arena_of = arena_of
        self.policy = policy
        self.policy_name = policy_name
        self.residency = HostResidency(host, policy, clock=clock)
        self.residency.room_for = self.room_for
        self.residency.clean_quota = self.clean_quota
        self.host_quota: Callable[[NamespaceState], int | None] = lambda _ns: None
        """The ``host_bytes`` quota of a namespace's tenant (None: none). Set by the daemon from
        its Tenancy; stores (``fit``), promotions and imports (``room_for``) keep to it."""
        self.chain: list[TierLink] = []
        self.fleet: SharedLink | None = None  # the shared tier, outside the index
        self.namespaces: dict[int, NamespaceState] = {}
        self.expired_counters = Counters()  # of the namespaces expire_idle forgot
        self._max_namespaces = max_namespaces
        self._clock = clock
        self.jobs = JobTable()
        self.pinned_blocks = 0
        self.writing_blocks = 0
        self.verify_bytes = True
        """Give every committed block a digest (config ``verify_bytes``; set by the daemon)."""

    def add_storage_tier(
        self, tier: StorageTier, write_policy: WritePolicy, opened: Recovered | None = None
    ) -> TierLink:
        """Put ``tier`` at the end of the chain and restore what it holds (blocking, at start);
        ``opened``: what ``tier.open()`` already returned (TierLink.restore), else opened here."""
        link = TierLink(self.residency, tier, write_policy, self.namespaces.values, level=len(self.chain))
        self.chain.append(link)
        self.residency.links = self.chain
        link.restored = link.restore(self.register_namespace, opened)
        return link

    def add_shared_tier(self, tier: SharedTier) -> SharedLink:
        """Consult and feed ``tier`` (started by the caller) after the local chain."""
        self.fleet = SharedLink(self.residency, tier)
        return self.fleet

    # -- namespaces -------------------------------------------------------------------------------

    def register_namespace(self, spec: Namespace) -> NamespaceState:
        ns = self.namespaces.get(spec.namespace_id)
        if ns is not None:
            if ns.spec.digest != spec.digest:  # 63-bit id collision: refuse, never alias
                raise FailedPrecondition("namespace id collision", field="namespace")
            ns.last_used = self._clock()
            return ns
        if len(self.namespaces) >= self._max_namespaces:
            raise ResourceExhausted(f"too many namespaces (max {self._max_namespaces})", field="namespace")
        block_bytes = spec.block_bytes
        if not self.host.fits(block_bytes):
            raise InvalidArgument(
                f"block of {block_bytes} bytes does not fit a slab of {self.host.slab_bytes} bytes"
                " (raise slab_bytes)",
                field="namespace.block_bytes",
            )
        ns = NamespaceState(
            spec.namespace_id,
            spec,
            block_bytes,
            self.host.slot_bytes_for(block_bytes),
            last_used=self._clock(),
            pool=self.arena_of(spec.tenant),
        )
        self.namespaces[ns.id] = ns
        return ns

    def used(self, ns: NamespaceState) -> None:
        """An RPC named ``ns`` (it is not idle)."""
        ns.last_used = self._clock()

    def expire_idle(self, idle_s: float, busy: Callable[[int], bool]) -> list[NamespaceState]:
        """Forget the namespaces that hold no entry (so no job, pin or copy below either) nor
        slot held back after a lapsed lease, and were not used for ``idle_s``, unless
        ``busy(id)`` (a published-index reader); their counters stay in the totals. Returns
        them."""
        cutoff = self._clock() - idle_s
        gone = [
            ns
            for ns in self.namespaces.values()  # (limbo slots: still its tenant's)
            if not ns.entries and not ns.limbo_blocks and ns.last_used <= cutoff and not busy(ns.id)
        ]
        for ns in gone:
            del self.namespaces[ns.id]
            self.expired_counters.add(ns.counters)
        return gone

    def namespace(self, namespace_id: int) -> NamespaceState:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id} (register it first)", field="namespace_id")
        return ns

    def release_session(self, session: Session) -> None:
        """Abort the session's store jobs and release its pins (close or lease expiry).

        After an expiry the aborted slots stay out of use for one more lease period (limbo): a
        stalled shm writer that wakes up late then writes into a slot nobody else holds. A load
        whose bytes still wait on a data connection keeps its pins until they leave
        (``load_sent``); the data channel drops such a connection when its session ends.
        """
        hold_until = self._clock() + session.ttl_s if session.expired else 0.0
        for job_id in list(session.store_jobs):
            job = self.jobs.get(session.id, job_id, StoreJob)
            # A daemon-side copy still writing into the slots holds them back as well.
            copying = job_id in self.jobs.copying
            self._end_store(session, job, False, (), self._clock() + session.ttl_s if copying else hold_until)
        for job_id in list(session.load_jobs):
            self._finish_load(session, self.jobs.get(session.id, job_id, LoadJob))

    def abort_job(self, session: Session, job: Job) -> None:
        """Its transfer failed: free a store's entries, unpin a load's (if still live)."""
        if not self.jobs.is_live(job):
            return
        if isinstance(job, StoreJob):
            self._end_store(session, job, False, (), 0.0)
        else:
            self._finish_load(session, job)

    def sweep_limbo(self) -> int:
        return self.residency.sweep_limbo()

    @property
    def limbo_blocks(self) -> int:
        return self.residency.limbo_blocks

    # -- figures ----------------------------------------------------------------------------------

    def totals(self) -> Counters:
        total = Counters()
        total.add(self.expired_counters)  # (counters never go back: Prometheus totals)
        for ns in self.namespaces.values():
            total.add(ns.counters)
        return total

    def figures(self) -> dict[str, int | str]:
        """The cache's own gauges, for Stats and /metrics."""
        return {
            "pinned_blocks": self.pinned_blocks,
            "writing_blocks": self.writing_blocks,
            "limbo_blocks": self.limbo_blocks,
            "eviction_policy": self.policy_name,
        }

    def read_figures(self) -> dict[TierId, ReadFigure]:
        """What reading each tier below the host tier into it costs now (kvtierd.cache.read_figures);
        a tier with no read measured yet is absent."""
        figures = [(TierId(link.id), link.read_figures) for link in self.chain]
        if self.fleet is not None:
            figures.append((TierId(self.fleet.tier.id), self.fleet.read_figures))
        out: dict[TierId, ReadFigure] = {}
        for tier, source in figures:
            fig = source.figure()
            if fig is not None:
                out[tier] = fig
        return out

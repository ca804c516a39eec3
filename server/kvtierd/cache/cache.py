"""TieredCache: the sole writer of the block index; decides where bytes go.

It answers with plain data (job ids, arena offsets) and never touches payload bytes: transports
move them (the client itself over shm, the data channel over tcp, the daemon's copier over
cuda_ipc) and report completion; storage tiers move them between the host tier and themselves
when the chain's links ask (kvtierd.cache.chain).

Primitives (event-loop thread only; no locks). Each either fully succeeds or changes nothing:

* ``register_namespace(spec)`` -> NamespaceState (idempotent; id derived from the digest, so it
  is the same across daemon restarts and never names another namespace).
* ``lookup(ns, keys, options)``, ``prepare_load`` / ``complete_load``, ``load_queued`` /
  ``load_sent``: served by the cache's ``reads`` (kvtierd.cache.reads).
* ``await prepare_store`` -> per key RESERVED (entry WRITING) / ALREADY_PRESENT / REJECTED: the
  request checked, the caller admitted (kvtierd.cache.admission), room made and the keys
  reserved by the cache's ``stores`` (kvtierd.cache.stores); ``complete_store(ok)`` -> WRITING
  entries become READY, or are freed.
* ``admit_pins`` after a load or a pinned lookup pinned: over the caller's ``pinned_bytes``, the
  job is released.
* ``release_session`` aborts a session's stores and releases its pins (close or lease expiry).
  A load job still sending keeps its pins until its last ``load_sent`` (kvtierd.cache.reads).

Parts (one component, one writer), over one :class:`~kvtierd.cache.state.CacheState`:
:class:`~kvtierd.cache.reads.Reads` (lookups, holds, loads), :class:`~kvtierd.cache.stores.Stores`
(quota fit, room, two-phase stores, corrupt claims), :class:`~kvtierd.cache.admission.Admission`
(every count a tenant can exhaust), :class:`~kvtierd.cache.residency.HostResidency` (host slots,
eviction, limbo), :class:`~kvtierd.cache.chain.TierLink` per storage tier (copies, demotion; its
``promotion`` and ``recovery``), :class:`~kvtierd.cache.fleet.SharedLink` for the shared tier
(imports, exports), :class:`~kvtierd.cache.jobs.JobTable` (jobs and the data plane's view of
them). This module holds the lifecycle of namespaces, sessions and the tiers' attachment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtier_contract.identity import Namespace
from kvtierd.cache.admission import Admission, SessionView
from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.chain import TierLink
from kvtierd.cache.fleet import SharedLink
from kvtierd.cache.jobs import Job, JobTable, LoadJob, StoreJob
from kvtierd.cache.lookup import LOCAL, LookupOptions, LookupResult
from kvtierd.cache.origins import check_origin
from kvtierd.cache.read_figures import ReadFigure
from kvtierd.cache.reads import Reads
from kvtierd.cache.residency import HostResidency
from kvtierd.cache.state import CacheState
from kvtierd.cache.stores import Stores
from kvtierd.domain import TierId, Transport
from kvtierd.index import Entry, NamespaceState
from kvtierd.policies import EvictionPolicy, WritePolicy
from kvtierd.sessions import Session
from kvtierd.stats import Counters
from kvtierd.tenancy import Tenancy
from kvtierd.tenants import Tenant
from kvtierd.tiers import HostTier, Recovered, SharedTier, StorageTier


class TieredCache:
    """Owns the cache's state (:class:`~kvtierd.cache.state.CacheState`: the index of every
    namespace, the jobs, the chain of storage tiers below the host tier), its host residency
    and its admission, and the two parts that write the index over that one state: ``reads``
    (:class:`~kvtierd.cache.reads.Reads`) and ``stores`` (:class:`~kvtierd.cache.stores.Stores`).
    Callers outside the cache call the primitives below; those that use one part take it.

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
        arena_of: Callable[[str | None, bool], int] = lambda _owner, _group: 0,
        tenancy: Tenancy | None = None,
        sessions: SessionView | None = None,
    ) -> None:
        self.host = host
        # the host arena (pool) of a tenant's blocks, fixed for a namespace when registered
        self.arena_of = arena_of
        self.policy = policy
        self.policy_name = policy_name
        self.residency = HostResidency(host, policy, clock=clock)
        self.namespaces: dict[int, NamespaceState] = {}
        self.jobs = JobTable()
        self.admission = Admission(tenancy or Tenancy(None), self.namespaces, self.jobs, sessions)
        """Every count a tenant can exhaust (kvtierd.cache.admission); ``sessions``: the
        daemon's session table, whose sessions it counts."""
        self.state = CacheState(host, policy, self.residency, self.namespaces, self.jobs, self.admission)
        self.reads = Reads(self.state)
        self.stores = Stores(self.state)
        self.residency.room_for = self.stores.room_for
        self.residency.clean_quota = self.stores.clean_quota
        self.expired_counters = Counters()  # of the namespaces expire_idle forgot
        self._max_namespaces = max_namespaces
        self._clock = clock

    # -- the state's figures and settings ---------------------------------------------------------

    @property
    def chain(self) -> list[TierLink]:
        return self.state.chain

    @property
    def fleet(self) -> SharedLink | None:
        return self.state.fleet

    @property
    def pinned_blocks(self) -> int:
        return self.state.pinned_blocks

    @property
    def writing_blocks(self) -> int:
        return self.state.writing_blocks

    @property
    def verify_bytes(self) -> bool:
        """Give every committed block a digest (config ``verify_bytes``; set by the daemon)."""
        return self.state.verify_bytes

    @verify_bytes.setter
    def verify_bytes(self, on: bool) -> None:
        self.state.verify_bytes = on

    def add_storage_tier(
        self, tier: StorageTier, write_policy: WritePolicy, opened: Recovered | None = None
    ) -> TierLink:
        """Put ``tier`` at the end of the chain and restore what it holds (blocking, at start);
        ``opened``: what ``tier.open()`` already returned (TierLink.restore), else opened here."""
        link = TierLink(
            self.residency,
            tier,
            write_policy,
            self.namespaces.values,
            admission=self.admission,
            level=len(self.chain),
        )
        self.chain.append(link)
        self.residency.links = self.chain
        link.recovery.restored = link.restore(self.register_namespace, opened)
        return link

    def add_shared_tier(self, tier: SharedTier) -> SharedLink:
        """Consult and feed ``tier`` (started by the caller) after the local chain."""
        self.state.fleet = SharedLink(self.residency, tier)
        return self.state.fleet

    # -- namespaces -------------------------------------------------------------------------------

    def register_namespace(self, spec: Namespace, charged_to: str | None = None) -> NamespaceState:
        """The namespace of ``spec``, made now unless it is registered (its ``namespaces``
        quota charged to ``charged_to``, by default its owner)."""
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
            pool=self.arena_of(spec.owner, spec.group is not None),
            charged_to=charged_to or spec.owner,
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
            until = self._clock() + session.ttl_s if copying else hold_until
            self.stores.end_store(session, job, False, (), until)
        for job_id in list(session.load_jobs):
            self.reads.finish_load(session, self.jobs.get(session.id, job_id, LoadJob))

    def abort_job(self, session: Session, job: Job) -> None:
        """Its transfer failed: free a store's entries, unpin a load's (if still live)."""
        if not self.jobs.is_live(job):
            return
        if isinstance(job, StoreJob):
            self.stores.end_store(session, job, False, (), 0.0)
        else:
            self.reads.finish_load(session, job)

    # -- stores and loads: the parts' primitives, at the cache boundary ---------------------------

    async def prepare_store(
        self,
        session: Session,
        ns: NamespaceState,
        keys: Sequence[bytes],
        transport: Transport,
        *,
        token_ids: Sequence[int] = (),
        parent: bytes | None = None,
        caller: Tenant | None = None,
    ) -> tuple[StoreJob | None, bytes, list[int]]:
        """Per key RESERVED (entry WRITING) / ALREADY_PRESENT / REJECTED, each check once: the
        request (``token_ids``: all the keys' tokens or none; ``parent``: the key before
        ``keys[0]`` or None; InvalidArgument naming ``token_ids`` / ``parent_key``), the caller's
        right to store into ``ns`` (a group's: its publishers) and its job quotas first, before
        anything is evicted for it; with a chain, the room made (``Stores.make_room``: it may
        wait on NVMe), then the session and the job quotas again (the wait may have outlived
        the lease, other stores may have reserved); then the owner's host bytes
        (``Stores.fit``) and the reservation, with no await between."""
        check_origin(ns, keys, token_ids, parent)
        self.admission.admit_store_into(caller, ns)
        self.admission.admit_jobs(caller, session)
        if self.state.chain:  # the tenant's coldest blocks are written down before ``fit`` evicts them
            await self.stores.make_room(ns, keys)
            session = self.admission.recheck(caller, session)
        self.stores.fit(ns, len(keys))
        return self.stores.reserve(session, ns, keys, transport, token_ids=token_ids, parent=parent)

    def complete_store(
        self,
        session: Session,
        job_id: int,
        ok: bool,
        item_ok: Sequence[bool] = (),
        *,
        hold_until: float = 0.0,
        digests: Sequence[int] = (),
    ) -> tuple[int, int]:
        """WRITING entries become READY, or are freed: (committed, aborted). ``digests``: one
        per reserved key (their order), each committed block's digest; empty: tcp jobs take
        the digests of what the data channel received, other blocks get none."""
        job = self.stores.checked_job(session, job_id, item_ok, digests)
        return self.stores.end_store(session, job, ok, item_ok, hold_until, digests)

    async def lookup(
        self, ns: NamespaceState, keys: Sequence[bytes], options: LookupOptions = LOCAL
    ) -> LookupResult:
        """``Reads.lookup``."""
        return await self.reads.lookup(ns, keys, options)

    async def prepare_load(
        self,
        session: Session,
        ns: NamespaceState,
        keys: Sequence[bytes],
        transport: Transport,
        *,
        host_only: bool = False,
        answer_by: AnswerBy | None = None,
        caller: Tenant | None = None,
    ) -> tuple[LoadJob | None, dict[int, int]]:
        """``Reads.prepare_load`` after the caller's job quotas."""
        self.admission.admit_jobs(caller, session)
        return await self.reads.prepare_load(
            session, ns, keys, transport, host_only=host_only, answer_by=answer_by
        )

    def admit_pins(self, caller: Tenant | None, session: Session, job: LoadJob) -> None:
        """The caller's ``pinned_bytes``, ``job`` pinned: over it, the job is released at once
        (nothing stays pinned; no load counted: nothing moved) and ResourceExhausted raised."""
        try:
            self.admission.admit_pins(caller, session)
        except ResourceExhausted:
            self.abort_job(session, job)
            raise

    def complete_load(self, session: Session, job_id: int) -> int:
        return self.reads.complete_load(session, job_id)

    def load_queued(self, job: LoadJob) -> None:
        self.reads.load_queued(job)

    def load_sent(self, job: LoadJob) -> None:
        self.reads.load_sent(job)

    def corrupt_claims(self, session: Session, job_id: int, indexes: Sequence[int]) -> list[Entry]:
        return self.stores.corrupt_claims(session, job_id, indexes)

    def drop_corrupt(self, entries: Sequence[Entry]) -> int:
        return self.stores.drop_corrupt(entries)

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
            "orphaned_blocks": self.residency.orphaned_blocks,
            "orphans_evicted": self.residency.orphans_evicted,
        }

    def read_figures(self) -> dict[TierId, ReadFigure]:
        """What reading each tier below the host tier into it costs now (kvtierd.cache.read_figures);
        a tier with no read measured yet is absent."""
        figures = [(TierId(link.id), link.promotion.read_figures) for link in self.chain]
        if self.fleet is not None:
            figures.append((TierId(self.fleet.tier.id), self.fleet.read_figures))
        out: dict[TierId, ReadFigure] = {}
        for tier, source in figures:
            fig = source.figure()
            if fig is not None:
                out[tier] = fig
        return out

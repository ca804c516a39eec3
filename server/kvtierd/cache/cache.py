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
  ``complete_store(ok)`` -> WRITING entries become READY, or are freed.
* ``release_session`` aborts a session's stores and releases its pins (close or lease expiry).
  A load job still sending keeps its pins until its last ``load_sent`` (kvtierd.cache.reads).

Parts (one component, one writer): :class:`~kvtierd.cache.residency.HostResidency` (host slots,
eviction, limbo), :class:`~kvtierd.cache.chain.TierLink` per storage tier (copies, demotion,
promotion), :class:`~kvtierd.cache.fleet.SharedLink` for the shared tier (imports, exports),
:class:`~kvtierd.cache.jobs.JobTable` (jobs and the data plane's view of them).

Size: over the house limit while the store half (prepare/complete_store, quota fit, corrupt
claims) is still written here; it is the store side's seam (kvtierd.cache.reads is the read
side's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence, Set

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtier_contract.identity import Namespace
from kvtierd.cache.chain import TierLink
from kvtierd.cache.fleet import SharedLink
from kvtierd.cache.jobs import Job, JobTable, LoadJob, StoreJob, check_live
from kvtierd.cache.read_figures import ReadFigure
from kvtierd.cache.reads import Reads
from kvtierd.cache.residency import HostResidency
from kvtierd.domain import StoreStatus, TierId, Transport
from kvtierd.events import MEDIUM_CPU
from kvtierd.events.wire import pack_tokens
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy, WritePolicy
from kvtierd.sessions import Session
from kvtierd.stats import Counters
from kvtierd.tiers import HostTier, Recovered, SharedTier, StorageTier


def check_digest_count(digests: Sequence[int], job: StoreJob) -> None:
    """A CompleteStore's digests: none, or exactly one per reserved key."""
    if digests and len(digests) != len(job.items):
        raise InvalidArgument(f"has {len(digests)} digests for {len(job.items)} reserved keys",
                              field="digests")


# A block keeps its token ids (4 bytes each, for its KV events) only while they take at most this
# share of its slot: a client's namespace of tiny blocks and many tokens per block cannot make
# the daemon hold more for its blocks than the quotas it is held to count (host_bytes, nvme_bytes).
TOKEN_SHARE_OF_SLOT = 64


def check_origin(ns: NamespaceState, keys: Sequence[bytes], token_ids: Sequence[int],
                 parent: bytes | None) -> None:
    """A store's optional token ids (exactly ``tokens_per_block`` per key) and parent key (32
    bytes): InvalidArgument naming the field otherwise."""
    if token_ids and len(token_ids) != len(keys) * ns.spec.tokens_per_block:
        raise InvalidArgument(
            f"has {len(token_ids)} token ids for {len(keys)} keys of "
            f"{ns.spec.tokens_per_block} tokens (expected {len(keys) * ns.spec.tokens_per_block}"
            " or none)", field="token_ids")
    if parent is not None and len(parent) != 32:
        raise InvalidArgument(f"must be 32 bytes (a block key) or empty, got {len(parent)}",
                              field="parent_key")


def _keep_origins(ns: NamespaceState, keys: Sequence[bytes], items: dict[int, Entry],
                  token_ids: Sequence[int], parent: bytes | None) -> None:
    """Each reserved entry (``items``: batch index -> entry) keeps its parent key and packed
    token ids for its KV events; token ids past their share of the slot are not kept."""
    span = 4 * ns.spec.tokens_per_block  # one block's packed token ids
    packed = pack_tokens(token_ids) if token_ids and \
        span * TOKEN_SHARE_OF_SLOT <= ns.slot_bytes else b""
    for i, e in items.items():
        e.origin = (keys[i - 1] if i else parent, packed[i * span:(i + 1) * span])


_check_live = check_live  # (kvtierd.cache.jobs: jobs attach only to live sessions)


def _split_batch(ns: NamespaceState, keys: Sequence[bytes],
                 status: bytearray) -> tuple[dict[bytes, int], set[Entry]]:
    """A store batch's keys not held yet (key -> its first index in the batch; the others are
    ALREADY_PRESENT in ``status`` and counted so), and its READY entries (not evicted to make
    room for it)."""
    protect: set[Entry] = set()
    for k in keys:
        e = ns.entries.get(k)
        if e is not None and e.state is EntryState.READY:
            protect.add(e)
    c = ns.counters
    fresh: dict[bytes, int] = {}
    entries = ns.entries
    for i, k in enumerate(keys):
        if k in entries or k in fresh:
            status[i] = StoreStatus.ALREADY_PRESENT
            c.stores_already_present += 1
        else:
            fresh[k] = i
    return fresh, protect


class TieredCache(Reads):
    """Owns the index (entries of every namespace), the jobs, the host residency and the chain
    of storage tiers below it.

    Concurrency: event-loop thread only, no locks. Data-plane servers on the same loop reach
    jobs through ``jobs`` (where bytes go); they never change the index.
    """

    def __init__(self, host: HostTier, policy: EvictionPolicy[Entry], *, max_namespaces: int,
                 policy_name: str = "lru", clock: Callable[[], float] = time.monotonic,
                 arena_of: Callable[[str | None], int] = lambda _tenant: 0) -> None:
        self.host = host
        # the host arena (pool) of a tenant's blocks, fixed for a namespace when registered
        self.arena_of = arena_of
        self.policy = policy
        self.policy_name = policy_name
        self.residency = HostResidency(host, policy, clock=clock)
        self.residency.room_for = self.room_for
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

    def add_storage_tier(self, tier: StorageTier, write_policy: WritePolicy,
                         opened: Recovered | None = None) -> TierLink:
        """Put ``tier`` at the end of the chain and restore what it holds (blocking, at start);
        ``opened``: what ``tier.open()`` already returned (TierLink.restore), else opened here."""
        link = TierLink(self.residency, tier, write_policy, self.namespaces.values,
                        level=len(self.chain))
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
            raise ResourceExhausted(f"too many namespaces (max {self._max_namespaces})",
                                    field="namespace")
        block_bytes = spec.block_bytes
        if not self.host.fits(block_bytes):
            raise InvalidArgument(
                f"block of {block_bytes} bytes does not fit a slab of {self.host.slab_bytes} bytes"
                " (raise slab_bytes)", field="namespace.block_bytes")
        ns = NamespaceState(spec.namespace_id, spec, block_bytes,
                            self.host.slot_bytes_for(block_bytes), last_used=self._clock(),
                            pool=self.arena_of(spec.tenant))
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
        gone = [ns for ns in self.namespaces.values()  # (limbo slots: still its tenant's)
                if not ns.entries and not ns.limbo_blocks and ns.last_used <= cutoff and
                not busy(ns.id)]
        for ns in gone:
            del self.namespaces[ns.id]
            self.expired_counters.add(ns.counters)
        return gone

    def namespace(self, namespace_id: int) -> NamespaceState:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id} (register it first)",
                           field="namespace_id")
        return ns

    def fit(self, ns: NamespaceState, n_blocks: int, protect: Set[Entry] = frozenset()) -> None:
        """Make ``n_blocks`` new host slots of ``ns`` fit its tenant's ``host_bytes`` quota
        (``fit_tenant``; nothing to do without one)."""
        quota = self.host_quota(ns)
        if quota is not None and ns.spec.tenant is not None and n_blocks:
            self.fit_tenant(ns.spec.tenant, n_blocks * ns.slot_bytes, quota, protect)

    def room_for(self, ns: NamespaceState, n: int, protect: Set[Entry] = frozenset()) -> int:
        """How many of ``n`` new host slots of ``ns`` (blocks promoted from below, imported
        from the cluster) its tenant's quota lets in, its own coldest blocks evicted for them
        as for a store; the rest stay where they are (misses for now)."""
        while n:
            try:
                self.fit(ns, n, protect)
                return n
            except ResourceExhausted:
                n //= 2
        return 0

    def fit_tenant(self, tenant: str, new_bytes: int, quota: int,
                   protect: Set[Entry] = frozenset()) -> None:
        """Make ``new_bytes`` of host slots fit ``tenant``'s ``quota``: its own coldest
        evictable blocks go first (never another tenant's, nor those in ``protect``);
        ResourceExhausted (quota host_bytes) when they cannot."""
        mine = [ns for ns in self.namespaces.values() if ns.spec.tenant == tenant]
        # resident, reserved (WRITING) and limbo slots, O(namespaces): a store that never
        # completes holds its slots against its own tenant's quota, not the shared arena
        used = sum((ns.counters.resident_blocks + ns.writing_blocks + ns.limbo_blocks) *
                   ns.slot_bytes for ns in mine)
        excess = used + new_bytes - quota
        if excess <= 0:
            return
        if new_bytes > quota:
            raise ResourceExhausted(f"quota host_bytes ({quota}) is smaller than one batch of "
                                    f"{new_bytes} bytes", field="quota", quota="host_bytes")
        owned = set(mine)
        victims = []
        for n, e in enumerate(self.policy.victims()):
            if excess <= 0 or n > 1 << 16:
                break
            if e.ns in owned and e.evictable() and e.in_host and e not in protect:
                victims.append(e)
                excess -= e.ns.slot_bytes
        if excess > 0:
            raise ResourceExhausted(f"quota host_bytes ({quota}) reached by tenant {tenant} "
                                    "(its blocks are pinned or being written)", field="quota",
                                    quota="host_bytes")
        for e in victims:
            self.residency.evict(e)

    # -- stores -----------------------------------------------------------------------------------

    async def make_room(self, ns: NamespaceState, keys: Sequence[bytes]) -> None:
        """Backpressure before a store: let the chain clean the host tier's cold end so the new
        blocks can be placed by evicting only blocks held below (no-op without a chain)."""
        if self.chain:
            new = sum(1 for k in keys if k not in ns.entries)
            await self.chain[0].ensure_room(ns.slot_bytes, new, pool=ns.pool)

    def prepare_store(self, session: Session, ns: NamespaceState, keys: Sequence[bytes],
                      transport: Transport, *, token_ids: Sequence[int] = (),
                      parent: bytes | None = None) -> tuple[StoreJob | None, bytes, list[int]]:
        """Reserve the keys not held yet. ``token_ids`` (all the keys' tokens, or none) and
        ``parent`` (the key before ``keys[0]``, or None) are kept with each reserved entry
        while KV events are on, for its ``BlockStored``; checked either way (InvalidArgument
        naming ``token_ids`` / ``parent_key``, nothing changed)."""
        check_origin(ns, keys, token_ids, parent)
        _check_live(session)
        status = bytearray(len(keys))
        offsets = [0] * len(keys)
        items: dict[int, Entry] = {}
        fresh, protect = _split_batch(ns, keys, status)
        job_id = self.jobs.next_id()
        c, entries = ns.counters, ns.entries
        # One walk of the victims for the batch; what cannot be placed now is rejected (nothing
        # evictable for this class: the rest of the batch cannot fit either).
        placed = self.residency.allocate_many(ns.slot_bytes, len(fresh), protect, ns.pool) \
            if fresh else []
        for (k, i), off in zip(fresh.items(), placed, strict=False):  # (placed: a prefix)
            e = Entry(ns, k, off, job_id)
            entries[k] = e
            items[i] = e
            status[i] = StoreStatus.RESERVED
            offsets[i] = off
        if self.residency.events is not None:
            _keep_origins(ns, keys, items, token_ids, parent)
        rejected = len(fresh) - len(placed)
        if rejected:
            c.stores_rejected += rejected
            for i in list(fresh.values())[len(placed):]:
                status[i] = StoreStatus.REJECTED
        if not items:
            return None, bytes(status), offsets
        job = StoreJob(job_id, session.id, ns, transport, items)
        self.jobs.add(job)
        session.store_jobs.add(job_id)
        self.writing_blocks += len(items)
        ns.writing_blocks += len(items)
        return job, bytes(status), offsets

    def complete_store(self, session: Session, job_id: int, ok: bool,
                       item_ok: Sequence[bool] = (), *, hold_until: float = 0.0,
                       digests: Sequence[int] = ()) -> tuple[int, int]:
        """``digests``: one per reserved key (their order), each committed block's digest
        (kvtierd.cache.flows computes or checks them); empty: tcp jobs take the digests of what
        the data channel received, other blocks get none."""
        job = self.jobs.get(session.id, job_id, StoreJob)
        self.jobs.not_copying(job_id)
        if item_ok and len(item_ok) != len(job.items):
            raise InvalidArgument(f"has {len(item_ok)} values for {len(job.items)} reserved keys",
                                  field="item_ok")
        check_digest_count(digests, job)
        return self._end_store(session, job, ok, item_ok, hold_until, digests)

    def _end_store(self, session: Session, job: StoreJob, ok: bool, item_ok: Sequence[bool],
                   hold_until: float, digests: Sequence[int] = ()) -> tuple[int, int]:
        self.jobs.remove(job)
        session.store_jobs.discard(job.id)
        committed: list[Entry] = []
        aborted = 0
        ns, c = job.ns, job.ns.counters
        for n, (i, e) in enumerate(sorted(job.items.items())):
            good = ok and (item_ok[n] if item_ok else True)
            if job.transport.daemon_moved and i not in job.received:
                good = False  # the daemon never received these bytes
            if good:
                e.state = EntryState.READY
                e.job = 0
                if self.verify_bytes:
                    e.digest = digests[n] if digests else job.digests.get(i)
                ns.ready[e.key] = e
                self.policy.insert(e)
                self.residency.count(e, +1)
                committed.append(e)
            else:
                self.residency.free_reserved(e, hold_until)
                aborted += 1
        self.writing_blocks -= len(job.items)
        job.ns.writing_blocks -= len(job.items)
        if committed:
            if self.residency.events is not None:
                self.residency.events.stored(committed, MEDIUM_CPU)
            for link in self.chain:
                link.on_committed(committed)
            if self.fleet is not None:
                self.fleet.on_committed(committed)
        c.stores_accepted += len(committed)
        c.stores_dropped += aborted
        name = f"bytes_in_{job.transport.label}"
        setattr(c, name, getattr(c, name) + len(committed) * ns.block_bytes)
        return len(committed), aborted

    def corrupt_claims(self, session: Session, job_id: int,
                       indexes: Sequence[int]) -> list[Entry]:
        """The blocks of load job ``job_id`` at key ``indexes`` (a client found their bytes did
        not match their digest) that have a digest and a host slot: the caller rehashes them
        (off the event loop, while the job's pins hold the slots: kvtierd.cache.flows), so a
        client cannot drop blocks that are fine, then ``drop_corrupt`` s those that differ.
        Every index is checked first (INVALID_ARGUMENT, nothing changes)."""
        job = self.jobs.get(session.id, job_id, LoadJob)
        self.jobs.moves_bytes(job)
        if len(indexes) > len(job.items):
            raise InvalidArgument(f"has {len(indexes)} indexes for a job of {len(job.items)} "
                                  "blocks", field="corrupt")
        for i in indexes:
            if i not in job.items:
                raise InvalidArgument(f"key {i} is not a block of job {job_id}", field="corrupt")
        return [e for e in (job.items[i] for i in dict.fromkeys(indexes))
                if e.digest is not None and e.in_host]

    def drop_corrupt(self, entries: Sequence[Entry]) -> int:
        """Take corrupt blocks (``corrupt_claims``, rehashed) out of the host tier, counted in
        ``corrupt_blocks``: the slot is freed at once when nothing else holds it (a block with
        a copy below stays READY, served from there after a verified read). One that another
        job still holds stays where it is: without a copy below it is no longer served and its
        slot goes when the host tier evicts it; with one, it stays READY (every load checks it
        again, and a later claim drops it). Never handed to the cluster tier's evict policy.
        How many were found corrupt."""
        n = 0
        for e in entries:
            ns = e.ns
            if ns.entries.get(e.key) is not e or not e.in_host:
                continue  # gone or moved meanwhile
            n += 1
            ns.counters.corrupt_blocks += 1
            if not e.evictable():
                if not e.copies:  # (with a copy it would stay in the index unserved for good)
                    ns.ready.pop(e.key, None)
                    if self.residency.events is not None:
                        self.residency.events.removed((e,), MEDIUM_CPU)
                continue
            if self.residency.events is not None:
                self.residency.events.removed((e,), MEDIUM_CPU)
            self.policy.remove(e, evicted=False)
            self.residency.count(e, -1)
            self.host.free(e.offset, ns.slot_bytes)
            e.offset = -1
            if not e.copies:
                self.residency.forget(e)
            else:
                for link in self.chain:
                    link.on_host_evicted(e)
        return n

    # -- sessions and transfers -------------------------------------------------------------------

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
            self._end_store(session, job, False, (),
                            self._clock() + session.ttl_s if copying else hold_until)
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
        return {"pinned_blocks": self.pinned_blocks, "writing_blocks": self.writing_blocks,
                "limbo_blocks": self.limbo_blocks, "eviction_policy": self.policy_name}

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

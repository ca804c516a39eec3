"""The store part of the cache: quota fit, room, two-phase stores, corrupt claims.

:class:`Stores` is handed the cache's :class:`~kvtierd.cache.state.CacheState` by
:class:`~kvtierd.cache.TieredCache` and reserves, commits and aborts its entries
(kvtierd.cache.reads pins and holds them; kvtierd.service.transfers runs the hashing around
these calls, off the event loop). A tenant's host bytes are the state's admission's to count
and refuse (kvtierd.cache.admission); evicting its own blocks to keep to them is done here.

* ``fit`` / ``room_for`` / ``fit_tenant``: a tenant's host quota, evicting what they may (held
  below first); ``make_room`` / ``clean_quota``: the flushes a batch waits for (what it evicts).
* ``reserve`` -> per key RESERVED (entry WRITING) / ALREADY_PRESENT / REJECTED;
  ``complete_store(ok)`` -> WRITING entries become READY, or are freed.
* ``corrupt_claims`` / ``drop_corrupt``: a load's claims of bytes that failed verification,
  checked against the slots and dropped only when they really differ.

Concurrency: event-loop thread only, no locks (the cache's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set

from kvtier_contract.errors import InvalidArgument, ResourceExhausted
from kvtierd.cache.jobs import LoadJob, StoreJob, check_live
from kvtierd.cache.origins import keep_origins
from kvtierd.cache.residency import ROOM_WAIT_S, file_under
from kvtierd.cache.staging import free_staged, stage
from kvtierd.cache.state import CacheState
from kvtierd.domain import StoreStatus, Transport
from kvtierd.events import MEDIUM_CPU
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.sessions import Session


def check_digest_count(digests: Sequence[int], job: StoreJob) -> None:
    """A CompleteStore's digests: none, or exactly one per reserved key."""
    if digests and len(digests) != len(job.items):
        raise InvalidArgument(
            f"has {len(digests)} digests for {len(job.items)} reserved keys", field="digests"
        )


def _split_batch(
    ns: NamespaceState, keys: Sequence[bytes], status: bytearray
) -> tuple[dict[bytes, int], set[Entry]]:
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


class Stores:
    """The store part of :class:`~kvtierd.cache.TieredCache`: reserves, commits and aborts
    entries of the cache's ``state`` (see the module docstring); the tenant's host bytes are
    counted and refused by the state's admission. Owns nothing of its own; event-loop thread
    only (the cache's)."""

    def __init__(self, state: CacheState) -> None:
        self.state = state

    def fit(self, ns: NamespaceState, n_blocks: int, protect: Set[Entry] = frozenset()) -> None:
        """Make ``n_blocks`` new host slots of ``ns`` fit its tenant's ``host_bytes`` quota
        (``fit_tenant``; nothing to do without one)."""
        quota = self.state.admission.host_quota(ns)
        if quota is not None and ns.spec.owner is not None and n_blocks:
            self.fit_tenant(ns.spec.owner, n_blocks * ns.slot_bytes, quota, protect)

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

    def fit_tenant(self, tenant: str, new_bytes: int, quota: int, protect: Set[Entry] = frozenset()) -> None:
        """Make ``new_bytes`` of host slots fit ``tenant``'s ``quota``: its own coldest
        evictable blocks go, those held below first (never another tenant's, nor those in
        ``protect``); ResourceExhausted (quota host_bytes) when they cannot."""
        admission = self.state.admission
        excess = admission.tenant_host_bytes(tenant) + new_bytes - quota
        if excess <= 0:
            return
        if new_bytes > quota:
            raise admission.refuse_host(quota, tenant, new_bytes)
        victims = self._own_victims(tenant, excess, protect)
        if sum(e.ns.slot_bytes for e in victims) < excess:
            raise admission.refuse_host(quota, tenant, new_bytes)
        for e in victims:
            self.state.residency.evict(e)

    def _own_victims(self, tenant: str, excess: int, protect: Set[Entry]) -> list[Entry]:
        """``tenant``'s coldest evictable host blocks (held below first, each coldest first)
        until ``excess`` bytes, or as many as there are within the scan."""
        mine: list[Entry] = []
        found = clean = 0  # bytes of those seen, of those held below or orphans (evicting them loses nothing)
        policy = self.state.policy
        look = 1024 if any(link.admitting for link in self.state.chain) else 0  # (for clean ones)
        for n, e in enumerate(self.state.policy.victims()):
            if clean >= excess or n > 1 << 16 or (found >= excess and n > look):
                break
            if e.ns.spec.owner == tenant and e.evictable() and e.in_host and e not in protect:
                mine.append(e)
                found += e.ns.slot_bytes
                clean += e.ns.slot_bytes if e.copies or policy.orphaned(e) else 0
        victims = []
        # held below (or orphans) first, each coldest first
        for e in sorted(mine, key=lambda e: not (e.copies or policy.orphaned(e))):
            if excess <= 0:
                break
            victims.append(e)
            excess -= e.ns.slot_bytes
        return victims

    # -- stores -----------------------------------------------------------------------------------

    async def make_room(self, ns: NamespaceState, keys: Sequence[bytes]) -> None:
        """Backpressure before a store (no-op without a chain): ``clean_quota`` then ``fit``,
        then the chain cleans the arena's cold end, so the new blocks evict only blocks held
        below; both waits together at most ROOM_WAIT_S."""
        if not self.state.chain:
            return
        deadline = time.monotonic() + ROOM_WAIT_S
        if self.state.admission.host_quota(ns) is not None:
            await self.clean_quota(ns, len(keys))  # (as ``fit`` counts them)
            self.fit(ns, len(keys))
        new = sum(1 for k in keys if k not in ns.entries)
        await self.state.chain[0].ensure_room(
            ns.slot_bytes, new, max(0.0, deadline - time.monotonic()), pool=ns.pool
        )

    async def clean_quota(self, ns: NamespaceState, n_blocks: int, timeout_s: float = ROOM_WAIT_S) -> None:
        """Let the chain write down the coldest blocks of ``ns``'s tenant that ``n_blocks`` new
        host slots of ``ns`` would evict (``fit``: its ``host_bytes``), up to ``timeout_s``."""
        admission = self.state.admission
        quota, tenant = admission.host_quota(ns), ns.spec.owner
        if quota is None or tenant is None or not n_blocks or not self.state.chain:
            return
        new_bytes = n_blocks * ns.slot_bytes

        def need() -> int:
            return admission.tenant_host_bytes(tenant) + new_bytes - quota

        await self.state.chain[0].clean_cold_end(
            need, lambda e: e.ns.spec.owner == tenant, timeout_s, 1 << 16
        )

    def reserve(
        self,
        session: Session,
        ns: NamespaceState,
        keys: Sequence[bytes],
        transport: Transport,
        *,
        token_ids: Sequence[int] = (),
        parent: bytes | None = None,
    ) -> tuple[StoreJob | None, bytes, list[int]]:
        """Reserve the keys not held yet (``TieredCache.prepare_store`` checked the request and
        made room). ``token_ids`` (all the keys' tokens, or none) and ``parent`` (the key before
        ``keys[0]``, or None) are kept with each reserved entry while KV events are on, for its
        ``BlockStored``; the parent links also while the host policy keeps chains whole."""
        check_live(session)  # (jobs attach only to live sessions)
        status = bytearray(len(keys))
        offsets = [0] * len(keys)
        fresh, protect = _split_batch(ns, keys, status)
        job_id = self.state.jobs.next_id()
        items = self._reserve(ns, fresh, protect, job_id, status, offsets)
        if self.state.residency.events.publishing:
            keep_origins(ns, keys, items, token_ids, parent)
        if self.state.policy.wants_parents:  # (parent links: for a prefix-aware policy only)
            for i, e in items.items():
                file_under(e, keys[i - 1] if i else parent)
        rejected = len(fresh) - len(items)  # (each placed key has its entry)
        if rejected:
            ns.counters.stores_rejected += rejected
            for i in list(fresh.values())[len(items) :]:
                status[i] = StoreStatus.REJECTED
        if not items:
            return None, bytes(status), offsets
        job = StoreJob(job_id, session.id, ns, transport, items)
        self.state.jobs.add(job)
        session.store_jobs.add(job_id)
        self.state.writing_blocks += len(items)
        ns.writing_blocks += len(items)
        return job, bytes(status), offsets

    def _reserve(
        self,
        ns: NamespaceState,
        fresh: dict[bytes, int],
        protect: set[Entry],
        job_id: int,
        status: bytearray,
        offsets: list[int],
    ) -> dict[int, Entry]:
        """Host slots for a prefix of the ``fresh`` keys (key -> batch index), each taken by a
        WRITING entry of job ``job_id`` put into the index, RESERVED in ``status`` with its
        offset in ``offsets``: batch index -> entry. One walk of the victims for the batch;
        the keys past that prefix cannot be placed now (nothing evictable for this class: the
        rest of the batch cannot fit either)."""
        placed = (
            self.state.residency.allocate_many(ns.slot_bytes, len(fresh), protect, ns.pool) if fresh else []
        )
        items: dict[int, Entry] = {}
        for (k, i), off in zip(fresh.items(), placed, strict=False):  # (placed: a prefix)
            e = Entry(ns, k, off, job_id)
            ns.entries[k] = e
            items[i] = e
            status[i] = StoreStatus.RESERVED
            offsets[i] = off
        return items

    async def stage(self, session: Session, job: StoreJob, pool: int) -> dict[int, int]:
        """Staging slots in arena ``pool`` (the session's own) for ``job``, whose arena the
        session maps read-only (kvtierd.cache.staging), placed as a store into ``pool`` is
        (with a chain, its coldest blocks written down first); none placed for some: the job
        ends, nothing reserved, and RESOURCE_EXHAUSTED."""
        if self.state.chain:
            await self.state.chain[0].ensure_room(job.ns.slot_bytes, len(job.items), pool=pool)
            check_live(session)  # (a release ends the session's jobs)
        if not stage(self.state.residency, job, pool):
            self.end_store(session, job, False, (), 0.0)
            raise ResourceExhausted(
                f"no room in the session's own arena to stage {len(job.items)} blocks for a "
                "group's arena it maps read-only (store fewer at once)",
                field="keys",
            )
        return job.staged

    def checked_job(
        self, session: Session, job_id: int, item_ok: Sequence[bool], digests: Sequence[int]
    ) -> StoreJob:
        """A CompleteStore's job, checked before anything changes: live and ``session``'s, no
        CUDA copy in flight, one ``item_ok`` and (when any) one digest per reserved key."""
        job = self.state.jobs.get(session.id, job_id, StoreJob)
        self.state.jobs.not_copying(job_id)
        check_digest_count(digests, job)
        if item_ok and len(item_ok) != len(job.items):
            raise InvalidArgument(
                f"has {len(item_ok)} values for {len(job.items)} reserved keys", field="item_ok"
            )
        return job

    def end_store(
        self,
        session: Session,
        job: StoreJob,
        ok: bool,
        item_ok: Sequence[bool],
        hold_until: float,
        digests: Sequence[int] = (),
    ) -> tuple[int, int]:
        self.state.jobs.remove(job)
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
                if self.state.verify_bytes:
                    e.digest = digests[n] if digests else job.digests.get(i)
                ns.ready[e.key] = e
                self.state.residency.count(e, +1)
                committed.append(e)
            else:
                self.state.residency.free_reserved(e, hold_until)
                aborted += 1
        self.state.writing_blocks -= len(job.items)
        job.ns.writing_blocks -= len(job.items)
        free_staged(self.state.residency, job, hold_until)  # (copied by now, or never to be)
        if committed:
            self.state.residency.enter_policy(committed)
            self._announce_committed(committed)
        c.stores_accepted += len(committed)
        c.stores_dropped += aborted
        name = f"bytes_in_{job.transport.label}"
        setattr(c, name, getattr(c, name) + len(committed) * ns.block_bytes)
        return len(committed), aborted

    def _announce_committed(self, committed: list[Entry]) -> None:
        """Blocks just committed (READY in the host tier) told to the KV events, to each
        storage tier's link (its write policy) and to the cluster tier's."""
        self.state.residency.events.stored(committed, MEDIUM_CPU)
        for link in self.state.chain:
            link.on_committed(committed)
        if self.state.fleet is not None:
            self.state.fleet.on_committed(committed)

    def corrupt_claims(self, session: Session, job_id: int, indexes: Sequence[int]) -> list[Entry]:
        """The blocks of load job ``job_id`` at key ``indexes`` (a client found their bytes did
        not match their digest) that have a digest and a host slot: the caller rehashes them
        (off the event loop, while the job's pins hold the slots: kvtierd.service.transfers), so a
        client cannot drop blocks that are fine, then ``drop_corrupt`` s those that differ.
        Every index is checked first (INVALID_ARGUMENT, nothing changes)."""
        job = self.state.jobs.get(session.id, job_id, LoadJob)
        self.state.jobs.moves_bytes(job)
        if len(indexes) > len(job.items):
            raise InvalidArgument(
                f"has {len(indexes)} indexes for a job of {len(job.items)} blocks", field="corrupt"
            )
        for i in indexes:
            if i not in job.items:
                raise InvalidArgument(f"key {i} is not a block of job {job_id}", field="corrupt")
        return [
            e for e in (job.items[i] for i in dict.fromkeys(indexes)) if e.digest is not None and e.in_host
        ]

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
                    self.state.residency.events.removed((e,), MEDIUM_CPU)
                continue
            self.state.residency.events.removed((e,), MEDIUM_CPU)
            orphan = self.state.policy.orphaned(e)
            self.state.policy.remove(e, evicted=False)
            self.state.residency.count(e, -1)
            self.state.host.free(e.offset, ns.slot_bytes)
            e.offset = -1
            if not e.copies:
                self.state.residency.forget(e, orphan=orphan)
            else:
                for link in self.state.chain:
                    link.on_host_evicted(e)
        return n

    # -- sessions and transfers -------------------------------------------------------------------

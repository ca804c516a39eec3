"""The chain below the host tier: one :class:`TierLink` per storage tier (NVMe today).

Part of the cache (kvtierd.cache). A link drives one :class:`~kvtierd.tiers.StorageTier` through
that seam alone, and keeps the copies' side of every entry (``entry.copy_in(level)``):

* **demote** (flush): a READY host block is written to the tier; durable, it gets its location.
  The link's :class:`~kvtierd.policies.WritePolicy` chooses when (at commit, at a hit, or to keep
  the host tier's cold end clean); a block already held is never written again.
* **host eviction** of a block with a copy keeps it READY (served from the tier from then on).
* **promote**: a load of a block held only below first reads it into a host slot (verified); a
  corrupt copy is quarantined and the block is a miss (kvtierd.cache.promotion).
* **evict copies** in the order of its policy when the tier is full: LRU, or prefix-aware
  below a prefix-aware host tier (``kvtierd.policies.link_policy``; orphans first).
* **recovery** puts the copies the tier found back into the index; **probes** of a degraded
  tier run as one task of the link; **drain** flushes and writes the tier's checkpoint
  (kvtierd.cache.recovery).

The link is one object over one state (its queue, its copy policy, its task set): this module
holds its state, demotion and copies, and it holds its two other parts, each handed what it uses:
``promotion`` (:class:`~kvtierd.cache.promotion.Promotion`: reads back into host slots) and
``recovery`` (:class:`~kvtierd.cache.recovery.LinkRecovery`: open, restore, probes,
checkpoint), which reach the link's copies through ``add_copy`` / ``drop_copy`` / ``spawn``.

Counters: per namespace in the cache's Counters, in the columns the tier names
(``tier.columns``, kvtierd.tiers.base.StorageColumns); the tier keeps its own figures
(``tier.stats()``); ``flushes_in_flight`` is the link's.

Concurrency: event-loop thread only. Every await point is followed by a re-check of the entry
(it may have been dropped meanwhile); pins taken before an await keep entries in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from kvtier_contract.identity import Namespace
from kvtierd.cache.admission import Admission
from kvtierd.cache.jobs import JobTable
from kvtierd.cache.promotion import Promotion, bump
from kvtierd.cache.recovery import LinkRecovery
from kvtierd.cache.residency import ROOM_WAIT_S, HostResidency
from kvtierd.events import MEDIUM_STORAGE
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy, WritePolicy, link_policy
from kvtierd.tenancy import Tenancy
from kvtierd.tiers.base import Recovered, StorageTier, TierUnavailable

log = logging.getLogger("kvtierd.chain")
MAX_FLUSHES_IN_FLIGHT = 256  # blocks queued or being written
FLUSH_BATCH_BYTES = 4 << 20  # one flush batch: a few MiB, one group commit
FLUSH_WORKERS = 2
MAX_VICTIM_SCAN = 4096  # copies looked at for one slot before the tier counts as full


class TierLink:
    """Owns the copy-eviction order of one storage tier, its write policy, the flush queue and
    workers, and the promotions in flight from it. See the module docstring."""

    def __init__(
        self,
        residency: HostResidency,
        tier: StorageTier,
        write_policy: WritePolicy,
        namespaces: Callable[[], Iterable[NamespaceState]],
        *,
        admission: Admission | None = None,
        level: int = 0,
    ) -> None:
        self.residency = residency
        # a tenant's nvme_bytes: counted, claimed and refused there (none: a link of no cache)
        self.admission = admission or Admission(Tenancy(None), {}, JobTable())
        self.tier = tier
        self.id = tier.id
        self.level = level  # this link's place in the chain (0: right below the host tier)
        self.write_policy = write_policy
        # entries holding a copy here: the host tier's kind of order (LRU unless prefix-aware)
        self.policy: EvictionPolicy[Entry] = link_policy(residency.policy)
        self._namespaces = namespaces
        self.columns = tier.columns
        self.flushes_in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushed = asyncio.Event()  # set whenever a flush batch ends
        self._flush_queue: deque[Entry] = deque()
        self._flush_workers = 0
        self.promotion = Promotion(self, residency, tier, level)
        """Reads copies back into host slots, and what that costs now: its ``read_figures``
        (kvtierd.cache.promotion)."""
        self.recovery = LinkRecovery(self, residency, tier, level, namespaces)
        """Opens the tier, puts its copies back into the index, probes it, checkpoints it
        (kvtierd.cache.recovery)."""

    def restore(
        self, register: Callable[[Namespace], NamespaceState], opened: Recovered | None = None
    ) -> int:
        """``recovery.restore``: the tier opened and its copies put back (at start)."""
        return self.recovery.restore(register, opened)

    @property
    def admitting(self) -> bool:
        return self.tier.admitting

    # -- demotion (host -> tier) ------------------------------------------------------------------

    def on_committed(self, entries: Sequence[Entry]) -> None:
        """Blocks just committed (head-first): those the write policy writes now are queued,
        tail-first under a prefix-aware order (their copies here then rank the tail coldest,
        as the host tier ranks them)."""
        chosen = list(self.write_policy.committed(entries))
        if self.policy.wants_parents:  # (orphans from the start are not worth writing)
            chosen = [e for e in reversed(chosen) if not self.residency.policy.orphaned(e)]
        for e in chosen:
            self.schedule_flush(e)
        self.maybe_flush()

    def on_hits(self, entries: Sequence[Entry]) -> None:
        if self.write_policy.counts_hits:
            for e in entries:
                e.hits += 1
        for e in self.write_policy.hit(entries):
            self.schedule_flush(e)  # a no-op once the copy exists

    def maybe_flush(self) -> None:
        """Flush the coldest dirty host blocks while the write policy wants them clean."""
        host = self.residency.host
        excess = self.write_policy.excess_bytes(host.used_bytes, host.capacity_bytes)
        if excess <= 0 or not self.tier.admitting:
            return
        for scanned, e in enumerate(self.residency.policy.victims()):
            if excess <= 0 or self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT or scanned > 4096:
                break
            if e.copy_in(self.level) is None and not e.flushing and not self.residency.policy.orphaned(e):
                self.schedule_flush(e)  # (an orphan is not worth writing: evicting it loses nothing)
            excess -= e.ns.slot_bytes

    def schedule_flush(self, e: Entry) -> None:
        """Queue ``e`` for writing to the tier; flush workers write the queue in batches."""
        if (
            e.copy_in(self.level) is not None
            or e.flushing
            or not e.in_host
            or not self.tier.admitting
            or not self._tenant_fits(e.ns)
        ):
            return
        e.flushing += 1  # claimed now: the host slot stays until the write is done
        self.admission.claim_nvme(self.level, e.ns.spec.owner, e.ns.block_bytes)
        self.flushes_in_flight += 1
        self._flush_queue.append(e)
        if self._flush_workers < FLUSH_WORKERS:
            self._flush_workers += 1
            self.spawn(self._flush_worker())

    async def _flush_worker(self) -> None:
        """Take up to FLUSH_BATCH_BYTES of the queue at a time: one batched write (one gathered
        write per run of adjacent slots, one group commit); two workers overlap the data writes
        of one batch with the commit of the other."""
        try:
            while self._flush_queue:
                batch: list[Entry] = []
                size = 0
                while self._flush_queue and (not batch or size < FLUSH_BATCH_BYTES):
                    e = self._flush_queue.popleft()
                    batch.append(e)
                    size += e.ns.block_bytes
                await self._flush_batch(batch)
        finally:
            self._flush_workers -= 1

    async def _flush_batch(self, batch: list[Entry]) -> None:
        targets: list[tuple[Entry, int]] = []
        locs: list[Any] = []
        tier, host = self.tier, self.residency.host
        try:
            for e in batch:
                ns = e.ns
                if not tier.knows_namespace(ns.spec.digest):
                    await tier.register_namespace(ns.spec.digest, ns.spec.to_dict())
                off = self._allocate(ns.block_bytes)
                if off is not None and e.in_host:
                    targets.append((e, off))
                elif off is not None:
                    tier.free(off, tier.slot_bytes_for(ns.block_bytes))
            if targets:
                locs = await tier.write_many(
                    [
                        (
                            off,
                            e.ns.spec.digest,
                            e.key,
                            host.view(e.offset, e.ns.slot_bytes),
                            e.ns.block_bytes,
                            e.digest,
                        )
                        for e, off in targets
                    ]
                )
        except TierUnavailable as err:
            for e, off in targets:
                tier.free(off, tier.slot_bytes_for(e.ns.block_bytes))
            targets, locs = [], []
            log.debug("flush failed: %s", err)
        finally:
            self._unclaim(batch)
        self._record_copies(targets, locs)
        self.maybe_flush()

    def _unclaim(self, batch: list[Entry]) -> None:
        """A flush batch ended (written or not): its entries' claims go."""
        for e in batch:
            e.flushing -= 1
            self.admission.unclaim_nvme(self.level, e.ns.spec.owner, e.ns.block_bytes)
        self.flushes_in_flight -= len(batch)
        self._flushed.set()

    def _record_copies(self, targets: list[tuple[Entry, int]], locs: list[Any]) -> None:
        """The copies a flush batch wrote: kept for the entries still indexed and READY without
        one, released otherwise."""
        demoted: list[Entry] = []
        for (e, _off), loc in zip(targets, locs, strict=True):
            ns = e.ns
            if ns.entries.get(e.key) is e and e.state is EntryState.READY and e.copy_in(self.level) is None:
                self.add_copy(e, loc, announce=False)
                demoted.append(e)
                ns.counters.demotions += 1
                bump(ns, self.columns.bytes_written, ns.block_bytes)
            else:
                self.tier.release(loc, ns.spec.digest, e.key)
        if demoted:
            self.residency.events.stored(demoted, MEDIUM_STORAGE)

    async def ensure_room(
        self, slot_bytes: int, count: int, timeout_s: float = ROOM_WAIT_S, *, pool: int = 0
    ) -> None:
        """Backpressure before ``count`` new host blocks in arena ``pool``: ``clean_cold_end``
        of that arena's blocks until they can be placed by evicting only blocks this tier
        holds, so that nothing is lost while the tier keeps up."""
        host = self.residency.host

        def need() -> int:
            return count * slot_bytes - host.free_bytes(pool)

        await self.clean_cold_end(need, lambda e: e.ns.pool == pool, timeout_s)

    async def clean_cold_end(
        self, need: Callable[[], int], mine: Callable[[Entry], bool], timeout_s: float, max_scan: int = 4096
    ) -> None:
        """Flush the coldest host blocks that are ``mine`` and wait (up to ``timeout_s``) until
        ``need()`` bytes of them are clean (evictable with a copy here), blocks being written
        included: an arena's room (``ensure_room``), a tenant's ``host_bytes`` (the cache's
        ``make_room``). Returns early when nothing more can be written."""
        deadline = time.monotonic() + timeout_s
        while self.tier.admitting:
            left, waiting = need(), False
            for scanned, e in enumerate(self.residency.policy.victims()):
                if left <= 0 or scanned >= max_scan:
                    break
                if e.pins or e.promoting is not None or not mine(e):
                    continue
                if e.copy_in(self.level) is None and not self.residency.policy.orphaned(e):
                    if not e.flushing:
                        if self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT:
                            waiting = True
                            break
                        self.schedule_flush(e)
                    waiting = True
                    if not e.flushing:  # could not be scheduled (not in host / not admitting)
                        continue
                left -= e.ns.slot_bytes
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                return
            self._flushed.clear()
            try:
                await asyncio.wait_for(self._flushed.wait(), remaining)
            except TimeoutError:
                return

    async def flush_all(self, deadline: float) -> int:
        """Drain: flush every dirty host block (bounded concurrency) until ``deadline``. Nothing
        while the tier's own copies are not in the index yet (a late open in progress)."""
        n = 0
        if not self.recovery.indexed:
            return n
        for ns in list(self._namespaces()):
            for e in list(ns.ready.values()):
                while self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                if time.monotonic() >= deadline or not self.tier.admitting:
                    return n
                if e.copy_in(self.level) is None and e.in_host:
                    self.schedule_flush(e)
                    n += 1
        while self.flushes_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return n

    # -- copies -----------------------------------------------------------------------------------

    def _tenant_fits(self, ns: NamespaceState) -> bool:
        """Whether one more block of ``ns`` fits its tenant's quota here, after evicting that
        tenant's own coldest copies (never another tenant's) within MAX_VICTIM_SCAN. A block
        that does not fit is not written here: it lives in the host tier only, and is lost
        when that evicts it (the tenant's quota, not the tier, is full)."""
        tenant = ns.spec.owner
        quota = None if tenant is None else self.admission.nvme_quota(tenant)
        if tenant is None or quota is None:
            return True
        if ns.block_bytes > quota:
            self.admission.refuse_nvme(tenant)
            return False
        used = self.admission.nvme_used(self.level, tenant, self.columns.resident_bytes)
        if used + ns.block_bytes <= quota:
            return True
        mine = [
            e
            for n, e in zip(range(MAX_VICTIM_SCAN), self.policy.victims(), strict=False)
            if e.ns.spec.owner == tenant
        ]
        for e in mine:
            if e.pins or e.holds or e.promoting is not None or e.copy_in(self.level) is None:
                continue
            self.drop_copy(e, corrupt=False)
            bump(e.ns, self.columns.evictions, 1)
            used -= e.ns.block_bytes
            if used + ns.block_bytes <= quota:
                return True
        self.admission.refuse_nvme(tenant)
        return False

    def _allocate(self, block_bytes: int) -> int | None:
        slot = self.tier.slot_bytes_for(block_bytes)
        off = self.tier.alloc(slot)
        if off is not None:
            return off
        for n, e in enumerate(self.policy.victims()):  # coldest copies; the freed slab may move
            if n >= MAX_VICTIM_SCAN:
                break  # held or being read as far as we looked: the tier is full for now
            if e.pins or e.holds or e.promoting is not None:
                continue
            self.drop_copy(e, corrupt=False)
            bump(e.ns, self.columns.evictions, 1)
            off = self.tier.alloc(slot)
            if off is not None:
                return off
        return None

    def add_copy(self, e: Entry, loc: Any, *, announce: bool = True) -> None:
        """``e`` is held here now (``announce``: told to KV events at once; the callers that
        add many tell them in one call)."""
        e.set_copy(self.level, loc)
        if announce:
            self.residency.events.stored((e,), MEDIUM_STORAGE)
        self.policy.insert(e)
        bump(e.ns, self.columns.resident_blocks, 1)
        bump(e.ns, self.columns.resident_bytes, e.ns.block_bytes)

    def drop_copy(self, e: Entry, *, corrupt: bool) -> None:
        """Forget ``e``'s copy here; an entry left with no copy at all leaves the index."""
        loc = e.copy_in(self.level)
        assert loc is not None
        e.set_copy(self.level, None)
        self.residency.events.removed((e,), MEDIUM_STORAGE)
        orphan = self.policy.orphaned(e)
        if not corrupt and orphan:
            self.residency.orphans_evicted += 1
        self.policy.remove(e, evicted=not corrupt)
        bump(e.ns, self.columns.resident_blocks, -1)
        bump(e.ns, self.columns.resident_bytes, -e.ns.block_bytes)
        if corrupt:
            self.tier.quarantine(loc, e.ns.spec.digest, e.key)
        else:
            self.tier.release(loc, e.ns.spec.digest, e.key)
        if e.offset < 0 and e.promoting is None and not e.copies:
            self.residency.forget(e, orphan=orphan)

    def on_host_evicted(self, e: Entry, *, orphan: bool = False) -> None:
        """``e`` lost its host slot but keeps its copy here (``orphan``: the host tier offered
        it first as an orphan; so is its copy here)."""
        if orphan:
            self.policy.orphan((e,))
        else:
            self.policy.touch(e)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self) -> None:
        """Wait until every flush, promotion and probe this link started has ended (tests,
        drain). Cancelling the wait (a drain deadline) cancels none of them."""
        while self._tasks:
            await asyncio.gather(*(asyncio.shield(t) for t in self._tasks))

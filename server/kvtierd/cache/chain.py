"""The chain below the host tier: one :class:`TierLink` per storage tier (NVMe today).

Part of the cache (kvtierd.cache). A link drives one :class:`~kvtierd.tiers.StorageTier` through
that seam alone, and keeps the copies' side of every entry (``entry.copy_in(level)``):

* **demote** (flush): a READY host block is written to the tier; durable, it gets its location.
  The link's :class:`~kvtierd.policies.WritePolicy` chooses when (at commit, at a hit, or to keep
  the host tier's cold end clean); a block already held is never written again.
* **host eviction** of a block with a copy keeps it READY (served from the tier from then on).
* **promote**: a load of a block held only below first reads it into a host slot (verified); a
  corrupt copy is quarantined and the block is a miss.
* **evict copies** in LRU order when the tier is full.
* **recovery** puts the copies the tier found back into the index (at start, or when a tier
  that could not be opened at start opens on a later probe); **drain** flushes and writes the
  tier's checkpoint.
* **probes** of a degraded tier (and the late open of one that could not be opened at start,
  with putting its copies back) run as one task of the link at a time (``probe_soon``): the
  caller never waits on the disk, cancelling it interrupts nothing, and ``settle()`` waits for
  it. Until a late open has put its copies back, ``flush_all`` and ``checkpoint`` do nothing:
  the index does not hold the tier's blocks yet, and a checkpoint of it would drop them.

Counters: per namespace in the cache's Counters, in the columns the tier names
(``tier.columns``, kvtierd.tiers.base.StorageColumns); the tier keeps its own figures
(``tier.stats()``); ``flushes_in_flight`` is the link's.

Concurrency: event-loop thread only. Every await point is followed by a re-check of the entry
(it may have been dropped meanwhile); pins taken before an await keep entries in place.

Size: just over the house limit, because demotion, promotion and copy eviction of one tier share
its queue, its copy policy and its task set; splitting them would spread one state machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from kvtier_contract.identity import Namespace
from kvtierd.cache.read_figures import ReadFigures
from kvtierd.cache.residency import HostResidency
from kvtierd.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy, LruPolicy, WritePolicy
from kvtierd.ratelog import RateLimitedLog
from kvtierd.tiers.base import CorruptCopy, Recovered, StorageTier, TierUnavailable

log = logging.getLogger("kvtierd.chain")
MAX_FLUSHES_IN_FLIGHT = 256  # blocks queued or being written
FLUSH_BATCH_BYTES = 4 << 20  # one flush batch: a few MiB, one group commit
FLUSH_WORKERS = 2
MAX_VICTIM_SCAN = 4096  # copies looked at for one slot before the tier counts as full
PROBE_LOG_INTERVAL_S = 300.0  # a probe failing the same unforeseen way logs this seldom


class TierLink:
    """Owns the copy-eviction order of one storage tier, its write policy, the flush queue and
    workers, and the promotions in flight from it. See the module docstring."""

    def __init__(self, residency: HostResidency, tier: StorageTier, write_policy: WritePolicy,
                 namespaces: Callable[[], Iterable[NamespaceState]], *, level: int = 0) -> None:
        self.residency = residency
        self.tier = tier
        self.id = tier.id
        self.level = level  # this link's place in the chain (0: right below the host tier)
        self.write_policy = write_policy
        self.policy: EvictionPolicy[Entry] = LruPolicy()  # entries holding a copy here
        self._namespaces = namespaces
        self.columns = tier.columns
        self.restored = 0  # copies put back into the index at start
        self.flushes_in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushed = asyncio.Event()  # set whenever a flush batch ends
        self._flush_queue: deque[Entry] = deque()
        self._flush_workers = 0
        # Set while the tier awaits a late open (it could not be opened at start), until the
        # copies it found are back in the index.
        self._deferred: Callable[[Namespace], NamespaceState] | None = None
        self._probing: asyncio.Task[None] | None = None  # the probe (or late open) in progress
        self._probe_failures = 0
        self._probe_log = RateLimitedLog(log, PROBE_LOG_INTERVAL_S)
        self.tenant_quota: Callable[[str], int | None] = lambda tenant: None
        """Bytes a tenant's blocks may occupy in this tier (for NVMe the tenants file's
        ``nvme_bytes``), None = unlimited; set by the daemon, read at every flush (a reload
        applies at once)."""
        self.quota_refused: Callable[[str], None] = lambda tenant: None
        """Called with the tenant each time ``tenant_quota`` keeps one of its blocks from being
        written here (the daemon counts it as that quota's refusal)."""
        self._claimed: dict[str, int] = {}  # tenant -> bytes queued or being written here
        self.read_figures = ReadFigures()
        """What promotions from this tier cost now (kvtierd.cache.read_figures): fed once per
        ``promote_many`` that read something."""

    @property
    def admitting(self) -> bool:
        return self.tier.admitting

    # -- recovery ---------------------------------------------------------------------------------

    def restore(self, register: Callable[[Namespace], NamespaceState],
                opened: Recovered | None = None) -> int:
        """Open the tier and put the copies it holds back into the index (at startup);
        ``opened``: what the caller's own ``tier.open()`` returned (the daemon opens the tier
        before it reserves host memory, to refuse a degraded one first), not opened again.

        A tier whose index cannot be read now (TierUnavailable: a missing or read-only
        directory, an I/O error) is left closed and degraded; the host tier serves, and
        :meth:`probe` opens and restores it once the disk is back."""
        try:
            rec = opened if opened is not None else self.tier.open()
        except TierUnavailable as err:
            log.error("%s tier not opened, the host tier serves alone until a probe opens it: "
                      "%s", self.tier.name, err)
            self._deferred = register
            return 0
        return self._put_back(rec, register)

    @property
    def indexed(self) -> bool:
        """Whether the index holds every copy the tier holds (False until a late open has put
        them back): only then may a drain flush to the tier and checkpoint it."""
        return self._deferred is None

    def probe_soon(self) -> None:
        """Start a probe of the degraded tier in the background, unless one is in progress: a
        task of this link (see the module docstring). A tier that could not be opened at start
        is opened there and its copies put back into the live index."""
        if self._probing is None:
            self._probing = self._spawn(self._probe())

    async def probe(self) -> bool:
        """``probe_soon`` and wait for that probe; whether the tier admits now. Cancelling the
        caller leaves the probe running."""
        self.probe_soon()
        task = self._probing
        assert task is not None
        await asyncio.shield(task)
        return self.tier.admitting

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            register = self._deferred
            if register is None:
                await loop.run_in_executor(None, self.tier.probe)
            else:
                try:
                    rec = await loop.run_in_executor(None, self.tier.open)
                except TierUnavailable as err:
                    log.debug("%s tier still unavailable: %s", self.tier.name, err)
                    return
                n = self._put_back(rec, register)  # no await between the open and this
                self._deferred = None
                self.restored += n
                log.info("%s tier opened late: %d copies restored", self.tier.name, n)
            self._probe_failures = 0
        except Exception:  # noqa: BLE001  (unforeseen: the traceback once, then rate-limited)
            self._probe_failures += 1
            if self._probe_failures == 1:
                log.exception("%s probe failed", self.tier.name)
            else:
                self._probe_log.error("%s probe failed again (%d times in a row)",
                                      self.tier.name, self._probe_failures, exc_info=False)
        finally:
            self._probing = None

    def _put_back(self, rec: Recovered, register: Callable[[Namespace], NamespaceState]) -> int:
        """Index the copies ``rec`` holds. At startup the index is empty; after a late open it
        is live: an entry stored meanwhile (READY, or WRITING: its commit then finds the copy
        and writes none; its abort leaves the block held here) gets the copy as its own; any
        other clash (a second copy, a size mismatch) releases the slot."""
        namespaces, skipped = _register_recovered(rec, register)
        restored = dropped = 0
        announced: list[Entry] = []
        for digest, key, loc in rec.blocks:
            home = namespaces.get(digest)
            if home is None or loc.payload_len != home.block_bytes:
                dropped += digest in skipped
                self.tier.release(loc, digest, key)
                continue
            e = home.entries.get(key)
            if e is None:
                e = Entry(home, key, -1, 0)
                e.state = EntryState.READY
                e.digest = self.tier.digest_of(loc)  # the block's digest from its commit
                home.entries[key] = e
                home.ready[key] = e
            elif e.copy_in(self.level) is not None:
                self.tier.release(loc, digest, key)
                continue
            self._add_copy(e, loc, announce=False)
            announced.append(e)
            restored += 1
        if announced and self.residency.events is not None:  # (at start: after the
            self.residency.events.stored(announced, MEDIUM_STORAGE)  # AllBlocksCleared)
        if skipped:  # one line, not one per namespace (a rule change can refuse many)
            why = sorted(set(skipped.values()))
            more = f" (and {len(why) - 3} more reasons)" if len(why) > 3 else ""
            log.warning("%s: %d recovered namespaces not restored, their %d blocks freed: %s%s",
                        self.tier.name, len(skipped), dropped, "; ".join(why[:3]), more)
        return restored

    # -- demotion (host -> tier) ------------------------------------------------------------------

    def on_committed(self, entries: Sequence[Entry]) -> None:
        for e in self.write_policy.committed(entries):
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
            if e.copy_in(self.level) is None and not e.flushing:
                self.schedule_flush(e)
            excess -= e.ns.slot_bytes

    def schedule_flush(self, e: Entry) -> None:
        """Queue ``e`` for writing to the tier; flush workers write the queue in batches."""
        if e.copy_in(self.level) is not None or e.flushing or not e.in_host \
                or not self.tier.admitting or not self._tenant_fits(e.ns):
            return
        e.flushing += 1  # claimed now: the host slot stays until the write is done
        if e.ns.spec.tenant is not None:
            self._claimed[e.ns.spec.tenant] = self._claimed.get(e.ns.spec.tenant, 0) + \
                e.ns.block_bytes
        self.flushes_in_flight += 1
        self._flush_queue.append(e)
        if self._flush_workers < FLUSH_WORKERS:
            self._flush_workers += 1
            self._spawn(self._flush_worker())

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
                locs = await tier.write_many([
                    (off, e.ns.spec.digest, e.key, host.view(e.offset, e.ns.slot_bytes),
                     e.ns.block_bytes, e.digest) for e, off in targets])
        except TierUnavailable as err:
            for e, off in targets:
                tier.free(off, tier.slot_bytes_for(e.ns.block_bytes))
            targets, locs = [], []
            log.debug("flush failed: %s", err)
        finally:
            for e in batch:
                e.flushing -= 1
                tenant = e.ns.spec.tenant
                if tenant is not None:
                    left = self._claimed.get(tenant, 0) - e.ns.block_bytes
                    if left > 0:
                        self._claimed[tenant] = left
                    else:
                        self._claimed.pop(tenant, None)
            self.flushes_in_flight -= len(batch)
            self._flushed.set()
        demoted: list[Entry] = []
        for (e, _off), loc in zip(targets, locs, strict=True):
            ns = e.ns
            if ns.entries.get(e.key) is e and e.state is EntryState.READY \
                    and e.copy_in(self.level) is None:
                self._add_copy(e, loc, announce=False)
                demoted.append(e)
                ns.counters.demotions += 1
                self._bump(ns, self.columns.bytes_written, ns.block_bytes)
            else:
                tier.release(loc, ns.spec.digest, e.key)
        if demoted and self.residency.events is not None:
            self.residency.events.stored(demoted, MEDIUM_STORAGE)
        self.maybe_flush()

    async def ensure_room(self, slot_bytes: int, count: int, timeout_s: float = 0.5, *,
                          pool: int = 0) -> None:
        """Backpressure before ``count`` new host blocks in arena ``pool``: flush the coldest
        host blocks of that arena and wait (up to ``timeout_s``) until they can be placed by
        evicting only blocks this tier holds, so that nothing is lost while the tier keeps up."""
        host = self.residency.host
        deadline = time.monotonic() + timeout_s
        while self.tier.admitting:
            need = count * slot_bytes - host.free_bytes(pool)
            waiting = False
            for scanned, e in enumerate(self.residency.policy.victims()):
                if need <= 0 or scanned >= 4096:
                    break
                if e.pins or e.promoting is not None or e.ns.pool != pool:
                    continue
                if e.copy_in(self.level) is None:
                    if not e.flushing:
                        if self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT:
                            waiting = True
                            break
                        self.schedule_flush(e)
                    waiting = True
                    if not e.flushing:  # could not be scheduled (not in host / not admitting)
                        continue
                need -= e.ns.slot_bytes
            if not waiting and need <= 0:
                return
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
        if not self.indexed:
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

    # -- promotion (tier -> host) -----------------------------------------------------------------

    async def promote_many(self, entries: list[Entry], protect: set[Entry], *,
                           asked: float | None = None) -> set[Entry]:
        """Make the host copies of ``entries`` valid, as many as the host tier can place now;
        returns those that now are. ``asked``: when the promotion was asked for (on
        ``read_figures.clock``; default: now), the start of the latency ``read_figures``
        measure.

        Room is made the write-back way first (no unflushed block is evicted for a promotion),
        host slots are taken up front, and the reads go in ~4 MiB batches, each block verified on
        its own: a corrupt one is quarantined and left out. Concurrent promotions of one entry
        are joined. The reads run as a task of this link: a caller cancelled meanwhile (an RPC
        past its deadline) leaves them to finish, so no entry stays ``promoting``.
        """
        if asked is None:
            asked = self.read_figures.clock()
        waiting = [e.promoting for e in entries if e.promoting is not None]
        if waiting:
            await asyncio.gather(*(asyncio.shield(f) for f in set(waiting)))
        pending = self._todo(entries)
        if pending:
            await self.ensure_room(pending[0].ns.slot_bytes, len(pending),
                                   pool=pending[0].ns.pool)
            pending = self._todo(entries)
        started = self._reserve(pending, protect)
        if started:
            await asyncio.shield(self._spawn(self._read(started, asked)))
        return {e for e in entries if e.in_host}

    def _todo(self, entries: Iterable[Entry]) -> list[Entry]:
        """Entries still in the index, held here, with no host slot and no promotion."""
        return [e for e in dict.fromkeys(entries) if not e.in_host and e.promoting is None
                and e.copy_in(self.level) is not None and e.ns.entries.get(e.key) is e]

    def _reserve(self, pending: list[Entry], protect: set[Entry]) -> list[Entry]:
        """Host slots for ``pending`` in order, until one cannot be placed (the host tier, or
        its tenant's host quota: ``residency.room_for``); each entry is ``promoting`` from here
        until its read ends."""
        loop = asyncio.get_running_loop()
        started: list[Entry] = []
        room: dict[NamespaceState, int] = {}
        for e in pending:
            if e.ns not in room:
                room[e.ns] = self.residency.room_for(
                    e.ns, sum(1 for p in pending if p.ns is e.ns), protect)
            if not room[e.ns]:
                break
            room[e.ns] -= 1
            off = self.residency.allocate(e.ns.slot_bytes, protect, e.ns.pool)
            if off is None:
                break
            e.offset, e.promoting = off, loop.create_future()
            started.append(e)
        return started

    async def _read(self, started: list[Entry], asked: float) -> None:
        """Read reserved entries in ~4 MiB batches (each one ``read_many``); the whole counts
        as one read batch of ``read_figures``."""
        began = self.read_figures.clock()
        jobs: list[list[Entry]] = []
        size = FLUSH_BATCH_BYTES
        for e in started:
            if size >= FLUSH_BATCH_BYTES:
                jobs.append([])
                size = 0
            jobs[-1].append(e)
            size += e.ns.block_bytes
        if len(jobs) == 1:
            nbytes, parts = await self._promote_job(jobs[0]), []
        else:  # parallel parts: each one's own time too (read_figures: not bandwidth)
            parts = await asyncio.gather(*(self._timed_job(job) for job in jobs))
            nbytes = sum(n for n, _ in parts)
        self.read_figures.observe(nbytes, asked, began, self.read_figures.clock(), parts)

    async def _timed_job(self, job: list[Entry]) -> tuple[int, float]:
        began = self.read_figures.clock()
        nbytes = await self._promote_job(job)
        return nbytes, self.read_figures.clock() - began

    async def _promote_job(self, job: list[Entry]) -> int:
        """Read one batch; the payload bytes promoted."""
        host = self.residency.host
        try:
            results = await self.tier.read_many([
                (e.copy_in(self.level), e.ns.spec.digest, e.key, host.view(e.offset, e.ns.slot_bytes))
                for e in job])
        except Exception as failure:  # noqa: BLE001  (every waiter must be released)
            results = [failure] * len(job)
        promoted: list[Entry] = []
        for e, err in zip(job, results, strict=True):
            fut, e.promoting = e.promoting, None
            ns = e.ns
            if err is None:
                self.residency.policy.insert(e)
                self.residency.count(e, +1)
                ns.counters.promotions += 1
                self._bump(ns, self.columns.bytes_read, ns.block_bytes)
                promoted.append(e)
            else:
                corrupt = isinstance(err, CorruptCopy)
                if corrupt:
                    log.warning("%s block %s… of %s failed verification (%s): quarantined",
                                self.tier.name, e.key[:4].hex(), ns.spec.model_id, err)
                    ns.counters.checksum_failures += 1
                else:  # the copy may be fine (a transient error): kept, a miss this time
                    log.warning("%s read failed: %s", self.tier.name, err)
                host.free(e.offset, ns.slot_bytes)
                e.offset = -1
                if corrupt and e.copy_in(self.level) is not None:
                    self._drop_copy(e, corrupt=True)
            if fut is not None:
                fut.set_result(None)
        if promoted and self.residency.events is not None:
            self.residency.events.stored(promoted, MEDIUM_CPU)
        return sum(e.ns.block_bytes for e in promoted)

    def prefetch(self, entries: Sequence[Entry]) -> int:
        """Start promoting, in the background, those of ``entries`` held only here; how many."""
        todo = [e for e in entries if not e.in_host and e.promoting is None
                and e.copy_in(self.level) is not None]
        if todo:
            self._spawn(self._promote_quietly(todo, self.read_figures.clock()))
        return len(todo)

    async def _promote_quietly(self, entries: list[Entry], asked: float) -> None:
        await self.promote_many(entries, set(), asked=asked)

    # -- copies -----------------------------------------------------------------------------------

    def _tenant_fits(self, ns: NamespaceState) -> bool:
        """Whether one more block of ``ns`` fits its tenant's quota here, after evicting that
        tenant's own coldest copies (never another tenant's) within MAX_VICTIM_SCAN. A block
        that does not fit is not written here: it lives in the host tier only, and is lost
        when that evicts it (the tenant's quota, not the tier, is full)."""
        tenant = ns.spec.tenant
        quota = None if tenant is None else self.tenant_quota(tenant)
        if tenant is None or quota is None:
            return True
        if ns.block_bytes > quota:
            self.quota_refused(tenant)
            return False
        resident = self.columns.resident_bytes
        used = self._claimed.get(tenant, 0) + sum(
            getattr(n.counters, resident) for n in self._namespaces() if n.spec.tenant == tenant)
        if used + ns.block_bytes <= quota:
            return True
        mine = [e for n, e in zip(range(MAX_VICTIM_SCAN), self.policy.victims(), strict=False)
                if e.ns.spec.tenant == tenant]
        for e in mine:
            if e.pins or e.holds or e.promoting is not None or e.copy_in(self.level) is None:
                continue
            self._drop_copy(e, corrupt=False)
            self._bump(e.ns, self.columns.evictions, 1)
            used -= e.ns.block_bytes
            if used + ns.block_bytes <= quota:
                return True
        self.quota_refused(tenant)
        return False

    def _allocate(self, block_bytes: int) -> int | None:
        slot = self.tier.slot_bytes_for(block_bytes)
        off = self.tier.alloc(slot)
        if off is not None:
            return off
        for n, e in enumerate(self.policy.victims()):  # LRU copies; the freed slab may move
            if n >= MAX_VICTIM_SCAN:
                break  # held or being read as far as we looked: the tier is full for now
            if e.pins or e.holds or e.promoting is not None:
                continue
            self._drop_copy(e, corrupt=False)
            self._bump(e.ns, self.columns.evictions, 1)
            off = self.tier.alloc(slot)
            if off is not None:
                return off
        return None

    def _add_copy(self, e: Entry, loc: Any, *, announce: bool = True) -> None:
        """``e`` is held here now (``announce``: told to KV events at once; the callers that
        add many tell them in one call)."""
        e.set_copy(self.level, loc)
        if announce and self.residency.events is not None:
            self.residency.events.stored((e,), MEDIUM_STORAGE)
        self.policy.insert(e)
        self._bump(e.ns, self.columns.resident_blocks, 1)
        self._bump(e.ns, self.columns.resident_bytes, e.ns.block_bytes)

    def _drop_copy(self, e: Entry, *, corrupt: bool) -> None:
        """Forget ``e``'s copy here; an entry left with no copy at all leaves the index."""
        loc = e.copy_in(self.level)
        assert loc is not None
        e.set_copy(self.level, None)
        if self.residency.events is not None:
            self.residency.events.removed((e,), MEDIUM_STORAGE)
        self.policy.remove(e, evicted=not corrupt)
        self._bump(e.ns, self.columns.resident_blocks, -1)
        self._bump(e.ns, self.columns.resident_bytes, -e.ns.block_bytes)
        if corrupt:
            self.tier.quarantine(loc, e.ns.spec.digest, e.key)
        else:
            self.tier.release(loc, e.ns.spec.digest, e.key)
        if e.offset < 0 and e.promoting is None and not e.copies:
            self.residency.forget(e)

    def on_host_evicted(self, e: Entry) -> None:
        """``e`` lost its host slot but keeps its copy here."""
        self.policy.touch(e)

    @staticmethod
    def _bump(ns: NamespaceState, column: str, n: int) -> None:
        setattr(ns.counters, column, getattr(ns.counters, column) + n)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self) -> None:
        """Wait until every flush, promotion and probe this link started has ended (tests,
        drain). Cancelling the wait (a drain deadline) cancels none of them."""
        while self._tasks:
            await asyncio.gather(*(asyncio.shield(t) for t in self._tasks))

    # -- shutdown ---------------------------------------------------------------------------------

    def checkpoint(self) -> bool:
        """Blocking: the tier records every copy it holds, for a warm next start; True once
        written. Nothing (False) while a probe or late open is in progress or the tier's copies
        are not in the index yet: the journals then stay, and the next start replays them."""
        if self._probing is not None or not self.indexed:
            log.warning("%s checkpoint skipped: the tier is still being opened or probed (the "
                        "next start replays its journals)", self.tier.name)
            return False
        nss = list(self._namespaces())
        namespaces = {ns.spec.digest: ns.spec.to_dict() for ns in nss}
        blocks = [(ns.spec.digest, e.key, e.copy_in(self.level)) for ns in nss
                  for e in ns.entries.values() if e.copy_in(self.level) is not None]
        self.tier.checkpoint(namespaces, blocks)
        return True


def _register_recovered(rec: Recovered, register: Callable[[Namespace], NamespaceState]
                        ) -> tuple[dict[bytes, NamespaceState], dict[bytes, str]]:
    """The recovered namespaces registered (by digest), and those this daemon cannot host (a
    moving ref...) with why."""
    namespaces: dict[bytes, NamespaceState] = {}
    skipped: dict[bytes, str] = {}
    for digest, spec in rec.namespaces.items():
        try:
            namespaces[digest] = register(Namespace.from_dict(spec))
        except Exception as err:  # noqa: BLE001  (skip it; one summary line in _put_back)
            skipped[digest] = str(err)
    return namespaces, skipped

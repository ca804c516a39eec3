"""Moves blocks between the host tier and the NVMe tier; the cache's second half.

The TieredCache owns the index and the host tier; this bridge owns the NVMe side of every entry:

* **flush** (demote): a READY host entry is written to NVMe; durable, it gets ``entry.nvme``.
  Write policies decide when: ``write-back`` (default) keeps the host tier's coldest end clean by
  flushing it once occupancy passes ``flush_watermark``, so that host eviction drops only blocks
  that NVMe holds; ``write-through`` flushes every committed store; ``selective`` flushes a block
  at its ``write_after_hits``-th hit. A block already on NVMe is never written again.
* **host eviction** of an entry with an NVMe copy keeps the entry (READY, on NVMe only).
* **promote**: a load of an NVMe-only entry first reads it into a host slot (header and payload
  verified); a corrupt slot is quarantined and the block is a miss.
* **NVMe eviction** frees NVMe copies in LRU order when the disk is full.
* **recovery** puts the blocks found on disk back into the index; **drain** flushes and writes
  the checkpoint.

Concurrency: event-loop thread only. Every await point is followed by a re-check of the entry
(it may have been dropped meanwhile); pins taken before an await keep entries in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Literal

from kvtier_contract.identity import Namespace
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy, LruPolicy
from kvtierd.tiers.nvme.device import DiskError
from kvtierd.tiers.nvme.format import CorruptSlot
from kvtierd.tiers.nvme.tier import NvmeLocation, NvmeTier

if TYPE_CHECKING:
    from kvtierd.cache import TieredCache

log = logging.getLogger("kvtierd.tiering")
WritePolicy = Literal["write-back", "write-through", "selective"]
MAX_FLUSHES_IN_FLIGHT = 256  # blocks queued or being written
FLUSH_BATCH_BYTES = 4 << 20  # one flush batch: a few MiB, one group commit
FLUSH_WORKERS = 2


class NvmeBridge:
    """Owns the NVMe policy (LRU over entries with an NVMe copy) and the flush/promote tasks."""

    def __init__(self, cache: TieredCache, nvme: NvmeTier, *, write_policy: WritePolicy,
                 flush_watermark: float, write_after_hits: int) -> None:
        self.cache = cache
        self.nvme = nvme
        self.policy: EvictionPolicy[Entry] = LruPolicy()
        self.write_policy = write_policy
        self.flush_watermark = flush_watermark
        self.write_after_hits = write_after_hits
        self.flushes_in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushed = asyncio.Event()  # set whenever a flush batch ends
        self._flush_queue: deque[Entry] = deque()
        self._flush_workers = 0

    # -- recovery ---------------------------------------------------------------------------------

    def load_recovered(self) -> int:
        """Open the NVMe tier and put what it holds back into the index (at startup)."""
        rec = self.nvme.open()
        namespaces: dict[bytes, NamespaceState] = {}
        for digest, spec in rec.namespaces.items():
            try:
                ns = self.cache.register_namespace(Namespace.from_dict(spec))
            except Exception as err:  # noqa: BLE001  (a spec this daemon cannot host: skip it)
                log.warning("recovered namespace %s not restored: %s", digest.hex()[:16], err)
                continue
            namespaces[digest] = ns
        restored = 0
        for digest, key, loc in rec.blocks:
            home = namespaces.get(digest)
            if home is None or key in home.entries or loc.payload_len != home.block_bytes:
                self.nvme.release(loc, digest, key)
                continue
            e = Entry(home, key, -1, 0)
            e.state = EntryState.READY
            e.nvme = loc
            home.entries[key] = e
            home.ready[key] = e
            self.policy.insert(e)
            self._count_nvme(e, +1)
            restored += 1
        return restored

    # -- flush (host -> NVMe) ---------------------------------------------------------------------

    def on_committed(self, entries: Iterable[Entry]) -> None:
        if self.write_policy == "write-through":
            for e in entries:
                self.schedule_flush(e)
        self.maybe_flush()

    def on_hits(self, entries: Iterable[Entry]) -> None:
        if self.write_policy != "selective":
            return
        for e in entries:
            e.hits += 1
            if e.hits >= self.write_after_hits:  # not ==: a flush refused at the N-th hit
                self.schedule_flush(e)  # (tier degraded) is retried; a no-op once on NVMe

    def maybe_flush(self) -> None:
        """write-back: flush the coldest dirty host entries while occupancy is over the mark."""
        if self.write_policy != "write-back" or not self.nvme.admitting:
            return
        host = self.cache.host
        excess = host.used_bytes - self.flush_watermark * host.capacity_bytes
        scanned = 0
        for e in self.cache.policy.victims():
            if excess <= 0 or self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT or scanned > 4096:
                break
            scanned += 1
            if e.nvme is None and not e.flushing:
                self.schedule_flush(e)
            excess -= e.ns.slot_bytes

    def schedule_flush(self, e: Entry) -> None:
        """Queue ``e`` for writing to NVMe; flush workers write the queue in batches."""
        if e.nvme is not None or e.flushing or not e.in_host or not self.nvme.admitting:
            return
        e.flushing = True  # claimed now: the host slot stays until the write is done
        self.flushes_in_flight += 1
        self._flush_queue.append(e)
        if self._flush_workers < FLUSH_WORKERS:
            self._flush_workers += 1
            self._spawn(self._flush_worker())

    async def _flush_worker(self) -> None:
        """Take up to FLUSH_BATCH_BYTES of the queue at a time: one gathered write per run of
        adjacent disk slots and one group commit per batch (two workers overlap the data
        writes of one batch with the commit of the other)."""
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
        locs: list[NvmeLocation] = []
        try:
            for e in batch:
                ns = e.ns
                if not self.nvme.knows_namespace(ns.spec.digest):
                    await self.nvme.register_namespace(ns.spec.digest, ns.spec.to_dict())
                off = self._allocate(ns.block_bytes)
                if off is not None and e.in_host:
                    targets.append((e, off))
                elif off is not None:
                    self.nvme.space.free(off, self.nvme.slot_bytes_for(ns.block_bytes))
            if targets:
                locs = await self.nvme.write_many([
                    (off, e.ns.spec.digest, e.key,
                     self.cache.host.arena.slot(e.offset, e.ns.slot_bytes), e.ns.block_bytes)
                    for e, off in targets])
        except DiskError as err:
            for e, off in targets:
                self.nvme.space.free(off, self.nvme.slot_bytes_for(e.ns.block_bytes))
            targets, locs = [], []
            log.debug("flush failed: %s", err)
        finally:
            for e in batch:
                e.flushing = False
            self.flushes_in_flight -= len(batch)
            self._flushed.set()
        for (e, _off), loc in zip(targets, locs, strict=True):
            ns = e.ns
            if ns.entries.get(e.key) is e and e.state is EntryState.READY and e.nvme is None:
                e.nvme = loc
                self.policy.insert(e)
                self._count_nvme(e, +1)
                ns.counters.demotions += 1
                ns.counters.nvme_bytes_written += ns.block_bytes
            else:
                self.nvme.release(loc, ns.spec.digest, e.key)
        self.maybe_flush()

    async def ensure_room(self, slot_bytes: int, count: int, timeout_s: float = 0.5) -> None:
        """Backpressure before a store of ``count`` new blocks: flush the coldest host blocks
        and wait (up to ``timeout_s``) until the store can be placed by evicting only blocks
        that NVMe holds, so that write-back loses nothing while the disk keeps up."""
        host = self.cache.host
        deadline = time.monotonic() + timeout_s
        while self.nvme.admitting:
            need = count * slot_bytes - (host.capacity_bytes - host.used_bytes)
            waiting = False
            for scanned, e in enumerate(self.cache.policy.victims()):
                if need <= 0 or scanned >= 4096:
                    break
                if e.pins or e.promoting is not None:
                    continue
                if e.nvme is None:
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
        """Drain: flush every dirty host entry (bounded concurrency) until ``deadline``."""
        n = 0
        for ns in list(self.cache.namespaces.values()):
            for e in list(ns.ready.values()):
                while self.flushes_in_flight >= MAX_FLUSHES_IN_FLIGHT and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                if time.monotonic() >= deadline or not self.nvme.admitting:
                    return n
                if e.nvme is None and e.in_host:
                    self.schedule_flush(e)
                    n += 1
        while self.flushes_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return n

    # -- promote (NVMe -> host) -------------------------------------------------------------------

    async def promote_many(self, entries: list[Entry], protect: set[Entry]) -> set[Entry]:
        """Make the host copies of ``entries`` valid; returns those that now are.

        Room is made the write-back way first (no unflushed block is evicted for a promotion),
        host slots are taken up front, and the NVMe reads go in ~4 MiB jobs (one coalesced
        ``preadv`` per run of adjacent disk slots), each block verified on its own: a corrupt
        one is quarantined and left out. Concurrent promotions of one entry are joined.
        """
        waiting = [e.promoting for e in entries if e.promoting is not None]
        if waiting:
            await asyncio.gather(*(asyncio.shield(f) for f in set(waiting)))

        def todo() -> list[Entry]:
            return [e for e in dict.fromkeys(entries) if not e.in_host and e.promoting is None
                    and e.nvme is not None and e.ns.entries.get(e.key) is e]

        pending = todo()
        if pending:
            await self.ensure_room(pending[0].ns.slot_bytes, len(pending))
            pending = todo()
        loop = asyncio.get_running_loop()
        started: list[Entry] = []
        for e in pending:
            off = self.cache.allocate_host(e.ns.slot_bytes, protect)
            if off is None:
                break
            e.offset, e.promoting = off, loop.create_future()
            started.append(e)
        jobs: list[list[Entry]] = []
        size = FLUSH_BATCH_BYTES
        for e in started:
            if size >= FLUSH_BATCH_BYTES:
                jobs.append([])
                size = 0
            jobs[-1].append(e)
            size += e.ns.block_bytes
        await asyncio.gather(*(self._promote_job(job) for job in jobs))
        return {e for e in entries if e.in_host}

    async def _promote_job(self, job: list[Entry]) -> None:
        arena = self.cache.host.arena
        try:
            results = await self.nvme.read_many([
                (e.nvme, e.ns.spec.digest, e.key, arena.slot(e.offset, e.ns.slot_bytes))
                for e in job])
        except Exception as failure:  # noqa: BLE001  (every waiter must be released)
            results = [failure] * len(job)
        for e, err in zip(job, results, strict=True):
            fut, e.promoting = e.promoting, None
            ns = e.ns
            if err is None:
                self.cache.policy.insert(e)
                c = ns.counters
                c.resident_blocks += 1
                c.resident_bytes += ns.block_bytes
                c.promotions += 1
                c.nvme_bytes_read += ns.block_bytes
            else:
                if isinstance(err, CorruptSlot):
                    log.warning("nvme block %s… of %s failed verification (%s): quarantined",
                                e.key[:4].hex(), ns.spec.model_id, err.reason)
                    ns.counters.checksum_failures += 1
                else:
                    log.warning("nvme read failed: %s", err)
                self.cache.host.free(e.offset, ns.slot_bytes)
                e.offset = -1
                if e.nvme is not None:
                    self._drop_nvme(e, corrupt=isinstance(err, CorruptSlot))
            if fut is not None:
                fut.set_result(None)

    def prefetch(self, ns: NamespaceState, keys: Iterable[bytes]) -> int:
        """Start promoting the NVMe-only blocks of a chain's ready prefix; how many."""
        todo: list[Entry] = []
        for k in keys:
            e = ns.ready.get(k)
            if e is None:
                break
            if not e.in_host and e.promoting is None:
                todo.append(e)
        if todo:
            self._spawn(self._promote_quietly(todo))
        return len(todo)

    async def _promote_quietly(self, entries: list[Entry]) -> None:
        await self.promote_many(entries, set())

    # -- NVMe space -------------------------------------------------------------------------------

    def _allocate(self, block_bytes: int) -> int | None:
        slot = self.nvme.slot_bytes_for(block_bytes)
        off = self.nvme.space.alloc(slot)
        if off is not None:
            return off
        for e in self.policy.victims():  # LRU NVMe copies; then the freed slab may move class
            if e.pins or e.promoting is not None:
                continue
            self._drop_nvme(e, corrupt=False)
            e.ns.counters.nvme_evictions += 1
            off = self.nvme.space.alloc(slot)
            if off is not None:
                return off
        return None

    def _drop_nvme(self, e: Entry, *, corrupt: bool) -> None:
        """Forget ``e``'s NVMe copy; an entry left with no copy at all leaves the index."""
        loc, e.nvme = e.nvme, None
        self.policy.remove(e, evicted=not corrupt)
        self._count_nvme(e, -1)
        if corrupt:
            self.nvme.quarantine(loc, e.ns.spec.digest, e.key)
        else:
            self.nvme.release(loc, e.ns.spec.digest, e.key)
        if e.offset < 0 and e.promoting is None:
            e.ns.ready.pop(e.key, None)
            del e.ns.entries[e.key]

    def on_host_evicted(self, e: Entry) -> None:
        """Hook from the cache: ``e`` lost its host copy but keeps its NVMe one."""
        self.policy.touch(e)

    @staticmethod
    def _count_nvme(e: Entry, sign: int) -> None:
        c = e.ns.counters
        c.nvme_resident_blocks += sign
        c.nvme_resident_bytes += sign * e.ns.block_bytes

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- shutdown ---------------------------------------------------------------------------------

    def checkpoint(self) -> None:
        namespaces = {ns.spec.digest: ns.spec.to_dict() for ns in self.cache.namespaces.values()}
        blocks = [(e.ns.spec.digest, e.key, e.nvme) for ns in self.cache.namespaces.values()
                  for e in ns.entries.values() if e.nvme is not None]
        self.nvme.checkpoint(namespaces, blocks)

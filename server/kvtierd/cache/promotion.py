"""The promotion side of a storage tier's link: reading copies back into host slots.

Part of the cache (kvtierd.cache): :class:`Promotion` is the part of a
:class:`~kvtierd.cache.chain.TierLink` (its ``promotion``) that reads copies back. A load of a
block held only below first reads it into a host slot (verified); a corrupt copy is quarantined
and the block is a miss. ``prefetch`` starts promotions in the
background. Every promotion feeds the link's ``read_figures`` (kvtierd.cache.read_figures).

Concurrency: event-loop thread only. The reads run as tasks of the link, so a caller cancelled
meanwhile leaves them to finish; an entry is ``promoting`` (a future others join) from the
moment its host slot is reserved until its read ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, Protocol

from kvtierd.cache.read_figures import ReadFigures
from kvtierd.cache.residency import ROOM_WAIT_S, HostResidency
from kvtierd.events import MEDIUM_CPU
from kvtierd.index import Entry, NamespaceState
from kvtierd.tiers.base import CorruptCopy, StorageColumns, StorageTier

log = logging.getLogger("kvtierd.chain")
READ_BATCH_BYTES = 4 << 20  # one read_many: a few MiB


def bump(ns: NamespaceState, column: str, n: int) -> None:
    """Add ``n`` to ``ns``'s counter ``column`` (a storage tier's column)."""
    setattr(ns.counters, column, getattr(ns.counters, column) + n)


class PromotionLink(Protocol):
    """What a promotion asks of its link (kvtierd.cache.chain.TierLink): room made the
    write-back way, its copies, its tasks."""

    async def ensure_room(
        self, slot_bytes: int, count: int, timeout_s: float = ROOM_WAIT_S, *, pool: int = 0
    ) -> None: ...

    def drop_copy(self, e: Entry, *, corrupt: bool) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class Promotion:
    """The promotion part of a :class:`~kvtierd.cache.chain.TierLink` (see the module
    docstring): owns its ``read_figures``; it is handed the link (room, copies, tasks), the host
    residency, the tier and its level; the promotions in flight are the entries' own
    ``promoting`` futures. Event-loop thread only."""

    def __init__(self, link: PromotionLink, residency: HostResidency, tier: StorageTier, level: int) -> None:
        self.link = link
        self.residency = residency
        self.tier = tier
        self.level = level
        self.columns: StorageColumns = tier.columns
        self.read_figures = ReadFigures()
        """What promotions from this tier cost now (kvtierd.cache.read_figures): fed once per
        ``promote_many`` that read something."""

    async def promote_many(
        self, entries: list[Entry], protect: set[Entry], *, asked: float | None = None
    ) -> set[Entry]:
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
        if pending:  # (the tenant's quota, then the arena: ROOM_WAIT_S for both)
            ns, deadline = pending[0].ns, time.monotonic() + ROOM_WAIT_S
            await self.residency.clean_quota(ns, len(pending), ROOM_WAIT_S)
            await self.link.ensure_room(
                ns.slot_bytes, len(pending), max(0.0, deadline - time.monotonic()), pool=ns.pool
            )
            pending = self._todo(entries)
        started = self._reserve(pending, protect)
        if started:
            await asyncio.shield(self.link.spawn(self._read(started, asked)))
        return {e for e in entries if e.in_host}

    def _todo(self, entries: Iterable[Entry]) -> list[Entry]:
        """Entries still in the index, held here, with no host slot and no promotion."""
        return [
            e
            for e in dict.fromkeys(entries)
            if not e.in_host
            and e.promoting is None
            and e.copy_in(self.level) is not None
            and e.ns.entries.get(e.key) is e
        ]

    def _reserve(self, pending: list[Entry], protect: set[Entry]) -> list[Entry]:
        """Host slots for ``pending`` in order, until one cannot be placed (the host tier, or
        its tenant's host quota: ``residency.room_for``); each entry is ``promoting`` from here
        until its read ends."""
        loop = asyncio.get_running_loop()
        started: list[Entry] = []
        room: dict[NamespaceState, int] = {}
        for e in pending:
            if e.ns not in room:
                room[e.ns] = self.residency.room_for(e.ns, sum(1 for p in pending if p.ns is e.ns), protect)
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
        size = READ_BATCH_BYTES
        for e in started:
            if size >= READ_BATCH_BYTES:
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
            results = await self.tier.read_many(
                [
                    (e.copy_in(self.level), e.ns.spec.digest, e.key, host.view(e.offset, e.ns.slot_bytes))
                    for e in job
                ]
            )
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
                bump(ns, self.columns.bytes_read, ns.block_bytes)
                promoted.append(e)
            else:
                self._read_failed(e, err)
            if fut is not None:
                fut.set_result(None)
        if promoted:
            self.residency.events.stored(promoted, MEDIUM_CPU)
        return sum(e.ns.block_bytes for e in promoted)

    def _read_failed(self, e: Entry, err: Exception) -> None:
        """``e``'s read into its reserved host slot failed: the slot is freed (a miss this
        time); a corrupt copy is quarantined (counted in ``checksum_failures``)."""
        ns = e.ns
        corrupt = isinstance(err, CorruptCopy)
        if corrupt:
            log.warning(
                "%s block %s… of %s failed verification (%s): quarantined",
                self.tier.name,
                e.key[:4].hex(),
                ns.spec.model_id,
                err,
            )
            ns.counters.checksum_failures += 1
        else:  # the copy may be fine (a transient error): kept, a miss this time
            log.warning("%s read failed: %s", self.tier.name, err)
        self.residency.host.free(e.offset, ns.slot_bytes)
        e.offset = -1
        if corrupt and e.copy_in(self.level) is not None:
            self.link.drop_copy(e, corrupt=True)

    def prefetch(self, entries: Sequence[Entry]) -> int:
        """Start promoting, in the background, those of ``entries`` held only here; how many."""
        todo = [
            e for e in entries if not e.in_host and e.promoting is None and e.copy_in(self.level) is not None
        ]
        if todo:
            self.link.spawn(self._promote_quietly(todo, self.read_figures.clock()))
        return len(todo)

    async def _promote_quietly(self, entries: list[Entry], asked: float) -> None:
        await self.promote_many(entries, set(), asked=asked)

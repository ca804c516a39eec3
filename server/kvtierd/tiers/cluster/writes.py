"""The write side of the cluster tier: ``offer``, the per-master queues and their writers.

:class:`ClusterWriter` is the part of :class:`~kvtierd.tiers.cluster.tier.ClusterTier` that
writes (see the tier's module docstring for ``offer``'s contract), handed to the tier. A write
is a plain ``SET … PX ttl``, never NX (a value planted before the real store must not outlive
it); each master has its own queue and writer, so a slow or dead master delays (and, past
``write_timeout_s``, drops) only its keys.

Concurrency: ``offer``, ``has_room`` and ``dropped`` run on the daemon's loop, ``stop`` on the
thread closing the tier; everything else on the tier's own loop thread; the figures both change
(``queued_*``, ``writes``, ``write_drops``, ``corrupt_exports``) and ``closed`` under the
writer's lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from kvtier_contract.digests import block_digest
from kvtierd.ratelog import RateLimitedLog
from kvtierd.tiers.base import SharedWriteItem
from kvtierd.tiers.cluster.format import encode_header, redis_key
from kvtierd.tiers.cluster.nodes import Node, Topology
from kvtierd.tiers.cluster.settings import ClusterSettings

log = logging.getLogger("kvtierd.cluster")

WriteItem = SharedWriteItem
"""(the block's :class:`Realm`, namespace digest, block key, the block's bytes: valid until
``done`` is called, the block's digest from its commit or None): a block whose bytes no longer
match their digest is not written (a write drop, counted in ``corrupt_exports`` too): the
cluster never gets bytes the host tier would not serve (docs/security.md)."""


class Offer:
    """One ``offer``: its admitted items, their results, and whom to tell. Tier thread only
    (after ``offer`` hands it over)."""

    __slots__ = ("items", "oks", "left", "done", "loop")

    def __init__(
        self, items: list[WriteItem], done: Callable[[list[bool]], None], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.items, self.done, self.loop = items, done, loop
        self.oks = [False] * len(items)
        self.left = len(items)


class ClusterWriter:
    """Owns the per-master write queues and their writer tasks, the write figures
    (``writes``, ``write_drops``, ``corrupt_exports``, ``queued_blocks``, ``queued_bytes``:
    admitted, not yet written or dropped) and ``closed``, with the lock they change under.
    Handed by the tier: its settings, its topology (read only), its loop (where the writers
    run) and ``poke`` (asks the tier for a slot-map refresh: a node failed or answered MOVED).
    See the module docstring for the threads."""

    def __init__(
        self,
        settings: ClusterSettings,
        topology: Topology,
        loop: asyncio.AbstractEventLoop,
        poke: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.topology = topology
        self._loop = loop
        self._poke = poke
        self.writes = self.write_drops = 0
        self.corrupt_exports = 0  # blocks not written: their bytes no longer matched
        self.queued_blocks = self.queued_bytes = 0
        self.closed = False
        self._lock = threading.Lock()
        self._corrupt_log = RateLimitedLog(log, 10.0)
        self._queues: dict[Node | None, deque[tuple[Offer, int]]] = {}
        self._writers: dict[Node, asyncio.Task[None]] = {}

    def stop(self) -> bool:
        """No more offers admitted (a writer's items left in its queue stay there, for
        ``drop_queued``); whether it was stopped already."""
        with self._lock:
            already, self.closed = self.closed, True
        return already

    def drop_queued(self) -> None:
        """Tier thread, once the writers are cancelled: what they held is dropped (each offer's
        ``done`` told)."""
        for q in self._queues.values():
            while q:
                offer, i = q.popleft()
                self._resolve(offer, i, False)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``offer`` would admit a block of ``nbytes`` now (a hint: no reservation)."""
        return (
            not self.closed
            and self.topology.known
            and self.queued_bytes + nbytes <= self.settings.queue_bytes
        )

    def dropped(self, n: int) -> None:
        """``n`` blocks were not offered because ``has_room`` said no: counted as drops."""
        with self._lock:
            self.write_drops += n

    def offer(self, items: list[WriteItem], done: Callable[[list[bool]], None]) -> int:
        """Admit the longest prefix of ``items`` that fits the queue; how many were. ``done``
        gets their results later, on the caller's loop (not called when none was admitted)."""
        n = nbytes = 0
        with self._lock:
            if not self.closed and self.topology.known:
                room = self.settings.queue_bytes - self.queued_bytes
                for _r, _, _, view, _d in items:
                    if nbytes + view.nbytes > room:
                        break
                    nbytes += view.nbytes
                    n += 1
            self.write_drops += len(items) - n
            self.queued_blocks += n
            self.queued_bytes += nbytes
        if n:
            offer = Offer(items[:n], done, asyncio.get_running_loop())
            try:
                self._loop.call_soon_threadsafe(self._dispatch, offer)
            except RuntimeError:  # the tier's loop has stopped (closing)
                self._loop_gone(offer)
        return n

    def _loop_gone(self, offer: Offer) -> None:
        with self._lock:
            self.write_drops += offer.left
            self.queued_blocks -= offer.left
            self.queued_bytes -= sum(v.nbytes for _r, _, _, v, _d in offer.items)
        self._notify(offer)

    def _dispatch(self, offer: Offer) -> None:
        """Tier thread: each item to its master's queue (no master: dropped now)."""
        if self.closed:
            self._loop_gone(offer)
            return
        rkeys = [redis_key(r, d, k) for r, d, k, _v, _d in offer.items]
        for node, idx in self.topology.group(rkeys).items():
            if node is None:
                for i in idx:
                    self._resolve(offer, i, False)
                continue
            q = self._queues.setdefault(node, deque())
            q.extend((offer, i) for i in idx)
            if node not in self._writers:
                task = self._loop.create_task(self._node_writer(node, q))
                self._writers[node] = task

    async def _node_writer(self, node: Node, q: deque[tuple[Offer, int]]) -> None:
        """One master's writes, one pipeline at a time (at most its share of
        ``inflight_bytes``); ends when its queue is empty."""
        ttl_ms = max(1, int(self.settings.ttl_s * 1000))
        share = max(1 << 20, self.settings.inflight_bytes // max(1, len(self.topology.masters())))
        try:
            while q:
                batch: list[tuple[Offer, int]] = []
                size = 0
                while q and (not batch or size < share):
                    offer, i = q.popleft()
                    batch.append((offer, i))
                    size += offer.items[i][3].nbytes
                results: list[bool] = [False] * len(batch)
                try:
                    results = await self._write(node, batch, ttl_ms)
                except Exception:  # noqa: BLE001  (a bug must not leave blocks pinned)
                    log.exception("cluster write to %s failed", node.address)
                finally:
                    for (offer, i), ok in zip(batch, results, strict=True):
                        self._resolve(offer, i, ok)
        finally:
            self._writers.pop(node, None)
            if q and not self.closed:  # cancelled with items left: they go to the next writer
                self._writers[node] = self._loop.create_task(self._node_writer(node, q))

    async def _write(self, node: Node, batch: list[tuple[Offer, int]], ttl_ms: int) -> list[bool]:
        # a block altered in the host tier since its commit is not exported (hashed on this
        # tier's thread, off the daemon's loop)
        intact = [
            expect is None or block_digest(view) == expect
            for _r, _d, _k, view, expect in (offer.items[i] for offer, i in batch)
        ]
        if not all(intact):
            with self._lock:
                self.corrupt_exports += intact.count(False)
            self._corrupt_log.warning(
                "cluster tier: %d block(s) no longer matched their digest: not written", intact.count(False)
            )
        items = [offer.items[i] for (offer, i), ok in zip(batch, intact, strict=True) if ok]

        def build(p: Any) -> None:  # no NX: a value planted before this one must not stay
            for r, d, k, view, _d in items:
                p.set(redis_key(r, d, k), b"".join((encode_header(r, d, k, view), view)), px=ttl_ms)

        out = await node.run(build, self.settings.write_timeout_s) if items else []
        if out is None:
            self._poke()
            return [False] * len(batch)
        results = iter(out)
        oks = []
        for (_r, _, _, view, _d), ok in zip((offer.items[i] for offer, i in batch), intact, strict=True):
            if not ok:
                oks.append(False)
                continue
            r = next(results)
            if isinstance(r, Exception):
                if isinstance(r, ResponseError):  # MOVED/ASK/CLUSTERDOWN: the slot map is stale
                    self._poke()
                oks.append(False)
                continue
            oks.append(True)
            node.bytes_written += view.nbytes
        return oks

    def _resolve(self, offer: Offer, i: int, ok: bool) -> None:
        offer.oks[i] = ok
        offer.left -= 1
        with self._lock:
            self.queued_blocks -= 1
            self.queued_bytes -= offer.items[i][3].nbytes
            if ok:
                self.writes += 1
            else:
                self.write_drops += 1
        if offer.left == 0:
            self._notify(offer)

    @staticmethod
    def _notify(offer: Offer) -> None:
        try:
            offer.loop.call_soon_threadsafe(offer.done, offer.oks)
        except RuntimeError:  # the daemon's loop is closed: nothing waits any more
            pass

"""The cluster tier: blocks shared by the daemons of many nodes through a Redis/Valkey Cluster.

Only kvtierd talks to the cluster (docs/cluster.md). Unlike the NVMe tier, the cluster is not a
tier of this daemon's copies: other daemons write and the cluster evicts on its own, so the
index never records what it holds. The cache asks it (kvtierd.cache.fleet):

* ``exists(digest, keys)`` -> one bool per key, within the lookup deadline (pipelined
  ``EXISTS``, one pipeline per master, masters in parallel); what is not answered in time is
  a miss.
* ``fetch(digest, keys, payload_len, dests)`` -> one :data:`FETCH_OK` / :data:`FETCH_MISS` /
  :data:`FETCH_CORRUPT` per key: ``GET`` (pipelined as above, at most ``inflight_bytes`` asked
  at once), each value verified (kvtierd.tiers.cluster.format) and copied into its ``dests``
  view (a host slot the cache reserved) before the call returns; a corrupt value is deleted in
  the background and counted.
* ``offer(items, done)``: queue blocks to write (``SET … NX PX ttl``); the bytes are read from
  the given views by the writer, so the caller keeps them valid (pinned) until ``done(oks)`` is
  called on the caller's loop. A full queue (``queue_bytes``) refuses, and those are counted
  as drops; so are writes to a node that is down or late.

Failure is a miss, never an error: a node that fails or answers late opens its breaker
(kvtierd.tiers.cluster.nodes); with no slot map (the cluster unreachable at start, or lost)
everything is a miss at once, and the tier comes back by itself when a refresh succeeds.

Lifecycle: built -> ``start()`` (a thread running the tier's own event loop: every Redis
socket, parse and digest happens there, never on the daemon's loop) -> ``close()`` (pending
writes are dropped and their ``done`` called). Thread-safety: ``exists``/``fetch`` are awaited
from the daemon's loop and run on the tier's; ``offer`` may be called from the daemon's loop;
``stats()`` reads plain figures from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from kvtierd.domain import TierId
from kvtierd.tiers.cluster.format import CorruptValue, encode_header, redis_key, verify
from kvtierd.tiers.cluster.nodes import Node, Topology
from kvtierd.tiers.cluster.settings import FETCH_CORRUPT, FETCH_MISS, FETCH_OK, ClusterSettings

log = logging.getLogger("kvtierd.cluster")
T = TypeVar("T")


WriteItem = tuple[bytes, bytes, memoryview]
"""(namespace digest, block key, the block's bytes: valid until ``done`` is called)."""


def _commands(name: str, rkeys: list[bytes]) -> Callable[[Any], None]:
    """A pipeline builder adding ``name rkey`` for each key."""
    def add(p: Any) -> None:
        fn = getattr(p, name)
        for k in rkeys:
            fn(k)
    return add


class ClusterTier:
    """See the module docstring. Owns its thread, its loop, the topology and the write queue."""

    name = "cluster"
    id = TierId.CLUSTER

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.topology = Topology(settings.seeds, settings.creds, settings.breaker_s)
        self.writes = self.write_drops = self.corrupt_values = self.lookup_timeouts = 0
        self.queued_blocks = self.queued_bytes = 0
        self.writing_blocks = 0  # taken from the queue, being written
        self._lock = threading.Lock()  # queued_* and the queue: offer() vs the writer
        self._queue: deque[tuple[list[WriteItem], Callable[[list[bool]], None],
                                 asyncio.AbstractEventLoop]] = deque()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvtier-cluster", daemon=True)
        self._wake: asyncio.Event | None = None
        self._refresh_now: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        started = threading.Event()

        def boot() -> None:
            self._wake, self._refresh_now = asyncio.Event(), asyncio.Event()
            self._tasks = [self._loop.create_task(self._refresher()),
                           self._loop.create_task(self._writer())]
            started.set()

        self._loop.call_soon(boot)
        self._thread.start()
        started.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def close(self) -> None:
        """Stop the thread; pending writes are dropped (their ``done`` called with False)."""
        if self._closed or not self._thread.is_alive():
            self._closed = True
            return
        self._closed = True

        async def stop() -> None:
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._drop_queue()
            await self.topology.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        except Exception:  # noqa: BLE001  (closing: nothing left to save)
            log.warning("cluster tier did not stop cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _drop_queue(self) -> None:
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
            self.queued_blocks = self.queued_bytes = 0
        for items, done, loop in pending:
            self.write_drops += len(items)
            self._notify(loop, done, [False] * len(items))

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the tier's loop; awaited from the daemon's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    @property
    def connected(self) -> bool:
        return self.topology.connected

    @property
    def pending_writes(self) -> int:
        """Blocks queued or being written (a drain waits for them, up to its deadline)."""
        return self.queued_blocks + self.writing_blocks

    # -- lookups and reads (awaited from the daemon's loop) --------------------------------------

    async def exists(self, digest: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held, as far as the cluster answers within the lookup deadline."""
        if not keys or self._closed:
            return [False] * len(keys)
        return await self._call(self._exists(digest, list(keys)))

    async def _exists(self, digest: bytes, keys: list[bytes]) -> list[bool]:
        deadline = time.monotonic() + self.settings.lookup_timeout_s
        rkeys = [redis_key(digest, k) for k in keys]
        found = [False] * len(keys)

        async def one(node: Node, idx: list[int]) -> None:
            out = await node.run(_commands("exists", [rkeys[i] for i in idx]),
                                 deadline - time.monotonic())
            if out is None:
                node.keys_missed += len(idx)
                self._poke()
                return
            for i, r in zip(idx, out, strict=True):
                hit = r == 1 if isinstance(r, int) else False
                found[i] = hit
                if hit:
                    node.keys_hit += 1
                else:
                    node.keys_missed += 1
                    self._check_moved(r)

        groups = self.topology.group(rkeys)
        await asyncio.gather(*(one(n, idx) for n, idx in groups.items() if n is not None))
        if time.monotonic() > deadline:
            self.lookup_timeouts += 1
        return found

    async def fetch(self, digest: bytes, keys: Sequence[bytes], payload_len: int,
                    dests: Sequence[memoryview]) -> list[int]:
        """Read, verify and copy each key's block into its ``dests`` view; see the module
        docstring. Returns only when no copy into ``dests`` is in progress any more."""
        if not keys or self._closed:
            return [FETCH_MISS] * len(keys)
        return await self._call(self._fetch(digest, list(keys), payload_len, list(dests)))

    async def _fetch(self, digest: bytes, keys: list[bytes], payload_len: int,
                     dests: list[memoryview]) -> list[int]:
        deadline = time.monotonic() + self.settings.fetch_timeout_s
        rkeys = [redis_key(digest, k) for k in keys]
        result = [FETCH_MISS] * len(keys)
        groups = {n: idx for n, idx in self.topology.group(rkeys).items() if n is not None}
        per_node = max(1, self.settings.inflight_bytes // max(1, payload_len * max(1, len(groups))))

        async def one(node: Node, idx: list[int]) -> None:
            for start in range(0, len(idx), per_node):
                chunk = idx[start:start + per_node]
                out = await node.run(_commands("get", [rkeys[i] for i in chunk]),
                                     deadline - time.monotonic())
                if out is None:
                    node.keys_missed += len(idx) - start
                    self._poke()
                    return
                for i, value in zip(chunk, out, strict=True):
                    if not isinstance(value, bytes):
                        node.keys_missed += 1
                        self._check_moved(value)
                        continue
                    node.bytes_read += len(value)
                    try:
                        payload = verify(value, digest, keys[i], payload_len)
                    except CorruptValue as err:
                        node.keys_missed += 1
                        self.corrupt_values += 1
                        result[i] = FETCH_CORRUPT
                        log.warning("cluster value %s on %s refused (%s): deleted",
                                    rkeys[i][:24].decode(), node.address, err.reason)
                        self._loop.create_task(self._delete(node, rkeys[i]))
                        continue
                    dests[i][:payload_len] = payload
                    node.keys_hit += 1
                    result[i] = FETCH_OK

        await asyncio.gather(*(one(n, idx) for n, idx in groups.items()))
        return result

    async def _delete(self, node: Node, rkey: bytes) -> None:
        await node.run(lambda p: p.delete(rkey), self.settings.write_timeout_s)

    def _check_moved(self, reply: Any) -> None:
        """A MOVED/ASK/CLUSTERDOWN answer: the slot map is stale; refresh it soon."""
        if isinstance(reply, ResponseError):
            self._poke()

    def _poke(self) -> None:
        """A node failed or answered MOVED: read the slot map again soon (a failover)."""
        if self._refresh_now is not None:
            self._refresh_now.set()

    # -- writes -----------------------------------------------------------------------------------

    def offer(self, items: list[WriteItem], done: Callable[[list[bool]], None]) -> bool:
        """Queue ``items`` for writing (all or none); False (counted as drops) when the queue
        is full, the tier closed or the cluster unknown. ``done`` runs on the caller's loop."""
        nbytes = sum(v.nbytes for _, _, v in items)
        with self._lock:
            if self._closed or not self.topology.known \
                    or self.queued_bytes + nbytes > self.settings.queue_bytes:
                self.write_drops += len(items)
                return False
            self._queue.append((items, done, asyncio.get_running_loop()))
            self.queued_blocks += len(items)
            self.queued_bytes += nbytes
        wake = self._wake
        if wake is not None:
            self._loop.call_soon_threadsafe(wake.set)
        return True

    async def _writer(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                batch = self._take()
                if not batch:
                    break
                await self._write(batch)

    def _take(self) -> list[tuple[list[WriteItem], Callable[[list[bool]], None],
                                  asyncio.AbstractEventLoop]]:
        """Offers up to ``inflight_bytes`` (at least one)."""
        out: list[tuple[list[WriteItem], Callable[[list[bool]], None],
                        asyncio.AbstractEventLoop]] = []
        size = 0
        with self._lock:
            while self._queue and (not out or size < self.settings.inflight_bytes):
                items, done, loop = self._queue.popleft()
                n = sum(v.nbytes for _, _, v in items)
                self.queued_blocks -= len(items)
                self.queued_bytes -= n
                self.writing_blocks += len(items)
                size += n
                out.append((items, done, loop))
        return out

    async def _write(self, batch: list[tuple[list[WriteItem], Callable[[list[bool]], None],
                                             asyncio.AbstractEventLoop]]) -> None:
        flat: list[WriteItem] = [it for items, _, _ in batch for it in items]
        rkeys = [redis_key(d, k) for d, k, _ in flat]
        oks = [False] * len(flat)
        deadline = time.monotonic() + self.settings.write_timeout_s
        ttl_ms = max(1, int(self.settings.ttl_s * 1000))

        def build(idx: list[int]) -> Callable[[Any], None]:
            def add(p: Any) -> None:
                for i in idx:
                    d, k, view = flat[i]
                    p.set(rkeys[i], b"".join((encode_header(d, k, view), view)), nx=True,
                          px=ttl_ms)
            return add

        async def one(node: Node, idx: list[int]) -> None:
            out = await node.run(build(idx), deadline - time.monotonic())
            if out is None:
                self._poke()
                return
            for i, r in zip(idx, out, strict=True):
                if isinstance(r, Exception):
                    self._check_moved(r)
                    continue
                oks[i] = True  # written, or already there (NX: the first writer wins)
                node.bytes_written += flat[i][2].nbytes if r else 0

        groups = self.topology.group(rkeys)
        await asyncio.gather(*(one(n, idx) for n, idx in groups.items() if n is not None))
        self.writes += sum(oks)
        self.write_drops += len(oks) - sum(oks)
        with self._lock:
            self.writing_blocks -= len(oks)
        pos = 0
        for items, done, loop in batch:
            self._notify(loop, done, oks[pos:pos + len(items)])
            pos += len(items)

    @staticmethod
    def _notify(loop: asyncio.AbstractEventLoop, done: Callable[[list[bool]], None],
                oks: list[bool]) -> None:
        try:
            loop.call_soon_threadsafe(done, oks)
        except RuntimeError:  # the daemon's loop is closed: nothing waits any more
            pass

    # -- topology ---------------------------------------------------------------------------------

    async def _refresher(self) -> None:
        assert self._refresh_now is not None
        was = None
        while True:
            ok = await self.topology.refresh(timeout=max(0.2, self.settings.lookup_timeout_s * 10))
            if ok != was:
                if ok:
                    log.info("cluster tier connected: %d masters",
                             len(self.topology.masters()))
                else:
                    log.warning("cluster tier unreachable: lookups miss, stores are dropped")
                was = ok
            interval = self.settings.refresh_s if ok else min(0.5, self.settings.refresh_s)
            try:
                await asyncio.wait_for(self._refresh_now.wait(), interval)
                await asyncio.sleep(0.1)  # coalesce a burst of MOVED answers
            except TimeoutError:
                pass
            self._refresh_now.clear()

    # -- figures ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"connected": self.connected, "write_policy": self.settings.write_policy,
                "queued_blocks": self.queued_blocks, "queued_bytes": self.queued_bytes,
                "writes": self.writes, "write_drops": self.write_drops,
                "corrupt_values": self.corrupt_values, "lookup_timeouts": self.lookup_timeouts,
                "topology_refreshes": self.topology.refreshes,
                "nodes": [n.figures() for n in sorted(self.topology.masters(),
                                                       key=lambda n: n.address)]}

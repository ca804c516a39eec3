"""The cluster tier: blocks shared by the daemons of many nodes through a Redis/Valkey Cluster.

Only kvtierd talks to the cluster (docs/cluster.md). Unlike the NVMe tier, the cluster is not a
tier of this daemon's copies: other daemons write and the cluster evicts on its own, so the
index never records what it holds. The cache asks it (kvtierd.cache.fleet):

Every call names the realm of the blocks (``realm_of(tenant, group)``, kvtierd.tiers.cluster.keys):
their Redis keys' prefix and the key of their MACs.

* ``exists(realm, digest, keys)`` -> one bool per key (pipelined ``EXISTS``, one pipeline per
  master, masters in parallel). The daemon's side waits at most the lookup deadline: what is not
  answered by then is a miss, however busy the tier's thread is.
* ``fetch(realm, digest, keys, payload_len, dests)`` -> one :data:`FETCH_OK` / :data:`FETCH_MISS` /
  :data:`FETCH_CORRUPT` per key: ``GET`` in pipelines of at most ``inflight_bytes`` in all,
  each pipeline within ``fetch_timeout_s``; each value verified (kvtierd.tiers.cluster.format)
  and copied into its ``dests`` view (a host slot the cache reserved) before the call returns,
  and it returns only once no copy into ``dests`` can happen any more. A corrupt value is
  deleted in the background and counted (``corrupt_values``; those whose MAC failed, i.e. not
  written by a daemon of this fleet and realm, in ``mac_failures`` too), logged at most once
  per 10 s.
* ``offer(items, done)``: queue blocks to write (a plain ``SET … PX ttl``, never NX: a value
  planted before the real store must not outlive it): as many of ``items``
  (a prefix) as fit ``queue_bytes`` are admitted, the rest dropped (counted); the number
  admitted is returned. The writer reads the bytes from the given views, so the caller keeps
  them valid (pinned) until ``done(oks)`` (one bool per admitted item) runs on the caller's
  loop; ``done`` is called exactly once, also when the tier closes. Each master has its own
  queue and writer: a slow or dead master delays (and, past ``write_timeout_s``, drops) only
  its own keys (the write side: a :class:`~kvtierd.tiers.cluster.writes.ClusterWriter`, the
  tier's ``writer``).

Failure is a miss, never an error: a node that fails or answers late opens its breaker
(kvtierd.tiers.cluster.nodes); with no slot map (the cluster unreachable at start, or lost)
everything is a miss at once, and the tier comes back by itself when a refresh succeeds.

Lifecycle: built -> ``start()`` (a thread running the tier's own event loop, uvloop when
installed: every Redis socket, parse, digest and copy happens there, never on the daemon's
loop) -> ``close()`` (every task of the tier's loop is cancelled; pending writes are dropped and
their ``done`` called). Thread-safety: ``exists``/``fetch`` are awaited from the daemon's loop
and run on the tier's; ``offer`` is called from the daemon's loop; the figures are plain ints
(those touched from both threads under a lock: the tier's, the writer's); ``stats()`` reads
them from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from kvtierd.domain import TierId
from kvtierd.ratelog import RateLimitedLog
from kvtierd.tiers.base import SharedColumns, SharedWriteItem
from kvtierd.tiers.cluster.bulk import WrongSize
from kvtierd.tiers.cluster.format import HEADER_BYTES, CorruptValue, redis_key, verify_parts
from kvtierd.tiers.cluster.keys import FleetKeys, Realm
from kvtierd.tiers.cluster.nodes import Node, Topology
from kvtierd.tiers.cluster.settings import FETCH_CORRUPT, FETCH_MISS, FETCH_OK, ClusterSettings
from kvtierd.tiers.cluster.writes import ClusterWriter

log = logging.getLogger("kvtierd.cluster")
T = TypeVar("T")
MIN_REFRESH_GAP_S = 0.5  # slot-map reads asked for by failures or MOVED: at most this often


def _commands(name: str, rkeys: list[bytes]) -> Callable[[Any], None]:
    """A pipeline builder adding ``name rkey`` for each key."""

    def add(p: Any) -> None:
        fn = getattr(p, name)
        for k in rkeys:
            fn(k)

    return add


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover  (uvloop is a dependency on Linux)
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class ClusterTier:
    """See the module docstring. Owns its thread, its loop, the topology, the read figures
    (``corrupt_values``, ``mac_failures``, ``lookup_timeouts``; the last under ``_lock``) and
    its ``writer`` (the write queues and their figures), which it hands the topology, the loop
    and ``_poke``. A :class:`~kvtierd.tiers.base.SharedTier`."""

    name = "cluster"
    id = TierId.CLUSTER
    columns = SharedColumns(hits="blocks_hit_cluster", imports="cluster_imports", corrupt="cluster_corrupt")

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.keys = FleetKeys(settings.fleet_key)  # ValueError: no (or a short) fleet key
        self.topology = Topology(settings.seeds, settings.creds, settings.breaker_s)
        self.corrupt_values = self.lookup_timeouts = 0
        self.mac_failures = 0  # values refused because their MAC failed (in corrupt_values too)
        self._refused_log = RateLimitedLog(log, 10.0)  # values refused (tier thread)
        self._lock = threading.Lock()  # lookup_timeouts: the daemon's loop and the tier's
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name="kvtier-cluster", daemon=True)
        self._refresh_now: asyncio.Event | None = None
        self.writer = ClusterWriter(settings, self.topology, self._loop, self._poke)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        started = threading.Event()

        def boot() -> None:
            self._refresh_now = asyncio.Event()
            self._loop.create_task(self._refresher())
            started.set()

        self._loop.call_soon(boot)
        self._thread.start()
        started.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def close(self) -> None:
        """Stop the thread: every task of the tier's loop is cancelled (fetches end, their
        callers see misses), pending writes are dropped (their ``done`` called with False)."""
        if self.writer.stop() or not self._thread.is_alive():
            return

        async def stop() -> None:
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.writer.drop_queued()  # the writers are gone: what they held is dropped
            await self.topology.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        except Exception:  # noqa: BLE001  (closing: nothing left to save)
            log.warning("cluster tier did not stop cleanly", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the tier's loop; awaited from the daemon's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    @property
    def closed(self) -> bool:
        """``close()`` began: its first step stops the writer, so the writer holds the flag."""
        return self.writer.closed

    @property
    def connected(self) -> bool:
        return self.topology.connected

    @property
    def write_policy(self) -> str:
        return self.settings.write_policy

    def realm_of(self, tenant: str | None, group: str | None = None) -> Realm:
        """The realm of a namespace naming ``tenant`` or ``group``: its group's or its tenant's
        with a tenants file, else the untenanted one of this daemon's ``cluster_realm`` (a
        client's claim of a tenant or a group is no credential)."""
        if not self.settings.tenanted:
            return self.keys.untenanted(self.settings.realm)
        return self.keys.group(group) if group is not None else self.keys.realm(tenant or "")

    @property
    def pending_writes(self) -> int:
        """Blocks admitted and not yet written or dropped (a drain waits for them)."""
        return self.writer.queued_blocks

    # -- writes (the writer's; called from the daemon's loop) ------------------------------------

    def offer(self, items: list[SharedWriteItem], done: Callable[[list[bool]], None]) -> int:
        """Queue blocks to write; see the module docstring (ClusterWriter.offer)."""
        return self.writer.offer(items, done)

    def has_room(self, nbytes: int) -> bool:
        return self.writer.has_room(nbytes)

    def dropped(self, n: int) -> None:
        self.writer.dropped(n)

    # -- lookups and reads (awaited from the daemon's loop) --------------------------------------

    async def exists(self, realm: Realm, digest: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held, as far as the cluster answers within the lookup deadline
        (counted from the caller's side: a busy tier thread makes misses, not delays)."""
        if not keys or self.closed:
            return [False] * len(keys)
        try:
            return await asyncio.wait_for(
                self._call(self._exists(realm, digest, list(keys))), self.settings.lookup_timeout_s
            )
        except TimeoutError:
            with self._lock:
                self.lookup_timeouts += 1
            return [False] * len(keys)

    async def _exists(self, realm: Realm, digest: bytes, keys: list[bytes]) -> list[bool]:
        deadline = time.monotonic() + self.settings.lookup_timeout_s
        rkeys = [redis_key(realm, digest, k) for k in keys]
        found = [False] * len(keys)

        async def one(node: Node, idx: list[int]) -> None:
            out = await node.run(_commands("exists", [rkeys[i] for i in idx]), deadline - time.monotonic())
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
        await asyncio.gather(
            *(one(n, idx) for n, idx in groups.items() if n is not None), return_exceptions=True
        )
        return found

    async def fetch(
        self,
        realm: Realm,
        digest: bytes,
        keys: Sequence[bytes],
        payload_len: int,
        dests: Sequence[memoryview],
    ) -> list[int]:
        """Read, verify and copy each key's block into its ``dests`` view; see the module
        docstring. Returns only when no copy into ``dests`` is in progress any more."""
        if not keys or self.closed:
            return [FETCH_MISS] * len(keys)
        return await self._call(self._fetch(realm, digest, list(keys), payload_len, list(dests)))

    async def _fetch(
        self, realm: Realm, digest: bytes, keys: list[bytes], payload_len: int, dests: list[memoryview]
    ) -> list[int]:
        rkeys = [redis_key(realm, digest, k) for k in keys]
        result = [FETCH_MISS] * len(keys)
        groups = {n: idx for n, idx in self.topology.group(rkeys).items() if n is not None}
        budget = max(1, self.settings.inflight_bytes // max(1, payload_len))  # keys at once
        total = sum(map(len, groups.values()))

        async def one(node: Node, idx: list[int]) -> None:
            per = len(idx) if total <= budget else max(1, budget * len(idx) // total)
            for start in range(0, len(idx), per):
                chunk = idx[start : start + per]
                out = await node.get_into(
                    [rkeys[i] for i in chunk],
                    [dests[i] for i in chunk],
                    payload_len,
                    self.settings.fetch_timeout_s,
                )
                if out is None:
                    node.keys_missed += len(idx) - start
                    self._poke()
                    return
                for i, reply in zip(chunk, out, strict=True):
                    result[i] = self._check(
                        node, reply, realm, digest, keys[i], rkeys[i], dests[i], payload_len
                    )

        # Every node's coroutine has ended (none raises) before this returns: no copy into
        # ``dests`` happens after the caller frees them.
        await asyncio.gather(*(one(n, idx) for n, idx in groups.items()), return_exceptions=True)
        return result

    def _check(
        self,
        node: Node,
        reply: Any,
        realm: Realm,
        digest: bytes,
        key: bytes,
        rkey: bytes,
        dest: memoryview,
        payload_len: int,
    ) -> int:
        """One GET's result: the payload is in ``dest`` if ``reply`` is a header; verified
        (identity, length, MAC, digest: kvtierd.tiers.cluster.format)."""
        if reply is None or isinstance(reply, ResponseError):
            node.keys_missed += 1
            self._check_moved(reply)
            return FETCH_MISS
        if isinstance(reply, WrongSize):
            err = CorruptValue(f"length {reply.length - HEADER_BYTES}, expected {payload_len}")
        else:
            node.bytes_read += HEADER_BYTES + payload_len
            try:
                verify_parts(reply, dest[:payload_len], realm, digest, key)
            except CorruptValue as e:
                err = e
            else:
                node.keys_hit += 1
                return FETCH_OK
        node.keys_missed += 1
        self.corrupt_values += 1
        self.mac_failures += err.forged
        self._refused_log.warning(
            "cluster value %s… on %s refused (%s): deleted", rkey[:40].decode(), node.address, err.reason
        )
        self._loop.create_task(self._delete(node, rkey))
        return FETCH_CORRUPT

    async def _delete(self, node: Node, rkey: bytes) -> None:
        await node.run(_commands("delete", [rkey]), self.settings.write_timeout_s)

    def _check_moved(self, reply: Any) -> None:
        """A MOVED/ASK/CLUSTERDOWN answer: the slot map is stale; refresh it soon."""
        if isinstance(reply, ResponseError):
            self._poke()

    def _poke(self) -> None:
        """A node failed or answered MOVED: read the slot map again soon (a failover)."""
        if self._refresh_now is not None:
            self._refresh_now.set()

    # -- topology ---------------------------------------------------------------------------------

    async def _refresher(self) -> None:
        assert self._refresh_now is not None
        was = None
        while True:
            try:
                ok = await self.topology.refresh(timeout=max(0.2, self.settings.lookup_timeout_s * 10))
            except Exception:  # noqa: BLE001  (the refresher must outlive any surprise)
                log.exception("cluster slot map refresh failed")
                ok = False
            if ok != was:
                if ok:
                    log.info("cluster tier connected: %d masters", len(self.topology.masters()))
                else:
                    log.warning("cluster tier unreachable: lookups miss, stores are dropped")
                was = ok
            interval = self.settings.refresh_s if ok else min(0.5, self.settings.refresh_s)
            await asyncio.sleep(MIN_REFRESH_GAP_S)  # pokes (failures, MOVED) coalesce here
            self._refresh_now.clear()
            try:
                await asyncio.wait_for(self._refresh_now.wait(), max(0.0, interval - MIN_REFRESH_GAP_S))
            except TimeoutError:
                pass
            self._refresh_now.clear()

    # -- figures ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        w = self.writer
        return {
            "connected": self.connected,
            "write_policy": self.settings.write_policy,
            "queued_blocks": w.queued_blocks,
            "queued_bytes": w.queued_bytes,
            "writes": w.writes,
            "write_drops": w.write_drops,
            "corrupt_exports": w.corrupt_exports,
            "corrupt_values": self.corrupt_values,
            "mac_failures": self.mac_failures,
            "lookup_timeouts": self.lookup_timeouts,
            "topology_refreshes": self.topology.refreshes,
            "nodes": [n.figures() for n in sorted(self.topology.masters(), key=lambda n: n.address)],
        }

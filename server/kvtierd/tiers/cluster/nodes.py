"""The cluster's masters as this daemon sees them: slot map, one client and breaker per node.

A :class:`Topology` holds the slot -> master map, read with ``CLUSTER SLOTS`` from any node that
answers (the seeds first), refreshed in the background every few seconds and soon after a node
fails or answers ``MOVED``. Keys are grouped by the master that owns their slot, computed
locally (CRC16, as Redis does), so a batch is one pipeline per master.

A :class:`Node` is one master: a redis-py asyncio client (hiredis parser, no retries of its
own), a circuit breaker and its figures. ``run(build, timeout)`` sends one pipeline and returns
one result (or exception) per command, or None when the node is skipped (breaker open) or the
pipeline failed or ran past ``timeout``: a failure opens the breaker for ``breaker_s``, doubling
while it keeps failing (at most 8x); while open the node's keys are misses at once; the first
request after that is the probe.

Concurrency: the cluster tier's own event loop thread only (kvtierd.tiers.cluster.tier). The
daemon's loop reads the figures (plain ints) for Stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from kvtierd.ratelog import RateLimitedLog
from kvtierd.tiers.cluster.bulk import BulkConnection
from kvtierd.tiers.cluster.settings import Credentials

log = logging.getLogger("kvtierd.cluster")
SLOTS = 16384
BREAKER_MAX_FACTOR = 8


class Node:
    """One master; see the module docstring."""

    def __init__(self, address: str, creds: Credentials, breaker_s: float) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.slots = 0
        self.keys_hit = self.keys_missed = self.bytes_read = self.bytes_written = 0
        self.errors = self.requests = 0
        self.latency_sum = 0.0
        self._breaker_s = breaker_s
        self._open_until = 0.0
        self._failures = 0
        self._probing = False  # the half-open probe is out
        kwargs: dict[str, Any] = {}
        if creds.tls:
            kwargs.update(
                ssl=True,
                ssl_ca_certs=creds.ca_file or None,
                ssl_certfile=creds.cert_file or None,
                ssl_keyfile=creds.key_file or None,
            )
        self.redis = aioredis.Redis(
            host=host.strip("[]"),
            port=int(port),
            username=creds.username or None,
            password=creds.password or None,
            socket_connect_timeout=creds.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
            protocol=2,
            **kwargs,
        )
        self._log = RateLimitedLog(log, 30.0)
        self.bulk = BulkConnection(host.strip("[]"), int(port), creds)

    @property
    def healthy(self) -> bool:
        """The breaker is closed (or open long enough that the next request is the probe)."""
        return time.monotonic() >= self._open_until

    async def get_into(
        self, rkeys: list[bytes], dests: list[memoryview], payload_len: int, timeout: float
    ) -> list[Any] | None:
        """Pipelined GETs into ``dests`` (kvtierd.tiers.cluster.bulk), under the breaker like
        ``run``: None when skipped, failed or late (no byte reaches ``dests`` afterwards)."""
        return await self._guarded(lambda: self.bulk.get_into(rkeys, dests, payload_len, timeout), timeout)

    async def _guarded(self, call: Callable[[], Awaitable[list[Any]]], timeout: float) -> list[Any] | None:
        if timeout <= 0 or not self.healthy or self._probing:
            return None
        probe = self._failures > 0
        self._probing = probe
        try:
            self.requests += 1
            t0 = time.monotonic()
            try:
                out = await call()
            except (Exception, TimeoutError) as err:  # noqa: BLE001  (a miss; the breaker)
                self.fail(err)
                return None
            self.latency_sum += time.monotonic() - t0
            self._failures = 0
            return out
        finally:
            if probe:
                self._probing = False

    async def run(self, build: Callable[[Any], None], timeout: float) -> list[Any] | None:
        """One pipeline (``build`` adds its commands); see the module docstring. While the
        breaker is half-open only one request (the probe) goes out; the others miss."""

        async def call() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            build(pipe)
            out: list[Any] = await asyncio.wait_for(pipe.execute(raise_on_error=False), timeout)
            return out

        return await self._guarded(call, timeout)

    def fail(self, err: BaseException | str) -> None:
        """Open the breaker (doubling while failures continue)."""
        self.errors += 1
        self._failures += 1
        factor = min(1 << (self._failures - 1), BREAKER_MAX_FACTOR)
        self._open_until = time.monotonic() + self._breaker_s * factor
        self._log.warning(
            "cluster node %s failed (%s): its keys are misses for %.1f s",
            self.address,
            err if isinstance(err, str) else type(err).__name__ + (f": {err}" if str(err) else ""),
            self._breaker_s * factor,
        )

    def figures(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "healthy": self.healthy,
            "hits": self.keys_hit,
            "misses": self.keys_missed,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "errors": self.errors,
            "requests": self.requests,
            "latency_seconds_sum": self.latency_sum,
            "slots": self.slots,
        }

    async def close(self) -> None:
        self.bulk.abort()
        try:
            await self.redis.aclose()
        except Exception:  # noqa: BLE001  (closing a dead node's sockets)
            pass


class Topology:
    """Slot map and nodes; see the module docstring."""

    def __init__(self, seeds: Iterable[str], creds: Credentials, breaker_s: float) -> None:
        self.seeds = list(seeds)
        self._creds = creds
        self._breaker_s = breaker_s
        self.nodes: dict[str, Node] = {}  # address -> node (masters seen so far, and seeds)
        self._slots: list[Node | None] = [None] * SLOTS
        self.refreshes = 0
        self.known = False  # a slot map was read at least once
        self._log = RateLimitedLog(log, 30.0)

    def node(self, address: str) -> Node:
        n = self.nodes.get(address)
        if n is None:
            n = self.nodes[address] = Node(address, self._creds, self._breaker_s)
        return n

    def masters(self) -> list[Node]:
        """Nodes owning slots. Safe from the daemon's thread too (Stats): ``list()`` copies the
        dict in one step, so a node added meanwhile on the tier's thread cannot break it."""
        return [n for n in list(self.nodes.values()) if n.slots]

    @property
    def connected(self) -> bool:
        return self.known and any(n.healthy for n in self.masters())

    def group(self, rkeys: list[bytes]) -> dict[Node | None, list[int]]:
        """Indices of ``rkeys`` per owning master (None: slot not served)."""
        out: dict[Node | None, list[int]] = {}
        slots = self._slots
        for i, k in enumerate(rkeys):
            out.setdefault(slots[key_slot(k)], []).append(i)
        return out

    async def refresh(self, timeout: float) -> bool:
        """Read the slot map from the first node that answers; whether one did."""
        candidates = list(
            dict.fromkeys(
                [a for a in (n.address for n in self.masters()) if self.nodes[a].healthy]
                + self.seeds
                + list(self.nodes)
            )
        )
        for address in candidates:
            node = self.node(address)
            try:
                raw = await asyncio.wait_for(
                    node.redis.execute_command("CLUSTER", "SLOTS"),  # type: ignore[no-untyped-call]
                    timeout,
                )
            except (Exception, TimeoutError) as err:  # noqa: BLE001  (try the next node)
                log.debug("CLUSTER SLOTS from %s failed: %s", address, err)
                continue
            try:
                self._apply(raw, address)
            except (ValueError, TypeError, IndexError, AttributeError) as err:
                log.warning("unreadable CLUSTER SLOTS from %s: %r", address, err)
                continue
            self.refreshes += 1
            self.known = True
            return True
        self._log.warning("no cluster node answered CLUSTER SLOTS (tried %s)", ", ".join(candidates))
        return False

    def _apply(self, raw: Any, via: str) -> None:
        slots: list[Node | None] = [None] * SLOTS
        counts: dict[str, int] = {}
        for row in raw:
            start, end, master = int(row[0]), int(row[1]), row[2]
            host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
            if not host or host == "?":  # announced without an address: the node we asked
                host = via.rpartition(":")[0]
            address = f"{host}:{int(master[1])}"
            node = self.node(address)
            slots[start : end + 1] = [node] * (end + 1 - start)
            counts[address] = counts.get(address, 0) + end + 1 - start
        self._slots = slots
        for address, node in self.nodes.items():
            node.slots = counts.get(address, 0)

    async def close(self) -> None:
        for n in self.nodes.values():
            await n.close()

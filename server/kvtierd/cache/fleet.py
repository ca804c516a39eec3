"""The cache's side of a shared tier (kvtierd.tiers.base.SharedTier): a tier outside the index.

Part of the cache (kvtierd.cache). One :class:`SharedLink` drives one shared tier (the cluster
tier, kvtierd.tiers.cluster, today) through that seam alone. A shared tier is written by the
daemons of many nodes and evicts on its own, so the index never records what it holds; a block
found only there is *imported*: fetched into a host slot, verified, and entered READY as if it
had been stored here, then served over any transport like every other hit.
``Entry.in_cluster`` (named after the first shared tier) only remembers that a block need not
be written there again.

* ``extend(ns, keys)``: how many of ``keys`` (the part of a lookup after the local prefix) the
  shared tier holds as a prefix, within the lookup deadline.
* ``import_(ns, keys, protect)``: fetch those of ``keys`` that the index lacks and the shared
  tier holds (asked first, with ``exists``) into host slots (reserved first, evicting in policy
  order, never an entry of ``protect``); the fetch runs as
  a task of this link, so a caller cancelled meanwhile (an RPC past its deadline) leaves it to
  finish, and no slot is freed while bytes are being copied into it. A key stored or imported
  meanwhile keeps that entry (our slot is freed).
* write policy ``commit``: every committed block is offered to the tier, its entry pinned
  until the write ends (the writer reads the host slot; no copy); ``evict``: a block leaving
  the host tier with no copy in the shared tier is copied out and offered (its slot goes at
  once).
  Either way a full queue or a failed write drops it (counted by the tier).

Every call names the realm of the namespace's values (``tier.realm_of(spec.tenant,
spec.group)``; for the cluster tier its tenant's or its group's with a tenants file,
kvtierd.tiers.cluster.keys). Figures go to
the tier's own counter columns (``tier.columns``).

Concurrency: event-loop thread only; the tier's I/O runs on its own thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from kvtier_contract.digests import block_digest
from kvtierd.cache.lookup import ready_prefix
from kvtierd.cache.read_figures import ReadFigures
from kvtierd.cache.residency import HostResidency
from kvtierd.events import MEDIUM_CPU, MEDIUM_REMOTE
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.tiers.base import FETCH_CORRUPT, FETCH_MISS, FETCH_OK, SharedTier

log = logging.getLogger("kvtierd.cluster")
T = TypeVar("T")


class SharedLink:
    """Owns the imports in flight and the pins of blocks being written. See the module
    docstring."""

    def __init__(self, residency: HostResidency, tier: SharedTier) -> None:
        self.residency = residency
        self.tier = tier
        self.columns = tier.columns
        self.write_policy = tier.write_policy
        self.imports_in_flight = 0
        self.read_figures = ReadFigures()
        """What imports cost now (kvtierd.cache.read_figures): fed once per fetch that imported
        something; asked = the start of ``import_`` (its EXISTS round trip counts)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        if self.write_policy == "evict":
            residency.on_evict = self._on_evict

    # -- lookups ----------------------------------------------------------------------------------

    async def extend(self, ns: NamespaceState, keys: Sequence[bytes]) -> int:
        """Leading keys of ``keys`` the tier holds (answered within the lookup deadline)."""
        if not keys or not self.tier.connected:
            return 0
        found = await self.tier.exists(self._realm(ns), ns.spec.digest, keys)
        try:
            return found.index(False)
        except ValueError:
            return len(found)

    # -- imports ----------------------------------------------------------------------------------

    async def import_(
        self, ns: NamespaceState, keys: Sequence[bytes], protect: set[Entry], *, prefix_only: bool = False
    ) -> list[Entry]:
        """Import the keys the index lacks (see the module docstring); the entries entered.
        ``prefix_only``: only those up to the first key the tier lacks (a lookup's prefix:
        nothing is evicted for blocks after a gap)."""
        todo = [k for k in dict.fromkeys(keys) if k not in ns.entries]
        if not todo or not self.tier.connected:
            return []
        asked = self.read_figures.clock()
        # Slots are taken (evicting) only for blocks the tier holds.
        present = await self.tier.exists(self._realm(ns), ns.spec.digest, todo)
        if prefix_only and False in present:
            present = present[: present.index(False)]
        todo = [k for k, p in zip(todo, present, strict=False) if p and k not in ns.entries]
        todo = todo[: self.residency.room_for(ns, len(todo), protect)]  # its tenant's quota
        offsets: list[int] = []
        for _ in todo:
            off = self.residency.allocate(ns.slot_bytes, protect, ns.pool)
            if off is None:
                break
            offsets.append(off)
        todo = todo[: len(offsets)]
        if not todo:
            return []
        task = self._spawn(self._import(ns, todo, offsets, asked))
        return await asyncio.shield(task)

    async def import_prefix(self, ns: NamespaceState, keys: Sequence[bytes]) -> list[Entry]:
        """Import the blocks that extend the local READY prefix of ``keys`` (up to the first one
        the tier lacks); the entries imported. The local prefix (what the caller is about to
        hold) is never evicted to make room."""
        prefix = ready_prefix(ns, keys)
        if len(prefix) == len(keys):
            return []
        return await self.import_(ns, keys[len(prefix) :], set(prefix), prefix_only=True)

    async def _import(
        self, ns: NamespaceState, keys: list[bytes], offsets: list[int], asked: float
    ) -> list[Entry]:
        host = self.residency.host
        self.imports_in_flight += len(keys)
        began = self.read_figures.clock()
        try:
            results = await self.tier.fetch(
                self._realm(ns),
                ns.spec.digest,
                keys,
                ns.block_bytes,
                [host.view(off, ns.slot_bytes) for off in offsets],
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task itself is cancelled (the daemon's loop is closing)
            results = [FETCH_MISS] * len(keys)  # the tier closed: its thread copies no more
        except Exception:  # noqa: BLE001  (the tier failed: its fetch has ended; misses)
            log.warning("%s fetch failed", self.tier.name, exc_info=True)
            results = [FETCH_MISS] * len(keys)
        finally:
            self.imports_in_flight -= len(keys)
        self.read_figures.observe(
            sum(r == FETCH_OK for r in results) * ns.block_bytes, asked, began, self.read_figures.clock()
        )
        return self._enter(ns, keys, offsets, results)

    def _enter(
        self, ns: NamespaceState, keys: list[bytes], offsets: list[int], results: list[int]
    ) -> list[Entry]:
        """Index the blocks fetched into their host slots (READY, as if stored here); the
        others' slots are freed. The entries entered."""
        host = self.residency.host
        entered: list[Entry] = []
        corrupt = 0
        for k, off, r in zip(keys, offsets, results, strict=True):
            corrupt += r == FETCH_CORRUPT
            if r != FETCH_OK or k in ns.entries:  # a miss, or stored/imported meanwhile
                host.free(off, ns.slot_bytes)
                continue
            e = Entry(ns, k, off, 0)
            e.state = EntryState.READY
            e.in_cluster = True
            # The tier verified its own checksum in fetch; the host tier's digest is xxh3_64
            # of the bytes as imported (kvtier_contract.digests).
            e.digest = block_digest(host.view(off, ns.block_bytes))
            ns.entries[k] = e
            ns.ready[k] = e
            self.residency.policy.insert(e)
            self.residency.count(e, +1)
            entered.append(e)
        self._bump(ns, self.columns.corrupt, corrupt)
        self._bump(ns, self.columns.imports, len(entered))
        if entered:
            self.residency.events.stored(entered, MEDIUM_CPU)
        if entered:
            for link in self.residency.links:  # an NVMe write-through keeps a copy too
                link.on_committed(entered)
        return entered

    def count_hits(self, ns: NamespaceState, n: int, *, moved_from_host: bool) -> None:
        """``n`` hits counted as misses (or, once imported, as host hits) were hits here."""
        c, tpb = ns.counters, ns.spec.tokens_per_block
        self._bump(ns, self.columns.hits, n)
        if moved_from_host:
            c.blocks_hit_host -= n
        else:
            c.blocks_missed -= n
            c.tokens_hit += n * tpb
            c.tokens_missed -= n * tpb

    def _realm(self, ns: NamespaceState) -> Any:
        """The realm of ``ns``'s blocks in the tier: its group's, else its tenant's."""
        return self.tier.realm_of(ns.spec.tenant, ns.spec.group)

    @staticmethod
    def _bump(ns: NamespaceState, column: str, n: int) -> None:
        if n:
            setattr(ns.counters, column, getattr(ns.counters, column) + n)

    # -- writes -----------------------------------------------------------------------------------

    def on_committed(self, entries: Sequence[Entry]) -> None:
        if self.write_policy != "commit":
            return
        todo = [e for e in entries if not e.in_cluster and e.in_host]
        if not todo:
            return
        host = self.residency.host
        realm = self._realm
        items = [
            (realm(e.ns), e.ns.spec.digest, e.key, host.view(e.offset, e.ns.block_bytes), e.digest)
            for e in todo
        ]
        admitted = todo[: self.tier.offer(items, lambda oks: self._written(admitted, oks))]
        for e in admitted:
            e.pins += 1  # the writer reads the slot: it stays until done (before any await)

    def _on_evict(self, e: Entry) -> None:
        """write policy ``evict``: ``e`` is leaving the host tier (its slot still valid)."""
        if e.in_cluster:
            return
        if not self.tier.has_room(e.ns.block_bytes):
            self.tier.dropped(1)  # it leaves unwritten: a drop, as offer would count it
            return
        data = bytes(self.residency.host.view(e.offset, e.ns.block_bytes))

        def done(oks: list[bool]) -> None:
            if oks[0] and e.ns.entries.get(e.key) is e:  # still indexed (a copy on NVMe)
                e.in_cluster = True
                self.residency.events.stored((e,), MEDIUM_REMOTE)

        self.tier.offer([(self._realm(e.ns), e.ns.spec.digest, e.key, memoryview(data), e.digest)], done)

    def _written(self, entries: list[Entry], oks: list[bool]) -> None:
        """``done`` of a commit-policy offer: the slots may go; written blocks are not resent
        (and, with KV events on, are published as held REMOTE: never removed, since the
        tier evicts on its own and no daemon sees it; docs/events.md)."""
        written = []
        for e, ok in zip(entries, oks, strict=True):
            e.pins -= 1
            if ok:
                e.in_cluster = True
                written.append(e)
        if written:
            self.residency.events.stored(written, MEDIUM_REMOTE)

    # -- lifecycle --------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self) -> None:
        """Wait for the imports in flight (drain, tests)."""
        while self._tasks:
            await asyncio.gather(*(asyncio.shield(t) for t in self._tasks))

    def close(self) -> None:
        self.tier.close()


ClusterLink = SharedLink  # (its name while the cluster tier was the only shared tier)

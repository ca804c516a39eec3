"""Host residency: which blocks hold a host slot, and making room for new ones.

Part of the cache (kvtierd.cache): the :class:`HostResidency` owns the host tier's slots as the
index sees them (allocation with eviction in policy order, the limbo of slots held back after a
lease lapsed) and the host eviction policy. An evicted block that has a copy in a storage tier
stays READY (served from there); one without leaves the index.

Ownership: owned by the TieredCache; the chain's links (kvtierd.cache.chain) use it to place
promoted blocks. Event-loop thread only; no locks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from kvtierd.events import MEDIUM_CPU, NO_EVENTS, EventSink
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy
from kvtierd.tiers import HostTier

ROOM_WAIT_S = 0.5
"""How long a store or a promotion waits at most for the chain to write down the host blocks it
will evict (its tenant's coldest, its arena's): within the SDK's 1 s RPC deadline. Past it,
blocks not written down yet are evicted all the same (lost), and blocks still being written
count against the tenant's ``host_bytes`` (the store is refused, the promotion is a miss)."""


async def _no_wait(_ns: NamespaceState, _n: int, _timeout_s: float) -> None:
    """``HostResidency.clean_quota`` of a cache without quotas."""


MAX_ANCESTORS = 4096
"""How far up a chain a commit touches its prefix (``HostResidency.touch_ancestors``)."""


def descendants(ns: NamespaceState, key: bytes) -> list[Entry]:
    """The entries of ``ns`` filed below ``key`` (its ``children``, theirs, ...) still indexed,
    each after its parent (head-first); iterative, each key once (a cycle of parent keys a
    client made up ends)."""
    out: list[Entry] = []
    seen = {key}
    stack = [key]
    children, entries = ns.children, ns.entries
    while stack:
        below = children.get(stack.pop())
        for c in (below,) if isinstance(below, Entry) else below or ():
            if c.key not in seen and entries.get(c.key) is c:
                seen.add(c.key)
                out.append(c)
                stack.append(c.key)
    return out


def file_under(e: Entry, parent: bytes | None) -> None:
    """``parent`` is the key before ``e``'s in its chain (None: a head, or unknown); the first
    parent learned stays. For a prefix-aware policy only (``HostResidency.file_under``)."""
    if parent is None or e.parent is not None:
        return
    e.parent = parent
    children = e.ns.children
    below = children.get(parent)
    if below is None:
        children[parent] = e
    elif isinstance(below, Entry):
        children[parent] = {below, e}
    else:
        below.add(e)


def file_chain(chain: Sequence[Entry], policy: EvictionPolicy[Entry]) -> None:
    """A lookup's hits (a chain from its prompt's head): each one's parent is the one before,
    filed while ``policy`` keeps chains whole (nothing is done otherwise)."""
    if not policy.wants_parents:
        return
    # (most hits were filed by their store: ~25 µs for a 1,000-hit chain)
    for i in [i for i in range(1, len(chain)) if chain[i].parent is None]:
        file_under(chain[i], chain[i - 1].key)


class CopyHolder(Protocol):
    """What residency asks of a storage tier's link (kvtierd.cache.chain.TierLink)."""

    @property
    def admitting(self) -> bool: ...

    @property
    def policy(self) -> EvictionPolicy[Entry]: ...

    def on_host_evicted(self, e: Entry, *, orphan: bool = False) -> None: ...

    def on_committed(self, entries: Sequence[Entry]) -> None: ...


class HostResidency:
    """See the module docstring."""

    def __init__(
        self, host: HostTier, policy: EvictionPolicy[Entry], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.host = host
        self.policy = policy
        self.links: Sequence[CopyHolder] = ()  # the storage tiers below, set by the cache
        # Called with a block about to lose its host slot (its bytes still there): the cluster
        # tier's "evict" write policy (kvtierd.cache.fleet).
        self.on_evict: Callable[[Entry], None] | None = None
        # How many of n new slots of a namespace its tenant's host quota lets in (its own
        # coldest blocks evicted for them): promotions and imports ask before they allocate.
        # Set by the cache (TieredCache.room_for); by default, all of them.
        self.room_for: Callable[[NamespaceState, int, set[Entry]], int] = lambda _ns, n, _protect: n
        # Before that, promotions let the chain write down the tenant's coldest blocks that
        # room would evict (TieredCache.clean_quota, waiting up to ``timeout_s``); by default,
        # no wait.
        self.clean_quota: Callable[[NamespaceState, int, float], Awaitable[None]] = _no_wait
        self.events: EventSink = NO_EVENTS
        """Where blocks entering and leaving the tiers are told (KV events; a no-op sink while
        they are off). Chosen by the daemon's composition root; the cache and the links call it
        where a block becomes visible in a tier (host: commit, promotion, import) or leaves it
        (host: eviction, corrupt drop)."""
        self.orphans_evicted = 0
        """Blocks evicted (host slots, storage copies) while offered first as orphans."""
        self._clock = clock
        # Slots of stores aborted by lease expiry, held back until a deadline: the session's
        # process may be stalled, not dead, and still copying into them over shm.
        # (free at, offset, the namespace whose slot it was: its limbo_blocks count it)
        self._limbo: deque[tuple[float, int, NamespaceState]] = deque()

    # -- placing blocks ---------------------------------------------------------------------------

    def allocate(self, slot_bytes: int, protect: set[Entry], pool: int = 0) -> int | None:
        """A free slot of ``slot_bytes`` in arena ``pool`` (the namespace's: ``ns.pool``),
        evicting blocks of that arena in policy order if needed; None if none can be.

        Walks victims in policy order and takes whichever comes first: an evictable entry of the
        same size class (its slot is reused), or a slab of another class whose every live slot
        holds an evictable entry (those entries are evicted and the slab moves to this class).
        So slabs follow demand instead of staying with the class that took them first, and a
        store that cannot be placed evicts nothing: pinned and WRITING entries keep their slabs.
        With a storage tier admitting, blocks it already holds (or orphans: no loss) are evicted
        before any it does not.
        A held block (pinned lookup) is evicted only while a copy below remains.
        """
        placed = self.allocate_many(slot_bytes, 1, protect, pool)
        return placed[0] if placed else None

    def allocate_many(self, slot_bytes: int, count: int, protect: set[Entry], pool: int = 0) -> list[int]:
        """``allocate`` for ``count`` slots at once: as many as can be placed (the first
        ``len(result)`` of the caller's blocks get them, the rest cannot be placed now), by
        the same rules and in the same victim order, with one walk of the victims for the
        whole batch instead of one per slot (a full cache evicts as it stores: a fresh walk
        per slot cost a 256-key PrepareStore ~8 µs per key here; docs/benchmarks.md §19)."""
        out: list[int] = []
        self._take(slot_bytes, pool, out, count)
        if len(out) < count and any(link.admitting for link in self.links):
            self._make_room(slot_bytes, protect, pool, out, count, clean_only=True, max_scan=1024)
        if len(out) < count:
            self._make_room(slot_bytes, protect, pool, out, count, clean_only=False)
        return out

    def _make_room(
        self,
        slot_bytes: int,
        protect: set[Entry],
        pool: int,
        taken: list[int],
        count: int,
        *,
        clean_only: bool,
        max_scan: int = 1 << 62,
    ) -> None:
        """Evict in policy order, taking each slot that frees up, until ``taken`` holds
        ``count`` slots (or nothing more can be evicted, or ``max_scan`` victims were seen)."""
        groups: dict[int, list[Entry]] = {}  # slab -> its evictable entries seen so far
        for n, e in enumerate(self.policy.victims()):
            if n >= max_scan or len(taken) >= count:
                break
            if (
                e.ns.pool != pool
                or e.pins
                or e.flushing
                or e in protect
                or (clean_only and not e.copies and not self.policy.orphaned(e))  # (an orphan loses nothing)
                or (e.holds and not e.copies)
            ):  # a held block keeps its last copy
                continue
            if e.ns.slot_bytes == slot_bytes:
                self.evict(e)
            else:
                slab = self.host.slab_of(e.offset)
                group = groups.setdefault(slab, [])
                group.append(e)
                if len(group) < self.host.live_slots(slab):
                    continue
                del groups[slab]
                for victim in group:
                    self.evict(victim)  # the emptied slab is back in the pool
            self._take(slot_bytes, pool, taken, count)

    def _take(self, slot_bytes: int, pool: int, taken: list[int], count: int) -> None:
        """Free slots of ``slot_bytes`` in arena ``pool`` appended to ``taken`` until it holds
        ``count`` (or none is free)."""
        alloc = self.host.alloc
        while len(taken) < count:
            off = alloc(slot_bytes, pool)
            if off is None:
                break
            taken.append(off)

    def evict(self, e: Entry) -> None:
        """Give up ``e``'s host slot (READY, evictable); it stays READY if a copy remains."""
        assert e.evictable(), e
        orphan = self.policy.orphaned(e)
        self.orphans_evicted += orphan
        self.policy.remove(e, evicted=True)
        e.ns.counters.evictions += 1
        self.events.removed((e,), MEDIUM_CPU)
        if self.on_evict is not None:
            self.on_evict(e)
        self.count(e, -1)
        self.host.free(e.offset, e.ns.slot_bytes)
        e.offset = -1
        if not e.copies:
            self.forget(e, orphan=orphan)
            return
        for link in self.links:
            link.on_host_evicted(e, orphan=orphan)

    # -- leaving ----------------------------------------------------------------------------------

    def free_reserved(self, e: Entry, hold_until: float = 0.0) -> None:
        """An aborted store's entry leaves the index; its slot is freed (or held in limbo).
        An entry that got a copy below while it was written (a late open found the block)
        stays instead, READY and held only there."""
        e.job = 0  # a data channel still holding this entry sees it is no longer its to write
        self.free_slot(e.offset, e.ns, hold_until)
        if not e.copies:
            self.forget(e)
            return
        e.offset, e.state = -1, EntryState.READY
        e.ns.ready[e.key] = e
        for link in self.links:
            link.on_host_evicted(e)

    def free_slot(self, offset: int, ns: NamespaceState, hold_until: float = 0.0) -> None:
        """A slot of ``ns``'s size that holds no entry (an aborted store's, a store's staging
        slot) is freed, or held in limbo until ``hold_until`` (counted as ``ns``'s)."""
        if hold_until:
            self._limbo.append((hold_until, offset, ns))
            ns.limbo_blocks += 1
        else:
            self.host.free(offset, ns.slot_bytes)

    def forget(self, e: Entry, *, orphan: bool = False) -> None:
        """``e`` has no copy anywhere: it leaves the index and its descendants are orphans.
        ``orphan``: ``e`` was one when its last copy went (its policy said so before removing
        it); what is filed below an orphan is one already (``check_reachable`` keeps that
        true), so nothing is walked: evicting an orphaned chain block by block, in any order,
        walks it once, not once per block."""
        e.ns.ready.pop(e.key, None)
        del e.ns.entries[e.key]
        if self.policy.wants_parents:
            self._unfile(e)
            if not orphan:
                self.orphan(descendants(e.ns, e.key))

    # -- chains -----------------------------------------------------------------------------------

    def enter_policy(self, committed: Sequence[Entry]) -> None:
        """Blocks just committed (head-first, batch order) into the eviction order: inserted,
        and for a prefix-aware policy checked for a missing parent and their prefix touched."""
        self.policy.insert_many(committed)
        self.check_reachable(committed)
        self.touch_ancestors(committed)

    def check_reachable(self, entries: Sequence[Entry]) -> None:
        """Blocks just committed: those whose parent is not indexed or is an orphan, and what
        is filed below them, are orphans from the start (so below an orphan all are: a hit
        makes a block reachable again only with its whole prefix, ``PrefixPolicy.touch``).
        A block already orphaned (by its parent's turn in this batch) is not walked again."""
        if not self.policy.wants_parents:
            return
        indexed = entries[0].ns.entries if entries else {}
        for e in entries:
            if e.parent is None or self.orphaned(e):
                continue
            parent = indexed.get(e.parent)
            if parent is None or self.orphaned(parent):
                self.orphan([e, *descendants(e.ns, e.key)])

    @property
    def orphaned_blocks(self) -> int:
        """Blocks some tier offers first as orphans, each once (Stats: O(orphans))."""
        if not self.policy.wants_parents:
            return 0
        held = set(self.policy.orphaned_keys())
        for link in self.links:
            held.update(link.policy.orphaned_keys())
        return len(held)

    def orphaned(self, e: Entry) -> bool:
        """Whether a tier (host, or a link below) offers ``e`` first as an orphan."""
        return self.policy.orphaned(e) or any(link.policy.orphaned(e) for link in self.links)

    def touch_ancestors(self, committed: Sequence[Entry]) -> None:
        """Blocks just committed (head-first) extend a chain held here: its indexed ancestors
        (at most ``MAX_ANCESTORS`` up) are touched after them, head last, so a chain's new tail
        ranks colder than the prefix it hangs from (a lookup touched that prefix before the
        engine computed the tail; without this the tail, stored later, would outlive it)."""
        if not committed or not self.policy.wants_parents:
            return
        first = committed[0]
        entries, key = first.ns.entries, first.parent
        above: list[Entry] = []
        while key is not None and len(above) < MAX_ANCESTORS:
            e = entries.get(key)
            if e is None:
                break
            above.append(e)
            key = e.parent
        if above:
            above.reverse()  # (head-first, as touch_many takes a chain)
            self.policy.touch_many([e for e in above if e.in_host])

    def orphan(self, entries: list[Entry]) -> None:
        """``entries`` (head-first) can no longer be hit: the host policy and the links' offer
        them first."""
        if not entries:
            return
        self.policy.orphan(entries)
        for link in self.links:
            link.policy.orphan(entries)

    @staticmethod
    def _unfile(e: Entry) -> None:
        """``e`` left the index: out of its parent's children."""
        if e.parent is None:
            return
        children = e.ns.children
        below = children.get(e.parent)
        if below is e:
            del children[e.parent]
        elif isinstance(below, set):
            below.discard(e)
            if len(below) == 1:
                children[e.parent] = below.pop()

    @staticmethod
    def count(e: Entry, sign: int) -> None:
        c = e.ns.counters
        c.resident_blocks += sign
        c.resident_bytes += sign * e.ns.block_bytes

    # -- limbo ------------------------------------------------------------------------------------

    def sweep_limbo(self) -> int:
        """Return held-back slots whose time has come to the tier; how many were returned."""
        now, n = self._clock(), 0
        while self._limbo and self._limbo[0][0] <= now:
            _, offset, ns = self._limbo.popleft()
            ns.limbo_blocks -= 1
            slot_bytes = ns.slot_bytes
            self.host.free(offset, slot_bytes)
            n += 1
        return n

    @property
    def limbo_blocks(self) -> int:
        return len(self._limbo)

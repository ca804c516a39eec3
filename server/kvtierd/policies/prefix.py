"""Prefix-aware eviction (issue 42): LRU order that keeps key chains whole.

Block keys chain (each key hashes its parent's) and a lookup hits a longest prefix, so a block
is worth keeping only while its ancestors are: the head of a chain must outlive its tail, and a
block whose ancestor left the cache (an *orphan*) can never be hit again. :class:`PrefixPolicy`
orders resident keys as LRU does, with two differences:

- batch primitives (``insert_many``, ``touch_many``) take a chain's keys head-first, as the
  cache has them, and place them so that the deepest is the coldest: among blocks stored or hit
  together, the tail goes first;
- ``orphan(keys)`` moves resident keys (head-first, as ``insert_many``) to the victim front,
  before every reachable key, the deepest first. A later hit (``touch``) proves a key
  reachable again (its ancestor was stored anew) and it rejoins the LRU order.

The cache tells it which keys are orphans (``wants_parents``: it keeps the blocks' parent
links for this policy; kvtierd.cache.residency). Primitives are O(1), batches O(k).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from kvtierd.policies.base import EvictionPolicy, K, chunked_victims


class PrefixPolicy(EvictionPolicy[K]):
    """LRU over reachable keys, behind a front list of orphans; every primitive O(1) (O(k)
    for a batch of k).

    Owns two ``OrderedDict`` s of resident keys, best victim first; a key is in exactly one::

        orphans    resident, an ancestor left the cache (victims before any reachable key)
        reachable  resident, LRU order (deepest of a batch the coldest)

    Transitions::

        insert(k) / insert_many(ks)      -> MRU end of reachable (a batch tail-first)
        touch(k) / touch_many(ks)        -> MRU end of reachable (from either list)
        orphan(ks)                       reachable/orphans -> front of orphans (deepest first)
        remove(k, evicted=...)           -> unknown (no history)

    Concurrency: event-loop thread only; no locks.
    """

    wants_parents = True

    def __init__(self) -> None:
        self._reachable: OrderedDict[K, None] = OrderedDict()
        self._orphans: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        assert key not in self, f"insert of resident key {key!r}"
        self._reachable[key] = None

    def insert_many(self, keys: Sequence[K]) -> None:
        """Insert a chain given head-first: its deepest key ends up the coldest."""
        for key in reversed(keys):
            self.insert(key)

    def touch(self, key: K) -> None:
        if key in self._reachable:
            self._reachable.move_to_end(key)
        elif key in self._orphans:  # hit: reachable again
            del self._orphans[key]
            self._reachable[key] = None

    def touch_many(self, keys: Iterable[K]) -> None:
        """Touch a chain given head-first (a lookup's hits): its deepest key the coldest."""
        ks = keys if isinstance(keys, Sequence) else list(keys)
        if not self._orphans:  # the common case, in C (1,000 keys ≈ 20 µs)
            try:
                deque(map(self._reachable.move_to_end, reversed(ks)), maxlen=0)
                return
            except KeyError:  # an unknown key: touching again, one by one, ends in the same order
                pass
        for key in reversed(ks):
            self.touch(key)

    def orphan(self, keys: Sequence[K]) -> None:
        """Move resident ``keys`` (head-first) to the victim front, the last one first."""
        for key in keys:
            if key in self._reachable:
                del self._reachable[key]
            elif key not in self._orphans:
                continue  # not resident: no-op
            self._orphans[key] = None
            self._orphans.move_to_end(key, last=False)

    def orphaned(self, key: K) -> bool:
        return key in self._orphans

    def remove(self, key: K, *, evicted: bool) -> None:
        if key in self._reachable:
            del self._reachable[key]
        else:
            self._orphans.pop(key, None)

    def victims(self) -> Iterator[K]:
        return chunked_victims(lambda: chain(self._orphans, self._reachable), self.__contains__)

    @property
    def orphans(self) -> int:
        """Resident keys known to be orphans."""
        return len(self._orphans)

    def orphaned_keys(self) -> Iterable[K]:
        return self._orphans.keys()

    def __len__(self) -> int:
        return len(self._reachable) + len(self._orphans)

    def __contains__(self, key: object) -> bool:
        return key in self._reachable or key in self._orphans

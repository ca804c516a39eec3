"""The eviction-policy seam (which resident entry should the cache give up first) and its default
policy, :class:`LruPolicy` (least recently used; ARC is :mod:`kvtierd.policies.arc`).

A policy only *orders* keys; it never frees, pins or moves anything. The cache owns
residency and tells the policy what happened through four primitives:

- ``insert(key)``: ``key`` became resident (its entry reached READY). The key must not
  already be resident in the policy; doing so is a bug and asserts.
- ``touch(key)``: ``key`` was hit (lookup hit or load). No-op if ``key`` is not resident.
- ``remove(key, *, evicted)``: ``key`` left residency. ``evicted=True`` means the cache
  dropped it to make space (history-keeping policies such as ARC remember a ghost);
  ``evicted=False`` means it went for another reason (delete, expiry, failed write) and
  leaves no history. No-op if ``key`` is unknown.
- ``insert_many(keys)`` / ``touch_many(keys)``: a chain's keys, head-first (as stored or
  hit); by default ``insert`` / ``touch`` of each in order.
- ``orphan(keys)``: resident ``keys`` (head-first) lost an ancestor: no lookup can reach them
  any more. A no-op for policies that do not keep chains whole (LRU, ARC); those that do
  (``wants_parents``: kvtierd.policies.prefix) offer them first. ``orphaned(key)`` says
  whether a key is offered first for that reason.
- ``victims()``: resident keys, best victim first. Lazy: the caller usually consumes a
  few candidates, skipping the ones it cannot evict (pinned, being read).

Lifecycle of one key, from the policy's point of view::

    (unknown) --insert--> RESIDENT --touch--> RESIDENT
    RESIDENT --remove(evicted=False)--> (unknown)
    RESIDENT --remove(evicted=True)---> (unknown, or a bounded ghost for ARC)

Iteration contract for ``victims()`` (shared by every implementation through
:func:`chunked_victims`): the iterator works on snapshots taken in growing chunks
(4, 8, 16, ... keys), so consuming ``k`` candidates costs O(k), never O(len(policy)).
The caller may call any primitive while iterating, including ``remove`` on the key it
was just given; the iterator never raises because of it. Guarantees:

- every yielded key is resident at the moment it is yielded (keys removed after their
  chunk was taken are skipped);
- each key is yielded at most once per iterator, even if it is touched mid-iteration,
  so a "skip the pinned ones" loop always terminates;
- order reflects the policy's state when each chunk was taken: keys inserted or
  touched mid-iteration are seen, if at all, at their new position in a later chunk.

Concurrency: every policy is single-threaded, driven from the daemon's event-loop
thread only; there are no locks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

FIRST_CHUNK = 4
"""Keys in the first snapshot chunk of ``victims()``; each later chunk doubles."""


class EvictionPolicy(ABC, Generic[K]):
    """Orders resident keys for eviction; see the module docstring for the primitives.

    Owns only its bookkeeping (key order, and for some policies ghost history); the
    cache owns the entries and decides when and what to evict.
    Concurrency: event-loop thread only; no locks.
    """

    wants_parents = False
    """Whether the cache should keep its blocks' parent links and tell it of orphans."""

    @abstractmethod
    def insert(self, key: K) -> None:
        """Record that ``key`` became resident; asserts it was not resident already."""

    def insert_many(self, keys: Sequence[K]) -> None:
        """``insert`` each key of a chain given head-first (policies may order them otherwise)."""
        for key in keys:
            self.insert(key)

    def orphan(self, keys: Sequence[K]) -> None:
        """Resident ``keys`` (head-first) can no longer be hit; no-op by default."""

    def orphaned(self, key: K) -> bool:
        """Whether ``key`` is offered first as an orphan; False by default."""
        return False

    def orphaned_keys(self) -> Iterable[K]:
        """The keys offered first as orphans (none by default)."""
        return ()

    @abstractmethod
    def touch(self, key: K) -> None:
        """Record a hit on ``key``; no-op if ``key`` is not resident."""

    def touch_many(self, keys: Iterable[K]) -> None:
        """``touch`` each key in order (policies may do it faster)."""
        for key in keys:
            self.touch(key)

    @abstractmethod
    def remove(self, key: K, *, evicted: bool) -> None:
        """Forget resident ``key``; ``evicted`` says it was dropped for space. No-op if unknown."""

    @abstractmethod
    def victims(self) -> Iterator[K]:
        """Yield resident keys, best victim first, under the module's iteration contract."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys (ghosts are not counted)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (a ghost is not resident)."""


def chunked_victims(order: Callable[[], Iterator[K]], resident: Callable[[K], bool]) -> Iterator[K]:
    """Yield from ``order()`` lazily, in snapshot chunks, tolerating mutation in between.

    ``order`` returns a fresh iterator over the resident keys in current victim order; it
    is called once per chunk and fully consumed up to the chunk size before anything is
    yielded, so the underlying containers are never mutated while being iterated. Each
    chunk restarts from the front and skips keys already yielded; with doubling chunk
    sizes the total work for ``k`` consumed keys stays O(k).
    """
    yielded: set[K] = set()
    size = FIRST_CHUNK
    while True:
        chunk = list(islice((key for key in order() if key not in yielded), size))
        if not chunk:
            return
        for key in chunk:
            if resident(key):  # the caller may have removed it since the snapshot
                yielded.add(key)
                yield key
        size *= 2


class LruPolicy(EvictionPolicy[K]):
    """Least recently used: the key hit or inserted longest ago goes first; every primitive is O(1).

    Owns one ``OrderedDict`` of resident keys, least recently used first. Keeps no
    history, so ``remove(evicted=True)`` and ``remove(evicted=False)`` are the same.
    Concurrency: event-loop thread only; no locks.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        assert key not in self._order, f"insert of resident key {key!r}"
        self._order[key] = None

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        """Move resident keys to MRU in order; the loop runs in C (1,000 keys ≈ 20 µs)."""
        deque(map(self._order.move_to_end, keys), maxlen=0)

    def remove(self, key: K, *, evicted: bool) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[K]:
        return chunked_victims(lambda: iter(self._order), self.__contains__)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03) for a cache of varying size.

Classic ARC assumes a fixed capacity ``c`` and performs its own replacement. Here the
cache decides *when* to evict (its capacity is in bytes, so the entry count varies);
ARC only decides *what* via ``victims()``. The adaptation:

- ``ghost_capacity`` plays the role of ``c`` for history: ``len(B1) + len(B2)`` never
  exceeds it (the oldest ghost, from either list, is dropped first) and the target
  ``p`` is clamped to ``[0, ghost_capacity]``.
- REPLACE becomes an ordering: if ``len(T1) > p`` (or T2 is empty) T1 is offered first,
  LRU end first, then T2; otherwise T2 first, then T1. The choice is re-made at every
  snapshot chunk of ``victims()``, so it adapts as the caller evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain
from typing import Literal

from kvtierd.policies.base import EvictionPolicy, K, chunked_victims


class ArcPolicy(EvictionPolicy[K]):
    """ARC ordering over resident keys, with bounded ghost history; O(1) primitives.

    Owns four key lists (each ``OrderedDict``, least recent first); a key is in at most
    one of them::

        T1  resident, seen once          B1  ghost of a key evicted from T1
        T2  resident, seen at least twice B2  ghost of a key evicted from T2

    Transitions::

        insert(k), k unknown          -> T1
        insert(k), k in B1            -> T2, p += max(1, |B2|/|B1|)  (clamped to ghost_capacity)
        insert(k), k in B2            -> T2, p -= max(1, |B1|/|B2|)  (clamped to 0)
        touch(k),  k in T1 or T2      -> MRU of T2
        remove(k, evicted=True)       T1 -> B1, T2 -> B2 (then drop oldest ghosts over capacity)
        remove(k, evicted=False)      T1/T2 -> unknown (no ghost)

    Ghosts live in one FIFO (``key -> 1 | 2``) so "oldest ghost first" spans both lists.
    Concurrency: event-loop thread only; no locks.
    """

    def __init__(self, ghost_capacity: int) -> None:
        if ghost_capacity < 0:
            raise ValueError(f"ghost_capacity must be >= 0, got {ghost_capacity}")
        self._ghost_capacity = ghost_capacity
        self._p = 0.0
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._ghosts: OrderedDict[K, Literal[1, 2]] = OrderedDict()  # oldest first
        self._b1_size = 0
        self._b2_size = 0

    @property
    def p(self) -> float:
        """Adaptive target size of T1, in entries, within ``[0, ghost_capacity]``."""
        return self._p

    @property
    def ghost_capacity(self) -> int:
        """Upper bound on ``b1_size + b2_size``."""
        return self._ghost_capacity

    @property
    def t1_size(self) -> int:
        """Resident keys seen once."""
        return len(self._t1)

    @property
    def t2_size(self) -> int:
        """Resident keys seen at least twice."""
        return len(self._t2)

    @property
    def b1_size(self) -> int:
        """Ghosts of keys evicted from T1."""
        return self._b1_size

    @property
    def b2_size(self) -> int:
        """Ghosts of keys evicted from T2."""
        return self._b2_size

    def insert(self, key: K) -> None:
        assert key not in self, f"insert of resident key {key!r}"
        ghost = self._ghosts.get(key)
        if ghost is None:
            self._t1[key] = None
            return
        if ghost == 1:  # evicted from T1 too early: grow T1's target
            delta = max(1.0, self._b2_size / self._b1_size)
            self._p = min(self._p + delta, float(self._ghost_capacity))
        else:  # evicted from T2 too early: shrink T1's target
            delta = max(1.0, self._b1_size / self._b2_size)
            self._p = max(self._p - delta, 0.0)
        self._drop_ghost(key)
        self._t2[key] = None

    def touch(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: K, *, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            ghost: Literal[1, 2] = 1
        elif key in self._t2:
            del self._t2[key]
            ghost = 2
        else:
            return
        if evicted:
            self._add_ghost(key, ghost)

    def victims(self) -> Iterator[K]:
        return chunked_victims(self._order, self.__contains__)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _order(self) -> Iterator[K]:
        """Current victim order: ARC's REPLACE choice of list, then the other list."""
        if len(self._t1) > self._p or not self._t2:
            return chain(self._t1, self._t2)
        return chain(self._t2, self._t1)

    def _add_ghost(self, key: K, ghost: Literal[1, 2]) -> None:
        if self._ghost_capacity == 0:
            return
        self._ghosts[key] = ghost
        if ghost == 1:
            self._b1_size += 1
        else:
            self._b2_size += 1
        while len(self._ghosts) > self._ghost_capacity:
            self._drop_ghost(next(iter(self._ghosts)))

    def _drop_ghost(self, key: K) -> None:
        if self._ghosts.pop(key) == 1:
            self._b1_size -= 1
        else:
            self._b2_size -= 1

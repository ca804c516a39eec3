"""LMCache's per-key L2 locks on top of kvtier's pinned lookups (no LMCache import).

LMCache locks keys one by one: every lookup-and-lock takes one lock on each key it reports
found, and later ``submit_unlock(keys)`` returns one lock per key, in any grouping (part of a
lookup's keys when the load plan drops them, the rest after the load). kvtier pins per lookup:
``lookup_pinned`` pins the hits of one batch under one pin id, released whole by
``Client.release(pin, epoch)``.

``PinTable`` joins the two. ``add(pin, epoch, keys)`` records a pin and the keys it locked;
``unlock(keys)`` takes one lock per key, oldest pin first, and answers the pins whose every key
is now unlocked, for the caller to release. Unlocking a key that holds no lock is ignored
(LMCache never does it; a daemon restart or a lease lapse may have dropped the pin already,
which is harmless: the blocks are then merely evictable).

Thread-safety: every method takes the table's lock; nothing in it blocks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass
class _Pin:
    pin: int
    epoch: int
    held: int  # keys of this pin still locked


class PinTable:
    """Owns the map key -> pins holding a lock on it, and each pin's count of locked keys."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, deque[_Pin]] = {}
        self._lock = threading.Lock()

    def add(self, pin: int, epoch: int, keys: Iterable[Hashable]) -> None:
        entry = _Pin(pin, epoch, 0)
        with self._lock:
            for key in keys:
                self._by_key.setdefault(key, deque()).append(entry)
                entry.held += 1

    def unlock(self, keys: Iterable[Hashable]) -> list[tuple[int, int]]:
        """Return one lock per key; the (pin, epoch) pairs that no key holds any more."""
        done: list[tuple[int, int]] = []
        with self._lock:
            for key in keys:
                pins = self._by_key.get(key)
                if not pins:
                    continue
                entry = pins.popleft()
                if not pins:
                    del self._by_key[key]
                entry.held -= 1
                if entry.held == 0:
                    done.append((entry.pin, entry.epoch))
        return done

    def drain(self) -> list[tuple[int, int]]:
        """Forget every lock; the pins to release (at close)."""
        with self._lock:
            pins = {(e.pin, e.epoch) for q in self._by_key.values() for e in q}
            self._by_key.clear()
        return sorted(pins)

    def __len__(self) -> int:
        """Keys holding at least one lock."""
        with self._lock:
            return len(self._by_key)

"""Per-key connection slots: the shm socket's handshakes per peer uid, the data port's
connections per tenant (docs/hardening.md "Handshake and connection slots")."""

from __future__ import annotations

from collections.abc import Hashable


class KeyedSlots:
    """At most ``per_key`` slots held per key (a Unix peer's uid, a tenant's name), so one
    holder cannot take the slots every other holder shares; ``per_key`` 0: no cap.

    Owner: its transport server. Event-loop thread only (plain counters, no lock)."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._held: dict[Hashable, int] = {}
        self.refused = 0

    def take(self, key: Hashable) -> bool:
        """One more slot for ``key``, or False (counted in ``refused``) when it holds its cap."""
        n = self._held.get(key, 0)
        if self.per_key and n >= self.per_key:
            self.refused += 1
            return False
        self._held[key] = n + 1
        return True

    def full(self, key: Hashable) -> bool:
        """Whether ``key`` holds its cap (``take`` would refuse)."""
        return bool(self.per_key) and self._held.get(key, 0) >= self.per_key

    def give(self, key: Hashable) -> None:
        """Give back one slot ``key`` took."""
        n = self._held.get(key, 0) - 1
        if n > 0:
            self._held[key] = n
        else:
            self._held.pop(key, None)

    def held(self, key: Hashable) -> int:
        return self._held.get(key, 0)

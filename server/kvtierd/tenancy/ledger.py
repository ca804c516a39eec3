"""The ledger: per holder, how much of a bounded resource it holds now.

For resources that no index or table counts already: the tenancy's counts each tenant's
control channels and the bytes they hold (a tenant of None is the single-tenant daemon's one
owner); the shm socket counts handshakes per peer uid, the data port connections per tenant,
each in a ledger of its own. ``take(holder, resource, n, limit)`` adds ``n`` if the holder's
total stays within ``limit`` (None: no limit) and says True, or changes nothing (False);
``give(holder, resource, n)`` returns them.

Ownership: whoever made it (the Tenancy, a transport server). Event-loop thread only (``held``
may be read from /metrics threads: a dict read of ints).
"""

from __future__ import annotations

from collections.abc import Hashable


class Ledger:
    """See the module docstring."""

    def __init__(self) -> None:
        self._held: dict[tuple[Hashable, str], int] = {}

    def take(self, holder: Hashable, resource: str, n: int, limit: int | None) -> bool:
        """Count ``n`` more of ``resource`` against ``holder`` unless that passes ``limit``."""
        assert n >= 0
        key = (holder, resource)
        now = self._held.get(key, 0)
        if limit is not None and now + n > limit:
            return False
        self._held[key] = now + n
        return True

    def give(self, holder: Hashable, resource: str, n: int) -> None:
        """Return ``n`` of ``resource`` that ``holder`` took."""
        key = (holder, resource)
        left = self._held.get(key, 0) - n
        assert left >= 0, (key, n)
        if left:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def held(self, holder: Hashable, resource: str) -> int:
        return self._held.get((holder, resource), 0)

    def total(self, resource: str) -> int:
        return sum(v for (_, r), v in list(self._held.items()) if r == resource)

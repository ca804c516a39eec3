"""The ledger: per tenant, how much of a bounded resource it holds now.

For resources that no index or table counts already: the bytes of control frames received but
not yet whole (``buffered_bytes``). ``take(tenant, resource, n, limit)`` adds ``n`` if the
tenant's total stays within ``limit`` (True) or changes nothing (False); ``give(tenant,
resource, n)`` returns them. A tenant of None is the single-tenant daemon's one owner.

Ownership: the daemon's Tenancy owns it. Event-loop thread only (``held`` may be read from
/metrics threads: a dict read of ints).
"""

from __future__ import annotations


class Ledger:
    """See the module docstring."""

    def __init__(self) -> None:
        self._held: dict[tuple[str | None, str], int] = {}

    def take(self, tenant: str | None, resource: str, n: int, limit: int | None) -> bool:
        """Count ``n`` more of ``resource`` against ``tenant`` unless that passes ``limit``."""
        assert n >= 0
        key = (tenant, resource)
        now = self._held.get(key, 0)
        if limit is not None and now + n > limit:
            return False
        self._held[key] = now + n
        return True

    def give(self, tenant: str | None, resource: str, n: int) -> None:
        """Return ``n`` of ``resource`` that ``tenant`` took."""
        key = (tenant, resource)
        left = self._held.get(key, 0) - n
        assert left >= 0, (key, n)
        if left:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def held(self, tenant: str | None, resource: str) -> int:
        return self._held.get((tenant, resource), 0)

    def total(self, resource: str) -> int:
        return sum(v for (_, r), v in list(self._held.items()) if r == resource)

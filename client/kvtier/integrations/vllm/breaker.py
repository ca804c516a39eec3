"""One circuit breaker per daemon address for every kvtier client of this process.

The connector's workers (their load and store sessions), the connector's scheduler-side lookup
session and the secondary tier's sessions all take theirs from ``shared_breaker``: one daemon,
one verdict on whether it answers. After the first call that finds the daemon down or silent,
every client of this process fails fast until the breaker's probe thread has seen it again.

Ownership and concurrency: the module owns the table of breakers (one per address, never
removed), under one lock; each ``kvtier.breaker.Breaker`` is thread-safe.
"""

from __future__ import annotations

import threading

from kvtier.breaker import Breaker

__all__ = ["shared_breaker"]

_BREAKERS: dict[str, Breaker] = {}
_BREAKERS_LOCK = threading.Lock()


def shared_breaker(address: str) -> Breaker:
    """The one breaker of this process for the daemon at ``address`` (workers' and scheduler's
    clients alike): one daemon, one verdict on whether it answers."""
    with _BREAKERS_LOCK:
        breaker = _BREAKERS.get(address)
        if breaker is None:
            breaker = _BREAKERS[address] = Breaker()
        return breaker

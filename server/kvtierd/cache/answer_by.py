"""AnswerBy: how long a request may wait on reads into the host tier before it must answer.

A PrepareLoad with a deadline (an engine step's budget) that waits on a slow tier (NVMe behind a
busy disk, the cluster over a slow link) must not let the deadline pass: the client would take
the silence for a daemon that is away, open its breaker, and miss every lookup meanwhile. So the
service gives the cache an ``AnswerBy`` (the deadline less what the answer and the client's copy
need, ``for_deadline``), the cache stops waiting there (the reads go on, as they do for a
cancelled RPC: a later request finds those blocks in the host tier) and answers with what the
host tier holds, and ``cut`` tells the client so (``PrepareLoadReply.deadline_cut``).

Lifecycle: made per request, by the request's handler, on the event-loop thread; ``wait`` any
number of times; read ``cut`` after the last. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

RESERVE_S = 0.005  # at least this much of a deadline is left for the answer and the copy
RESERVE_SHARE = 0.25  # and at least this share of it (a 100 ms step budget: answered by 75 ms)


class AnswerBy:
    """See the module docstring. ``until``: on the event loop's clock (``loop.time()``)."""

    __slots__ = ("until", "cut")

    def __init__(self, until: float) -> None:
        self.until = until
        self.cut = False  # waiting stopped at ``until`` with reads still running

    @classmethod
    def for_deadline(cls, left_s: float | None) -> AnswerBy | None:
        """The limit for a request with ``left_s`` seconds to its deadline (None: no deadline,
        no limit): what is left after ``RESERVE_S`` or ``RESERVE_SHARE`` of it, the larger."""
        if left_s is None:
            return None
        reserve = max(RESERVE_S, RESERVE_SHARE * left_s)
        return cls(asyncio.get_running_loop().time() + max(0.0, left_s - reserve))

    async def wait(self, aw: Awaitable[T]) -> T | None:
        """``await aw`` until ``until``; None (and ``cut``) when it had not ended by then. ``aw``
        is cancelled then, so it must be one that leaves its reads running when its caller is
        cancelled (``TierLink.promote_many``, ``ClusterLink.import_``)."""
        left = self.until - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(0.0, left))
        except TimeoutError:
            self.cut = True
            return None

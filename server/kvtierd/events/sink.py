"""The cache's side of KV events: the :class:`EventSink` seam, always present in the cache.
:class:`BlockEvents` takes what the cache says, in O(1) per call, and hands it to the
publisher's bounded :class:`EventQueue`; :class:`NoEvents` (events off) drops it.

Primitives (called by the cache, kvtierd.cache, where a block becomes visible in a tier or
leaves it): ``stored(entries, medium)``, ``removed(entries, medium)``; ``cleared()`` once, at
start; ``flush()`` at the drain; ``publishing``: whether anything is told (entries keep their
token ids and parents only then). The composition root (kvtierd.app.build.event_sink) picks
one sink per daemon, once. In ``BlockEvents`` a call only appends a record to a list; the list
goes to the queue once per event-loop iteration (``loop.call_soon``), or at once where no loop
runs yet (the NVMe recovery at start, which waits for room instead of dropping). Records hold
the entries themselves: the publisher thread reads only what never changes after a
reservation (``key``, ``ns.spec``, ``origin``).

Concurrency: ``BlockEvents``: event-loop thread only. ``NoEvents``: stateless, any thread.
``EventQueue``: any thread (one lock).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, Protocol

from kvtierd.events.wire import Medium

if TYPE_CHECKING:
    from kvtierd.index import Entry

Kind = Literal["stored", "removed", "cleared"]
Record = tuple[Kind, Medium | None, list["Entry"]]


class EventQueue:
    """Records on their way to the publisher thread, at most ``max_blocks`` blocks queued: a
    record that would pass it is dropped whole and its blocks counted in ``dropped_blocks``
    (the request path never waits). Owns its lock; any thread."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._items: deque[Record] = deque()
        self._blocks = 0
        self._cond = threading.Condition()
        self.dropped_blocks = 0
        self.dropped_records = 0

    def put(self, records: list[Record], *, wait: bool = False) -> bool:
        """Queue ``records`` together; whether they were (``wait``: block until there is room).
        Records larger than the whole queue go in when it is empty (the recovery at start)."""
        n = sum(max(1, len(r[2])) for r in records)
        with self._cond:
            while wait and self._blocks and self._blocks + n > self.max_blocks:
                self._cond.wait()
            if self._blocks and self._blocks + n > self.max_blocks:
                self.dropped_blocks += n
                self.dropped_records += len(records)
                return False
            self._items.extend(records)
            self._blocks += n
            self._cond.notify_all()
            return True

    def take(self, timeout_s: float) -> list[Record]:
        """Everything queued (waiting up to ``timeout_s`` for something)."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout_s)
            out = list(self._items)
            self._items.clear()
            self._blocks = 0
            self._cond.notify_all()
            return out

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def queued_blocks(self) -> int:
        return self._blocks


class EventSink(Protocol):
    """What the cache calls where a block enters or leaves a tier (see the module docstring)."""

    @property
    def publishing(self) -> bool: ...

    def stored(self, entries: Iterable[Entry], medium: Medium) -> None: ...

    def removed(self, entries: Iterable[Entry], medium: Medium) -> None: ...

    def cleared(self) -> None: ...

    def flush(self) -> None: ...


class NoEvents:
    """The sink while KV events are off: every call does nothing. Owns nothing; any thread."""

    publishing = False

    def stored(self, entries: Iterable[Entry], medium: Medium) -> None:
        pass

    def removed(self, entries: Iterable[Entry], medium: Medium) -> None:
        pass

    def cleared(self) -> None:
        pass

    def flush(self) -> None:
        pass


NO_EVENTS = NoEvents()
"""The one no-op sink (stateless: shared by every cache that publishes nothing)."""


class BlockEvents:
    """What the cache calls while KV events are on (see the module docstring). Owns the
    records of the current event-loop iteration; event-loop thread only."""

    publishing = True

    def __init__(self, queue: EventQueue) -> None:
        self.queue = queue
        self._pending: list[Record] = []
        self._flush_scheduled = False

    def stored(self, entries: Iterable[Entry], medium: Medium) -> None:
        """``entries`` became visible in ``medium`` (a commit's: in the request's order)."""
        batch = list(entries)
        if batch:
            self._add(("stored", medium, batch))

    def removed(self, entries: Iterable[Entry], medium: Medium) -> None:
        batch = list(entries)
        if batch:
            self._add(("removed", medium, batch))

    def cleared(self) -> None:
        self._add(("cleared", None, []))

    def _add(self, record: Record) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # at start, before the loop runs: recovery waits for room
            self.queue.put([record], wait=True)
            return
        self._pending.append(record)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand the records of this loop iteration to the queue (one lock)."""
        self._flush_scheduled = False
        if self._pending:
            pending, self._pending = self._pending, []
            self.queue.put(pending)

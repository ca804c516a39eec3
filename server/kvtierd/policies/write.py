"""Write policies: when the cache copies a host block down to a storage tier (demotion).

A write policy only *chooses*; the cache's chain link (kvtierd/cache/chain.py) queues and writes.
Three hooks, each answering which entries to demote now:

* ``committed(entries)``: a store job just committed these blocks;
* ``hit(entries)``: a lookup just hit these blocks (every hit, in order);
* ``excess_bytes(used, capacity)``: how many bytes at the cold end of the host tier should be
  clean (have a copy below) right now; the link flushes the coldest dirty blocks until then.

Whatever the policy, the link also cleans the cold end before a store or a promotion needs room
(backpressure), so that host eviction drops only blocks the storage tier holds while it keeps up.

* ``write-back`` (default): nothing at commit; keep the host tier's cold end clean past
  ``flush_watermark`` of its capacity.
* ``write-through``: every committed block.
* ``selective``: a block at its ``write_after_hits``-th hit (and every later hit until it has a
  copy: a flush refused while the tier was degraded is retried).

A policy never writes the index: ``selective`` reads ``Entry.hits``, which the cache counts for
policies that ask for it (``counts_hits``). Concurrency: event-loop thread only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Literal

from kvtierd.index import Entry

WritePolicyName = Literal["write-back", "write-through", "selective"]


class WritePolicy(ABC):
    """Chooses blocks to demote; see the module docstring."""

    name: WritePolicyName
    counts_hits = False
    """Whether the cache must count hits per entry (``Entry.hits``) for this policy."""

    def committed(self, entries: Sequence[Entry]) -> Iterable[Entry]:
        return ()

    def hit(self, entries: Sequence[Entry]) -> Iterable[Entry]:
        return ()

    def excess_bytes(self, used: int, capacity: int) -> float:
        return 0.0

    @abstractmethod
    def __repr__(self) -> str: ...


class WriteBack(WritePolicy):
    name: WritePolicyName = "write-back"

    def __init__(self, flush_watermark: float) -> None:
        self.flush_watermark = flush_watermark

    def excess_bytes(self, used: int, capacity: int) -> float:
        return used - self.flush_watermark * capacity

    def __repr__(self) -> str:
        return f"WriteBack(flush_watermark={self.flush_watermark})"


class WriteThrough(WritePolicy):
    name: WritePolicyName = "write-through"

    def committed(self, entries: Sequence[Entry]) -> Iterable[Entry]:
        return entries

    def __repr__(self) -> str:
        return "WriteThrough()"


class Selective(WritePolicy):
    name: WritePolicyName = "selective"
    counts_hits = True

    def __init__(self, write_after_hits: int) -> None:
        self.write_after_hits = write_after_hits

    def hit(self, entries: Sequence[Entry]) -> Iterable[Entry]:
        n = self.write_after_hits
        return [e for e in entries if e.hits >= n]  # not ==: see the module docstring

    def __repr__(self) -> str:
        return f"Selective(write_after_hits={self.write_after_hits})"


def make_write_policy(name: WritePolicyName, *, flush_watermark: float, write_after_hits: int) -> WritePolicy:
    """The policy called ``name`` (ValueError naming ``write_policy`` for another name)."""
    if name == "write-back":
        return WriteBack(flush_watermark)
    if name == "write-through":
        return WriteThrough()
    if name == "selective":
        return Selective(write_after_hits)
    raise ValueError(
        f"write_policy: unknown policy {name!r}; expected 'write-back', 'write-through' or 'selective'"
    )

"""Index entries and their state machine.

::

    (absent) --reserve--> WRITING --commit--> READY --evict/delete--> (absent)
                             |                 ^  |
                             +--abort--> (absent)  +-- pin / unpin (pins > 0: never evicted)

* WRITING entries are invisible to lookups and loads and never evicted; they belong to one store
  job (``job``) of one session, and are freed when that job aborts or the session's lease lapses.
* READY entries are immutable; ``pins`` counts load jobs holding them. Only READY entries with
  ``pins == 0`` may be evicted.

Keys are only ever compared within one namespace: each namespace has its own dict.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from kvtier_contract.identity import Namespace
from kvtierd.stats import Counters


class EntryState(enum.IntEnum):
    WRITING = 1
    READY = 2


class Entry:
    """One block. Identity-hashed (the eviction policies key on the object).

    Where its bytes are: ``offset >= 0`` -> a host slot (valid once READY and not promoting);
    ``copies`` -> its copies in storage tiers (tier id -> that tier's location; None when it has
    none), each durable. A READY entry has a valid host slot or at least one copy.
    ``flushing``: how many demotions are writing its host copy down (the host slot must stay);
    ``promoting``: a copy is being read into the host slot at ``offset`` (not valid yet).
    Written only by the cache (kvtierd.cache); tiers and transports only read it.
    """

    __slots__ = ("ns", "key", "state", "offset", "pins", "job", "copies", "flushing",
                 "promoting", "hits")

    def __init__(self, ns: NamespaceState, key: bytes, offset: int, job: int) -> None:
        self.ns = ns
        self.key = key
        self.state = EntryState.WRITING
        self.offset = offset
        self.pins = 0
        self.job = job
        self.copies: dict[int, Any] | None = None  # TierId -> location in that tier
        self.flushing = 0
        self.promoting: asyncio.Future[None] | None = None
        self.hits = 0

    @property
    def in_host(self) -> bool:
        """A valid host copy (READY, slot held, not being filled by a promotion)."""
        return self.offset >= 0 and self.promoting is None and self.state is EntryState.READY

    def copy_in(self, tier: int) -> Any:
        """This block's location in storage tier ``tier``, or None."""
        return self.copies.get(tier) if self.copies else None

    def evictable(self) -> bool:
        return self.state is EntryState.READY and self.pins == 0 and not self.flushing \
            and self.promoting is None

    def __repr__(self) -> str:
        return (f"Entry({self.key[:4].hex()}…, {self.state.name}, off={self.offset}, "
                f"pins={self.pins}, copies={sorted(self.copies or ())})")


@dataclass(eq=False)
class NamespaceState:
    """A registered namespace: its identity, fixed block size, entries and counters."""

    id: int
    spec: Namespace
    block_bytes: int
    slot_bytes: int
    entries: dict[bytes, Entry] = field(default_factory=dict)
    """Every entry of the namespace, WRITING or READY."""
    ready: dict[bytes, Entry] = field(default_factory=dict)
    """The READY subset: lookups and loads read only this one (a C-speed map over a chain)."""
    counters: Counters = field(default_factory=Counters)

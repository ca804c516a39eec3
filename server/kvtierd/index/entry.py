"""Index entries and their state machine.

::

    (absent) --reserve--> WRITING --commit--> READY --evict/delete--> (absent)
                             |                 ^  |
                             +--abort--> (absent)  +-- pin / unpin, hold / release

* WRITING entries are invisible to lookups and loads and never evicted; they belong to one store
  job (``job``) of one session, and are freed when that job aborts or the session's lease lapses.
* READY entries are immutable. ``pins`` counts load jobs (and cluster writes) reading their
  host slot: a pinned entry keeps its host copy. ``holds`` counts pinned lookups: a held entry
  stays in the index (it keeps its last copy; its host copy may go while a copy below
  remains). Only READY entries without pins may lose their host copy.

Keys are only ever compared within one namespace: each namespace has its own dict.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from kvtier_contract.identity import Namespace
from kvtierd.index.published import ReadyMap
from kvtierd.stats import Counters


class EntryState(enum.IntEnum):
    WRITING = 1
    READY = 2


class Entry:
    """One block. Identity-hashed (the eviction policies key on the object).

    Where its bytes are: ``offset >= 0`` -> a host slot (valid once READY and not promoting);
    ``copies`` -> its copies in the storage tiers of the cache's chain: one location (or None)
    per chain level, None when it has no copy at all (a tuple, not a dict: ~50 bytes instead of
    ~230 per entry held below), each durable. A READY entry has a valid host slot or a copy.
    ``flushing``: how many demotions are writing its host copy down (the host slot must stay);
    ``promoting``: a copy is being read into the host slot at ``offset`` (not valid yet).
    ``digest``: xxh3_64 of its bytes, fixed at its commit (kvtier_contract.digests; None when
    the daemon does not verify bytes): sent with every load, and its NVMe payload checksum.
    Written only by the cache (kvtierd.cache); tiers and transports only read it.
    """

    __slots__ = (
        "ns",
        "key",
        "state",
        "offset",
        "pins",
        "holds",
        "job",
        "copies",
        "flushing",
        "promoting",
        "hits",
        "in_cluster",
        "digest",
        "origin",
        "parent",
    )

    def __init__(self, ns: NamespaceState, key: bytes, offset: int, job: int) -> None:
        self.ns = ns
        self.key = key
        self.state = EntryState.WRITING
        self.offset = offset
        self.pins = 0
        self.holds = 0
        self.job = job
        self.copies: tuple[Any, ...] | None = None  # chain level -> location there, or None
        self.flushing = 0
        self.promoting: asyncio.Future[None] | None = None
        self.hits = 0
        self.in_cluster = False  # known to be in the cluster tier (not a copy: it may go)
        self.digest: int | None = None  # its bytes' digest, from its commit on
        # (parent key or None, token ids packed as u32, or b"") as its store said, kept only
        # while KV events are on (kvtierd.events): what a router needs to place the block
        self.origin: tuple[bytes | None, bytes] | None = None
        # The key of the block before it in its chain, or None (a chain's head, or not known):
        # kept only while the host tier's policy keeps chains whole (its ``wants_parents``;
        # kvtierd.cache.residency), which files the entry under it in ``ns.children``.
        self.parent: bytes | None = None

    @property
    def in_host(self) -> bool:
        """A valid host copy (READY, slot held, not being filled by a promotion)."""
        return self.offset >= 0 and self.promoting is None and self.state is EntryState.READY

    def copy_in(self, level: int) -> Any:
        """This block's location in the storage tier at chain ``level``, or None."""
        c = self.copies
        return c[level] if c is not None and level < len(c) else None

    def set_copy(self, level: int, loc: Any) -> None:
        """Record (or, with None, forget) the copy at chain ``level`` (the cache only)."""
        c = list(self.copies or ())
        c += [None] * (level + 1 - len(c))
        c[level] = loc
        self.copies = tuple(c) if any(x is not None for x in c) else None

    def evictable(self) -> bool:
        """Its host copy may go (a held entry only while a copy below remains)."""
        return (
            self.state is EntryState.READY
            and self.pins == 0
            and not self.flushing
            and self.promoting is None
            and (not self.holds or self.copies is not None)
        )

    def __repr__(self) -> str:
        return (
            f"Entry({self.key[:4].hex()}…, {self.state.name}, off={self.offset}, "
            f"pins={self.pins}, holds={self.holds}, copies={self.copies})"
        )


@dataclass(eq=False)
class NamespaceState:
    """A registered namespace: its identity, fixed block size, entries and counters."""

    id: int
    spec: Namespace
    block_bytes: int
    slot_bytes: int
    entries: dict[bytes, Entry] = field(default_factory=dict)
    """Every entry of the namespace, WRITING or READY."""
    ready: ReadyMap = field(default_factory=ReadyMap)
    """The READY subset: lookups and loads read only this one (a C-speed map over a chain).
    Its changes reach the namespace's published index, when a client asked for one."""
    counters: Counters = field(default_factory=Counters)
    writing_blocks: int = 0
    """Entries WRITING (reserved by open store jobs): their host slots count against the
    tenant's ``host_bytes`` quota as resident ones do (kvtierd.cache.TieredCache.fit_tenant)."""
    limbo_blocks: int = 0
    """Slots of its stores aborted by a lapsed lease, held back for one more lease (their
    writer may still be alive): they count against the tenant's ``host_bytes`` too, so letting
    leases lapse does not double what a tenant holds."""
    last_used: float = 0.0
    """When an RPC last named it (the cache's clock): an empty namespace idle for
    ``namespace_idle_s`` is forgotten (``TieredCache.expire_idle``)."""
    pool: int = 0
    """The host arena its blocks live in (its tenant's; fixed at registration)."""
    charged_to: str | None = None
    """Whose ``namespaces`` quota it counts against (kvtierd.cache.admission.admit_namespace):
    its owner, or the member of a group that registered the group's namespace before any
    publisher did (its act: a member never fills its group's quota)."""
    children: dict[bytes, Entry | set[Entry]] = field(default_factory=dict)
    """Parent key -> the entry filed under it, or a set of them when a chain branches (each
    entry under its ``parent``, once), kept only for a prefix-aware policy
    (kvtierd.cache.residency): a key may be absent from ``entries`` (its block left), its
    children are then orphans. An entry leaving the index leaves it (no empty set stays)."""

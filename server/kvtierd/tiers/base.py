"""The tier seam: a place that holds block bytes in slots. Tiers know no index entries.

Every tier has a space of ``capacity_bytes`` carved into slots (by size class, see
:class:`~kvtierd.tiers.host.SlabAllocator`) and these primitives, all event-loop thread only:

* ``slot_bytes_for(payload_len)`` / ``fits(payload_len)``: the slot a block of that size takes;
* ``alloc(slot_bytes)`` -> offset or None; ``free(offset, slot_bytes)``;
* ``capacity_bytes`` / ``used_bytes``; ``stats()`` -> the tier's own figures as plain data;
* lifecycle: built -> ``open()`` -> in use -> ``close()``.

Two kinds implement it:

* :class:`MemoryTier` (the host tier): bytes in memory that transports reach directly;
  ``view(offset, nbytes)``. Every block a client loads passes through it.
* :class:`StorageTier` (the NVMe tier, kvtierd.tiers.nvme): copies of host
  blocks, written and read in batches (``write_many`` durable when it returns, ``read_many``
  verified into host slots), ``release`` / ``quarantine`` of a copy, recovery at ``open()``,
  ``checkpoint()`` on drain, and degraded mode (``admitting``, ``probe()``).

Beside them, a :class:`SharedTier` (the cluster tier, kvtierd.tiers.cluster) is not a tier of
this daemon's slots: other daemons write it and it evicts on its own, so the index never records
what it holds. It answers ``exists`` / ``fetch`` (into host slots the cache reserved) and takes
``offer`` ed copies; failure there is a miss, never an error.

The :class:`~kvtierd.cache.TieredCache` alone decides what goes where and writes the index; it
drives storage tiers through this interface only (kvtierd/cache/chain.py) and shared tiers
through theirs (kvtierd/cache/fleet.py), so a new tier plugs in without touching the cache's
internals. Each tier names its own per-namespace counter columns (:class:`StorageColumns`,
:class:`SharedColumns`): the cache's code names no tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier_contract.errors import KvtierError
from kvtierd.domain import TierId


class Tier(ABC):
    """Space of slots; see the module docstring. Implementations own their allocator."""

    name: str
    id: TierId
    capacity_bytes: int
    used_bytes: int

    @abstractmethod
    def slot_bytes_for(self, payload_len: int) -> int:
        """Bytes of the slot that holds a block of ``payload_len`` bytes."""

    @abstractmethod
    def fits(self, payload_len: int) -> bool:
        """Whether a block of ``payload_len`` bytes fits one slot of this tier."""

    @abstractmethod
    def alloc(self, slot_bytes: int) -> int | None:
        """A free slot of ``slot_bytes`` (its offset), or None."""

    @abstractmethod
    def free(self, offset: int, slot_bytes: int) -> None:
        """Give a slot back."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """The tier's own figures (capacity, use, I/O counters) as plain data."""


class MemoryTier(Tier):
    """A tier whose slots are memory every transport reaches (the host tier)."""

    @abstractmethod
    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes of a slot (a view into the tier's memory)."""


@dataclass
class Recovered:
    """What a storage tier's ``open()`` found: namespace specs and the copies it holds."""

    namespaces: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    blocks: list[tuple[bytes, bytes, Any]] = field(default_factory=list)  # digest, key, location


WriteItem = tuple[int, bytes, bytes, memoryview, int, int | None]
"""(slot offset in the storage tier, namespace digest, key, host bytes, payload length, the
block's digest from its commit or None). A tier that checksums its copies uses that digest as
their checksum (kvtier_contract.digests), computing one only for None."""
ReadItem = tuple[Any, bytes, bytes, memoryview]
"""(location, namespace digest, key, host slot to fill)."""


@dataclass(frozen=True)
class StorageColumns:
    """The per-namespace counters (kvtierd.stats.Counters fields) a storage tier's link keeps:
    lookup hits served from it, copies resident (blocks, bytes), copies evicted, payload bytes
    read (promoted) and written (demoted)."""

    hits: str
    resident_blocks: str
    resident_bytes: str
    evictions: str
    bytes_read: str
    bytes_written: str


class StorageTier(Tier):
    """A tier of copies below the host tier; see the module docstring.

    ``admitting`` is False while degraded (``degraded_reason`` says why); ``probe()`` (blocking)
    tries to resume. A location is the tier's own value, kept by the cache in the entry.
    ``columns``: where the cache counts this tier's figures per namespace.
    """

    admitting: bool
    degraded_reason: str
    columns: StorageColumns

    @abstractmethod
    def open(self) -> Recovered:
        """Blocking, once at startup: format or recover; the copies found."""

    @abstractmethod
    def knows_namespace(self, digest: bytes) -> bool: ...

    @abstractmethod
    async def register_namespace(self, digest: bytes, spec: dict[str, Any]) -> None:
        """Record a namespace's spec once, so recovery can re-create it."""

    @abstractmethod
    async def write_many(self, items: list[WriteItem]) -> list[Any]:
        """Write copies into slots from ``alloc``; their locations, durable when it returns.
        Raises the tier's error type for the whole batch."""

    @abstractmethod
    async def read_many(self, items: list[ReadItem]) -> list[Exception | None]:
        """Read copies into host slots, each verified: None, or why that one failed."""

    def digest_of(self, loc: Any) -> int | None:
        """The block digest a copy was written with (kvtier_contract.digests), if the tier
        records one: a block restored from the tier, or promoted, keeps its digest."""
        return None

    @abstractmethod
    def release(self, loc: Any, digest: bytes, key: bytes) -> None:
        """A copy is no longer wanted; its slot is free again."""

    @abstractmethod
    def quarantine(self, loc: Any, digest: bytes, key: bytes) -> None:
        """A copy that failed verification: forgotten, its slot never reused this boot."""

    @abstractmethod
    def probe(self) -> bool:
        """Blocking: try to resume admission; whether the tier admits now."""

    @abstractmethod
    def checkpoint(
        self, namespaces: dict[bytes, dict[str, Any]], blocks: Iterable[tuple[bytes, bytes, Any]]
    ) -> None:
        """Blocking, on drain: record the whole index of this tier for a warm next start."""

    @abstractmethod
    def close(self) -> None: ...


FETCH_MISS, FETCH_OK, FETCH_CORRUPT = 0, 1, 2
"""The per-key answers of :meth:`SharedTier.fetch`."""

SharedWriteItem = tuple[Any, bytes, bytes, memoryview, int | None]
"""(the block's realm, namespace digest, block key, the block's bytes: valid until ``done`` is
called, the block's digest from its commit or None)."""


@dataclass(frozen=True)
class SharedColumns:
    """The per-namespace counters a shared tier's link keeps: lookup hits found there, blocks
    imported from it, values found corrupt there."""

    hits: str
    imports: str
    corrupt: str


class SharedTier(Protocol):
    """A tier shared by the daemons of many nodes, outside the index; see the module docstring.

    Every call names a *realm* (``realm_of(tenant, group)``: the tier's own value) that scopes the
    blocks' names and how they are authenticated. ``write_policy``: ``"commit"`` (offer every
    committed block) or ``"evict"`` (offer a block leaving the host tier without a copy there).

    Lifecycle: built -> ``start()`` (connects in the background; ``connected`` says when) ->
    ``close()`` (blocking: pending writes are dropped, their ``done`` called). ``exists`` /
    ``fetch`` are awaited and ``offer`` is called from the daemon's loop; ``stats()`` from any
    thread.
    """

    name: str
    id: TierId
    columns: SharedColumns

    @property
    def write_policy(self) -> str: ...

    @property
    def connected(self) -> bool: ...

    @property
    def pending_writes(self) -> int:
        """Blocks admitted by ``offer`` and not yet written or dropped (a drain waits)."""

    def realm_of(self, tenant: str | None, group: str | None = None) -> Any:
        """The realm of a namespace's blocks: its ``group``'s when it has one, else its
        ``tenant``'s (each a tier's own value)."""

    async def exists(self, realm: Any, digest: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held, as far as the tier answers within the lookup deadline."""

    async def fetch(
        self, realm: Any, digest: bytes, keys: Sequence[bytes], payload_len: int, dests: Sequence[memoryview]
    ) -> list[int]:
        """Read and verify each key's block into its ``dests`` view: one ``FETCH_*`` each;
        returns only once no copy into ``dests`` can happen any more."""

    def offer(self, items: list[SharedWriteItem], done: Callable[[list[bool]], None]) -> int:
        """Admit a prefix of ``items`` for writing; how many. ``done(oks)`` runs once on the
        caller's loop when they are written or dropped (not called when none was admitted)."""

    def has_room(self, nbytes: int) -> bool:
        """Whether ``offer`` would admit a block of ``nbytes`` now (a hint)."""

    def dropped(self, n: int) -> None:
        """``n`` blocks were not offered because ``has_room`` said no: counted as drops."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class TierUnavailable(KvtierError):
    """A storage tier could not write a batch (degraded, full, I/O error): none of it is held."""


class CorruptCopy(KvtierError):
    """A copy failed verification when read back (one ``read_many`` result): never served."""

"""The tier seam: a place that holds block bytes in slots. Tiers know no index entries.

Every tier has a space of ``capacity_bytes`` carved into slots (by size class, see
:class:`~kvtierd.tiers.slabs.SlabAllocator`) and these primitives, all event-loop thread only:

* ``slot_bytes_for(payload_len)`` / ``fits(payload_len)``: the slot a block of that size takes;
* ``alloc(slot_bytes)`` -> offset or None; ``free(offset, slot_bytes)``;
* ``capacity_bytes`` / ``used_bytes``; ``stats()`` -> the tier's own figures as plain data;
* lifecycle: built -> ``open()`` -> in use -> ``close()``.

Two kinds implement it:

* :class:`MemoryTier` (the host tier): bytes in memory that transports reach directly;
  ``view(offset, nbytes)``. Every block a client loads passes through it.
* :class:`StorageTier` (the NVMe tier; the cluster tier of a later issue): copies of host
  blocks, written and read in batches (``write_many`` durable when it returns, ``read_many``
  verified into host slots), ``release`` / ``quarantine`` of a copy, recovery at ``open()``,
  ``checkpoint()`` on drain, and degraded mode (``admitting``, ``probe()``).

The :class:`~kvtierd.cache.TieredCache` alone decides what goes where and writes the index; it
drives storage tiers through this interface only (kvtierd/cache/chain.py), so a new storage tier
plugs in without touching the cache's internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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


class StorageTier(Tier):
    """A tier of copies below the host tier; see the module docstring.

    ``admitting`` is False while degraded (``degraded_reason`` says why); ``probe()`` (blocking)
    tries to resume. A location is the tier's own value, kept by the cache in the entry.
    """

    admitting: bool
    degraded_reason: str

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
    def checkpoint(self, namespaces: dict[bytes, dict[str, Any]],
                   blocks: Iterable[tuple[bytes, bytes, Any]]) -> None:
        """Blocking, on drain: record the whole index of this tier for a warm next start."""

    @abstractmethod
    def close(self) -> None: ...


class TierUnavailable(KvtierError):
    """A storage tier could not write a batch (degraded, full, I/O error): none of it is held."""


class CorruptCopy(KvtierError):
    """A copy failed verification when read back (one ``read_many`` result): never served."""

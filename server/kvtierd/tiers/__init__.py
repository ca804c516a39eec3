"""Tiers allocate, store and return bytes; they know no index entries (kvtierd.tiers.base).

``HostTier``: one memfd arena carved into slots (the :class:`MemoryTier`). ``NvmeTier``
(kvtierd.tiers.nvme): block files with a journal (a :class:`StorageTier`). ``ClusterTier``
(kvtierd.tiers.cluster, needs redis-py): a Redis/Valkey Cluster shared by many daemons (a
:class:`SharedTier`).
"""

from kvtierd.tiers.base import (
    MemoryTier,
    Recovered,
    SharedColumns,
    SharedTier,
    StorageColumns,
    StorageTier,
    Tier,
)
from kvtierd.tiers.host import Arena, HostTier, SlabAllocator

__all__ = [
    "Arena",
    "HostTier",
    "MemoryTier",
    "Recovered",
    "SharedColumns",
    "SharedTier",
    "SlabAllocator",
    "StorageColumns",
    "StorageTier",
    "Tier",
]

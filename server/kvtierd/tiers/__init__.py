"""Tiers allocate and free slots and know no keys. ``HostTier``: one memfd arena carved into slots."""

from kvtierd.tiers.host import Arena, HostTier
from kvtierd.tiers.slabs import SlabAllocator

__all__ = ["Arena", "HostTier", "SlabAllocator"]

"""Host tier: one memfd arena carved into slots by size class.

Primitives (all O(1) amortized):

* ``slot_bytes_for(block_bytes)`` -> the size class (block size rounded up to ``slot_align_bytes``).
* ``alloc(slot_bytes)`` -> arena offset, or None when no slot of that class is free and no slab is.
* ``free(offset, slot_bytes)``: the slot returns to its slab; an emptied slab returns to the pool,
  so slabs move between classes: a class that starves gets the slabs that others emptied.
* ``slab_of(offset)`` / ``live_slots(slab)``: which slab a slot is in and how many of its slots
  are allocated (the cache uses them to empty exactly one slab for a starving class).

The arena is a memfd (``memfd_create``): the daemon maps it once, and same-host clients map the
same pages after receiving the fd over a Unix socket (the shm transport), so the daemon never
copies payloads on that path.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field


class Arena:
    """One memfd of ``size`` bytes mapped read-write.

    Owns the fd and the mapping; ``close()`` releases both. Thread-safety: the mapping is plain
    memory; who may write which range is decided by the index (a slot is written only while its
    entry is WRITING and read only while pinned or READY).
    """

    def __init__(self, size: int, *, prefault: bool = True, name: str = "kvtier-host") -> None:
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            if prefault:
                # Allocate the pages now: the first copy into a slot must not pay the faults.
                os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mm)

    def slot(self, offset: int, nbytes: int) -> memoryview:
        assert 0 <= offset and offset + nbytes <= self.size, (offset, nbytes)
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        self.view.release()
        try:
            self.mm.close()
        except BufferError:  # a transport still holds a slice; the fd closes anyway
            pass
        os.close(self.fd)


@dataclass(eq=False)
class _Slab:
    base: int
    slot_bytes: int = 0
    free_slots: list[int] = field(default_factory=list)
    live: int = 0


class HostTier:
    """Slot allocator over an :class:`Arena`; knows no keys.

    Owned by the TieredCache; event-loop thread only, no locks.
    """

    name = "host"

    def __init__(self, arena: Arena, *, slab_bytes: int, slot_align_bytes: int) -> None:
        assert slab_bytes % slot_align_bytes == 0
        self.arena = arena
        self.slab_bytes = slab_bytes
        self.slot_align_bytes = slot_align_bytes
        self.num_slabs = arena.size // slab_bytes
        self.capacity_bytes = self.num_slabs * slab_bytes
        self._slabs = [_Slab(base=i * slab_bytes) for i in range(self.num_slabs)]
        self._free_slabs = list(reversed(range(self.num_slabs)))
        self._partial: dict[int, dict[int, _Slab]] = {}  # slot_bytes -> slabs with a free slot
        self.used_bytes = 0  # bytes of allocated slots

    def slot_bytes_for(self, block_bytes: int) -> int:
        a = self.slot_align_bytes
        return (block_bytes + a - 1) // a * a

    def fits(self, block_bytes: int) -> bool:
        return 0 < self.slot_bytes_for(block_bytes) <= self.slab_bytes

    def alloc(self, slot_bytes: int) -> int | None:
        partial = self._partial.setdefault(slot_bytes, {})
        if not partial:
            if not self._free_slabs:
                return None
            slab = self._slabs[self._free_slabs.pop()]
            n = self.slab_bytes // slot_bytes
            slab.slot_bytes = slot_bytes
            slab.free_slots = [slab.base + i * slot_bytes for i in range(n - 1, -1, -1)]
            partial[slab.base] = slab
        base, slab = next(iter(partial.items()))
        offset = slab.free_slots.pop()
        slab.live += 1
        if not slab.free_slots:
            del partial[base]
        self.used_bytes += slot_bytes
        return offset

    def free(self, offset: int, slot_bytes: int) -> None:
        slab = self._slabs[offset // self.slab_bytes]
        assert slab.slot_bytes == slot_bytes and slab.live > 0, (offset, slot_bytes)
        slab.free_slots.append(offset)
        slab.live -= 1
        self.used_bytes -= slot_bytes
        partial = self._partial[slot_bytes]
        if slab.live == 0:
            # Whole slab empty: back to the pool so any class can take it.
            partial.pop(slab.base, None)
            slab.free_slots = []
            slab.slot_bytes = 0
            self._free_slabs.append(slab.base // self.slab_bytes)
        else:
            partial[slab.base] = slab

    def free_slabs(self) -> int:
        return len(self._free_slabs)

    def slab_of(self, offset: int) -> int:
        """Index of the slab that holds the slot at ``offset``."""
        return offset // self.slab_bytes

    def live_slots(self, slab: int) -> int:
        """Allocated slots in slab ``slab`` (0 while it is in the pool)."""
        return self._slabs[slab].live

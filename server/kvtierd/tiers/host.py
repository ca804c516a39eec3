"""Host tier: memfd arenas carved into slots by size class, and the slot allocator it does that
with (:class:`SlabAllocator`, which the NVMe tier uses over its block files too).

Allocation is the :class:`SlabAllocator`'s: one pool per arena. Arena 0 is the shared one
(``host_bytes``); a daemon with tenants adds one arena per tenant whose engines map memory (shm,
cuda_ipc), so a tenant's mapping holds only its own blocks (docs/security.md). Offsets are in
the allocator's one linear space; an arena's slots are ``[base, base + size)`` of it, and what a
client that mapped an arena sees is ``offset - base``.

The arena is a memfd (``memfd_create``): the daemon maps it once, and same-host clients map the
same pages after receiving the fd over a Unix socket (the shm transport), so the daemon never
copies payloads on that path. It is sealed against shrinking, growing and further sealing
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before any client sees it: a client's
``ftruncate`` fails with EPERM instead of turning every attached engine's next load into a
SIGBUS. ``intact()`` re-checks size and seals (the daemon's sweeper; health NOT_SERVING if not).

**SlabAllocator**: fixed-size slots carved out of slabs by size class; knows no keys.
Primitives (all O(1) amortized):

* ``slot_bytes_for(nbytes)`` -> the size class (rounded up to ``slot_align_bytes``).
* ``alloc(slot_bytes)`` -> offset, or None when no slot of that class is free and no slab is.
* ``free(offset, slot_bytes)``: the slot returns to its slab; an emptied slab returns to the pool,
  so slabs move between classes: a class that starves gets the slabs that others emptied.
* ``claim(offset, slot_bytes)``: allocate that very slot (recovery re-creating its index).
* ``slab_of(offset)`` / ``live_slots(slab)``: which slab a slot is in and how many of its slots
  are allocated (the cache uses them to empty exactly one slab for a starving class).

Offsets are in one linear space; the host tier maps it onto its arenas, the NVMe tier onto its
block files (slabs never straddle two files).

**Pools** (``add_pool(nbytes)``): the space is a sequence of pools, each a run of slabs that only
``alloc(slot_bytes, pool)`` of that pool hands out; a slab emptied returns to its own pool. The
host tier makes one pool per arena (the shared one, then one per tenant with its own arena); pools
after the first start one guard slab after the previous one ends, so two slots of different pools
are never adjacent (a run of adjacent slots is one arena's memory). ``SlabAllocator(capacity)``
makes pool 0 of that size; the NVMe tier uses only that one.

Ownership and concurrency: a SlabAllocator is owned by one tier, the HostTier by the
TieredCache; event-loop thread only, no locks (an Arena's memory: see :class:`Arena`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

from kvtierd.domain import TierId
from kvtierd.tiers.base import MemoryTier


@dataclass(eq=False)
class _Slab:
    base: int
    pool: int
    slot_bytes: int = 0
    free_slots: dict[int, None] = field(default_factory=dict)  # an ordered set: O(1) claim
    live: int = 0


class SlabAllocator:
    """Owned by one tier; event-loop thread only, no locks."""

    def __init__(self, capacity_bytes: int, *, slab_bytes: int, slot_align_bytes: int) -> None:
        assert slab_bytes % slot_align_bytes == 0
        self.slab_bytes = slab_bytes
        self.slot_align_bytes = slot_align_bytes
        self.capacity_bytes = 0
        self.used_bytes = 0  # bytes of allocated slots
        self._slabs: list[_Slab] = []  # every slab of the space, guards included
        self._free_slabs: list[list[int]] = []  # per pool
        # per pool: slot_bytes -> slabs with a free slot
        self._partial: list[dict[int, dict[int, _Slab]]] = []
        self.pool_bases: list[int] = []
        self.pool_bytes: list[int] = []
        self.pool_used: list[int] = []
        self.add_pool(capacity_bytes)

    @property
    def num_slabs(self) -> int:
        return self.capacity_bytes // self.slab_bytes

    def add_pool(self, nbytes: int) -> int:
        """A new pool of ``nbytes`` (rounded down to whole slabs) after the last one: its id."""
        pool = len(self.pool_bases)
        if pool:
            self._slabs.append(_Slab(base=len(self._slabs) * self.slab_bytes, pool=-1))  # guard
        first, n = len(self._slabs), nbytes // self.slab_bytes
        self._slabs.extend(_Slab(base=(first + i) * self.slab_bytes, pool=pool) for i in range(n))
        self._free_slabs.append(list(reversed(range(first, first + n))))
        self._partial.append({})
        self.pool_bases.append(first * self.slab_bytes)
        self.pool_bytes.append(n * self.slab_bytes)
        self.pool_used.append(0)
        self.capacity_bytes += n * self.slab_bytes
        return pool

    def pool_of(self, offset: int) -> int:
        """The pool that holds the slot at ``offset`` (-1: a guard slab, or outside the space)."""
        index = offset // self.slab_bytes
        return self._slabs[index].pool if 0 <= index < len(self._slabs) else -1

    def slot_bytes_for(self, nbytes: int) -> int:
        a = self.slot_align_bytes
        return (nbytes + a - 1) // a * a

    def fits(self, nbytes: int) -> bool:
        return 0 < self.slot_bytes_for(nbytes) <= self.slab_bytes

    def _take_slab(self, index: int, slot_bytes: int) -> _Slab:
        slab = self._slabs[index]
        n = self.slab_bytes // slot_bytes
        slab.slot_bytes = slot_bytes
        slab.free_slots = dict.fromkeys(slab.base + i * slot_bytes for i in range(n - 1, -1, -1))
        self._partial[slab.pool].setdefault(slot_bytes, {})[slab.base] = slab
        return slab

    def alloc(self, slot_bytes: int, pool: int = 0) -> int | None:
        partial = self._partial[pool].setdefault(slot_bytes, {})
        if not partial:
            if not self._free_slabs[pool]:
                return None
            self._take_slab(self._free_slabs[pool].pop(), slot_bytes)
        base, slab = next(iter(partial.items()))
        offset, _ = slab.free_slots.popitem()  # last in, first out: lowest offset first
        self._taken(slab, slot_bytes)
        return offset

    def claim(self, offset: int, slot_bytes: int) -> bool:
        """Allocate exactly the slot at ``offset``; False if it cannot be (other class, taken)."""
        index = offset // self.slab_bytes
        if (
            not 0 <= index < len(self._slabs)
            or (offset - index * self.slab_bytes) % slot_bytes
            or self._slabs[index].pool < 0
        ):
            return False
        slab = self._slabs[index]
        if slab.slot_bytes == 0:
            self._free_slabs[slab.pool].remove(index)
            self._take_slab(index, slot_bytes)
        if slab.slot_bytes != slot_bytes or offset not in slab.free_slots:
            return False
        del slab.free_slots[offset]
        self._taken(slab, slot_bytes)
        return True

    def _taken(self, slab: _Slab, slot_bytes: int) -> None:
        slab.live += 1
        if not slab.free_slots:
            del self._partial[slab.pool][slot_bytes][slab.base]
        self.used_bytes += slot_bytes
        self.pool_used[slab.pool] += slot_bytes

    def free(self, offset: int, slot_bytes: int) -> None:
        slab = self._slabs[offset // self.slab_bytes]
        assert slab.slot_bytes == slot_bytes and slab.live > 0, (offset, slot_bytes)
        slab.free_slots[offset] = None
        slab.live -= 1
        self.used_bytes -= slot_bytes
        self.pool_used[slab.pool] -= slot_bytes
        partial = self._partial[slab.pool][slot_bytes]
        if slab.live == 0:
            # Whole slab empty: back to its pool so any class can take it.
            partial.pop(slab.base, None)
            slab.free_slots = {}
            slab.slot_bytes = 0
            self._free_slabs[slab.pool].append(slab.base // self.slab_bytes)
        else:
            partial[slab.base] = slab

    def free_slabs(self, pool: int | None = None) -> int:
        """Slabs in the pool ``pool`` (every pool's: None)."""
        if pool is None:
            return sum(len(f) for f in self._free_slabs)
        return len(self._free_slabs[pool])

    def free_bytes(self, pool: int) -> int:
        """Bytes of ``pool`` not in allocated slots."""
        return self.pool_bytes[pool] - self.pool_used[pool]

    def slab_of(self, offset: int) -> int:
        """Index of the slab that holds the slot at ``offset``."""
        return offset // self.slab_bytes

    def live_slots(self, slab: int) -> int:
        """Allocated slots in slab ``slab`` (0 while it is in the pool)."""
        return self._slabs[slab].live


class Arena:
    """One memfd of ``size`` bytes mapped read-write.

    Owns the fd and the mapping; ``close()`` releases both. Thread-safety: the mapping is plain
    memory; who may write which range is decided by the index (a slot is written only while its
    entry is WRITING and read only while pinned or READY).

    Sealed against resizing (an ``ftruncate`` would fault every mapping). ``read_only``: a
    group's arena, which clients map read-only: sealed after the daemon's own mapping with
    ``F_SEAL_FUTURE_WRITE`` too, so no one can map it writable again, ``write(2)`` it or punch
    a hole in it (a read-only descriptor alone is not enough: a memfd reopened through
    ``/proc/<pid>/fd`` comes back read-write); only the daemon's mapping, made first, writes.
    """

    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # (Linux 5.1; Python 3.12)

    def __init__(
        self, size: int, *, prefault: bool = True, name: str = "kvtier-host", read_only: bool = False
    ) -> None:
        self.size = size
        self.seals = self.SEALS | (self.F_SEAL_FUTURE_WRITE if read_only else 0)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            if prefault:
                # Allocate the pages now: the first copy into a slot must not pay the faults.
                os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, self.seals)  # (after the mapping: see above)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mm)

    def intact(self) -> bool:
        """Whether the memfd still has its size and its seals (it cannot lose them; checked
        anyway: a size change would make every mapping fault)."""
        try:
            return (
                os.fstat(self.fd).st_size == self.size
                and fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & self.seals == self.seals
            )
        except OSError:
            return False

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


class HostTier(SlabAllocator, MemoryTier):
    """The host tier: slot allocator over :class:`Arena` s, one pool each; knows no keys.

    ``arena`` is arena 0 (the shared one); ``add_arena`` adds another (its pool id). Arenas live
    as long as the tier: a pool never changes hands, so a slot never moves to another arena's
    owner (nothing needs zeroing). Owned by the TieredCache; event-loop thread only, no locks.
    """

    name = "host"
    id = TierId.HOST

    def __init__(self, arena: Arena, *, slab_bytes: int, slot_align_bytes: int) -> None:
        super().__init__(arena.size, slab_bytes=slab_bytes, slot_align_bytes=slot_align_bytes)
        self.arena = arena
        self.arenas = [arena]

    def add_arena(self, arena: Arena) -> int:
        """Another arena as a pool of its own (its size a whole number of slabs): the pool id."""
        assert arena.size % self.slab_bytes == 0, arena.size
        self.arenas.append(arena)
        return self.add_pool(arena.size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        pool = self.pool_of(offset)
        return self.arenas[pool].slot(offset - self.pool_bases[pool], nbytes)

    def intact(self) -> bool:
        """Every arena still has its size and seals."""
        return all(a.intact() for a in self.arenas)

    def close(self) -> None:
        for a in self.arenas:
            a.close()

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "arenas": [
                {"capacity_bytes": n, "used_bytes": u}
                for n, u in zip(self.pool_bytes, self.pool_used, strict=True)
            ],
        }

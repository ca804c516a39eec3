"""Host tier: memfd arenas carved into slots by size class.

Allocation is the :class:`kvtierd.tiers.slabs.SlabAllocator`'s: one pool per arena. Arena 0 is
the shared one (``host_bytes``); a daemon with tenants adds one arena per tenant whose engines
map memory (shm, cuda_ipc), so a tenant's mapping holds only its own blocks
(docs/security.md). Offsets are in the allocator's one linear space; an arena's slots are
``[base, base + size)`` of it, and what a client that mapped an arena sees is ``offset - base``.

The arena is a memfd (``memfd_create``): the daemon maps it once, and same-host clients map the
same pages after receiving the fd over a Unix socket (the shm transport), so the daemon never
copies payloads on that path. It is sealed against shrinking, growing and further sealing
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before any client sees it: a client's
``ftruncate`` fails with EPERM instead of turning every attached engine's next load into a
SIGBUS. ``intact()`` re-checks size and seals (the daemon's sweeper; health NOT_SERVING if not).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

from kvtierd.domain import TierId
from kvtierd.tiers.base import MemoryTier
from kvtierd.tiers.slabs import SlabAllocator


class Arena:
    """One memfd of ``size`` bytes mapped read-write.

    Owns the fd and the mapping; ``close()`` releases both. Thread-safety: the mapping is plain
    memory; who may write which range is decided by the index (a slot is written only while its
    entry is WRITING and read only while pinned or READY).
    """

    SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

    def __init__(self, size: int, *, prefault: bool = True, name: str = "kvtier-host") -> None:
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            if prefault:
                # Allocate the pages now: the first copy into a slot must not pay the faults.
                os.posix_fallocate(self.fd, 0, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, self.SEALS)
            self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
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
                and fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & self.SEALS == self.SEALS
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

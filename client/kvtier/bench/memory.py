"""The memory a bench's buffers live in, of the kind kvtier's paths meet (issue 41).

The engine's side (put's source, get_into's destination: one batch buffer) is an
``engine_buffer``: page-aligned, as pinned memory and large torch tensors are, prefaulted, huge
pages where the kernel gives them. The daemon's side of a memcpy baseline is ``arena_memory``: a
memfd mapped shared and populated, in 4 KiB pages, blocks page-aligned, as a client maps the
daemon's arena.

Why: until issue 41 the memcpy baselines copied between two numpy arrays (each 16 bytes into a
page, anonymous, huge pages) while kvtier copied from page-aligned 4 KiB-page slots into such an
array (the bench's get_into destination, and a fresh bytearray per block for get). The
baseline never met glibc's ``rep movsb`` aliasing penalty (a destination 1-63 bytes after its
source modulo 4 KiB: a quarter of memcpy's speed below the L2 size on AMD;
kvtier.transports.shm) that the path met and worked around with a slower loop, nor the arena's
4 KiB pages. Now both copy the same bytes between the same kinds of memory, in the same state
(destination reused and prefaulted, source cold). What then separates get_into from memcpy is
kvtier's own work: the copy itself runs at 0.9-1.05x memcpy (measured without a daemon), and
each call adds its PrepareLoad and CompleteLoad (1.2-2 ms per 64 MiB batch on the 2-vCPU host)
and hashes on a second thread, which needs a free core (issue 41's report).
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from kvtier.bench.plan import Plan


def engine_buffer(nbytes: int, fill: int = 0) -> np.ndarray:
    """The engine's side: ``nbytes`` of page-aligned anonymous memory (huge pages asked for),
    every page written once."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB ones
            mm.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mm, np.uint8)  # holds the mapping
    buf.fill(fill)
    return buf


def engine_batch(plan: Plan, block: int, seed: int = 0) -> np.ndarray:
    """One batch of random bytes (``seed``: the same bytes each time) in an ``engine_buffer``."""
    buf = engine_buffer(plan.blocks_per_batch(block) * block)
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.nbytes, dtype=np.uint8)
    return buf


def arena_memory(nbytes: int, fill: int = 0x5A) -> np.ndarray:
    """The daemon's side of a memcpy: ``nbytes`` of a memfd mapped shared and populated (4 KiB
    pages, page-aligned), every page written once, as kvtier's arena is mapped by a client."""
    fd = os.memfd_create("kvtier-bench-arena")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    buf = np.frombuffer(mm, np.uint8)
    buf.fill(fill)
    return buf

"""The memory behind ``NamespaceHandle.get``: one buffer per call, returned as per-block views.

A get of ``n`` blocks takes one buffer of ``n * block_bytes`` (an anonymous, page-aligned
mapping; 2 MiB pages where transparent huge pages allow, so a fresh buffer costs a few dozen page
faults, not one per 4 KiB) and returns one writable ``memoryview`` per block, in order. A block
copied into fresh memory pays for that memory (the kernel zeroes every page it hands out:
measured 0.13-0.68x of a copy into memory already faulted in, with a new bytearray per block), so
a buffer no longer in use is kept and reused (``GetBuffers``).

Lifetime: the caller owns the views a get returns for as long as it holds any of them, or
anything made over their memory (a slice, ``numpy.frombuffer``, ``torch.frombuffer``, another
memoryview): each holds a reference to the buffer, and a buffer is reused only once nothing
does (its reference count says so). A raw address taken from a view (``ctypes``, ``data_ptr``)
holds nothing: it is valid only while a view is held. Views of one get never share memory with
another get's views that are still held.
"""

from __future__ import annotations

import mmap
import sys
import threading

KEEP = 2
"""Buffers a ``GetBuffers`` keeps for reuse (the memory a handle holds between gets: at most
``KEEP`` times its largest get)."""


def fresh(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of ``nbytes``, asked for huge pages (faulted in by its first
    copy)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # kernels without transparent huge pages
            pass
    return buf


class GetBuffers:
    """The buffers of one handle's gets. ``take(n, block_bytes)`` hands out one buffer of
    ``n * block_bytes`` as ``n`` block views: a kept buffer of that size that no view (nor any
    other export) holds any more, else a fresh one, kept in place of an unused one while fewer
    than ``KEEP`` are kept. Thread-safe: the choice is made under a lock, and a buffer handed
    out is held by its views before the lock is released, so two gets never share one."""

    def __init__(self) -> None:
        self._kept: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int, block_bytes: int) -> list[memoryview]:
        if n <= 0:
            return []
        size = n * block_bytes
        with self._lock:
            buf = self._reusable(size)
            if buf is None:
                buf = fresh(size)
                self._keep(buf)
            whole = memoryview(buf)
            views = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(n)]
            whole.release()  # the slices hold the buffer; the pool does not
        return views

    def _reusable(self, size: int) -> mmap.mmap | None:
        for i in range(len(self._kept)):
            if len(self._kept[i]) == size and _unused(self._kept, i):
                return self._kept[i]
        return None

    def _keep(self, buf: mmap.mmap) -> None:
        """Keep ``buf`` in place of a kept buffer nothing holds, or beside the others while
        fewer than ``KEEP`` are kept; else not at all (every kept one is in use)."""
        if len(self._kept) < KEEP:
            self._kept.append(buf)
            return
        for i in range(len(self._kept)):
            if _unused(self._kept, i):
                self._kept[i] = buf  # the old one is unmapped once garbage
                return

    def clear(self) -> None:
        """Forget every kept buffer (each is unmapped once nothing holds it)."""
        with self._lock:
            self._kept.clear()

    @property
    def kept(self) -> int:
        """How many buffers are kept (in use or not)."""
        return len(self._kept)


def _unused(kept: list[mmap.mmap], i: int) -> bool:
    """Whether nothing but ``kept`` holds ``kept[i]``: no view, slice or other export of its
    memory is alive (every one of them holds a reference to the mapping, CPython's reference
    count: the list's and ``getrefcount``'s argument are the 2 expected)."""
    return sys.getrefcount(kept[i]) == 2

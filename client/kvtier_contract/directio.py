"""Direct I/O helpers both halves use: aligned buffers and the O_DIRECT probe.

The daemon's NVMe tier decides with :func:`probe_direct` whether its block files use O_DIRECT;
``kvtier bench``'s raw-disk baseline decides the same way, so that the baseline does the same I/O
as the path it is held against. Blocking; no state.
"""

from __future__ import annotations

import errno
import mmap
import os


def aligned_buffer(nbytes: int, align: int = mmap.PAGESIZE) -> memoryview:
    """``nbytes`` of zeroed anonymous memory starting at a multiple of ``align`` (a power of two).

    The view keeps its mapping alive; the memory is freed when the last view on it goes.
    """
    assert nbytes > 0 and align > 0 and align & (align - 1) == 0, (nbytes, align)
    if align <= mmap.PAGESIZE:  # mmap returns page-aligned memory
        return memoryview(mmap.mmap(-1, nbytes))
    import ctypes  # only for alignments above a page

    mm = mmap.mmap(-1, nbytes + align)
    anchor = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(anchor)
    del anchor  # release the export so that the view below is the only one
    skip = -address % align
    return memoryview(mm)[skip : skip + nbytes]


def probe_direct(dir_fd: int, name: str, align: int, flags: int = 0) -> tuple[bool, str]:
    """Whether O_DIRECT works in the directory ``dir_fd``: an ``align``-byte write and read of the
    scratch file ``name`` (created, then removed) that read back the same bytes; and a note
    saying what was found. ``flags`` are added to the open (e.g. O_NOFOLLOW | O_CLOEXEC)."""
    step = "open with O_DIRECT"
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | flags, 0o600, dir_fd=dir_fd)
    except OSError as e:
        return False, f"buffered: {step} failed ({errno.errorcode.get(e.errno or 0, e)})"
    try:
        out, back = aligned_buffer(align), aligned_buffer(align)
        out[:] = bytes(range(256)) * (align // 256)
        step = f"aligned {align}-byte write"
        os.pwritev(fd, [out], 0)
        step = f"aligned {align}-byte read"
        os.preadv(fd, [back], 0)
        if back != out:
            return False, "buffered: O_DIRECT read back other bytes than written"
        return True, f"O_DIRECT: aligned {align}-byte write and read succeeded"
    except OSError as e:
        return False, f"buffered: {step} failed ({errno.errorcode.get(e.errno or 0, e)})"
    finally:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

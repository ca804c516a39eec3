"""The raw-disk baseline of ``kvtier bench nvme``: plain file I/O of the bytes the tier moves.

The bench's own code (the SDK never imports the daemon), doing the work of the path it is held
against, so that a ratio compares like with like:

* files: fresh ones beside the tier, created as the tier creates its block files (exclusive,
  ``posix_fallocate`` of the whole size, fsync of the file and of the directory), then opened
  with O_DIRECT where the filesystem takes it and buffered where it does not. Whether it does is
  found once, with the daemon's own probe (kvtier_contract.directio): an aligned write and read
  of a scratch file (``direct_io``; ``direct_io_note`` says what happened).
* bytes: one slot of the tier's slot size (a 4 KiB header region + the block) per ``pwritev`` /
  ``preadv``, at slot-aligned offsets, from page-aligned anonymous memory (mmap), random bytes.
* pattern: batch by batch, the slots of a batch on 1 thread or on a pool; every written batch
  ends with one ``fdatasync`` (the tier's group commit). A read checks the bytes it got back.

Owner: one suite run. ``write`` / ``read`` use the caller's thread or the given pool; not
re-entrant (the staging buffers are shared by every batch).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvtier_contract.directio import aligned_buffer, probe_direct

_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _fsync_path(path: Path, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RawFile:
    """One open, preallocated file of the baseline; owns its fd (``close`` it once, at the end)."""

    def __init__(self, path: Path, fd: int, direct: bool) -> None:
        self.path, self.fd, self.direct = path, fd, direct

    def pwrite(self, offset: int, view: memoryview) -> None:
        """All of ``view`` at ``offset`` (short writes continued) or OSError."""
        done = 0
        while done < view.nbytes:
            n = os.pwritev(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"write {self.path} at {offset + done}: wrote nothing")
            done += n

    def pread_into(self, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset``; the bytes read (fewer only at end of file)."""
        done = 0
        while done < view.nbytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class RawDisk:
    """Fresh files of ``slots`` slots of ``slot_bytes`` in ``directory``, written and read batch by
    batch (``per_batch`` slots), with O_DIRECT when the filesystem has it (module docstring)."""

    def __init__(
        self,
        directory: Path,
        *,
        slot_bytes: int,
        per_batch: int,
        slots: int,
        pool: ThreadPoolExecutor,
        align: int = 4096,
    ) -> None:
        assert slot_bytes % align == 0 and mmap.PAGESIZE % align == 0, (slot_bytes, align)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory, self.pool = directory, pool
        self.slot, self.per_batch, self.slots = slot_bytes, per_batch, slots
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # the daemon's own probe (kvtier_contract.directio), so both do the same I/O
            self.direct_io, self.direct_io_note = probe_direct(
                dir_fd, f".raw-probe-{os.getpid()}", align, _OPEN_FLAGS
            )
        finally:
            os.close(dir_fd)
        span = per_batch * slot_bytes
        self._src, self._dst = aligned_buffer(span), aligned_buffer(span)
        np.frombuffer(self._src, np.uint8)[:] = np.random.default_rng(7).integers(
            0, 256, span, dtype=np.uint8
        )  # random bytes: nothing below may skip zeros
        self.src = [self._src[i * slot_bytes : (i + 1) * slot_bytes] for i in range(per_batch)]
        self.dst = [self._dst[i * slot_bytes : (i + 1) * slot_bytes] for i in range(per_batch)]
        self._count = 0

    def create(self) -> RawFile:
        """A fresh file of ``slots`` slots, preallocated and synced like the tier's block files."""
        self._count += 1
        path = self.directory / f"raw-{self._count:04d}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.slots * self.slot)
            os.fsync(fd)
            _fsync_path(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        direct = self.direct_io
        try:
            fd = os.open(path, os.O_RDWR | _OPEN_FLAGS | (os.O_DIRECT if direct else 0))
        except OSError as e:
            if not (direct and e.errno in _UNSUPPORTED):
                raise
            direct = False  # this file refuses O_DIRECT although the probe file took it
            fd = os.open(path, os.O_RDWR | _OPEN_FLAGS)
        return RawFile(path, fd, direct)

    def drop(self, f: RawFile) -> None:
        f.close()
        f.path.unlink()
        _fsync_path(self.directory, os.O_RDONLY | os.O_DIRECTORY)

    def _each_batch(self, fn: Callable[[int], object], threads: int, after: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for b0 in range(0, self.slots, self.per_batch):
            idx = range(b0, min(self.slots, b0 + self.per_batch))
            if threads == 1:
                for i in idx:
                    fn(i)
            else:
                list(self.pool.map(fn, idx))
            after()
        return time.perf_counter() - t0

    def write(self, f: RawFile, threads: int) -> float:
        """Seconds to write every slot, one fdatasync per batch (group commit)."""
        slot, src, k = self.slot, self.src, self.per_batch
        return self._each_batch(lambda i: f.pwrite(i * slot, src[i % k]), threads, f.sync)

    def read(self, f: RawFile, threads: int) -> float:
        """Seconds to read every slot back; the last batch's bytes are checked."""
        slot, dst, k = self.slot, self.dst, self.per_batch

        def one(i: int) -> None:
            if f.pread_into(i * slot, dst[i % k]) != slot:
                raise RuntimeError(f"raw read: short read at slot {i}")

        took = self._each_batch(one, threads, lambda: None)
        if not np.array_equal(
            np.frombuffer(self._dst, np.uint8),  # the last batch (every
            np.frombuffer(self._src, np.uint8),
        ):  # batch wrote these bytes)
            raise AssertionError("raw read returned other bytes than were written")
        return took

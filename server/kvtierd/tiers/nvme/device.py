"""The one disk seam of the NVMe tier: every byte the tier reads or writes goes through here.

* :class:`Device` (ABC): one open, fixed-size file. ``pread_into`` / ``pwrite`` scatter/gather at
  an absolute offset (``preadv`` / ``pwritev``, looping over short transfers), ``sync``
  (``fdatasync``), ``close``; attributes ``path``, ``size``, ``direct`` (O_DIRECT in effect) and
  ``align`` (what offsets, buffer addresses and lengths must be multiples of under O_DIRECT).
* :class:`FileSystem`: one directory. Names resolve relative to its fd, no symlink is followed
  (``O_NOFOLLOW``) and only regular files are opened. ``create_file`` (exclusive, preallocated),
  ``open_file``, ``entries`` / ``listdir``, ``rename`` / ``remove`` (then fsync of the directory),
  ``read_file`` / ``write_file_atomic`` (tmp + fsync + rename + directory fsync) for metadata.
  O_DIRECT is probed once, on first use, with an aligned write and read of a scratch file;
  ``direct_io`` / ``direct_io_note`` say what was found, and files open buffered without it.
* :func:`aligned_buffer` (from :mod:`kvtier_contract.directio`): mmap-backed memory aligned for
  O_DIRECT staging.

Tests wrap this seam to inject faults: ``kvtierd.testing.faults`` (never imported by the daemon).

Errors: every ``OSError`` becomes a :class:`DiskError` (:mod:`kvtierd.tiers.nvme.errors`).

Durability: O_DIRECT bypasses the page cache, not the device cache; only a successful ``sync()``
makes writes durable. ``SyncFailed`` is sticky per Device: Linux may drop the pages of a failed
writeback and report the next fsync as a success, so after one failure every later ``sync()`` of
that Device raises too, and nothing written to it may ever be reported as persisted.

Concurrency: Devices serve a bounded I/O thread pool. Concurrent ``pread_into`` / ``pwrite`` at
distinct offsets are safe (positional syscalls, GIL released); ``sync()`` may run concurrently with
writes (it covers the writes completed before it started). ``close()`` may race them: calls in
progress finish on the open fd, which is closed when the last of them returns (never reused under
one); a call that starts after ``close()`` raises DiskIOError(EBADF). A FileSystem may be shared
between threads. Every disk system call is in this one module, so that "all disk I/O goes through
here" can be checked by reading one file.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from kvtier_contract.directio import probe_direct
from kvtierd.tiers.nvme.buffers import Buffer as Buffer
from kvtierd.tiers.nvme.buffers import WBuffer as WBuffer
from kvtierd.tiers.nvme.buffers import advance, nbytes
from kvtierd.tiers.nvme.errors import DiskError as DiskError
from kvtierd.tiers.nvme.errors import DiskFull as DiskFull
from kvtierd.tiers.nvme.errors import DiskIOError as DiskIOError
from kvtierd.tiers.nvme.errors import SyncFailed as SyncFailed
from kvtierd.tiers.nvme.errors import UnsafeFile as UnsafeFile
from kvtierd.tiers.nvme.errors import as_disk_errors
from kvtierd.tiers.nvme.errors import disk_error as disk_error

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO must not hang open()
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


class Device(ABC):
    """One open, fixed-size file (see the module docstring for the contract).

    ``path``: for messages. ``size``: bytes, fixed at open (files are preallocated). ``direct``:
    O_DIRECT in effect, so offsets, buffer addresses and lengths must be multiples of ``align``.
    ``sync_failed``: a sync failed (sticky); only a new open of the file can be trusted again.
    """

    path: str
    size: int
    direct: bool
    align: int

    @property
    def sync_failed(self) -> bool:
        return False

    @abstractmethod
    def pread_into(self, offset: int, views: Sequence[WBuffer]) -> int:
        """Fill ``views`` in order from ``offset``; returns the bytes read (fewer only at EOF)."""

    @abstractmethod
    def pwrite(self, offset: int, views: Sequence[Buffer]) -> int:
        """Write ``views`` in order at ``offset``, all of them or raise; returns the byte count."""

    @abstractmethod
    def sync(self) -> None:
        """fdatasync: on return, every write completed before the call is durable."""

    @abstractmethod
    def close(self) -> None: ...


class FileDevice(Device):
    """A Device over an open file descriptor; owns the fd (made by :class:`FileSystem`).

    The fd is counted in use by every call in progress (under ``_lock``): ``close()`` closes it at
    once when none is, else the last call to return does."""

    def __init__(self, fd: int, path: str, *, size: int, direct: bool, align: int) -> None:
        self._fd, self.path, self.size, self.direct, self.align = fd, path, size, direct, align
        self._sync_failed: str | None = None
        self._lock = threading.Lock()
        self._users = 0  # calls in progress on the fd
        self._closing = False

    @property
    def sync_failed(self) -> bool:
        return self._sync_failed is not None

    @contextmanager
    def _use(self, what: str) -> Iterator[int]:
        """The fd, kept open until the block ends; DiskIOError(EBADF) once closed."""
        with self._lock:
            if self._closing:
                raise DiskIOError(f"{what}: {self.path} is closed", err=errno.EBADF)
            self._users += 1
        try:
            yield self._fd
        finally:
            with self._lock:
                self._users -= 1
                fd = self._take_fd()
            if fd >= 0:
                os.close(fd)

    def _take_fd(self) -> int:
        """Under ``_lock``: the fd to close now (closing and no call in progress), or -1."""
        if not self._closing or self._users:
            return -1
        fd, self._fd = self._fd, -1
        return fd

    def _check(self, offset: int, views: Sequence[Buffer]) -> None:
        if self.direct:
            a = self.align
            assert offset % a == 0 and all(memoryview(v).nbytes % a == 0 for v in views), (
                f"O_DIRECT transfer not aligned to {a}: offset {offset}"
            )

    def pread_into(self, offset: int, views: Sequence[WBuffer]) -> int:
        self._check(offset, views)
        with self._use(f"read at {offset}") as fd:
            return self._pread(fd, offset, views)

    def _pread(self, fd: int, offset: int, views: Sequence[WBuffer]) -> int:
        done, pending = 0, advance(views, 0)
        while pending:
            try:
                n = os.preadv(fd, pending[:_IOV_MAX], offset + done)
            except OSError as e:
                raise disk_error(e, f"read {self.path} at {offset + done}") from e
            if n == 0:
                break  # end of file
            done += n
            pending = advance(pending, n)
        return done

    def pwrite(self, offset: int, views: Sequence[Buffer]) -> int:
        count = nbytes(views)
        self._check(offset, views)
        assert 0 <= offset and offset + count <= self.size, (self.path, offset, count, self.size)
        with self._use(f"write at {offset}") as fd:
            return self._pwrite(fd, offset, views)

    def _pwrite(self, fd: int, offset: int, views: Sequence[Buffer]) -> int:
        done, pending = 0, advance(views, 0)
        while pending:
            try:
                n = os.pwritev(fd, pending[:_IOV_MAX], offset + done)
            except OSError as e:
                raise disk_error(e, f"write {self.path} at {offset + done}") from e
            if n == 0:
                raise DiskIOError(f"write {self.path} at {offset + done}: wrote nothing", err=errno.EIO)
            done += n
            pending = advance(pending, n)
        return done

    def sync(self) -> None:
        if self._sync_failed is not None:
            raise SyncFailed(
                f"fdatasync {self.path}: an earlier sync failed ({self._sync_failed})", err=errno.EIO
            )
        with self._use("fdatasync") as fd:
            try:
                os.fdatasync(fd)
            except OSError as e:
                err = disk_error(e, f"fdatasync {self.path}", sync=True)
                self._sync_failed = str(err)
                raise err from e

    def close(self) -> None:
        with self._lock:
            self._closing = True
            fd = self._take_fd()
        if fd >= 0:
            os.close(fd)

    def fileno(self) -> int:
        return self._fd


EntryKind = Literal["file", "symlink", "dir", "other"]


@dataclass(frozen=True)
class Entry:
    """One directory entry as ``lstat`` sees it (symlinks are not followed)."""

    name: str
    kind: EntryKind
    size: int


class FileSystem:
    """One directory and the files in it; the tier's only way to touch the disk.

    Owns the directory fd. Thread-safe (the O_DIRECT probe runs once, under a lock).
    """

    def __init__(self, directory: str, *, io_align: int = 4096, create: bool = False) -> None:
        assert io_align >= 512 and io_align & (io_align - 1) == 0, io_align
        self.directory, self.io_align = directory, io_align
        with as_disk_errors(f"open directory {directory}"):
            if create:
                os.makedirs(directory, mode=0o700, exist_ok=True)
            self._dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._probe_lock = threading.Lock()
        self._direct: bool | None = None
        self.direct_io_note = "not probed yet"

    def close(self) -> None:
        fd, self._dirfd = self._dirfd, -1
        if fd >= 0:
            os.close(fd)

    def _path(self, name: str) -> str:
        assert name and "/" not in name and "\0" not in name and name not in (".", ".."), name
        return os.path.join(self.directory, name)

    # -- O_DIRECT -------------------------------------------------------------------------------

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT works here (probed on first use; reason in ``direct_io_note``)."""
        with self._probe_lock:
            if self._direct is None:
                self._direct, self.direct_io_note = self._probe_direct()
            return self._direct

    def _probe_direct(self) -> tuple[bool, str]:
        name = f".kvtier-probe-{os.getpid()}-{threading.get_ident()}"
        return probe_direct(self._dirfd, name, self.io_align, _OPEN_FLAGS)

    # -- files ----------------------------------------------------------------------------------

    def _preallocate(self, fd: int, nbytes: int) -> None:
        os.posix_fallocate(fd, 0, nbytes)

    def _unlink_quietly(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dirfd)
        except OSError:
            pass

    def create_file(self, name: str, size_bytes: int, *, direct: bool | None = None) -> Device:
        """Create ``name`` (must not exist) with ``size_bytes`` allocated, durably, and open it.

        On any failure (DiskFull when the space is not there) the partial file is removed.
        """
        assert size_bytes > 0 and size_bytes % self.io_align == 0, size_bytes
        path = self._path(name)
        with as_disk_errors(f"create {path}"):
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self._dirfd)
        try:
            with as_disk_errors(f"preallocate {size_bytes} bytes for {path}"):
                self._preallocate(fd, size_bytes)
            with as_disk_errors(f"fsync {path}", sync=True):
                os.fsync(fd)
            self.sync_dir()
        except BaseException:
            self._unlink_quietly(name)
            raise
        finally:
            os.close(fd)
        return self.open_file(name, direct=direct)

    def open_file(self, name: str, *, direct: bool | None = None, readonly: bool = False) -> Device:
        """Open an existing regular file. ``direct``: None = O_DIRECT when the probe found it
        works, True = O_DIRECT or DiskIOError, False = buffered. Symlinks raise UnsafeFile."""
        path = self._path(name)
        use_direct = self.direct_io if direct is None else direct
        if direct and not self.direct_io:
            raise DiskIOError(
                f"open {path}: O_DIRECT unsupported here ({self.direct_io_note})", err=errno.EINVAL
            )
        flags = (os.O_RDONLY if readonly else os.O_RDWR) | _OPEN_FLAGS
        try:
            fd = os.open(name, flags | (os.O_DIRECT if use_direct else 0), dir_fd=self._dirfd)
        except OSError as e:
            if not (use_direct and direct is None and e.errno in _UNSUPPORTED):
                raise disk_error(e, f"open {path}") from e
            use_direct = False  # this file refuses O_DIRECT although the probe file took it
            with as_disk_errors(f"open {path}"):
                fd = os.open(name, flags, dir_fd=self._dirfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafeFile(f"open {path}: not a regular file", err=errno.EINVAL)
        return FileDevice(fd, path, size=st.st_size, direct=use_direct, align=self.io_align)

    def read_file(self, name: str, *, max_bytes: int = 1 << 20) -> bytes | None:
        """The content of a small regular file, or None when it does not exist."""
        try:
            dev = self.open_file(name, direct=False, readonly=True)
        except DiskIOError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        try:
            if dev.size > max_bytes:
                raise DiskIOError(
                    f"read {dev.path}: {dev.size} bytes, more than {max_bytes}", err=errno.EFBIG
                )
            buf = bytearray(dev.size)
            return bytes(buf[: dev.pread_into(0, [buf])])
        finally:
            dev.close()

    def write_file_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` by ``data``: after a crash, either all of it or the previous content."""
        tmp = name + ".tmp"
        with as_disk_errors(f"create {self._path(tmp)}"):
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600, dir_fd=self._dirfd)
        dev = FileDevice(fd, self._path(tmp), size=len(data), direct=False, align=1)
        try:
            dev.pwrite(0, [data])
            dev.sync()
        except BaseException:
            self._unlink_quietly(tmp)
            raise
        finally:
            dev.close()
        self.rename(tmp, name)

    # -- directory ------------------------------------------------------------------------------

    def listdir(self) -> list[str]:
        with as_disk_errors(f"list {self.directory}"):
            return sorted(os.listdir(self._dirfd))

    def entries(self) -> list[Entry]:
        """Every entry with its kind and size, from lstat: nothing is followed."""
        out = []
        for name in self.listdir():
            try:
                with as_disk_errors(f"lstat {self._path(name)}"):
                    st = os.stat(name, dir_fd=self._dirfd, follow_symlinks=False)
            except DiskIOError as e:
                if e.errno == errno.ENOENT:
                    continue  # removed meanwhile
                raise
            m = st.st_mode
            kind: EntryKind = (
                "symlink"
                if stat.S_ISLNK(m)
                else "file"
                if stat.S_ISREG(m)
                else "dir"
                if stat.S_ISDIR(m)
                else "other"
            )
            out.append(Entry(name, kind, st.st_size))
        return out

    def sync_dir(self) -> None:
        with as_disk_errors(f"fsync directory {self.directory}", sync=True):
            os.fsync(self._dirfd)

    def rename(self, src: str, dst: str) -> None:
        """Atomically replace ``dst`` by ``src`` and make the rename durable."""
        with as_disk_errors(f"rename {self._path(src)} -> {self._path(dst)}"):
            os.rename(src, dst, src_dir_fd=self._dirfd, dst_dir_fd=self._dirfd)
        self.sync_dir()

    def remove(self, name: str) -> None:
        """Unlink ``name`` (a symlink itself, never its target) and make it durable."""
        with as_disk_errors(f"remove {self._path(name)}"):
            os.unlink(name, dir_fd=self._dirfd)
        self.sync_dir()

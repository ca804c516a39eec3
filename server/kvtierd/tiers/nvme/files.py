"""The NVMe tier's open directory: its FileSystem and one Device per block file.

Role: what a tier's startup (:mod:`kvtierd.tiers.nvme.startup`) opens and hands to the tier
(:mod:`kvtierd.tiers.nvme.tier`), which then reads, writes, syncs and reopens through it. Block
offsets are linear over all files: ``file * file_bytes + offset``.

Primitives: ``open_missing()`` (every block file not open yet, created when absent),
``reopen_unwritable()`` (the probe), ``pread`` / ``pwrite`` at a linear offset, ``sync(file)``,
``write_checkpoint(...)`` (the whole index, in the log's terms: file and offset), ``close()``.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import Device, DiskError, DiskIOError, FileSystem
from kvtierd.tiers.nvme.values import NvmeLocation

_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # block files opened read-only then


class BlockFiles:
    """Owns the FileSystem of a tier's directory, the Device of each block file (None: not open)
    and which of them are open read-only (a read-only filesystem), until ``close``.

    Concurrency: ``devices`` changes only on the thread that opens or probes (the startup, the
    cache's probe thread); the I/O threads read through ``pread``, which reads once more on the
    new Device when a probe swapped it (and closed the old one) mid-read; a closing Device waits
    for the reads in progress on it (Device contract). Everything else: one thread at a time.
    """

    def __init__(self, fs: FileSystem, *, file_bytes: int, count: int) -> None:
        self.fs = fs
        self.file_bytes = file_bytes
        self.devices: list[Device | None] = [None] * count
        self.readonly: set[int] = set()

    @property
    def writable(self) -> bool:
        """Every block file open, none of them read-only."""
        return all(d is not None for d in self.devices) and not self.readonly

    def linear(self, file: int, offset: int) -> int:
        return file * self.file_bytes + offset

    def where(self, linear: int) -> tuple[Device, int]:
        """The Device and file offset of a linear offset (DiskError: its file is not open)."""
        file, off = divmod(linear, self.file_bytes)
        dev = self.devices[file]
        if dev is None:
            raise DiskError(f"block file {file} is not available")
        return dev, off

    def pread(self, linear: int, views: list[memoryview]) -> None:
        """I/O thread: read at a linear offset (once more on a Device a probe swapped in)."""
        dev, off = self.where(linear)
        try:
            dev.pread_into(off, views)
        except DiskIOError as e:
            if e.errno != errno.EBADF or self.where(linear)[0] is dev:
                raise
            self.where(linear)[0].pread_into(off, views)

    def pwrite(self, linear: int, views: list[memoryview]) -> None:
        """I/O thread: write at a linear offset."""
        dev, off = self.where(linear)
        dev.pwrite(off, views)

    def sync(self, file: int) -> None:
        """Commit thread: the block file's data durable."""
        dev = self.devices[file]
        if dev is None:
            raise DiskError(f"block file {file} is not available")
        dev.sync()

    def open_missing(self) -> DiskError | None:
        """Open (or create) every block file not open yet; the last problem met, or None. One
        that exists but cannot be opened for writing (EROFS, EACCES, EPERM) is opened read-only
        (its blocks stay readable; a problem); any other DiskError stops here (a problem)."""
        names = set(self.fs.listdir())
        problem: DiskError | None = None
        for i in range(len(self.devices)):
            if self.devices[i] is not None:
                continue
            name = fmt.data_file_name(i)
            try:
                if name not in names:
                    self.devices[i] = self.fs.create_file(name, self.file_bytes)
                    continue
                dev, problem = self._open_existing(i, name, problem)
                if dev.size < self.file_bytes:
                    # A truncated file: writing past its end would fail (an assert in the
                    # device, not a DiskError) and leak slots; the tier stays degraded.
                    dev.close()
                    raise DiskIOError(
                        f"{dev.path}: {dev.size} bytes, expected "
                        f"{self.file_bytes} (truncated; see kvtier fsck)",
                        err=errno.EINVAL,
                    )
                self.devices[i] = dev
            except DiskError as e:
                return e
        return problem

    def _open_existing(self, i: int, name: str, problem: DiskError | None) -> tuple[Device, DiskError | None]:
        self.readonly.discard(i)
        try:
            return self.fs.open_file(name), problem
        except DiskIOError as e:
            if e.errno not in _NOT_WRITABLE:
                raise
            dev = self.fs.open_file(name, readonly=True)
            self.readonly.add(i)
            return dev, e

    def reopen_unwritable(self) -> None:
        """Reopen for writing the block files open read-only or whose sync failed; a file that
        is fine stays as it is. The new Device is swapped in before the old one is closed, and
        closing waits for the reads in progress on it (Device contract): none sees a closed fd."""
        for i, dev in enumerate(self.devices):
            if dev is None or (i not in self.readonly and not dev.sync_failed):
                continue
            self.devices[i] = self.fs.open_file(fmt.data_file_name(i))  # DiskError: stays as is
            self.readonly.discard(i)
            dev.close()

    def write_checkpoint(
        self,
        namespaces: dict[bytes, dict[str, Any]],
        blocks: Iterable[tuple[bytes, bytes, NvmeLocation]],
        *,
        journal_gen: int,
    ) -> None:
        """Blocking: the whole index as ``checkpoint.kvc``, its END naming ``journal_gen`` (the
        journal that continues after it); see :func:`kvtierd.tiers.nvme.journal.write_checkpoint`."""
        records: list[jnl.NsRecord | jnl.AddRecord] = [
            jnl.NsRecord(d, spec) for d, spec in namespaces.items()
        ]
        for digest, key, loc in blocks:
            file, off = divmod(loc.offset, self.file_bytes)
            records.append(
                jnl.AddRecord(digest, key, file, off, loc.payload_len, loc.slot_bytes, loc.checksum, loc.seq)
            )
        jnl.write_checkpoint(self.fs, records, journal_gen=journal_gen)

    def close(self) -> None:
        for dev in self.devices:
            if dev is not None:
                dev.close()
        self.devices, self.readonly = [], set()
        self.fs.close()

"""The NVMe tier's open directory, its FileSystem and one Device per block file, and the
gathered I/O on those files.

Role: what a tier's startup (:mod:`kvtierd.tiers.nvme.startup`) opens and hands to the tier
(:mod:`kvtierd.tiers.nvme.tier`), which then reads, writes, syncs and reopens through it. Block
offsets are linear over all files: ``file * file_bytes + offset``.

Primitives of :class:`BlockFiles`: ``open_missing()`` (every block file not open yet, created
when absent), ``reopen_unwritable()`` (the probe), ``pread`` / ``pwrite`` at a linear offset,
``sync(file)``, ``write_checkpoint(...)`` (the whole index, in the log's terms: file and
offset), ``close()``.

Batched block I/O (the "how" of :meth:`NvmeTier.write_many` / :meth:`NvmeTier.read_many`):
:func:`write_runs` / :func:`read_runs` turn a batch of slots into one gathered ``pwritev`` /
``preadv`` per run of slots that follow each other in one block file (through the ``pwrite`` /
``pread`` the tier passes in: a BlockFiles'), slot headers built here, and each block read then
verified on its own. They keep no state: the header buffers are the call's, the arena slots
the caller's; each runs on one of the tier's I/O threads per batch, and batches touch disjoint
slots.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable
from typing import Any

from kvtier_contract.directio import aligned_buffer
from kvtierd.tiers.base import WriteItem
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import Device, DiskError, DiskIOError, FileSystem
from kvtierd.tiers.nvme.values import NvmeLocation

_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # block files opened read-only then
ReadItem = tuple[NvmeLocation, bytes, bytes, memoryview]  # location, digest, key, arena slot
Transfer = Callable[[int, list[memoryview]], None]  # (linear offset, views): one gathered call


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


# -- gathered I/O: one call per run of adjacent slots ---------------------------------------------


def write_runs(
    items: list[WriteItem], seqs: list[int], *, io_align: int, file_bytes: int, pwrite: Transfer
) -> list[int]:
    """Headers computed here (payload checksums too, unless the item carries its block's
    digest), then one ``pwrite`` per run of adjacent slots. Returns the checksums in item order."""
    a, fb = io_align, file_bytes
    checksums = [0] * len(items)
    headers = aligned_buffer(a * len(items), a)
    order = sorted(range(len(items)), key=lambda i: items[i][0])
    run: list[memoryview] = []
    run_start = run_end = -1
    for i in order:
        offset, digest, key, view, plen, given = items[i]
        region = view[: fmt.round_up(plen, a)]
        h = fmt.new_header(digest, key, region[:plen], sequence=seqs[i], io_align=a, checksum=given)
        hdr = headers[i * a : (i + 1) * a]
        fmt.encode_header_into(h, hdr)
        checksums[i] = h.payload_checksum
        if offset != run_end or offset // fb != run_start // fb:
            if run:
                pwrite(run_start, run)
            run, run_start = [], offset
        run += [hdr, region]
        run_end = offset + fmt.slot_bytes(plen, a)
    if run:
        pwrite(run_start, run)
    return checksums


def read_runs(
    items: list[ReadItem], *, io_align: int, file_bytes: int, pread: Transfer
) -> list[Exception | None]:
    """One ``pread`` per run of adjacent slots into the arena slots, then every block verified:
    per item None or the CorruptSlot that makes it a miss."""
    a, fb = io_align, file_bytes
    headers = aligned_buffer(a * len(items), a)
    regions = [dest[: fmt.round_up(loc.payload_len, a)] for loc, _d, _k, dest in items]
    order = sorted(range(len(items)), key=lambda i: items[i][0].offset)
    run: list[memoryview] = []
    start = end = -1
    for i in order:
        loc = items[i][0]
        if loc.offset != end or loc.offset // fb != start // fb:
            if run:
                pread(start, run)
            run, start = [], loc.offset
        run += [headers[i * a : (i + 1) * a], regions[i]]
        end = loc.offset + loc.slot_bytes
    if run:
        pread(start, run)
    return [_verify(headers[i * a : (i + 1) * a], regions[i], item) for i, item in enumerate(items)]


def _verify(header: memoryview, region: memoryview, item: ReadItem) -> Exception | None:
    loc, digest, key, _dest = item
    try:
        h = fmt.decode_header(
            header, expect_digest=digest, expect_key=key, expect_payload_len=loc.payload_len
        )
        if h.sequence != loc.seq:
            raise fmt.CorruptSlot("wrong_key", f"sequence {h.sequence}, expected {loc.seq}")
        fmt.verify_payload(h, region)
    except fmt.CorruptSlot as e:
        return e
    return None

"""NvmeTier: block files in a directory, written durably, read with verification.

Knows locations, not entries: the TieredCache decides which block goes where and when; this
class moves bytes between arena slots and slots of the block files, and keeps the journal.

Lifecycle::

    tier = NvmeTier(cfg)          # nothing touched yet
    recovered = tier.open()       # format or recover the directory (blocking; at startup)
    locs = await tier.write_many(items)  # durable when it returns (group commit + journal)
    errs = await tier.read_many(items)   # each block verified: None, CorruptSlot or DiskError
    tier.release(loc, ...)        # slot free again (DEL journaled lazily)
    tier.checkpoint(entries)      # on drain: warm next start
    tier.close()

Concurrency: the allocator, counters and degraded state belong to the event-loop thread; block
I/O runs on a bounded pool of ``io_threads`` threads; every journal write and every fdatasync runs
on one commit thread, one group at a time, so a block is reported durable only after its bytes,
its header and its journal record are (a failed fsync fails the whole group, never later "ok").

Opening and recovery live in :mod:`kvtierd.tiers.nvme.startup` (a base class), the plain values
in :mod:`kvtierd.tiers.nvme.values` (re-exported here).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from kvtier_contract.directio import aligned_buffer
from kvtierd.domain import TierId
from kvtierd.lockfile import OwnerLock
from kvtierd.tiers.base import StorageColumns, StorageTier, WriteItem
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme import runs
from kvtierd.tiers.nvme.device import Device, DiskError, DiskFull, DiskIOError, FileSystem
from kvtierd.tiers.nvme.startup import NvmeStartup
from kvtierd.tiers.nvme.values import NvmeConfig, NvmeFigures, NvmeLocation
from kvtierd.tiers.slabs import SlabAllocator

__all__ = ["NvmeConfig", "NvmeFigures", "NvmeLocation", "NvmeTier"]
log = logging.getLogger("kvtierd.nvme")


class NvmeTier(NvmeStartup, StorageTier):
    """Owns the block files, the slot allocator over them, the I/O pool and the journal."""

    name = "nvme"
    id = TierId.NVME
    columns = StorageColumns(
        hits="blocks_hit_nvme",
        resident_blocks="nvme_resident_blocks",
        resident_bytes="nvme_resident_bytes",
        evictions="nvme_evictions",
        bytes_read="nvme_bytes_read",
        bytes_written="nvme_bytes_written",
    )

    def __init__(self, cfg: NvmeConfig, fs_factory: Callable[..., FileSystem] = FileSystem) -> None:
        assert cfg.file_bytes % cfg.slab_bytes == 0 and cfg.slab_bytes % cfg.io_align == 0
        self.cfg = cfg
        self.io_align = cfg.io_align
        self._fs_factory = fs_factory
        self.fs: FileSystem | None = None
        self.files: list[Device | None] = []
        nfiles = max(1, cfg.capacity_bytes // cfg.file_bytes)
        self.space = SlabAllocator(
            nfiles * cfg.file_bytes, slab_bytes=cfg.slab_bytes, slot_align_bytes=cfg.io_align
        )
        self.figures = NvmeFigures()
        self.admitting = False
        self.degraded_reason = "not open"
        self._seq = 0
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvtier-nvme-io")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-commit")
        self._tls = threading.local()
        self._journal: jnl.JournalWriter | None = None
        self._journal_gen = 0
        self._pending: list[tuple[Any, asyncio.Future[None] | None]] = []
        self._dirty_files: set[int] = set()
        self._commit_task: asyncio.Task[None] | None = None
        self._known_ns: set[bytes] = set()
        self._quarantine: set[int] = set()
        self._readonly: set[int] = set()  # block files open read-only (a read-only filesystem)
        self.owner: OwnerLock | None = None  # the directory's LOCK_NAME, from lock() to close()

    # -- startup ----------------------------------------------------------------------------------

    def slot_bytes_for(self, payload_len: int) -> int:
        return fmt.slot_bytes(payload_len, self.io_align)

    def fits(self, payload_len: int) -> bool:
        return self.slot_bytes_for(payload_len) <= self.cfg.slab_bytes

    # -- I/O ----------------------------------------------------------------------------------------

    def _linear(self, file: int, offset: int) -> int:
        return file * self.cfg.file_bytes + offset

    def _where(self, linear: int) -> tuple[Device, int]:
        file, off = divmod(linear, self.cfg.file_bytes)
        dev = self.files[file]
        if dev is None:
            raise DiskError(f"block file {file} is not available")
        return dev, off

    def _pread(self, linear: int, views: list[memoryview]) -> None:
        """I/O thread: read at a linear offset; once more on the new Device when a probe
        swapped the file's Device (and closed the old one) between looking it up and the read."""
        dev, off = self._where(linear)
        try:
            dev.pread_into(off, views)
        except DiskIOError as e:
            if e.errno != errno.EBADF or self._where(linear)[0] is dev:
                raise
            self._where(linear)[0].pread_into(off, views)

    def _header_buffer(self) -> memoryview:
        buf: memoryview | None = getattr(self._tls, "hdr", None)
        if buf is None:
            buf = self._tls.hdr = aligned_buffer(self.io_align, self.io_align)
        return buf

    def alloc(self, slot_bytes: int) -> int | None:
        return self.space.alloc(slot_bytes)

    def free(self, offset: int, slot_bytes: int) -> None:
        """A slot from ``alloc`` that was never written (a failed or abandoned flush)."""
        self.space.free(offset, slot_bytes)

    @property
    def capacity_bytes(self) -> int:  # type: ignore[override]
        return self.space.capacity_bytes

    @property
    def used_bytes(self) -> int:  # type: ignore[override]
        return self.space.used_bytes

    def stats(self) -> dict[str, Any]:
        """Tier-wide figures, named as NvmeStats' fields."""
        f = self.figures
        return {
            "directory": self.cfg.directory,
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "admitting": self.admitting,
            "degraded_reason": self.degraded_reason,
            "direct_io": f.direct_io,
            "bytes_written": f.bytes_written,
            "bytes_read": f.bytes_read,
            "checksum_failures": f.checksum_failures,
            "quarantined_slots": f.quarantined_slots,
            "commit_groups": f.commit_groups,
            "write_errors": f.write_errors,
            "recovery_seconds": f.recovery_seconds,
            "recovered_blocks": f.recovered_blocks,
            "recovery_quarantined": f.recovery_quarantined,
            "recovery_mode": f.recovery_mode,
        }

    def knows_namespace(self, digest: bytes) -> bool:
        return digest in self._known_ns

    async def register_namespace(self, digest: bytes, spec: dict[str, Any]) -> None:
        """Journal the namespace's spec once, so recovery can re-create it."""
        if digest in self._known_ns or self._journal is None:
            return
        self._known_ns.add(digest)
        try:
            await self._commit(jnl.NsRecord(digest, spec), sync_files=False)
        except DiskError:
            # Not durable: journal it again with the next block of the namespace, or recovery
            # would drop every block written after this failure for want of its namespace.
            self._known_ns.discard(digest)
            raise

    async def write_many(self, items: list[WriteItem]) -> list[NvmeLocation]:
        """``write`` for a batch: ``(offset, digest, key, arena slot, payload_len, checksum)``
        each (checksum: the block's digest, or None to compute it), slots allocated by the
        caller. One gathered ``pwritev`` per run of adjacent slots, one group
        commit for all; durable when it returns, or DiskError for the whole batch."""
        if not self.admitting:
            raise DiskError(f"nvme tier not admitting: {self.degraded_reason}")
        seqs = list(range(self._seq + 1, self._seq + 1 + len(items)))
        self._seq += len(items)
        loop = asyncio.get_running_loop()
        fb = self.cfg.file_bytes
        try:
            checksums = await loop.run_in_executor(
                self._io,
                partial(
                    runs.write_runs, items, seqs, io_align=self.io_align, file_bytes=fb, pwrite=self._pwrite
                ),
            )
            records = []
            for (offset, digest, key, _view, plen, _c), seq, checksum in zip(
                items, seqs, checksums, strict=True
            ):
                file, off = divmod(offset, fb)
                self._dirty_files.add(file)
                records.append(
                    jnl.AddRecord(digest, key, file, off, plen, self.slot_bytes_for(plen), checksum, seq)
                )
            for r in records[:-1]:
                self._pending.append((r, None))  # same group as the last one, which is awaited
            await self._commit(records[-1], sync_files=True)
        except DiskError as e:
            self.figures.write_errors += 1
            self._degrade(e)
            raise
        self.figures.writes += len(items)
        self.figures.bytes_written += sum(it[4] for it in items)
        return [
            NvmeLocation(offset, self.slot_bytes_for(plen), plen, checksum, seq)
            for (offset, _d, _k, _v, plen, _c), seq, checksum in zip(items, seqs, checksums, strict=True)
        ]

    def _pwrite(self, linear: int, views: list[memoryview]) -> None:
        """I/O thread: write at a linear offset."""
        dev, off = self._where(linear)
        dev.pwrite(off, views)

    async def read_many(
        self, items: list[tuple[NvmeLocation, bytes, bytes, memoryview]]
    ) -> list[Exception | None]:
        """Read a batch of blocks into arena slots in one executor call: one ``preadv`` per run
        of adjacent disk slots, then every block verified on its own. Per item: None (verified)
        or the CorruptSlot / DiskError that makes it a miss."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(
                self._io,
                partial(
                    runs.read_runs,
                    items,
                    io_align=self.io_align,
                    file_bytes=self.cfg.file_bytes,
                    pread=self._pread,
                ),
            )
        except DiskError as e:
            results = [e] * len(items)
        for (loc, *_), err in zip(items, results, strict=True):
            if err is None:
                self.figures.reads += 1
                self.figures.bytes_read += loc.payload_len
            elif isinstance(err, fmt.CorruptSlot):
                self.figures.checksum_failures += 1
        return results

    def digest_of(self, loc: NvmeLocation) -> int:
        """The payload checksum: the block's digest (written as given at demotion)."""
        return loc.checksum

    def release(self, loc: NvmeLocation, digest: bytes, key: bytes) -> None:
        """The slot is free again; its DEL record rides with the next commit group."""
        self.space.free(loc.offset, loc.slot_bytes)
        file, off = divmod(loc.offset, self.cfg.file_bytes)
        self._pending.append((jnl.DelRecord(digest, key, file, off), None))

    def quarantine(self, loc: NvmeLocation, digest: bytes, key: bytes) -> None:
        """A slot that failed verification: forgotten, never reused during this boot."""
        self.figures.quarantined_slots += 1
        self._quarantine.add(loc.offset)
        file, off = divmod(loc.offset, self.cfg.file_bytes)
        self._pending.append((jnl.DelRecord(digest, key, file, off), None))

    # -- group commit -----------------------------------------------------------------------------

    async def _commit(self, record: Any, *, sync_files: bool) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((record, fut))
        if self._commit_task is None or self._commit_task.done():
            self._commit_task = asyncio.get_running_loop().create_task(self._commit_loop())
        await fut

    async def _commit_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while any(f is not None for _, f in self._pending):
            batch, self._pending = self._pending, []
            files, self._dirty_files = self._dirty_files, set()
            try:
                await loop.run_in_executor(self._committer, self._sync_group, files, [r for r, _ in batch])
            except DiskError as e:
                self._degrade(e)
                for _, f in batch:
                    if f is not None and not f.done():
                        f.set_exception(e)
                continue
            self.figures.commit_groups += 1
            for _, f in batch:
                if f is not None and not f.done():
                    f.set_result(None)

    def _sync_group(self, files: Iterable[int], records: list[Any]) -> None:
        """Commit thread: data files durable first, then their journal records."""
        for i in sorted(files):
            dev = self.files[i]
            if dev is None:
                raise DiskError(f"block file {i} is not available")
            dev.sync()
        assert self._journal is not None
        for r in records:
            self._journal.append(r)
        self._journal.flush_and_sync()

    # -- health -----------------------------------------------------------------------------------

    def _degrade(self, e: DiskError) -> None:
        if self.admitting:
            log.error("nvme tier degraded, not admitting: %s", e)
        self.admitting = False
        self.degraded_reason = f"{type(e).__name__}: {e}"

    def probe(self) -> bool:
        """Blocking: try to resume admission (space back, device healthy). True if admitting."""
        if self.admitting or self.fs is None:
            return self.admitting
        try:
            self.fs.write_file_atomic("probe.tmp", bytes(self.io_align))
            self.fs.remove("probe.tmp")
            self._reopen_unwritable()
            self._open_files()
            if any(d is None for d in self.files) or self._readonly:
                return False
            if self._journal is None or self._journal.failed:
                # Never reopen a journal whose sync failed: continue in a new generation.
                self._journal_gen = max(self._journal_gen, self._journal.gen if self._journal else 0) + 1
                self._journal = jnl.JournalWriter.open(self.fs, self._journal_gen)
        except (DiskError, DiskFull, OSError) as e:
            self.degraded_reason = f"{type(e).__name__}: {e}"
            return False
        log.info("nvme tier admitting again")
        self.admitting, self.degraded_reason = True, ""
        return True

    def _reopen_unwritable(self) -> None:
        """Reopen for writing the block files open read-only or whose sync failed; a file that
        is fine stays as it is. The new Device is swapped in before the old one is closed, and
        closing waits for the reads in progress on it (Device contract): none sees a closed fd."""
        assert self.fs is not None
        for i, dev in enumerate(self.files):
            if dev is None or (i not in self._readonly and not dev.sync_failed):
                continue
            self.files[i] = self.fs.open_file(fmt.data_file_name(i))  # DiskError: stays as is
            self._readonly.discard(i)
            dev.close()

    # -- shutdown ---------------------------------------------------------------------------------

    def checkpoint(
        self, namespaces: dict[bytes, dict[str, Any]], blocks: Iterable[tuple[bytes, bytes, NvmeLocation]]
    ) -> None:
        """Blocking: write the whole index so the next start is warm, then rotate the journal."""
        if self.fs is None:
            return
        records: list[Any] = [jnl.NsRecord(d, spec) for d, spec in namespaces.items()]
        for digest, key, loc in blocks:
            file, off = divmod(loc.offset, self.cfg.file_bytes)
            records.append(
                jnl.AddRecord(digest, key, file, off, loc.payload_len, loc.slot_bytes, loc.checksum, loc.seq)
            )
        new_gen = max(self._journal_gen, self._journal.gen if self._journal else 0) + 1
        jnl.write_checkpoint(self.fs, records, journal_gen=new_gen)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        jnl.remove_journals_before(self.fs, new_gen)
        self._journal_gen = new_gen

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._committer.shutdown(wait=True)
        if self._journal is not None:
            self._journal.close()
        for dev in self.files:
            if dev is not None:
                dev.close()
        if self.fs is not None:
            self.fs.close()
        if self.owner is not None:
            self.owner.release()
            self.owner = None

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

Parts: the open directory is a :class:`~kvtierd.tiers.nvme.files.BlockFiles` (None until
open), made and recovered, with the first journal, by an
:class:`~kvtierd.tiers.nvme.startup.NvmeStartup` per ``open()`` attempt and handed over; the
commit thread is a :class:`~kvtierd.tiers.nvme.journal.GroupCommit`; the plain values live in
:mod:`kvtierd.tiers.nvme.values` (re-exported here).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from kvtierd.domain import TierId
from kvtierd.lockfile import OwnerLock
from kvtierd.tiers import SlabAllocator
from kvtierd.tiers.base import Recovered, StorageColumns, StorageTier, WriteItem
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import Device, DiskError, DiskFull, FileSystem
from kvtierd.tiers.nvme.files import BlockFiles, read_runs, write_runs
from kvtierd.tiers.nvme.startup import NvmeStartup, Opened
from kvtierd.tiers.nvme.values import NvmeConfig, NvmeFigures, NvmeLocation

__all__ = ["NvmeConfig", "NvmeFigures", "NvmeLocation", "NvmeTier"]
log = logging.getLogger("kvtierd.nvme")


class NvmeTier(StorageTier):
    """Owns the open directory (``disk``: the block files), the slot allocator over them, the
    I/O pool, the journal writer and its generation, the group commit (``_commits``, handed
    ``_sync_group`` and ``_degrade``), the degraded state and the directory's lock (``owner``);
    see the module docstring for the concurrency contract."""

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
        self.disk: BlockFiles | None = None  # the open directory, from open() to close()
        nfiles = max(1, cfg.capacity_bytes // cfg.file_bytes)
        self.space = SlabAllocator(
            nfiles * cfg.file_bytes, slab_bytes=cfg.slab_bytes, slot_align_bytes=cfg.io_align
        )
        self.figures = NvmeFigures()
        self.admitting = False
        self.degraded_reason = "not open"
        self._seq = 0
        self._io = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvtier-nvme-io")
        self._commits = jnl.GroupCommit(self._sync_group, self._degrade)
        self._journal: jnl.JournalWriter | None = None
        self._journal_gen = 0
        self._known_ns: set[bytes] = set()
        self._quarantine: set[int] = set()
        self.owner: OwnerLock | None = None  # the directory's LOCK_NAME, from lock() to close()

    @property
    def fs(self) -> FileSystem | None:
        """The open directory's FileSystem (None: not open)."""
        return self.disk.fs if self.disk is not None else None

    @property
    def files(self) -> list[Device | None]:
        """The block files' Devices (None: not open; empty: the tier is not open)."""
        return self.disk.devices if self.disk is not None else []

    # -- startup ----------------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the directory's lock (one daemon per directory), creating the directory if
        needed; nothing else is touched. InUse: another live process holds it; OSError: it
        cannot be made now (the daemon starts anyway, and ``open()`` takes it later). The
        daemon calls this first of all at start; ``open()`` calls it when not held yet."""
        if self.owner is None:
            os.makedirs(self.cfg.directory, mode=0o700, exist_ok=True)
            self.owner = OwnerLock.take(os.path.join(self.cfg.directory, fmt.LOCK_NAME))

    def open(self) -> Recovered:
        """Format the directory, or recover its index (blocking; call before serving), through
        an :class:`NvmeStartup`, whose :class:`Opened` the tier then owns.

        Two ways to fail, neither fatal to the daemon:

        * the index cannot be read (directory, metadata or log unreadable; no room for the
          metadata of a fresh directory): DiskError, and nothing stays open, so ``open()`` may
          be called again later (the cache's probe does, then restores what it finds);
        * what comes after reading it fails (a block file that cannot be created or opened for
          writing, the post-crash checkpoint, the new journal: a full or read-only filesystem):
          the tier opens degraded. The recovered copies are returned and readable (block files
          that cannot be written are opened read-only); ``probe()`` resumes admission.
        """
        self.admitting, self.degraded_reason = False, "not open"
        startup = NvmeStartup(self.cfg, self._fs_factory, self.space, self._io)
        try:
            opened = startup.run(self.lock)
        except BaseException as e:  # anything at all: back to "not open", so open() may repeat
            self._not_open(startup, e)
            raise
        finally:
            self.figures.recovery_quarantined = startup.quarantined
            if startup.direct_io is not None:
                self.figures.direct_io, self.figures.direct_io_note = startup.direct_io
        self._adopt(opened, startup)
        return opened.recovered

    def _not_open(self, startup: NvmeStartup, e: BaseException) -> None:
        """After a failed ``open()`` (the startup closed what it opened): the slots a partial
        rebuild claimed free again (a fresh allocator), the reason kept."""
        if startup.problem is not None:
            self._degrade(startup.problem)
        self.space = SlabAllocator(
            self.space.capacity_bytes, slab_bytes=self.cfg.slab_bytes, slot_align_bytes=self.cfg.io_align
        )
        if isinstance(e, DiskError):
            self.degraded_reason = f"{type(e).__name__}: {e}"

    def _adopt(self, opened: Opened, startup: NvmeStartup) -> None:
        """The end of a successful ``open()``: what the startup opened is the tier's now, with
        the recovery's figures; admission resumes unless a block file is missing or read-only
        or no journal is open (then the tier stays degraded until a probe)."""
        self.disk, self._journal, self._journal_gen = opened.files, opened.journal, opened.journal_gen
        self._seq = max(opened.log.max_slot_seq, self._seq)
        self._known_ns = set(opened.recovered.namespaces)
        if startup.problem is not None:
            self._degrade(startup.problem)
        f = self.figures
        f.recovery_seconds = startup.seconds
        f.recovered_blocks = len(opened.recovered.blocks)
        f.recovery_mode = "warm" if opened.log.stats.journal_records == 0 else "replay"
        if opened.files.writable and self._journal is not None:
            self.admitting, self.degraded_reason = True, ""

    def slot_bytes_for(self, payload_len: int) -> int:
        return fmt.slot_bytes(payload_len, self.io_align)

    def fits(self, payload_len: int) -> bool:
        return self.slot_bytes_for(payload_len) <= self.cfg.slab_bytes

    # -- I/O ----------------------------------------------------------------------------------------

    def _open_disk(self) -> BlockFiles:
        if self.disk is None:
            raise DiskError(f"nvme tier not open: {self.degraded_reason}")
        return self.disk

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
            "commit_groups": self._commits.groups,
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
            await self._commits.commit(jnl.NsRecord(digest, spec))
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
        loop, fb, pwrite = asyncio.get_running_loop(), self.cfg.file_bytes, self._open_disk().pwrite
        try:
            checksums = await loop.run_in_executor(
                self._io,
                partial(write_runs, items, seqs, io_align=self.io_align, file_bytes=fb, pwrite=pwrite),
            )
            records = []
            for (offset, digest, key, _view, plen, _c), seq, checksum in zip(
                items, seqs, checksums, strict=True
            ):
                file, off = divmod(offset, fb)
                self._commits.dirty(file)
                records.append(
                    jnl.AddRecord(digest, key, file, off, plen, self.slot_bytes_for(plen), checksum, seq)
                )
            for r in records[:-1]:
                self._commits.queue(r)  # same group as the last one, which is awaited
            await self._commits.commit(records[-1])
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
                    read_runs,
                    items,
                    io_align=self.io_align,
                    file_bytes=self.cfg.file_bytes,
                    pread=self._open_disk().pread,
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
        self._commits.queue(jnl.DelRecord(digest, key, file, off))

    def quarantine(self, loc: NvmeLocation, digest: bytes, key: bytes) -> None:
        """A slot that failed verification: forgotten, never reused during this boot."""
        self.figures.quarantined_slots += 1
        self._quarantine.add(loc.offset)
        file, off = divmod(loc.offset, self.cfg.file_bytes)
        self._commits.queue(jnl.DelRecord(digest, key, file, off))

    # -- group commit -----------------------------------------------------------------------------

    def _sync_group(self, files: Iterable[int], records: list[Any]) -> None:
        """Commit thread: data files durable first, then their journal records."""
        disk = self._open_disk()
        for i in sorted(files):
            disk.sync(i)
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
        disk = self.disk
        if self.admitting or disk is None:
            return self.admitting
        try:
            disk.fs.write_file_atomic("probe.tmp", bytes(self.io_align))
            disk.fs.remove("probe.tmp")
            disk.reopen_unwritable()
            if (problem := disk.open_missing()) is not None:
                self._degrade(problem)
            if not disk.writable:
                return False
            if self._journal is None or self._journal.failed:
                # Never reopen a journal whose sync failed: continue in a new generation.
                self._journal_gen = max(self._journal_gen, self._journal.gen if self._journal else 0) + 1
                self._journal = jnl.JournalWriter.open(disk.fs, self._journal_gen)
        except (DiskError, DiskFull, OSError) as e:
            self.degraded_reason = f"{type(e).__name__}: {e}"
            return False
        log.info("nvme tier admitting again")
        self.admitting, self.degraded_reason = True, ""
        return True

    # -- shutdown ---------------------------------------------------------------------------------

    def checkpoint(
        self, namespaces: dict[bytes, dict[str, Any]], blocks: Iterable[tuple[bytes, bytes, NvmeLocation]]
    ) -> None:
        """Blocking: write the whole index so the next start is warm, then rotate the journal."""
        disk = self.disk
        if disk is None:
            return
        new_gen = max(self._journal_gen, self._journal.gen if self._journal else 0) + 1
        disk.write_checkpoint(namespaces, blocks, journal_gen=new_gen)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        jnl.remove_journals_before(disk.fs, new_gen)
        self._journal_gen = new_gen

    def close(self) -> None:
        self._io.shutdown(wait=True)
        self._commits.close()
        if self._journal is not None:
            self._journal.close()
        if self.disk is not None:
            self.disk.close()
        if self.owner is not None:
            self.owner.release()
            self.owner = None

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

Size: over the house limit because open/recovery, batched I/O, group commit and degraded-mode
probing share the file set and the commit thread; each part is small.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier_contract.directio import aligned_buffer
from kvtierd.domain import TierId
from kvtierd.lockfile import InUse, OwnerLock
from kvtierd.progress import Progress
from kvtierd.tiers.base import Recovered, StorageColumns, StorageTier, WriteItem
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import (
    Device,
    DiskError,
    DiskFull,
    DiskIOError,
    FileSystem,
    disk_error,
)
from kvtierd.tiers.slabs import SlabAllocator

log = logging.getLogger("kvtierd.nvme")
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # block files opened read-only then


@dataclass(frozen=True, slots=True)
class NvmeLocation:
    """Where a block lives on disk; ``offset`` is linear over all files (file * file_bytes + …)."""

    offset: int
    slot_bytes: int
    payload_len: int
    checksum: int
    seq: int


@dataclass(frozen=True, kw_only=True)
class NvmeConfig:
    directory: str
    capacity_bytes: int
    io_align: int = 4096
    file_bytes: int = 1 << 30
    slab_bytes: int = 64 << 20
    io_threads: int = 4
    journal_rotate_bytes: int = 64 << 20
    progress_interval_s: float = 5.0  # recovery logs how far it got at most this often


@dataclass
class NvmeFigures:
    """Tier-wide figures (per-namespace ones live in the cache's Counters)."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    checksum_failures: int = 0
    quarantined_slots: int = 0
    commit_groups: int = 0
    write_errors: int = 0
    recovery_seconds: float = 0.0
    recovered_blocks: int = 0
    recovery_quarantined: int = 0
    recovery_mode: str = ""
    direct_io: bool = False
    direct_io_note: str = ""


class NvmeTier(StorageTier):
    """Owns the block files, the slot allocator over them, the I/O pool and the journal."""

    name = "nvme"
    id = TierId.NVME
    columns = StorageColumns(hits="blocks_hit_nvme", resident_blocks="nvme_resident_blocks",
                             resident_bytes="nvme_resident_bytes", evictions="nvme_evictions",
                             bytes_read="nvme_bytes_read", bytes_written="nvme_bytes_written")

    def __init__(self, cfg: NvmeConfig, fs_factory: Callable[..., FileSystem] = FileSystem) -> None:
        assert cfg.file_bytes % cfg.slab_bytes == 0 and cfg.slab_bytes % cfg.io_align == 0
        self.cfg = cfg
        self.io_align = cfg.io_align
        self._fs_factory = fs_factory
        self.fs: FileSystem | None = None
        self.files: list[Device | None] = []
        nfiles = max(1, cfg.capacity_bytes // cfg.file_bytes)
        self.space = SlabAllocator(nfiles * cfg.file_bytes, slab_bytes=cfg.slab_bytes,
                                   slot_align_bytes=cfg.io_align)
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

    def lock(self) -> None:
        """Take the directory's lock (one daemon per directory), creating the directory if
        needed; nothing else is touched. InUse: another live process holds it; OSError: it
        cannot be made now (the daemon starts anyway, and ``open()`` takes it later). The
        daemon calls this first of all at start; ``open()`` calls it when not held yet."""
        if self.owner is None:
            os.makedirs(self.cfg.directory, mode=0o700, exist_ok=True)
            self.owner = OwnerLock.take(os.path.join(self.cfg.directory, fmt.LOCK_NAME))

    def slot_bytes_for(self, payload_len: int) -> int:
        return fmt.slot_bytes(payload_len, self.io_align)

    def fits(self, payload_len: int) -> bool:
        return self.slot_bytes_for(payload_len) <= self.cfg.slab_bytes

    def open(self) -> Recovered:
        """Format the directory, or recover its index (blocking; call before serving).

        Two ways to fail, neither fatal to the daemon:

        * the index cannot be read (directory, metadata or log unreadable; no room for the
          metadata of a fresh directory): DiskError, and nothing stays open, so ``open()`` may
          be called again later (the cache's probe does, then restores what it finds);
        * what comes after reading it fails (a block file that cannot be created or opened for
          writing, the post-crash checkpoint, the new journal: a full or read-only filesystem):
          the tier opens degraded. The recovered copies are returned and readable (block files
          that cannot be written are opened read-only); ``probe()`` resumes admission.
        """
        t0 = time.monotonic()
        self.admitting, self.degraded_reason = False, "not open"
        self.figures.recovery_quarantined = 0
        try:
            rec = self._read_index()
            recovered = self._rebuild(rec)
            self._seq = max(rec.max_slot_seq, self._seq)
            self._journal_gen = rec.next_gen
            self._start_journal(rec, recovered)
        except BaseException as e:  # anything at all: back to "not open", so open() may repeat
            self._close_files()
            if isinstance(e, DiskError):
                self.degraded_reason = f"{type(e).__name__}: {e}"
            raise
        writable = all(d is not None for d in self.files) and not self._readonly
        self._known_ns = set(recovered.namespaces)
        f = self.figures
        f.recovery_seconds = time.monotonic() - t0
        f.recovered_blocks = len(recovered.blocks)
        f.recovery_mode = "warm" if rec.stats.journal_records == 0 else "replay"
        if writable and self._journal is not None:
            self.admitting, self.degraded_reason = True, ""
        log.info("nvme tier %s: %d blocks recovered (%s, %d quarantined) in %.3fs; direct I/O %s",
                 self.cfg.directory, f.recovered_blocks, f.recovery_mode, f.recovery_quarantined,
                 f.recovery_seconds, f.direct_io)
        return recovered

    def _start_journal(self, rec: jnl.Recovery, recovered: Recovered) -> None:
        """Compact a replayed journal into a checkpoint and open the next journal; a DiskError
        here only degrades (the journals stay: the next start, or a probe, continues them)."""
        assert self.fs is not None
        writable = all(d is not None for d in self.files) and not self._readonly
        try:
            if rec.stats.journal_records and writable:
                # After a crash: compact what was replayed into a checkpoint now, so that journals
                # do not pile up (and restarts slow down) across repeated crashes.
                self.checkpoint(recovered.namespaces, recovered.blocks)
            self._journal = jnl.JournalWriter.open(self.fs, self._journal_gen)
        except DiskError as e:
            self._degrade(e)
            log.error("nvme tier %s opened degraded (recovered blocks are served, none "
                      "admitted until a probe succeeds): %s", self.cfg.directory, e)

    def _read_index(self) -> jnl.Recovery:
        """Open the directory and its block files, read checkpoint and journals (DiskError when
        any of it cannot be read; a block file that cannot be written only degrades)."""
        cfg = self.cfg
        self.fs = fs = self._fs_factory(cfg.directory, io_align=cfg.io_align, create=True)
        try:
            self.lock()  # before anything is read or written: a late open races no one
        except InUse as e:
            raise DiskError(str(e), err=errno.EBUSY) from None
        except OSError as e:
            raise disk_error(e, f"lock {cfg.directory}") from None
        self.figures.direct_io = fs.direct_io
        self.figures.direct_io_note = getattr(fs, "direct_io_note", "")
        raw = fs.read_file(fmt.META_NAME)
        nfiles = self.space.capacity_bytes // cfg.file_bytes
        if raw is None:
            meta = fmt.StoreMeta(io_align=cfg.io_align, file_bytes=cfg.file_bytes, files=nfiles,
                                 created_ns=time.time_ns())
            fs.write_file_atomic(fmt.META_NAME, meta.encode())
        else:
            meta = fmt.StoreMeta.decode(raw)
            if (meta.io_align, meta.file_bytes) != (cfg.io_align, cfg.file_bytes):
                raise ValueError(f"disk_dir: formatted with io_align {meta.io_align} and file "
                                 f"size {meta.file_bytes}; configured {cfg.io_align} and "
                                 f"{cfg.file_bytes} (use another directory)")
        self.files = [None] * nfiles
        self._open_files()
        return jnl.recover(fs, self._progress("reading the index", "records"))

    def _progress(self, what: str, unit: str, total: int | None = None) -> Progress:
        """INFO lines on how far a recovery phase got (at most every progress_interval_s)."""
        return Progress(f"nvme tier {self.cfg.directory}: {what}", log.info, total=total,
                        unit=unit, interval_s=self.cfg.progress_interval_s)

    def _close_files(self) -> None:
        """Back to "not open" after a failed ``open()``: files, journal and directory closed,
        the slots a partial ``_rebuild`` claimed free again."""
        for dev in self.files:
            if dev is not None:
                dev.close()
        self.files, self._readonly = [], set()
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self.fs is not None:
            self.fs.close()
            self.fs = None
        self.space = SlabAllocator(self.space.capacity_bytes, slab_bytes=self.cfg.slab_bytes,
                                   slot_align_bytes=self.cfg.io_align)

    def _open_files(self) -> None:
        """Open (or create) every missing block file. One that exists but cannot be opened for
        writing (EROFS, EACCES, EPERM) is opened read-only: its blocks stay readable, the tier
        degraded (``_readonly``) until a probe reopens it for writing."""
        assert self.fs is not None
        names = set(self.fs.listdir())
        for i in range(len(self.files)):
            if self.files[i] is not None:
                continue
            name = fmt.data_file_name(i)
            try:
                if name in names:
                    dev = self._open_existing(i, name)
                    if dev.size < self.cfg.file_bytes:
                        # A truncated file: writing past its end would fail (an assert in the
                        # device, not a DiskError) and leak slots; the tier stays degraded.
                        dev.close()
                        raise DiskIOError(f"{dev.path}: {dev.size} bytes, expected "
                                          f"{self.cfg.file_bytes} (truncated; see kvtier fsck)",
                                          err=errno.EINVAL)
                    self.files[i] = dev
                else:
                    self.files[i] = self.fs.create_file(name, self.cfg.file_bytes)
            except DiskError as e:
                self._degrade(e)
                return

    def _open_existing(self, i: int, name: str) -> Device:
        assert self.fs is not None
        self._readonly.discard(i)
        try:
            return self.fs.open_file(name)
        except DiskIOError as e:
            if e.errno not in _NOT_WRITABLE:
                raise
            dev = self.fs.open_file(name, readonly=True)
            self._readonly.add(i)
            self._degrade(e)
            return dev

    def _rebuild(self, rec: Any) -> Recovered:
        """Claim the slots of recovered blocks. After a crash (journal records replayed) every
        header is validated against its record, on the I/O threads in parallel; after a clean
        stop the checkpoint is trusted (every later read verifies header and payload anyway)."""
        out = Recovered(namespaces=dict(rec.namespaces))
        candidates: list[tuple[bytes, bytes, NvmeLocation]] = []
        progress = self._progress("locating blocks", "blocks", len(rec.entries))
        for i, ((digest, key), add) in enumerate(rec.entries.items()):
            if not i & 0xFFF:
                progress.tick(i)
            loc = NvmeLocation(self._linear(add.file, add.offset), add.slot_bytes, add.payload_len,
                               add.payload_checksum, add.slot_seq)
            usable = add.file < len(self.files) and self.files[add.file] is not None
            if not usable or digest not in out.namespaces:
                log.warning("recovery: block at %d dropped: no such file or namespace", loc.offset)
                self.figures.recovery_quarantined += 1
                continue
            candidates.append((digest, key, loc))
        progress.finish(len(rec.entries))
        problems: list[str | None] = [None] * len(candidates)
        if rec.stats.journal_records:
            step = 10_000
            progress = self._progress("validating block headers", "blocks", len(candidates))
            for start in range(0, len(candidates), step):
                chunk = candidates[start : start + step]
                problems[start : start + len(chunk)] = self._io.map(self._header_problem, chunk)
                progress.tick(start + len(chunk))
            progress.finish(len(candidates))
        progress = self._progress("claiming slots", "blocks", len(candidates))
        for i, ((digest, key, loc), problem) in enumerate(zip(candidates, problems, strict=True)):
            if not i & 0xFFF:
                progress.tick(i, f"{self.figures.recovery_quarantined} dropped")
            if problem is None and not self.space.claim(loc.offset, loc.slot_bytes):
                problem = "slot overlaps another block"
            if problem is not None:
                log.warning("recovery: block at %d dropped: %s", loc.offset, problem)
                self.figures.recovery_quarantined += 1
                continue
            out.blocks.append((digest, key, loc))
        progress.finish(len(candidates), f"{self.figures.recovery_quarantined} dropped")
        return out

    def _header_problem(self, block: tuple[bytes, bytes, NvmeLocation]) -> str | None:
        digest, key, loc = block
        try:
            self._check_header(loc, digest, key)
        except (fmt.CorruptSlot, DiskError) as e:
            return str(e)
        return None

    def _check_header(self, loc: NvmeLocation, digest: bytes, key: bytes) -> None:
        hdr = self._header_buffer()
        self._pread(loc.offset, [hdr])
        h = fmt.decode_header(hdr, expect_digest=digest, expect_key=key,
                              expect_payload_len=loc.payload_len)
        if h.payload_checksum != loc.checksum or h.sequence != loc.seq:
            raise fmt.CorruptSlot("wrong_key", "header differs from the journal record")

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
            "directory": self.cfg.directory, "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes, "admitting": self.admitting,
            "degraded_reason": self.degraded_reason, "direct_io": f.direct_io,
            "bytes_written": f.bytes_written, "bytes_read": f.bytes_read,
            "checksum_failures": f.checksum_failures, "quarantined_slots": f.quarantined_slots,
            "commit_groups": f.commit_groups, "write_errors": f.write_errors,
            "recovery_seconds": f.recovery_seconds, "recovered_blocks": f.recovered_blocks,
            "recovery_quarantined": f.recovery_quarantined, "recovery_mode": f.recovery_mode,
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

    async def write_many(self, items: list[WriteItem]
                         ) -> list[NvmeLocation]:
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
            checksums = await loop.run_in_executor(self._io, self._write_runs, items, seqs)
            records = []
            for (offset, digest, key, _view, plen, _c), seq, checksum in zip(
                    items, seqs, checksums, strict=True):
                file, off = divmod(offset, fb)
                self._dirty_files.add(file)
                records.append(jnl.AddRecord(digest, key, file, off, plen,
                                             self.slot_bytes_for(plen), checksum, seq))
            for r in records[:-1]:
                self._pending.append((r, None))  # same group as the last one, which is awaited
            await self._commit(records[-1], sync_files=True)
        except DiskError as e:
            self.figures.write_errors += 1
            self._degrade(e)
            raise
        self.figures.writes += len(items)
        self.figures.bytes_written += sum(it[4] for it in items)
        return [NvmeLocation(offset, self.slot_bytes_for(plen), plen, checksum, seq)
                for (offset, _d, _k, _v, plen, _c), seq, checksum in zip(
                    items, seqs, checksums, strict=True)]

    def _write_runs(self, items: list[WriteItem],
                    seqs: list[int]) -> list[int]:
        """I/O thread: headers computed here (payload checksums too, unless the item carries its
        block's digest), then one pwritev per run of slots that follow each other in one file.
        Returns the checksums in item order."""
        a, fb = self.io_align, self.cfg.file_bytes
        checksums = [0] * len(items)
        headers = aligned_buffer(a * len(items), a)
        order = sorted(range(len(items)), key=lambda i: items[i][0])
        run: list[memoryview] = []
        run_start = run_end = -1
        for i in order:
            offset, digest, key, view, plen, given = items[i]
            region = view[: fmt.round_up(plen, a)]
            h = fmt.new_header(digest, key, region[:plen], sequence=seqs[i], io_align=a,
                               checksum=given)
            hdr = headers[i * a : (i + 1) * a]
            fmt.encode_header_into(h, hdr)
            checksums[i] = h.payload_checksum
            if offset != run_end or offset // fb != run_start // fb:
                self._flush_run(run_start, run)
                run, run_start = [], offset
            run += [hdr, region]
            run_end = offset + self.slot_bytes_for(plen)
        self._flush_run(run_start, run)
        return checksums

    def _flush_run(self, start: int, views: list[memoryview]) -> None:
        if views:
            dev, off = self._where(start)
            dev.pwrite(off, views)

    async def read_many(self, items: list[tuple[NvmeLocation, bytes, bytes, memoryview]]
                        ) -> list[Exception | None]:
        """Read a batch of blocks into arena slots in one executor call: one ``preadv`` per run
        of adjacent disk slots, then every block verified on its own. Per item: None (verified)
        or the CorruptSlot / DiskError that makes it a miss."""
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._io, self._read_runs, items)
        except DiskError as e:
            results = [e] * len(items)
        for (loc, *_), err in zip(items, results, strict=True):
            if err is None:
                self.figures.reads += 1
                self.figures.bytes_read += loc.payload_len
            elif isinstance(err, fmt.CorruptSlot):
                self.figures.checksum_failures += 1
        return results

    def _read_runs(self, items: list[tuple[NvmeLocation, bytes, bytes, memoryview]]
                   ) -> list[Exception | None]:
        a, fb = self.io_align, self.cfg.file_bytes
        headers = aligned_buffer(a * len(items), a)
        regions = [dest[: fmt.round_up(loc.payload_len, a)] for loc, _d, _k, dest in items]
        order = sorted(range(len(items)), key=lambda i: items[i][0].offset)
        run: list[memoryview] = []
        start = end = -1
        for i in order:
            loc = items[i][0]
            if loc.offset != end or loc.offset // fb != start // fb:
                if run:
                    self._pread(start, run)
                run, start = [], loc.offset
            run += [headers[i * a : (i + 1) * a], regions[i]]
            end = loc.offset + loc.slot_bytes
        if run:
            self._pread(start, run)
        results: list[Exception | None] = []
        for i, (loc, digest, key, _dest) in enumerate(items):
            try:
                h = fmt.decode_header(headers[i * a : (i + 1) * a], expect_digest=digest,
                                      expect_key=key, expect_payload_len=loc.payload_len)
                if h.sequence != loc.seq:
                    raise fmt.CorruptSlot("wrong_key", f"sequence {h.sequence}, expected {loc.seq}")
                fmt.verify_payload(h, regions[i])
                results.append(None)
            except fmt.CorruptSlot as e:
                results.append(e)
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
                await loop.run_in_executor(self._committer, self._sync_group, files,
                                           [r for r, _ in batch])
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
                self._journal_gen = max(self._journal_gen, self._journal.gen if self._journal
                                        else 0) + 1
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

    def checkpoint(self, namespaces: dict[bytes, dict[str, Any]],
                   blocks: Iterable[tuple[bytes, bytes, NvmeLocation]]) -> None:
        """Blocking: write the whole index so the next start is warm, then rotate the journal."""
        if self.fs is None:
            return
        records: list[Any] = [jnl.NsRecord(d, spec) for d, spec in namespaces.items()]
        for digest, key, loc in blocks:
            file, off = divmod(loc.offset, self.cfg.file_bytes)
            records.append(jnl.AddRecord(digest, key, file, off, loc.payload_len, loc.slot_bytes,
                                         loc.checksum, loc.seq))
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

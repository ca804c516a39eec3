"""The NVMe tier's startup: format the directory or recover its index, then reopen the block
files; also what a probe reuses to reopen files after a failure.

Role: the opening half of :class:`kvtierd.tiers.nvme.tier.NvmeTier` (a base class of it, apart
because opening and recovery are a phase of their own: read the log, locate, validate and claim
every block, start the journal). Ownership: the state is the NvmeTier's (declared below); this
class only holds its startup methods. Concurrency: blocking; ``open()`` runs at startup or on the
cache's probe thread while nothing else touches the tier; header validation fans out to the I/O
pool.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvtierd.lockfile import InUse, OwnerLock
from kvtierd.progress import Progress
from kvtierd.tiers.base import Recovered
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import Device, DiskError, DiskIOError, FileSystem, disk_error
from kvtierd.tiers.nvme.values import NvmeConfig, NvmeFigures, NvmeLocation
from kvtierd.tiers.slabs import SlabAllocator

log = logging.getLogger("kvtierd.nvme")
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)  # block files opened read-only then


class NvmeStartup:
    """Opening and recovery of an NvmeTier's directory (see the module docstring)."""

    cfg: NvmeConfig
    io_align: int
    fs: FileSystem | None
    files: list[Device | None]
    space: SlabAllocator
    figures: NvmeFigures
    admitting: bool
    degraded_reason: str
    owner: OwnerLock | None
    _fs_factory: Callable[..., FileSystem]
    _seq: int
    _io: ThreadPoolExecutor
    _tls: threading.local
    _journal: jnl.JournalWriter | None
    _journal_gen: int
    _known_ns: set[bytes]
    _readonly: set[int]

    if TYPE_CHECKING:  # NvmeTier's, used here

        def checkpoint(
            self, namespaces: dict[bytes, dict[str, Any]], blocks: Iterable[tuple[bytes, bytes, NvmeLocation]]
        ) -> None: ...
        def _degrade(self, e: DiskError) -> None: ...
        def _linear(self, file: int, offset: int) -> int: ...
        def _pread(self, linear: int, views: list[memoryview]) -> None: ...
        def _header_buffer(self) -> memoryview: ...

    def lock(self) -> None:
        """Take the directory's lock (one daemon per directory), creating the directory if
        needed; nothing else is touched. InUse: another live process holds it; OSError: it
        cannot be made now (the daemon starts anyway, and ``open()`` takes it later). The
        daemon calls this first of all at start; ``open()`` calls it when not held yet."""
        if self.owner is None:
            os.makedirs(self.cfg.directory, mode=0o700, exist_ok=True)
            self.owner = OwnerLock.take(os.path.join(self.cfg.directory, fmt.LOCK_NAME))

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
        self._opened(rec, recovered, t0)
        return recovered

    def _opened(self, rec: jnl.Recovery, recovered: Recovered, t0: float) -> None:
        """The end of a successful ``open()`` (started at monotonic ``t0``): the recovery's
        figures and log line; admission resumes unless a block file is missing or read-only or
        no journal is open (then the tier stays degraded until a probe)."""
        writable = all(d is not None for d in self.files) and not self._readonly
        self._known_ns = set(recovered.namespaces)
        f = self.figures
        f.recovery_seconds = time.monotonic() - t0
        f.recovered_blocks = len(recovered.blocks)
        f.recovery_mode = "warm" if rec.stats.journal_records == 0 else "replay"
        if writable and self._journal is not None:
            self.admitting, self.degraded_reason = True, ""
        log.info(
            "nvme tier %s: %d blocks recovered (%s, %d quarantined) in %.3fs; direct I/O %s",
            self.cfg.directory,
            f.recovered_blocks,
            f.recovery_mode,
            f.recovery_quarantined,
            f.recovery_seconds,
            f.direct_io,
        )

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
            log.error(
                "nvme tier %s opened degraded (recovered blocks are served, none "
                "admitted until a probe succeeds): %s",
                self.cfg.directory,
                e,
            )

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
            meta = fmt.StoreMeta(
                io_align=cfg.io_align, file_bytes=cfg.file_bytes, files=nfiles, created_ns=time.time_ns()
            )
            fs.write_file_atomic(fmt.META_NAME, meta.encode())
        else:
            meta = fmt.StoreMeta.decode(raw)
            if (meta.io_align, meta.file_bytes) != (cfg.io_align, cfg.file_bytes):
                raise ValueError(
                    f"disk_dir: formatted with io_align {meta.io_align} and file "
                    f"size {meta.file_bytes}; configured {cfg.io_align} and "
                    f"{cfg.file_bytes} (use another directory)"
                )
        self.files = [None] * nfiles
        self._open_files()
        return jnl.recover(fs, self._progress("reading the index", "records"))

    def _progress(self, what: str, unit: str, total: int | None = None) -> Progress:
        """INFO lines on how far a recovery phase got (at most every progress_interval_s)."""
        return Progress(
            f"nvme tier {self.cfg.directory}: {what}",
            log.info,
            total=total,
            unit=unit,
            interval_s=self.cfg.progress_interval_s,
        )

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
        self.space = SlabAllocator(
            self.space.capacity_bytes, slab_bytes=self.cfg.slab_bytes, slot_align_bytes=self.cfg.io_align
        )

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
                        raise DiskIOError(
                            f"{dev.path}: {dev.size} bytes, expected "
                            f"{self.cfg.file_bytes} (truncated; see kvtier fsck)",
                            err=errno.EINVAL,
                        )
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

    def _rebuild(self, rec: jnl.Recovery) -> Recovered:
        """Claim the slots of recovered blocks. After a crash (journal records replayed) every
        header is validated against its record, on the I/O threads in parallel; after a clean
        stop the checkpoint is trusted (every later read verifies header and payload anyway)."""
        out = Recovered(namespaces=dict(rec.namespaces))
        candidates = self._locate(rec, out.namespaces)
        problems: list[str | None] = [None] * len(candidates)
        if rec.stats.journal_records:
            problems = self._validate(candidates)
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

    def _locate(
        self, rec: jnl.Recovery, namespaces: dict[bytes, dict[str, Any]]
    ) -> list[tuple[bytes, bytes, NvmeLocation]]:
        """The recovered blocks whose file is open and whose namespace is known."""
        candidates: list[tuple[bytes, bytes, NvmeLocation]] = []
        progress = self._progress("locating blocks", "blocks", len(rec.entries))
        for i, ((digest, key), add) in enumerate(rec.entries.items()):
            if not i & 0xFFF:
                progress.tick(i)
            loc = NvmeLocation(
                self._linear(add.file, add.offset),
                add.slot_bytes,
                add.payload_len,
                add.payload_checksum,
                add.slot_seq,
            )
            usable = add.file < len(self.files) and self.files[add.file] is not None
            if not usable or digest not in namespaces:
                log.warning("recovery: block at %d dropped: no such file or namespace", loc.offset)
                self.figures.recovery_quarantined += 1
                continue
            candidates.append((digest, key, loc))
        progress.finish(len(rec.entries))
        return candidates

    def _validate(self, candidates: list[tuple[bytes, bytes, NvmeLocation]]) -> list[str | None]:
        """Each candidate's header read and checked against its record, on the I/O threads."""
        problems: list[str | None] = [None] * len(candidates)
        step = 10_000
        progress = self._progress("validating block headers", "blocks", len(candidates))
        for start in range(0, len(candidates), step):
            chunk = candidates[start : start + step]
            problems[start : start + len(chunk)] = self._io.map(self._header_problem, chunk)
            progress.tick(start + len(chunk))
        progress.finish(len(candidates))
        return problems

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
        h = fmt.decode_header(hdr, expect_digest=digest, expect_key=key, expect_payload_len=loc.payload_len)
        if h.payload_checksum != loc.checksum or h.sequence != loc.seq:
            raise fmt.CorruptSlot("wrong_key", "header differs from the journal record")

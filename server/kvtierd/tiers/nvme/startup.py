"""The NVMe tier's startup: format the directory or recover its index, open the block files,
claim the slots of the blocks recovered and start the next journal.

Role: :class:`NvmeStartup` is one opening of an :class:`~kvtierd.tiers.nvme.tier.NvmeTier`'s
directory, a phase of its own (read the log, locate, validate and claim every block, compact a
replayed log, open the journal); what it opens it hands to the tier as an :class:`Opened`,
which the tier then owns. ``NvmeTier.open()`` makes one per attempt: a failed one closes what
it opened and may be repeated.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier_contract.directio import aligned_buffer
from kvtierd.lockfile import InUse
from kvtierd.progress import Progress
from kvtierd.tiers import SlabAllocator
from kvtierd.tiers.base import Recovered
from kvtierd.tiers.nvme import format as fmt
from kvtierd.tiers.nvme import journal as jnl
from kvtierd.tiers.nvme.device import DiskError, FileSystem, disk_error
from kvtierd.tiers.nvme.files import BlockFiles
from kvtierd.tiers.nvme.values import NvmeConfig, NvmeLocation

log = logging.getLogger("kvtierd.nvme")


@dataclass(frozen=True)
class Opened:
    """What a startup hands to its tier: the open block files, the next journal (None: it could
    not be opened, the tier stays degraded) and its generation, the log as read (``log``: the
    slot sequence to continue from, whether records were replayed) and the blocks recovered,
    their slots claimed in the tier's allocator."""

    files: BlockFiles
    journal: jnl.JournalWriter | None
    journal_gen: int
    log: jnl.Recovery
    recovered: Recovered


class NvmeStartup:
    """One opening of a tier's directory (see the module docstring).

    Owns the :class:`BlockFiles` it opens until ``run`` hands them over (closed again when it
    fails), the per-thread header buffers of the validation, and what it learns on the way:
    ``problem`` (the last DiskError that leaves the tier degraded, or None), ``quarantined``
    (blocks dropped), ``direct_io`` (the filesystem's, once opened). Handed: the tier's slot
    allocator (it claims the recovered blocks' slots there; after a failure the tier starts a
    fresh one) and the tier's I/O pool. Concurrency: blocking, one thread (startup, or the
    cache's probe thread while nothing else touches the tier); header validation fans out to
    the I/O pool.
    """

    def __init__(
        self,
        cfg: NvmeConfig,
        fs_factory: Callable[..., FileSystem],
        space: SlabAllocator,
        io: ThreadPoolExecutor,
    ) -> None:
        self.cfg = cfg
        self.space = space
        self._fs_factory = fs_factory
        self._io = io
        self._tls = threading.local()
        self.files: BlockFiles | None = None
        self.problem: DiskError | None = None
        self.quarantined = 0
        self.seconds = 0.0  # how long a successful run took
        self.direct_io: tuple[bool, str] | None = None  # (direct I/O, why not), once fs is open

    def run(self, lock: Callable[[], None]) -> Opened:
        """Open the directory (``lock``: the tier takes its lock, after the FileSystem is made
        and before anything is read or written), read its index, claim the recovered blocks,
        start the journal. DiskError: the index cannot be read; anything raised leaves nothing
        open. Logs what was recovered."""
        t0 = time.monotonic()
        try:
            rec = self._read_index(lock)
            recovered = self._rebuild(rec)
            assert self.files is not None
            journal, gen = self._start_journal(self.files, rec, recovered)
        except BaseException:
            if self.files is not None:
                self.files.close()
                self.files = None
            raise
        self.seconds = time.monotonic() - t0
        log.info(
            "nvme tier %s: %d blocks recovered (%s, %d quarantined) in %.3fs; direct I/O %s",
            self.cfg.directory,
            len(recovered.blocks),
            "warm" if rec.stats.journal_records == 0 else "replay",
            self.quarantined,
            self.seconds,
            self.direct_io is not None and self.direct_io[0],
        )
        return Opened(self.files, journal, gen, rec, recovered)

    def _start_journal(
        self, files: BlockFiles, rec: jnl.Recovery, recovered: Recovered
    ) -> tuple[jnl.JournalWriter | None, int]:
        """Compact a replayed journal into a checkpoint and open the next journal: (it, its
        generation). A DiskError here only degrades (the journals stay: the next start, or a
        probe, continues them)."""
        gen = rec.next_gen
        try:
            if rec.stats.journal_records and files.writable:
                # After a crash: compact what was replayed into a checkpoint now, so that journals
                # do not pile up (and restarts slow down) across repeated crashes.
                files.write_checkpoint(recovered.namespaces, recovered.blocks, journal_gen=gen + 1)
                jnl.remove_journals_before(files.fs, gen + 1)
                gen += 1
            return jnl.JournalWriter.open(files.fs, gen), gen
        except DiskError as e:
            self.problem = e
            log.error(
                "nvme tier %s opened degraded (recovered blocks are served, none "
                "admitted until a probe succeeds): %s",
                self.cfg.directory,
                e,
            )
            return None, gen

    def _read_index(self, lock: Callable[[], None]) -> jnl.Recovery:
        """Open the directory and its block files, read checkpoint and journals (DiskError when
        any of it cannot be read; a block file that cannot be written only degrades)."""
        cfg = self.cfg
        fs = self._fs_factory(cfg.directory, io_align=cfg.io_align, create=True)
        nfiles = self.space.capacity_bytes // cfg.file_bytes
        self.files = BlockFiles(fs, file_bytes=cfg.file_bytes, count=nfiles)
        try:
            lock()  # before anything is read or written: a late open races no one
        except InUse as e:
            raise DiskError(str(e), err=errno.EBUSY) from None
        except OSError as e:
            raise disk_error(e, f"lock {cfg.directory}") from None
        self.direct_io = (fs.direct_io, getattr(fs, "direct_io_note", ""))
        raw = fs.read_file(fmt.META_NAME)
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
        self.problem = self.files.open_missing() or self.problem
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
                progress.tick(i, f"{self.quarantined} dropped")
            if problem is None and not self.space.claim(loc.offset, loc.slot_bytes):
                problem = "slot overlaps another block"
            if problem is not None:
                log.warning("recovery: block at %d dropped: %s", loc.offset, problem)
                self.quarantined += 1
                continue
            out.blocks.append((digest, key, loc))
        progress.finish(len(candidates), f"{self.quarantined} dropped")
        return out

    def _locate(
        self, rec: jnl.Recovery, namespaces: dict[bytes, dict[str, Any]]
    ) -> list[tuple[bytes, bytes, NvmeLocation]]:
        """The recovered blocks whose file is open and whose namespace is known."""
        files = self.files
        assert files is not None
        candidates: list[tuple[bytes, bytes, NvmeLocation]] = []
        progress = self._progress("locating blocks", "blocks", len(rec.entries))
        for i, ((digest, key), add) in enumerate(rec.entries.items()):
            if not i & 0xFFF:
                progress.tick(i)
            loc = NvmeLocation(
                files.linear(add.file, add.offset),
                add.slot_bytes,
                add.payload_len,
                add.payload_checksum,
                add.slot_seq,
            )
            usable = add.file < len(files.devices) and files.devices[add.file] is not None
            if not usable or digest not in namespaces:
                log.warning("recovery: block at %d dropped: no such file or namespace", loc.offset)
                self.quarantined += 1
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
        """I/O thread: the slot's header read into this thread's buffer and checked."""
        assert self.files is not None
        hdr: memoryview | None = getattr(self._tls, "hdr", None)
        if hdr is None:
            hdr = self._tls.hdr = aligned_buffer(self.cfg.io_align, self.cfg.io_align)
        self.files.pread(loc.offset, [hdr])
        h = fmt.decode_header(hdr, expect_digest=digest, expect_key=key, expect_payload_len=loc.payload_len)
        if h.payload_checksum != loc.checksum or h.sequence != loc.seq:
            raise fmt.CorruptSlot("wrong_key", "header differs from the journal record")

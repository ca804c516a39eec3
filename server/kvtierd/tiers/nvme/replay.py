"""Recovery of the NVMe tier's index log: the checkpoint (if valid), then the later journals
replayed in generation order, each up to its first torn or corrupt record.

Role: the read side of :mod:`kvtierd.tiers.nvme.journal` (which re-exports :func:`recover`,
:class:`Recovery` and :class:`RecoveryStats`). Ownership: a recovery owns the state it builds and
returns it; the files stay the FileSystem's. Concurrency: startup only, one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.progress import Progress
from kvtierd.tiers.nvme.device import FileSystem
from kvtierd.tiers.nvme.records import (
    CHECKPOINT_NAME,
    MAX_LOG_FILE_BYTES,
    AddRecord,
    DelRecord,
    FrameScan,
    NsRecord,
    Record,
    parse_journal_name,
    scan_frames,
)


@dataclass(frozen=True)
class RecoveryStats:
    """What recovery read. ``torn_tail_bytes``: ignored bytes after the first torn or corrupt
    record of each journal, summed (the zero tail of a preallocated file is not counted).
    ``ignored_checkpoint``: a checkpoint.kvc was there but invalid. ``problems``: lines to log."""

    checkpoint_records: int  # NS + ADD records of the checkpoint used (0: none or ignored)
    journal_records: int  # records replayed from journals
    torn_tail_bytes: int
    ignored_checkpoint: bool
    journals: int  # journal files replayed
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recovery:
    """The index as the log describes it; the caller validates every entry's slot header.
    ``next_gen``: for the new JournalWriter, above every journal name present. ``max_slot_seq``:
    the highest slot_seq of any ADD read (new slot sequences continue above it)."""

    namespaces: dict[bytes, dict[str, Any]]
    entries: dict[tuple[bytes, bytes], AddRecord]
    next_gen: int
    max_slot_seq: int
    stats: RecoveryStats


class _Replay:
    """Applies records in order; ``by_location`` is the key each slot holds (for slot reuse)."""

    def __init__(self) -> None:
        self.namespaces: dict[bytes, dict[str, Any]] = {}
        self.entries: dict[tuple[bytes, bytes], AddRecord] = {}
        self.by_location: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self.max_slot_seq = 0

    def apply(self, records: list[Record]) -> None:
        entries, by_location = self.entries, self.by_location
        for rec in records:
            if type(rec) is AddRecord:
                k, loc = (rec.digest, rec.key), (rec.file, rec.offset)
                if (old := entries.get(k)) is not None:
                    del by_location[old.file, old.offset]
                if (other := by_location.get(loc)) is not None:
                    del entries[other]  # the slot was reused: its previous key is gone
                entries[k], by_location[loc] = rec, k
                self.max_slot_seq = max(self.max_slot_seq, rec.slot_seq)
            elif isinstance(rec, DelRecord):
                k, loc = (rec.digest, rec.key), (rec.file, rec.offset)
                if (old := entries.get(k)) is not None and (old.file, old.offset) == loc:
                    del entries[k], by_location[loc]
            elif isinstance(rec, NsRecord):
                self.namespaces[rec.digest] = rec.spec


def recover(fs: FileSystem, progress: Progress | None = None, *, tick_every: int = 1 << 16) -> Recovery:
    """Read ``checkpoint.kvc`` (if present and valid), then replay the journals of generation >=
    its journal_gen (all of them without one) in generation order, each up to its first torn or
    corrupt record. Raises DiskError when a file cannot be read. Startup only, one thread.
    ``progress`` hears the records read so far, within a file every ``tick_every`` records."""
    names = {e.name: e.kind for e in fs.entries()}
    state, reader = _Replay(), _Reader(fs, progress, tick_every)
    ckpt_records, ckpt_gen, ignored = reader.checkpoint(state, names)
    journals = sorted((g, name) for name in names if (g := parse_journal_name(name)) is not None)
    replayed, journal_records, torn = 0, 0, 0
    for g, name in journals:
        if g < ckpt_gen or names[name] != "file":
            continue  # superseded by the checkpoint; or not a regular file: fsck reports it
        scan = reader.journal(state, name)
        replayed, journal_records = replayed + 1, journal_records + len(scan.records)
        torn += scan.torn_bytes
    if progress is not None:
        progress.finish(
            reader.read,
            f"{ckpt_records} from the checkpoint, {journal_records} replayed from {replayed} journal(s)",
        )
    stats = RecoveryStats(ckpt_records, journal_records, torn, ignored, replayed, tuple(reader.problems))
    next_gen = max([1, ckpt_gen] + [g + 1 for g, _ in journals])
    return Recovery(state.namespaces, state.entries, next_gen, state.max_slot_seq, stats)


class _Reader:
    """One recovery's reading of the log files: the records read so far (for progress) and the
    problems to log. Owned by one ``recover`` call; one thread."""

    def __init__(self, fs: FileSystem, progress: Progress | None, tick_every: int) -> None:
        self.fs, self.progress, self.tick_every = fs, progress, tick_every
        self.read = 0  # records of the files read before the current one
        self.problems: list[str] = []

    def ticker(self, name: str) -> Callable[[int], None] | None:
        progress = self.progress
        if progress is None:
            return None
        return lambda n: progress.tick(self.read + n, f"reading {name}")

    def _done(self, scan: FrameScan, what: str) -> None:
        self.read += len(scan.records)
        if self.progress is not None:
            self.progress.tick(self.read, what)

    def checkpoint(self, state: _Replay, names: Mapping[str, str]) -> tuple[int, int, bool]:
        """Apply the checkpoint when valid: (its records, the journal_gen its END names, whether
        one was there but ignored)."""
        if CHECKPOINT_NAME not in names:
            return 0, 0, False
        problem, scan = _read_checkpoint(
            self.fs, names[CHECKPOINT_NAME], self.ticker(CHECKPOINT_NAME), self.tick_every
        )
        self._done(scan, f"{CHECKPOINT_NAME} read")
        if problem is None and scan.end_record is not None:
            state.apply(scan.records)
            return len(scan.records), scan.end_record[1], False
        self.problems.append(f"{CHECKPOINT_NAME} ignored: {problem}")
        return 0, 0, True

    def journal(self, state: _Replay, name: str) -> FrameScan:
        """Replay one journal file up to its first torn or corrupt record."""
        scan = scan_frames(
            self.fs.read_file(name, max_bytes=MAX_LOG_FILE_BYTES) or b"",
            checkpoint=False,
            tick=self.ticker(name),
            tick_every=self.tick_every,
        )
        state.apply(scan.records)
        self._done(scan, f"{name} replayed")
        if scan.problem:
            self.problems.append(f"{name}: replay stopped, {scan.problem}; {scan.torn_bytes} bytes ignored")
        return scan


def _read_checkpoint(
    fs: FileSystem, kind: str, tick: Callable[[int], None] | None = None, tick_every: int = 1 << 16
) -> tuple[str | None, FrameScan]:
    """(why the checkpoint must be ignored or None, what it holds)."""
    if kind != "file":
        return f"a {kind}, not a regular file", FrameScan()
    scan = scan_frames(
        fs.read_file(CHECKPOINT_NAME, max_bytes=MAX_LOG_FILE_BYTES) or b"",
        checkpoint=True,
        tick=tick,
        tick_every=tick_every,
    )
    if scan.end_record is None:
        return f"no END record ({scan.problem or 'ends early'})", scan
    if scan.end_record[0] != len(scan.records):
        return f"END counts {scan.end_record[0]} records, {len(scan.records)} found", scan
    if scan.torn_bytes:
        return f"{scan.torn_bytes} non-zero bytes after END", scan
    return None, scan

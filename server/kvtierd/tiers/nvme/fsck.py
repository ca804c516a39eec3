"""Offline check of an NVMe tier directory (``kvtierd fsck DIR``): read-only, follows no symlink.

``fsck(directory)`` reads ``kvtier.meta``, then walks every data file slot by slot: at each
io_align boundary it decodes a header region; a valid header whose payload verifies is a valid slot
and the walk jumps over it; anything else advances one io_align block. Classification per block:

* valid slot: header and payload checksums match (counted with its payload bytes);
* empty: an all-zero header region (never written);
* unrecognized: non-zero bytes without the magic: stale payload of a reused slot, normal after
  slots are freed and reallocated (a header whose magic itself was destroyed looks the same);
* superseded: a valid header whose payload fails, overlapped by a valid slot with a higher sequence
  (an older copy partly overwritten by a newer slot: normal);
* corrupt: any other header that carries the magic but fails validation (a problem).

The directory level reports missing, zero-length, truncated and oversized data files, foreign files,
leftover temporary files, symlinks and non-regular entries (reported, never opened). The walk reads
with buffered I/O (no O_DIRECT probe: fsck writes nothing). ``main(argv)`` returns 0 when clean,
1 when problems were found, 2 when the directory is unusable (missing, no or bad meta file), 3
when a live daemon holds the directory (``kvtier.lock``: its files change under the walk, so the
verdict would mean nothing; stop the daemon first). fsck holds a shared lock for the walk, so a
daemon does not start on the directory meanwhile. With a :class:`~kvtierd.progress.Progress`,
the walk reports how far it got (bytes and slots checked, rate): ``main`` prints it on stderr.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier_contract.units import format_bytes
from kvtierd.lockfile import InUse, shared
from kvtierd.progress import Progress
from kvtierd.tiers.nvme.device import Device, DiskError, Entry, FileSystem
from kvtierd.tiers.nvme.format import (
    LOCK_NAME,
    META_NAME,
    PREFIXES_NAME,
    CorruptMeta,
    CorruptSlot,
    SlotHeader,
    StoreMeta,
    data_file_name,
    decode_header,
    parse_data_file_name,
    round_up,
    verify_payload,
)
from kvtierd.tiers.nvme.journal import CHECKPOINT_NAME, parse_journal_name


@dataclass(frozen=True)
class Problem:
    """One finding: ``name`` is the entry in the directory, ``offset`` the slot's file offset."""

    name: str
    kind: str  # corrupt_slot, missing_file, zero_length, truncated, oversized, foreign_file,
    #            stale_temp, symlink, not_regular, unreadable
    detail: str
    offset: int | None = None


@dataclass
class FileSummary:
    """Counts for one data file; empty / unrecognized are in io_align blocks, the rest in slots."""

    name: str
    size: int
    valid: int = 0
    payload_bytes: int = 0
    empty: int = 0
    unrecognized: int = 0
    superseded: int = 0
    corrupt: int = 0


@dataclass
class FsckReport:
    directory: str
    meta: StoreMeta | None = None
    unusable: str | None = None  # why the directory cannot be checked at all
    files: list[FileSummary] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    checked_bytes: int = 0  # of the data files walked so far

    @property
    def clean(self) -> bool:
        return self.unusable is None and not self.problems

    def total(self, counter: str) -> int:
        """Sum of one FileSummary counter ("valid", "corrupt", ...) over the data files."""
        return sum(int(getattr(f, counter)) for f in self.files)


def fsck(directory: str, progress: Progress | None = None) -> FsckReport:
    """Check ``directory``; InUse when a live daemon holds it (nothing is read then).
    ``progress`` (its total and unit are set here: bytes of data files) hears how far it got."""
    with shared(os.path.join(directory, LOCK_NAME)):
        return _fsck(directory, progress)


def _fsck(directory: str, progress: Progress | None) -> FsckReport:
    report = FsckReport(directory)
    try:
        fs = FileSystem(directory)
    except DiskError as e:
        report.unusable = str(e)
        return report
    try:
        _check_directory(fs, report, progress)
    finally:
        fs.close()
    if progress is not None:
        progress.finish(report.checked_bytes, _counts(report))
    report.problems.sort(key=lambda p: (p.name, -1 if p.offset is None else p.offset))
    return report


def _counts(report: FsckReport) -> str:
    return (
        f"{report.total('valid')} valid slot(s), {report.total('corrupt')} corrupt, "
        f"{len(report.problems)} problem(s)"
    )


def _check_directory(fs: FileSystem, report: FsckReport, progress: Progress | None) -> None:
    try:
        raw = fs.read_file(META_NAME)
        if raw is None:
            report.unusable = f"no {META_NAME}: not a kvtier NVMe directory (or never formatted)"
            return
        meta = report.meta = StoreMeta.decode(raw)
        entries = {e.name: e for e in fs.entries()}
    except (DiskError, CorruptMeta) as err:
        report.unusable = str(err)
        return
    for entry in entries.values():
        _check_entry(entry, meta, report)
    data = [entries.get(data_file_name(index)) for index in range(meta.files)]
    if progress is not None:
        progress.total, progress.unit = sum(e.size for e in data if e and e.kind == "file"), "bytes"
        progress.say(f"checking {meta.files} data file(s), {format_bytes(progress.total)}")
    for index, found in enumerate(data):
        if found is None:
            report.problems.append(
                Problem(data_file_name(index), "missing_file", "listed by the meta file, absent")
            )
        elif found.kind == "file":
            _check_data_file(fs, found, meta, report, progress)
            report.checked_bytes += found.size


def _check_entry(e: Entry, meta: StoreMeta, report: FsckReport) -> None:
    """Problems an entry shows from its name and lstat alone (nothing is opened here)."""
    index = parse_data_file_name(e.name)
    if e.kind == "symlink":
        report.problems.append(Problem(e.name, "symlink", "a symlink: not followed, not read"))
    elif e.name == CHECKPOINT_NAME or parse_journal_name(e.name) is not None:
        if e.kind != "file":  # the index log: its own checks are recover()'s, at startup
            report.problems.append(Problem(e.name, "not_regular", f"a {e.kind}, not a regular file"))
    elif e.name in (META_NAME, LOCK_NAME, PREFIXES_NAME) or (index is not None and index < meta.files):
        if e.kind != "file":
            report.problems.append(Problem(e.name, "not_regular", f"a {e.kind}, not a regular file"))
    elif e.name.endswith(".tmp") or e.name.startswith(".kvtier-probe-"):
        report.problems.append(Problem(e.name, "stale_temp", "left by an interrupted write"))
    elif index is not None:
        report.problems.append(
            Problem(e.name, "foreign_file", f"data file beyond the {meta.files} the meta file lists")
        )
    else:
        report.problems.append(Problem(e.name, "foreign_file", f"unexpected {e.kind}, not touched"))


def _check_data_file(
    fs: FileSystem, e: Entry, meta: StoreMeta, report: FsckReport, progress: Progress | None
) -> None:
    summary = FileSummary(e.name, e.size)
    report.files.append(summary)
    if e.size == 0:
        report.problems.append(Problem(e.name, "zero_length", f"0 bytes, expected {meta.file_bytes}"))
        return
    if e.size < meta.file_bytes:
        report.problems.append(
            Problem(
                e.name,
                "truncated",
                f"{e.size} bytes, expected {meta.file_bytes}; checking the slots that are there",
            )
        )
    elif e.size > meta.file_bytes:
        report.problems.append(Problem(e.name, "oversized", f"{e.size} bytes, expected {meta.file_bytes}"))
    try:
        dev = fs.open_file(e.name, direct=False, readonly=True)
    except DiskError as err:
        report.problems.append(Problem(e.name, "unreadable", str(err)))
        return
    tick = None
    if progress is not None:

        def tick(offset: int) -> None:
            if progress.due():
                progress.report(report.checked_bytes + offset, f"{_counts(report)}; at {e.name}")

    try:
        _walk(dev, meta.io_align, summary, report.problems, tick)
    except DiskError as err:
        report.problems.append(Problem(e.name, "unreadable", str(err)))
    finally:
        dev.close()


def _walk(
    dev: Device,
    a: int,
    summary: FileSummary,
    problems: list[Problem],
    tick: Callable[[int], None] | None = None,
) -> None:
    size = dev.size
    region = bytearray(a)
    payload = bytearray()
    valid_offsets: list[int] = []
    valid_sequences: list[int] = []
    suspects: list[tuple[int, int, int, str]] = []  # (offset, end, sequence, reason)
    offset = 0
    while offset + a <= size:
        if tick is not None:
            tick(offset)
        if dev.pread_into(offset, [region]) < a:
            break  # the file shrank meanwhile
        try:
            h = decode_header(region, available_bytes=size - offset)
        except CorruptSlot as c:
            _count_bad_header(c, offset, summary, problems)
            offset += a
            continue
        payload, problem = _check_payload(dev, offset, h, payload)
        if problem is not None:
            suspects.append((offset, offset + h.slot_bytes, h.sequence, problem))
            offset += a  # the bytes inside may hold newer slots
            continue
        valid_offsets.append(offset)
        valid_sequences.append(h.sequence)
        summary.valid += 1
        summary.payload_bytes += h.payload_len
        offset += h.slot_bytes
    _judge_suspects(suspects, valid_offsets, valid_sequences, summary, problems)


def _check_payload(dev: Device, offset: int, h: SlotHeader, buf: bytearray) -> tuple[bytearray, str | None]:
    """Read and verify the payload of the slot at ``offset`` whose header ``h`` decoded:
    (``buf``, or a bigger buffer when it was too small, for the next slot; why the payload is
    corrupt, or None)."""
    a = h.io_align
    need = round_up(h.payload_len, a)
    if len(buf) < need:
        buf = bytearray(need)
    view = memoryview(buf)[:need]
    try:
        if dev.pread_into(offset + a, [view]) < need:
            raise CorruptSlot("bad_length", "payload runs past the end of file")
        verify_payload(h, view)
    except CorruptSlot as c:
        return buf, str(c)
    return buf, None


def _count_bad_header(c: CorruptSlot, offset: int, summary: FileSummary, problems: list[Problem]) -> None:
    """A slot whose header does not decode: never written, not ours, or corrupt."""
    if c.reason == "zero":
        summary.empty += 1
    elif c.reason == "bad_magic":
        summary.unrecognized += 1
    else:
        summary.corrupt += 1
        problems.append(Problem(summary.name, "corrupt_slot", str(c), offset))


def _judge_suspects(
    suspects: list[tuple[int, int, int, str]],
    valid_offsets: list[int],
    valid_sequences: list[int],
    summary: FileSummary,
    problems: list[Problem],
) -> None:
    """A slot whose payload fails verification is superseded when a newer valid slot lies inside
    it (its space was reused), else corrupt."""
    for start, end, sequence, reason in suspects:
        lo, hi = bisect.bisect_right(valid_offsets, start), bisect.bisect_left(valid_offsets, end)
        if any(s > sequence for s in valid_sequences[lo:hi]):
            summary.superseded += 1
        else:
            summary.corrupt += 1
            problems.append(Problem(summary.name, "corrupt_slot", reason, start))


def format_report(report: FsckReport, *, max_problems: int = 50) -> str:
    """The report for a person: a verdict line, the layout, one line per data file, problems."""
    if report.unusable is not None:
        return f"kvtierd fsck {report.directory}: UNUSABLE: {report.unusable}"
    verdict = "clean" if report.clean else f"{len(report.problems)} problem(s)"
    lines = [f"kvtierd fsck {report.directory}: {verdict}"]
    if (m := report.meta) is not None:
        created = datetime.datetime.fromtimestamp(m.created_ns / 1e9, datetime.UTC)
        lines.append(
            f"format {m.format_version}, io_align {m.io_align}, {m.files} data file(s) of "
            f"{m.file_bytes} bytes, created {created:%Y-%m-%d %H:%M:%S} UTC"
        )
    unit = f"{report.meta.io_align}-byte" if report.meta is not None else "io-aligned"
    for f in report.files:
        lines.append(
            f"  {f.name}: {f.valid} valid slot(s) ({f.payload_bytes} payload bytes), "
            f"{f.corrupt} corrupt, {f.superseded} superseded; {unit} units outside slots: "
            f"{f.empty} empty, {f.unrecognized} unrecognized"
        )
    for p in report.problems[:max_problems]:
        where = f" @ {p.offset}" if p.offset is not None else ""
        lines.append(f"  PROBLEM {p.name}{where}: {p.kind}: {p.detail}")
    if len(report.problems) > max_problems:
        lines.append(f"  ... and {len(report.problems) - max_problems} more")
    return "\n".join(lines)


FSCK_DESCRIPTION = """\
Check an NVMe tier directory (--disk-dir) offline, read-only: the meta file, every data file
slot by slot (header and payload checksums), leftover, foreign and missing files. Prints a
report on stdout and, while it runs, progress lines on stderr (bytes and slots checked, rate).

It refuses a directory a live daemon holds (its kvtier.lock): the files change under a running
daemon, so the verdict would mean nothing; stop the daemon first. While fsck runs, a daemon
does not start on the directory.

exit status: 0 clean, 1 problems found, 2 unusable directory (missing, no or bad meta file),
3 refused: a live daemon holds the directory."""


def add_fsck_arguments(f: argparse.ArgumentParser) -> None:
    """``kvtierd fsck``'s arguments (this module's parser and ``kvtierd fsck``'s)."""
    f.add_argument("directory", help="the NVMe tier directory (the daemon's --disk-dir)")
    f.add_argument("--max-problems", type=int, default=50, help="problems listed in the report (default 50)")
    f.add_argument(
        "--progress-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between progress lines on stderr (default 5; 0: none)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtierd fsck",
        description=FSCK_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fsck_arguments(parser)
    args = parser.parse_args(argv)
    progress = None
    if args.progress_interval > 0:
        progress = Progress(f"kvtierd fsck {args.directory}", _stderr, interval_s=args.progress_interval)
    try:
        report = fsck(args.directory, progress)
    except InUse as e:
        print(
            f"kvtierd fsck {args.directory}: REFUSED: {e}; stop that daemon first (its files "
            "change while it runs)",
            file=sys.stderr,
        )
        return 3
    print(format_report(report, max_problems=args.max_problems))
    return 2 if report.unusable is not None else 0 if report.clean else 1


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

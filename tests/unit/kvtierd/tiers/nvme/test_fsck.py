"""Offline fsck over real directories: two data files of 16 blocks, a handful of slots each.

Slots are written with the format module straight into the files (as the tier would), then the
scenario damages the directory and checks what fsck reports and that it touched nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from tests_helpers import Ticks

from kvtierd.lockfile import InUse, OwnerLock
from kvtierd.progress import Progress
from kvtierd.tiers.nvme.format import (
    LOCK_NAME,
    META_NAME,
    StoreMeta,
    data_file_name,
    encode_header,
    new_header,
    slot_bytes,
)
from kvtierd.tiers.nvme.fsck import FsckReport, format_report, fsck, main

A = 4096
BLOCKS = 16
NS = b"\x11" * 32


def payload(n: int, seed: int) -> bytes:
    return bytes((i * 13 + seed) % 251 for i in range(n))


def make_store(root: Path, *, io_align: int = A, files: int = 2) -> Path:
    d = root / "nvme"
    d.mkdir(parents=True)
    meta = StoreMeta(io_align=io_align, file_bytes=BLOCKS * io_align, files=files, created_ns=1)
    (d / META_NAME).write_bytes(meta.encode())
    for i in range(files):
        with open(d / data_file_name(i), "wb") as f:
            f.truncate(BLOCKS * io_align)
    return d


def put(
    d: Path, offset: int, *, n: int = 6000, seed: int = 1, sequence: int = 1, file: int = 0, io_align: int = A
) -> int:
    """Write one slot (key = seed) at ``offset``; returns the offset just after it."""
    data = payload(n, seed)
    h = new_header(NS, bytes([seed]) * 32, data, sequence=sequence, io_align=io_align)
    with open(d / data_file_name(file), "r+b") as f:
        f.seek(offset)
        f.write(encode_header(h) + data)
    return offset + slot_bytes(n, io_align)


def poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def snapshot(d: Path) -> dict[str, tuple[int, str]]:
    """Every entry with its mtime and content digest (symlinks as their target), and the
    directory's own mtime (a file created and removed again shows there)."""
    out = {".": (d.stat().st_mtime_ns, "")}
    for p in sorted(d.iterdir()):
        if p.is_symlink():
            out[p.name] = (0, os.readlink(p))
        elif p.is_dir():
            out[p.name] = (p.lstat().st_mtime_ns, "dir")
        else:
            out[p.name] = (p.lstat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def kinds(report: FsckReport) -> list[tuple[str, str, int | None]]:
    return [(p.name, p.kind, p.offset) for p in report.problems]


@pytest.mark.parametrize("io_align", [4096, 16384])
def test_clean_directory(tmp_path: Path, io_align: int, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_store(tmp_path, io_align=io_align)
    end = put(d, 0, seed=1, io_align=io_align)  # 3 blocks: header + 2 of payload (at 4 KiB)
    put(d, end, seed=2, n=100, io_align=io_align)  # 2 blocks
    put(d, 0, seed=3, file=1, io_align=io_align)
    before = snapshot(d)
    report = fsck(str(d))
    assert report.clean, format_report(report)
    assert report.total("valid") == 3
    assert report.total("payload_bytes") == 6000 + 100 + 6000
    assert report.total("corrupt") == report.total("unrecognized") == 0
    used = [slot_bytes(6000, io_align) + slot_bytes(100, io_align), slot_bytes(6000, io_align)]
    assert [f.empty for f in report.files] == [BLOCKS - u // io_align for u in used]
    assert main([str(d)]) == 0
    assert ": clean" in capsys.readouterr().out
    assert snapshot(d) == before  # read-only: nothing written, no probe file


def test_flipped_payload_byte(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    end = put(d, 0, seed=1)
    put(d, end, seed=2)
    poke(d / data_file_name(0), end + A + 4000, b"\x00")  # inside the second slot's payload
    report = fsck(str(d))
    assert kinds(report) == [("blocks-00000.kvt", "corrupt_slot", end)]
    assert "bad_payload_checksum" in report.problems[0].detail
    assert report.total("valid") == 1  # the first slot is untouched
    assert main([str(d)]) == 1


def test_torn_header_over_old_payload(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1, n=4 * A)  # slot at 0: header + 4 payload blocks
    # A new slot at A, over the old payload: only its first 512 bytes reached the disk.
    new = new_header(NS, b"\x09" * 32, payload(100, 9), sequence=2)
    poke(d / data_file_name(0), A, encode_header(new)[:512])
    report = fsck(str(d))
    corrupt = [p for p in report.problems if p.kind == "corrupt_slot"]
    assert [(p.offset, p.detail.split(":")[0]) for p in corrupt] == [
        (0, "bad_payload_checksum"),
        (A, "bad_padding"),
    ]


def test_torn_header_over_zeros_is_caught_by_its_payload(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    h = new_header(NS, b"\x01" * 32, payload(6000, 1), sequence=1)
    poke(d / data_file_name(0), 0, encode_header(h)[:512])  # header whole, payload never written
    report = fsck(str(d))
    assert kinds(report) == [("blocks-00000.kvt", "corrupt_slot", 0)]
    assert report.problems[0].detail == "bad_payload_checksum"


def test_newer_slot_over_an_older_one_is_not_a_problem(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1, n=4 * A, sequence=1)  # old: blocks 0-4
    put(d, 2 * A, seed=2, n=100, sequence=2)  # newer, inside the old one's payload
    report = fsck(str(d))
    assert report.clean, format_report(report)
    assert (report.files[0].valid, report.files[0].superseded) == (1, 1)
    # The same bytes with the sequences the other way round: the older slot damaged a newer one.
    d2 = make_store(tmp_path / "other")
    put(d2, 0, seed=1, n=4 * A, sequence=5)
    put(d2, 2 * A, seed=2, n=100, sequence=4)
    assert kinds(fsck(str(d2))) == [("blocks-00000.kvt", "corrupt_slot", 0)]


def test_zero_length_file(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    (d / data_file_name(1)).write_bytes(b"")
    report = fsck(str(d))
    assert kinds(report) == [("blocks-00001.kvt", "zero_length", None)]
    assert report.total("valid") == 1


def test_truncated_file(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    end = put(d, 0, seed=1)  # blocks 0-2
    put(d, end, seed=2)  # blocks 3-5
    os.truncate(d / data_file_name(0), end + 2 * A)  # the second slot loses its last block
    report = fsck(str(d))
    assert kinds(report) == [
        ("blocks-00000.kvt", "truncated", None),
        ("blocks-00000.kvt", "corrupt_slot", end),
    ]
    assert "bad_length" in report.problems[1].detail
    assert report.total("valid") == 1


def test_missing_data_file(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    (d / data_file_name(1)).unlink()
    assert kinds(fsck(str(d))) == [("blocks-00001.kvt", "missing_file", None)]


def test_foreign_and_leftover_files_are_reported_and_not_touched(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    (d / "notes.txt").write_bytes(b"an operator's file")
    (d / data_file_name(7)).write_bytes(b"not listed by the meta file")
    (d / "kvtier.meta.tmp").write_bytes(b"{")
    (d / "subdir").mkdir()
    before = snapshot(d)
    report = fsck(str(d))
    assert sorted(kinds(report)) == [
        ("blocks-00007.kvt", "foreign_file", None),
        ("kvtier.meta.tmp", "stale_temp", None),
        ("notes.txt", "foreign_file", None),
        ("subdir", "foreign_file", None),
    ]
    assert report.total("valid") == 1
    assert snapshot(d) == before


def test_symlinks_are_reported_and_never_followed(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    # Outside the directory: a data file with two valid slots, and one full of garbage.
    outside = make_store(tmp_path / "outside", files=1)
    put(outside, 0, seed=5)
    put(outside, 3 * A, seed=6)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"KVTBLK01" + b"\xff" * (BLOCKS * A - 8))  # magic, then nonsense
    (d / data_file_name(1)).unlink()
    os.symlink(outside / data_file_name(0), d / data_file_name(1))  # in a data file's place
    os.symlink(garbage, d / "blocks-00002.kvt")
    report = fsck(str(d))
    assert sorted(kinds(report)) == [
        ("blocks-00001.kvt", "symlink", None),
        ("blocks-00002.kvt", "symlink", None),
    ]
    assert report.total("valid") == 1  # had fsck followed blocks-00001.kvt, it would count 3
    assert [f.name for f in report.files] == ["blocks-00000.kvt"]
    assert report.total("corrupt") == 0  # had it read the garbage, a corrupt slot would show


@pytest.mark.parametrize("damage", ["no_dir", "no_meta", "bad_meta", "meta_symlink"])
def test_unusable_directory(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_store(tmp_path)
    meta = d / META_NAME
    if damage == "no_dir":
        d = tmp_path / "absent"
    elif damage == "no_meta":
        meta.unlink()
    elif damage == "bad_meta":
        meta.write_bytes(b'{"format_version": 9}')
    else:
        real = tmp_path / "real.meta"
        meta.rename(real)
        os.symlink(real, meta)
    report = fsck(str(d))
    assert report.unusable is not None and not report.clean
    assert main([str(d)]) == 2
    assert "UNUSABLE" in capsys.readouterr().out


def test_report_for_a_person(tmp_path: Path) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    poke(d / data_file_name(0), 20, b"\xee")  # inside the header: checksum mismatch
    text = format_report(fsck(str(d)), max_problems=1)
    lines = text.splitlines()
    assert lines[0].endswith(": 1 problem(s)")
    assert "io_align 4096, 2 data file(s) of 65536 bytes" in lines[1]
    assert "blocks-00000.kvt: 0 valid slot(s)" in lines[2]
    assert lines[-1] == "  PROBLEM blocks-00000.kvt @ 0: corrupt_slot: bad_header_checksum"


def test_a_directory_a_live_daemon_holds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    held = OwnerLock.take(str(d / LOCK_NAME))  # as a daemon holds it while it runs
    try:
        before = snapshot(d)
        with pytest.raises(InUse) as exc:
            fsck(str(d))
        assert exc.value.pid == os.getpid()
        assert main([str(d)]) == 3
        err = capsys.readouterr().err
        assert "REFUSED" in err and f"pid {os.getpid()}" in err and str(d) in err, err
        assert snapshot(d) == before
    finally:
        held.release()
    report = fsck(str(d))  # the daemon stopped: checked, and its lock file is no problem
    assert report.clean and report.total("valid") == 1, format_report(report)


def test_progress_counts_bytes_and_slots_with_a_rate_while_the_walk_runs(tmp_path: Path) -> None:
    d = make_store(tmp_path)  # two files of 16 blocks of 4 KiB: 128 KiB
    end = put(d, 0, seed=1)
    put(d, end, seed=2, n=100)
    put(d, 0, seed=3, file=1)
    lines: list[str] = []
    progress = Progress("fsck", lines.append, interval_s=10.0, clock=Ticks())
    report = fsck(str(d), progress)
    assert report.clean
    assert lines[0] == "fsck: checking 2 data file(s), 128.0 KiB"
    ticks = lines[1:-1]  # one clock read per io_align step: a line every 10 of them
    assert 2 <= len(ticks) <= 4, lines
    first = ticks[0]
    assert first.startswith("fsck: ") and " of 128.0 KiB (" in first and "/s, " in first, first
    assert "valid slot(s), 0 corrupt, 0 problem(s); at blocks-0000" in first, first
    assert lines[-1].startswith("fsck: 128.0 KiB of 128.0 KiB (100%), ")
    assert lines[-1].endswith("; done; 3 valid slot(s), 0 corrupt, 0 problem(s)"), lines[-1]


def test_short_work_stays_quiet_and_the_cli_prints_progress_to_stderr_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = make_store(tmp_path)
    put(d, 0, seed=1)
    lines: list[str] = []
    fsck(str(d), Progress("fsck", lines.append, interval_s=3600.0))
    assert lines == ["fsck: checking 2 data file(s), 128.0 KiB"]  # no progress line, no "done"
    assert main([str(d), "--progress-interval", "1e-9"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"kvtierd fsck {d}: clean") and "%" not in out
    err_lines = err.splitlines()
    assert err_lines[0] == f"kvtierd fsck {d}: checking 2 data file(s), 128.0 KiB"
    assert len(err_lines) > 10 and "(100%)" in err_lines[-1] and "done" in err_lines[-1]
    assert main([str(d), "--progress-interval", "0"]) == 0
    assert capsys.readouterr().err == ""  # 0: no progress at all

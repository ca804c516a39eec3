"""The NVMe tier's recovery says how far it got: records read from the checkpoint and replayed
from the journals, block headers validated, slots claimed (kvtierd.progress over real files;
an interval of 0 or a clock moved by hand stands in for a large tier)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tests_helpers import Ticks

from kvtierd.progress import Progress
from kvtierd.tiers.nvme.device import FileSystem
from kvtierd.tiers.nvme.journal import AddRecord, JournalWriter, NsRecord, recover, write_checkpoint
from kvtierd.tiers.nvme.tier import NvmeConfig, NvmeTier

DIGEST = bytes(range(32))
NS = NsRecord(DIGEST, {"model": "m"})


def add(i: int) -> AddRecord:
    return AddRecord(DIGEST, bytes([i]) * 32, 0, i * 8192, 5000, 8192, 0xC0FFEE + i, i + 1)


def test_recover_reports_the_records_read_per_file_and_within_a_file(tmp_path: Path) -> None:
    fs = FileSystem(str(tmp_path / "nvme"), create=True)
    try:
        write_checkpoint(fs, [NS, *(add(i) for i in range(30))], journal_gen=2)
        w = JournalWriter.open(fs, 2, capacity_bytes=1 << 16)
        for i in range(30, 70):
            w.append(add(i))
        w.flush_and_sync()
        w.close()
        lines: list[str] = []
        still = Progress("recovery", lines.append, unit="records", interval_s=0.0, clock=lambda: 5.0)
        rec = recover(fs, still, tick_every=16)
    finally:
        fs.close()
    assert len(rec.entries) == 70
    assert lines == [  # interval 0: every tick is a line (a clock that does not move: no rate)
        "recovery: 16 records, 0.0s; reading checkpoint.kvc",
        "recovery: 31 records, 0.0s; checkpoint.kvc read",
        "recovery: 47 records, 0.0s; reading journal-00000002.kvj",
        "recovery: 63 records, 0.0s; reading journal-00000002.kvj",
        "recovery: 71 records, 0.0s; journal-00000002.kvj replayed",
        "recovery: 71 records, 0.0s; done; 31 from the checkpoint, 40 replayed from 1 journal(s)",
    ], lines


def test_recover_reports_at_most_once_per_interval(tmp_path: Path) -> None:
    fs = FileSystem(str(tmp_path / "nvme"), create=True)
    try:
        w = JournalWriter.open(fs, 1, capacity_bytes=1 << 16)
        for i in range(200):
            w.append(add(i))
        w.flush_and_sync()
        w.close()
        lines: list[str] = []
        progress = Progress("recovery", lines.append, unit="records", interval_s=3.0, clock=Ticks())
        recover(fs, progress, tick_every=10)
    finally:
        fs.close()
    # 20 in-file ticks and one at the file's end, each a clock read (a line: one more): a line
    # every third tick, then "done"
    assert len(lines) == 8, lines
    assert lines[0] == "recovery: 30 records, 7 records/s, 4.0s; reading journal-00000001.kvj"
    done = "done; 0 from the checkpoint, 200 replayed from 1 journal(s)"
    assert lines[-1] == f"recovery: 200 records, 6 records/s, 29.0s; {done}"


def test_a_tier_replaying_its_journal_logs_each_phase(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = NvmeConfig(
        directory=str(tmp_path / "nvme"),
        capacity_bytes=1 << 20,
        file_bytes=1 << 20,
        slab_bytes=256 << 10,
        io_threads=1,
        progress_interval_s=0.0,
    )
    first = NvmeTier(cfg)
    first.open()
    assert first._journal is not None  # a crash after these records were journaled:
    for rec in (NS, *(add(i) for i in range(5))):  # recovery replays them, checks their headers
        first._journal.append(rec)
    first._journal.flush_and_sync()
    first.close()
    caplog.set_level(logging.INFO, logger="kvtierd.nvme")
    again = NvmeTier(cfg)
    try:
        again.open()
    finally:
        again.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    where = f"nvme tier {cfg.directory}: "
    assert any(m.startswith(where + "reading the index: 6 records") and "done" in m for m in said), said
    assert any(m.startswith(where + "locating blocks: 5 of 5 blocks (100%)") for m in said), said
    assert any(m.startswith(where + "validating block headers: 5 of 5 blocks (100%)") for m in said), said
    assert any(
        m.startswith(where + "claiming slots: 5 of 5 blocks (100%)") and "5 dropped" in m for m in said
    ), said

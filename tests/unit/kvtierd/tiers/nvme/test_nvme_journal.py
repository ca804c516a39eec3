"""The NVMe index log: journal + checkpoints over real files, faults injected through the seam.

Slots are 8 KiB at offsets ``slot(i)``; keys are ``k(i)``; one namespace ``NS``. An ADD frame is
136 bytes, so a 4 KiB journal holds 30 of them.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_contract.errors import InvalidArgument
from kvtierd.testing.faults import FaultyFileSystem
from kvtierd.tiers.nvme.device import DiskFull, SyncFailed
from kvtierd.tiers.nvme.journal import (
    ADD_FRAME_BYTES,
    CHECKPOINT_NAME,
    CHECKPOINT_TMP,
    END_BODY,
    T_END,
    AddRecord,
    DelRecord,
    JournalWriter,
    NsRecord,
    Recovery,
    encode_frame,
    encode_record,
    journal_name,
    recover,
    remove_journals_before,
    write_checkpoint,
)

A = 4096
DIGEST = bytes(range(32))
NS = NsRecord(DIGEST, {"model": "qwen3-0.6b", "block_tokens": 16})


def k(i: int) -> bytes:
    return bytes([i]) * 32


def slot(i: int) -> int:
    return i * 8192


def add(key: int, at: int, seq: int | None = None) -> AddRecord:
    return AddRecord(DIGEST, k(key), 0, slot(at), 5000, 8192, 0xC0FFEE + key, seq or key)


def dele(key: int, at: int) -> DelRecord:
    return DelRecord(DIGEST, k(key), 0, slot(at))


def index(r: Recovery) -> dict[int, int]:
    """key number -> slot number, the shape the expected states below are written in."""
    return {key[0]: rec.offset // 8192 for (_, key), rec in r.entries.items()}


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[FaultyFileSystem]:
    f = FaultyFileSystem(str(tmp_path / "nvme"), create=True)
    yield f
    f.close()


def journal(
    fs: FaultyFileSystem, gen: int, *records: AddRecord | DelRecord | NsRecord, capacity_bytes: int = A
) -> JournalWriter:
    w = JournalWriter.open(fs, gen, capacity_bytes=capacity_bytes)
    for r in records:
        w.append(r)
    w.flush_and_sync()
    return w


# -- journal round trip and replay rules ------------------------------------------------------------


def test_empty_directory_recovers_nothing(fs: FaultyFileSystem) -> None:
    r = recover(fs)
    assert (r.namespaces, r.entries, r.next_gen, r.max_slot_seq) == ({}, {}, 1, 0)
    assert not r.stats.ignored_checkpoint and r.stats.journals == 0


def test_append_sync_recover_round_trip(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, NS, add(1, 1, seq=7), add(2, 2, seq=9), add(3, 3, seq=8))
    assert w.records_synced == 4 and w.pending_records == 0
    assert w.bytes_written == len(encode_record(NS, 1)) + 3 * ADD_FRAME_BYTES
    w.close()
    r = recover(fs)
    assert r.namespaces == {DIGEST: NS.spec}
    assert index(r) == {1: 1, 2: 2, 3: 3}
    assert r.entries[(DIGEST, k(2))] == add(2, 2, seq=9)
    assert (r.next_gen, r.max_slot_seq) == (2, 9)
    assert (r.stats.journal_records, r.stats.journals, r.stats.torn_tail_bytes) == (4, 1, 0)


def test_slot_reuse_keeps_only_the_newest_key(fs: FaultyFileSystem) -> None:
    journal(
        fs,
        1,
        add(1, 1),
        add(2, 1),  # B takes A's slot 1: A is gone
        add(3, 2),
        add(3, 4),
        add(5, 2),
    ).close()  # 3 moved to slot 4 before 5 took slot 2
    assert index(recover(fs)) == {2: 1, 3: 4, 5: 2}


def test_del_removes_only_the_mapping_it_names(fs: FaultyFileSystem) -> None:
    journal(
        fs,
        1,
        add(1, 1),
        add(2, 2),
        dele(1, 1),  # 1 deleted
        add(2, 3),
        dele(2, 2),
    ).close()  # stale DEL: 2 lives in slot 3 now
    assert index(recover(fs)) == {2: 3}


def test_unsynced_appends_are_not_written(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, add(1, 1))
    w.append(add(2, 2))
    assert w.pending_records == 1
    w.close()  # dropped, never durable
    assert index(recover(fs)) == {1: 1}


# -- torn and corrupt journals ----------------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 4, 19, 20, 60, ADD_FRAME_BYTES - 1])
def test_torn_tail_keeps_earlier_records(fs: FaultyFileSystem, keep: int) -> None:
    w = journal(fs, 1, add(1, 1), add(2, 2))
    fs.devices[journal_name(1)].tear_next_write(keep, succeed=True)  # crash mid-record
    w.append(add(3, 3))
    w.flush_and_sync()
    w.close()
    r = recover(fs)
    assert index(r) == {1: 1, 2: 2}  # record 3 ignored
    torn = encode_record(add(3, 3), 3)[:keep].rstrip(b"\0")
    assert r.stats.torn_tail_bytes == len(torn) > 0
    assert r.stats.journal_records == 2 and "replay stopped" in r.stats.problems[0]


def test_reopened_journal_overwrites_its_torn_tail(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, add(1, 1), add(2, 2))
    fs.devices[journal_name(1)].tear_next_write(100, succeed=True)
    w.append(add(3, 3))
    w.flush_and_sync()
    w.close()
    journal(fs, 1, add(4, 4)).close()  # appends after record 2, the torn bytes zeroed first
    r = recover(fs)
    assert index(r) == {1: 1, 2: 2, 4: 4}
    assert (r.stats.torn_tail_bytes, r.stats.problems) == (0, ())


def test_reopened_journal_never_lets_a_stale_frame_follow(fs: FaultyFileSystem) -> None:
    journal(fs, 1, add(1, 1), add(2, 2), add(3, 3)).close()
    fs.open_file(journal_name(1))
    fs.devices[journal_name(1)].flip_byte(ADD_FRAME_BYTES + 60)  # record 2 corrupt, 3 intact
    journal(fs, 1, add(4, 4)).close()  # takes seq 2 at record 2's place; record 3 (seq 3) zeroed
    r = recover(fs)
    assert index(r) == {1: 1, 4: 4} and r.stats.torn_tail_bytes == 0


def test_a_valid_frame_out_of_sequence_stops_replay(fs: FaultyFileSystem) -> None:
    journal(fs, 1, add(1, 1), add(2, 2)).close()
    fs.open_file(journal_name(1))
    fs.devices[journal_name(1)].poke(2 * ADD_FRAME_BYTES, encode_record(add(3, 3), 5))  # stale
    r = recover(fs)
    assert index(r) == {1: 1, 2: 2} and r.stats.torn_tail_bytes == ADD_FRAME_BYTES


@pytest.mark.parametrize("where", [0, 5, 20, 60, ADD_FRAME_BYTES - 1])  # magic, pad, body, crc
def test_flipped_byte_in_middle_record_stops_replay_there(fs: FaultyFileSystem, where: int) -> None:
    journal(fs, 1, add(1, 1), add(2, 2), add(3, 3)).close()
    fs.open_file(journal_name(1))
    fs.devices[journal_name(1)].flip_byte(ADD_FRAME_BYTES + where)
    r = recover(fs)
    assert index(r) == {1: 1}  # 2 is corrupt, 3 follows it: both ignored
    assert r.stats.torn_tail_bytes == 2 * ADD_FRAME_BYTES


def test_journal_rolls_over_to_the_next_generation_when_full(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, *(add(i, i) for i in range(1, 101)))  # 30 per 4 KiB file
    assert w.gen == 4 and w.records_synced == 100
    w.close()
    r = recover(fs)
    assert len(r.entries) == 100 and (r.stats.journals, r.next_gen) == (4, 5)


def test_symlinked_journal_is_never_followed(fs: FaultyFileSystem, tmp_path: Path) -> None:
    journal(fs, 1, add(1, 1)).close()
    outside = FaultyFileSystem(str(tmp_path / "outside"), create=True)
    journal(outside, 5, add(9, 9)).close()
    os.symlink(tmp_path / "outside" / journal_name(5), tmp_path / "nvme" / journal_name(5))
    r = recover(fs)
    assert index(r) == {1: 1} and r.stats.journals == 1
    assert r.next_gen == 6  # the name is taken, whatever it is
    outside.close()


def test_spec_too_large_is_refused_and_consumes_no_seq(fs: FaultyFileSystem) -> None:
    w = JournalWriter.open(fs, 1)
    w.append(add(1, 1))
    with pytest.raises(InvalidArgument):
        w.append(NsRecord(DIGEST, {"x": "y" * (64 << 10)}))
    w.append(add(2, 2))
    w.flush_and_sync()
    w.close()
    assert index(recover(fs)) == {1: 1, 2: 2}  # seqs stayed contiguous


# -- checkpoints ------------------------------------------------------------------------------------


def rotate(fs: FaultyFileSystem, w: JournalWriter, snapshot: list[NsRecord | AddRecord]) -> JournalWriter:
    """The rotation sequence of the commit thread: next generation, checkpoint, old journals go."""
    w.flush_and_sync()
    w.close()
    nxt = JournalWriter.open(fs, w.gen + 1, capacity_bytes=A)
    write_checkpoint(fs, snapshot, journal_gen=nxt.gen)
    return nxt


def test_checkpoint_then_later_generation(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, NS, add(1, 1), add(2, 2))
    w = rotate(fs, w, [NS, add(1, 1), add(2, 2)])
    w.append(dele(1, 1))
    w.append(add(3, 3))
    w.flush_and_sync()
    w.close()
    r = recover(fs)  # journal 1 still there (crash before removal): skipped, the checkpoint has it
    assert index(r) == {2: 2, 3: 3} and r.namespaces == {DIGEST: NS.spec}
    assert (r.stats.checkpoint_records, r.stats.journal_records, r.stats.journals) == (3, 2, 1)
    assert remove_journals_before(fs, 2) == 1
    assert sorted(os.listdir(fs.directory)) == [CHECKPOINT_NAME, journal_name(2)]
    r2 = recover(fs)
    assert (index(r2), r2.next_gen) == ({2: 2, 3: 3}, 3)


def test_crash_during_checkpoint_write_keeps_the_old_one(fs: FaultyFileSystem) -> None:
    w = rotate(fs, journal(fs, 1, add(1, 1)), [add(1, 1)])  # checkpoint: {1}, journal_gen 2
    w.close()

    def crashing() -> Iterator[AddRecord]:
        yield add(1, 1)
        raise KeyboardInterrupt  # the process dies half way through the snapshot

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(fs, crashing(), journal_gen=3)
    half = fs.create_file(CHECKPOINT_TMP, A, direct=False)  # and a kill -9 leaves a half-written tmp file
    half.pwrite(0, [encode_record(add(7, 7), 1)])
    half.close()
    r = recover(fs)
    assert index(r) == {1: 1} and not r.stats.ignored_checkpoint and r.stats.checkpoint_records == 1
    write_checkpoint(fs, [add(2, 2)], journal_gen=3)  # replaces the stale tmp file
    assert CHECKPOINT_TMP not in os.listdir(fs.directory)
    assert index(recover(fs)) == {2: 2}


def _damage_checkpoint(fs: FaultyFileSystem, how: str) -> None:
    records: list[NsRecord | AddRecord] = [NS, add(1, 1), add(2, 2)]
    size = len(encode_record(NS, 1)) + 2 * ADD_FRAME_BYTES
    if how == "count_mismatch":
        data = b"".join(encode_record(r, i) for i, r in enumerate(records, 1))
        fs.write_file_atomic(CHECKPOINT_NAME, data + encode_frame(T_END, END_BODY.pack(2, 2), 4))
        return
    write_checkpoint(fs, records, journal_gen=2)
    dev = fs.open_file(CHECKPOINT_NAME)
    fd = fs.devices[CHECKPOINT_NAME]
    if how == "no_end":  # the last chunk never reached the disk
        fd.poke(size, bytes(A - size))
    else:  # a flipped byte in the middle record
        fd.flip_byte(size - ADD_FRAME_BYTES - 50)
    dev.close()


@pytest.mark.parametrize("how", ["no_end", "count_mismatch", "corrupt"])
def test_invalid_checkpoint_is_ignored_and_journals_replayed(fs: FaultyFileSystem, how: str) -> None:
    journal(fs, 1, NS, add(1, 1), add(5, 5)).close()
    _damage_checkpoint(fs, how)  # would say {1, 2} from journal 2 on
    journal(fs, 2, add(3, 3)).close()
    r = recover(fs)
    assert r.stats.ignored_checkpoint and r.stats.checkpoint_records == 0
    assert CHECKPOINT_NAME in r.stats.problems[0]
    assert index(r) == {1: 1, 5: 5, 3: 3}  # journals 1 and 2, nothing from the checkpoint
    assert r.stats.journals == 2


def test_checkpoint_disk_full_keeps_the_old_one(fs: FaultyFileSystem) -> None:
    write_checkpoint(fs, [add(1, 1)], journal_gen=2)
    fs.fail_allocate(errno.ENOSPC)
    with pytest.raises(DiskFull):
        write_checkpoint(fs, [add(2, 2)], journal_gen=3)
    assert index(recover(fs)) == {1: 1}
    assert CHECKPOINT_TMP not in os.listdir(fs.directory)


# -- device faults ----------------------------------------------------------------------------------


def test_sync_failure_is_final_and_claims_nothing(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, add(1, 1))
    fs.devices[journal_name(1)].fail_syncs(1)
    w.append(add(2, 2))
    with pytest.raises(SyncFailed):
        w.flush_and_sync()
    assert w.records_synced == 1 and w.failed  # record 2 is not durable (may or may not be on disk)
    with pytest.raises(SyncFailed):
        w.append(add(3, 3))
    with pytest.raises(SyncFailed):
        w.flush_and_sync()
    w.close()
    assert (1, 1) in index(recover(fs)).items()  # what was synced survives
    journal(fs, recover(fs).next_gen, add(4, 4)).close()  # a new generation works
    assert index(recover(fs))[4] == 4


def test_enospc_on_write_is_disk_full_and_retryable(fs: FaultyFileSystem) -> None:
    w = journal(fs, 1, add(1, 1))
    fs.devices[journal_name(1)].fail_writes(1, errno.ENOSPC)
    w.append(add(2, 2))
    with pytest.raises(DiskFull):
        w.flush_and_sync()
    assert (w.records_synced, w.pending_records) == (1, 1)
    w.flush_and_sync()  # the tail was kept: rewritten at the same offset
    w.close()
    assert index(recover(fs)) == {1: 1, 2: 2}


def test_enospc_creating_a_journal_leaves_no_file(fs: FaultyFileSystem) -> None:
    fs.fail_allocate(errno.ENOSPC)
    with pytest.raises(DiskFull):
        JournalWriter.open(fs, 1)
    assert os.listdir(fs.directory) == []


# -- scale ------------------------------------------------------------------------------------------


def test_ten_thousand_adds_recover_fast(fs: FaultyFileSystem) -> None:
    n = 10_000
    recs = [
        AddRecord(DIGEST, i.to_bytes(32, "big"), i % 4, (i // 4) * 8192, 5000, 8192, i, i) for i in range(n)
    ]
    journal(fs, 1, NS, *recs, capacity_bytes=2 << 20).close()
    t0 = time.perf_counter()
    r = recover(fs)
    journal_s = time.perf_counter() - t0
    write_checkpoint(fs, [NS, *recs], journal_gen=2)
    t0 = time.perf_counter()
    r2 = recover(fs)
    checkpoint_s = time.perf_counter() - t0
    print(f"\nrecover {n} ADDs: journal {journal_s * 1e3:.1f} ms, checkpoint {checkpoint_s * 1e3:.1f} ms")
    assert len(r.entries) == len(r2.entries) == n and r.max_slot_seq == n - 1
    assert r2.stats.checkpoint_records == n + 1 and r2.stats.journals == 0
    assert journal_s < 5 and checkpoint_s < 5  # generous: about 50 ms on a laptop


def test_golden_add_frame() -> None:
    # docs/journal_format.md, worked example
    rec = AddRecord(bytes(range(32)), b"\xaa" * 32, 1, 8192, 5, 8192, 0x9555E8555C62DCFD, 7)
    assert encode_record(rec, 1).hex() == (
        "4b564a31"
        "02000000"
        "6c000000"
        "01000000"
        "00000000" + bytes(range(32)).hex() + "aa" * 32 + "01000000"
        "0020000000000000"
        "0500000000000000"
        "0020000000000000"
        "fddc625c55e85595"
        "0700000000000000"
        "60833c4bd96fe5c5"
    )

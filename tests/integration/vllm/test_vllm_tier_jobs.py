"""The vLLM secondary tier's job runner (``TierJobs``, no vLLM) against a real daemon process:
rows round-trip byte for byte, and a hung daemon never holds the caller, even with more jobs
queued than the runner keeps."""

from __future__ import annotations

import os
import signal
import time

from conftest import DaemonProcess

from kvtier.integrations.vllm.tier.config import PoolGeometry, TierConfig, tier_namespace
from kvtier.integrations.vllm.tier.jobs import MAX_QUEUED_JOBS, JobDone, TierJobs

ROW = 16 * 2 * 2 * 64 * 2  # 8 KiB rows
GEOMETRY = PoolGeometry(
    row_bytes=ROW,
    chunk_tokens=16,
    kv_dtype="bfloat16",
    kv_layout="LBHNC",
    canonical=False,
    portable=False,
    tp_size=1,
    pp_size=1,
    world_size=1,
    groups="g",
    hash_algo="sha256",
)


def make_jobs(d: DaemonProcess, rows: bytearray) -> TierJobs:
    cfg = TierConfig(
        address=d.unix,
        model_revision="rev-a",
        tokenizer_digest="none",
        request_timeout_ms=500,
        lookup_timeout_ms=300,
        job_timeout_ms=2000,
    )
    return TierJobs(cfg, tier_namespace(cfg, GEOMETRY, model="/models/tiny"), memoryview(rows), ROW)


def keys(seed: int, n: int) -> list[bytes]:
    return [bytes([seed, i]) * 16 + b"\0\0\0\0" for i in range(n)]


def wait(jobs: TierJobs, n: int, timeout_s: float) -> list[JobDone]:
    done: list[JobDone] = []
    deadline = time.monotonic() + timeout_s
    while len(done) < n and time.monotonic() < deadline:
        done += jobs.finished()
        time.sleep(0.01)
    return done


def test_rows_round_trip_and_lookups_answer_the_stored_prefix(daemon: DaemonProcess) -> None:
    rows = bytearray(os.urandom(4 * ROW)) + bytearray(4 * ROW)
    jobs = make_jobs(daemon, rows)
    try:
        jobs.submit_store(1, keys(1, 3), [0, 1, 2])
        assert [d.ok for d in wait(jobs, 1, 10)] == [True]
        assert jobs.lookup(keys(1, 4)) == [True, True, True, False]
        assert jobs.lookup(keys(2, 2)) == [False, False]  # other keys: a miss
        jobs.submit_load(2, keys(1, 3), [5, 6, 7])
        (done,) = wait(jobs, 1, 10)
        assert done.ok and done.nbytes == 3 * ROW
        assert rows[5 * ROW : 8 * ROW] == rows[0 : 3 * ROW]
        stats = jobs.take_stats()
        assert (stats["stored_blocks"], stats["loaded_blocks"], stats["lookup_hits"]) == (3, 3, 3)
    finally:
        jobs.close()


def test_a_hung_daemon_never_holds_the_caller(daemon: DaemonProcess) -> None:
    rows = bytearray(8 * ROW)
    jobs = make_jobs(daemon, rows)
    try:
        jobs.submit_store(1, keys(1, 2), [0, 1])
        assert [d.ok for d in wait(jobs, 1, 10)] == [True]
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            n = MAX_QUEUED_JOBS + 20
            t0 = time.perf_counter()
            for j in range(n):
                jobs.submit_store(100 + j, keys(3, 2), [2, 3])
            jobs.submit_load(99, keys(1, 2), [4, 5])
            assert time.perf_counter() - t0 < 0.5  # 277 submissions, none waits for the daemon
            done = wait(jobs, n + 1, 30)
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        assert len(done) == n + 1 and not any(d.ok for d in done)  # failed, dropped, never hung
        load = next(d for d in done if d.job_id == 99)
        assert load.is_load and load.found == (False, False)
        assert jobs.take_stats()["store_dropped_blocks"] == 2 * n
    finally:
        jobs.close()

"""A frozen daemon never stalls the engine (DESIGN.md §7; issue 12, finding 3).

A real ``KvtierWorker`` over shm, driven without vLLM the way the connector drives it, steps
every 20 ms against a real daemon process: each step fences the previous step's store job (its
blocks are written again this step), loads 4 blocks the daemon holds and stores 4 new ones. The
daemon is SIGSTOPped for 8 s (sockets open, no answers), then SIGCONTed. Measured on the stepping
thread (wall time inside the worker's calls): during the stop kvtier takes under 10 % of the
thread's time and the step rate stays at 90 % or more of the rate before; after SIGCONT loads hit
again and stores are accepted again.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import DaemonProcess
from tests_helpers import worker_identity

import kvtier
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig
from kvtier.integrations.vllm.connector.planner import LoadJob, StoreJob
from kvtier.integrations.vllm.connector.worker import KvtierWorker

BS, L, H, D = 16, 2, 2, 64  # 16 KiB blocks
NUM_BLOCKS = 16
STEP_S = 0.02
STOP_S = 8.0
IDENTITY = worker_identity("test/stall")  # BS, L, H, D as above
HOT = [0, 1, 2, 3]  # engine blocks loads go into
FRESH = [8, 9, 10, 11]  # engine blocks this step's forward writes and its store reads

pytestmark = pytest.mark.timeout(120)


@dataclass
class Phase:
    """What the stepping thread saw in one phase."""

    steps: int = 0
    seconds: float = 0.0  # wall time of the phase
    kvtier_s: float = 0.0  # wall time inside the worker's calls
    slowest_s: float = 0.0  # the slowest step's time inside the worker
    hits: int = 0  # steps whose loads all succeeded
    stats: dict[str, Any] = field(default_factory=dict)

    def rate(self) -> float:
        return self.steps / self.seconds

    def share(self) -> float:
        return self.kvtier_s / self.seconds


class Engine:
    """The stepping thread's side: a paged CPU cache, a worker, a step counter."""

    def __init__(self, d: DaemonProcess) -> None:
        self.cache = torch.zeros(L, NUM_BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16)
        self.worker = KvtierWorker(IDENTITY, ConnectorConfig(address=d.unix, model_revision="r1"))
        self.worker.register([self.cache[i] for i in range(L)])
        self.ns = IDENTITY.namespace()
        self.hot_keys = self.ns.block_keys(list(range(len(HOT) * BS)))
        self.step_no = 0
        self.last_store: list[int] = []

    def step(self) -> tuple[float, bool]:
        """One engine step -> (seconds inside the worker, whether every load hit)."""
        self.step_no += 1
        t0 = time.perf_counter()
        self.worker.wait(self.last_store)  # FRESH blocks are written again below
        failed = self.worker.load([LoadJob("hot", BASE, [self.hot_keys], HOT)])
        spent = time.perf_counter() - t0
        self.cache[:, FRESH] = float(self.step_no % 97)  # "the forward"
        keys = self.ns.block_keys([self.step_no * 1000 + i for i in range(len(FRESH) * BS)])
        job = StoreJob(self.step_no, f"r{self.step_no}", BASE, [keys], FRESH)
        t1 = time.perf_counter()
        self.worker.submit_stores([job])
        spent += time.perf_counter() - t1
        self.last_store = [job.job_id]
        return spent, not failed

    def run(self, seconds: float) -> Phase:
        """Step every STEP_S (a late step starts at once, never two to catch up) for ``seconds``."""
        phase = Phase()
        start = time.perf_counter()
        due = start
        while time.perf_counter() - start < seconds:
            spent, hit = self.step()
            phase.steps += 1
            phase.kvtier_s += spent
            phase.slowest_s = max(phase.slowest_s, spent)
            phase.hits += hit
            due = max(due + STEP_S, time.perf_counter())
            time.sleep(max(0.0, due - time.perf_counter()))
        phase.seconds = time.perf_counter() - start
        phase.stats = self.worker.take_stats()
        return phase


def seed_hot(d: DaemonProcess) -> list[bytes]:
    with kvtier.Client.connect(d.unix) as c:
        h = c.register(IDENTITY.namespace())
        keys = h.block_keys(list(range(len(HOT) * BS)))
        assert h.put(keys, [bytes([5 + i]) * h.block_bytes for i in range(len(HOT))]).stored == 4
        return keys


def report(name: str, p: Phase) -> str:
    return (
        f"{name}: {p.steps} steps in {p.seconds:.2f} s ({p.rate():.1f}/s), kvtier "
        f"{p.kvtier_s:.3f} s ({100 * p.share():.1f} %), slowest {p.slowest_s * 1000:.0f} ms, "
        f"{p.hits} all-hit steps, fence {p.stats.get('fence_seconds', 0):.3f} s, "
        f"load {p.stats.get('load_seconds', 0):.3f} s, stored {p.stats.get('stored_blocks')}, "
        f"dropped {p.stats.get('store_dropped_blocks')}"
    )


def test_a_stopped_daemon_costs_the_engine_almost_nothing(daemon_factory: Any) -> None:
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    seed_hot(d)
    eng = Engine(d)
    try:
        before = eng.run(3.0)
        assert before.hits == before.steps  # healthy: every load hits, every store lands
        assert before.stats["stored_blocks"] >= 4 * (before.steps - 2)
        assert torch.all(eng.cache[:, HOT[1]].view(torch.uint8) == 6)  # the daemon's bytes
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            during = eng.run(STOP_S)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        after = eng.run(6.0)
        print(
            "\n"
            + "\n".join(report(n, p) for n, p in (("before", before), ("during", during), ("after", after)))
        )
        # the engine thread barely notices the stop (one step pays at most the step budget)
        assert during.share() < 0.10, report("during", during)
        assert during.rate() >= 0.9 * before.rate(), report("during", during)
        # and the daemon is used again once it answers: loads hit, stores land
        assert after.hits > 0, report("after", after)
        last = eng.run(1.0)
        assert last.hits == last.steps and last.stats["stored_blocks"] > 0, report("last", last)
    finally:
        eng.worker.close()


def test_the_fence_takes_over_a_store_stuck_in_an_rpc(daemon_factory: Any) -> None:
    """The store thread is inside PrepareStore (daemon stopped) when the fence needs the job's
    blocks back: the fence returns at once with a copy of them, the engine overwrites the
    blocks, and once the daemon answers the store commits the copy, not the new bytes."""
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    cache = torch.zeros(L, NUM_BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16)
    w = KvtierWorker(
        IDENTITY, ConnectorConfig(address=d.unix, model_revision="r1", request_timeout_ms=10_000)
    )
    w.register([cache[i] for i in range(L)])
    try:
        keys = IDENTITY.namespace().block_keys(list(range(100, 100 + len(FRESH) * BS)))
        cache[:, FRESH] = 1.0  # what the forward wrote: the bytes to store
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            w.submit_stores([StoreJob(7, "r", BASE, [keys], FRESH)])
            deadline = time.monotonic() + 5
            while w.stores._unread[7].state != "preparing":  # the store thread is in its RPC
                assert time.monotonic() < deadline
                time.sleep(0.001)
            t0 = time.perf_counter()
            w.wait([7])
            assert time.perf_counter() - t0 < 0.5  # a local copy, not the 10 s RPC deadline
            cache[:, FRESH] = 2.0  # the blocks' next owner writes them
        finally:
            d.proc.send_signal(signal.SIGCONT)
        assert w.drain(15)
        stats = w.take_stats()
        assert (stats["fence_snapshots"], stats["stored_blocks"]) == (1, 4)
        w.load([LoadJob("r", BASE, [keys], HOT)])
        assert torch.equal(cache[:, HOT], torch.ones_like(cache[:, HOT]))  # the bytes of the copy
    finally:
        w.close()

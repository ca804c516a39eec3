"""Recovery figures of ``kvtier bench nvme``: how long a kvtierd takes to come back over a full tier.

Driven through the daemon's public interfaces only: ``kvtierd serve --disk-dir`` (``NvmeDaemon``),
blocks stored with the SDK, SIGTERM / SIGKILL, and the recovery the daemon reports in Stats
(``nvme.recovery_seconds``, ``recovered_blocks``, ``recovery_mode``). The bench never reads or
writes the tier's files.

Each of ``plan.repeat`` cycles runs on a fresh directory (16 KiB blocks, write-through) and gives
one sample of every figure (``RECOVERY_FIGURES``):

1. start on the empty directory (``ready_empty_s``: process start to KVTIERD_READY), store
   ``plan.recovery_blocks`` blocks, SIGTERM (drain, checkpoint);
2. restart: ``ready_warm_s`` and ``recovery_warm_s`` (mode "warm", n blocks); store n more blocks
   (in the journal only: no checkpoint covers them), SIGKILL;
3. restart: ``ready_replay_s`` and ``recovery_replay_s`` (mode "replay": checkpoint plus journal,
   2n blocks, every slot header read back); SIGKILL, and the directory is removed.

So every replay sample replays a crash of its own, made the same way: n blocks checkpointed, n in
the journal.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import numpy as np

from kvtier.bench.baselines import block_views
from kvtier.bench.nvme_daemon import (
    FILE_BYTES,
    IO_ALIGN,
    NvmeDaemon,
    nvme_slot_bytes,
    nvme_stats,
    put_durable,
    round_up,
)
from kvtier.bench.plan import MiB, Plan, Results, size_label
from kvtier.bench.progress import Progress
from kvtier.bench.transfers import KeySource, bench_namespace, connect
from kvtier.client import Client

RECOVERY_BLOCK = 16 << 10
RECOVERY_FIGURES = ("ready_empty_s", "ready_warm_s", "recovery_warm_s", "ready_replay_s", "recovery_replay_s")
CYCLE_STEPS = 4  # progress steps per cycle: fill, warm restart, fill, replay restart


def disk_need(plan: Plan) -> int:
    """Peak bytes one cycle holds on disk (one directory at a time)."""
    return 2 * plan.recovery_blocks * nvme_slot_bytes(RECOVERY_BLOCK) + 1024 * MiB


class _RecoveryRig:
    """The flags, data and checks shared by every cycle; each cycle brings its own directory."""

    def __init__(self, plan: Plan, runs: Path, keys: KeySource, results: Results, progress: Progress) -> None:
        self.n, self.block = plan.recovery_blocks, RECOVERY_BLOCK
        self.keys, self.results, self.progress = keys, results, progress
        self.slab = 64 * MiB
        self.host = round_up(self.n * round_up(self.block, IO_ALIGN), self.slab)
        per_slab = 2 * self.slab // nvme_slot_bytes(self.block)
        want = (math.ceil(2 * self.n / per_slab) + 1) * 2 * self.slab
        self.disk = round_up(want, max(2 * self.slab, min(FILE_BYTES, want)))
        self.run_dir = runs / "kvtierd-recovery"
        self.per_batch = max(1, min(4096, plan.batch_bytes // self.block))
        data = np.random.default_rng(1).integers(0, 256, self.per_batch * self.block, np.uint8)
        self.views = block_views(data, self.block, self.per_batch)

    def start(self, disk_dir: Path) -> NvmeDaemon:
        return NvmeDaemon(
            self.run_dir, disk_dir, host_bytes=self.host, slab_bytes=self.slab, disk_bytes=self.disk
        )

    def fill(self, d: NvmeDaemon) -> None:
        """Store ``n`` fresh blocks and wait until all are durable."""
        self.progress.show(f"recovery: storing {self.n:,} blocks of {size_label(self.block)}")
        with contextlib.closing(connect(d.unix, "shm")) as client:
            ns = client.register(bench_namespace(self.block, name="kvtier-bench-recovery"))
            took = put_durable(
                client, ns, self.keys.take(self.n), self.views, self.per_batch, "recovery fill"
            )
        self.results.facts.setdefault("recovery_fill_blocks_per_s", []).append(round(self.n / took))

    def check(self, d: NvmeDaemon, mode: str, blocks: int) -> float:
        """The daemon's recovery seconds, after checking what it recovered."""
        with contextlib.closing(
            Client.connect(d.unix, "tcp", timeout_s=30, client_name="bench-recovery")
        ) as c:
            nv = nvme_stats(c)
        if nv["recovery_mode"] != mode or int(nv["recovered_blocks"]) != blocks:
            raise RuntimeError(
                f"recovery: expected {blocks:,} blocks ({mode}), the daemon "
                f"recovered {nv['recovered_blocks']:,} ({nv['recovery_mode']})"
            )
        return float(nv["recovery_seconds"])

    def cycle(self, disk_dir: Path) -> None:
        """One sample of every figure on ``disk_dir`` (steps 1-3 of the module docstring)."""
        results, progress, n = self.results, self.progress, self.n
        progress.show("recovery: starting kvtierd on an empty directory")
        with self.start(disk_dir) as d:
            results.add_seconds("ready_empty_s", d.ready_s)
            self.fill(d)
        progress.step("recovery fill")  # leaving the with-block sent SIGTERM: drain, checkpoint
        progress.show("recovery: restart after SIGTERM")
        with self.start(disk_dir) as d:
            results.add_seconds("recovery_warm_s", self.check(d, "warm", n))
            results.add_seconds("ready_warm_s", d.ready_s)
            progress.step("recovery")
            self.fill(d)  # in the journal only: no checkpoint covers these
            d.kill9()
        progress.step("recovery fill")
        progress.show("recovery: restart after kill -9")
        with self.start(disk_dir) as d:
            results.add_seconds("recovery_replay_s", self.check(d, "replay", 2 * n))
            results.add_seconds("ready_replay_s", d.ready_s)
            d.kill9()  # quicker than a drain; the directory goes next
        progress.step("recovery")


def bench_recovery(
    plan: Plan, runs: Path, root: Path, keys: KeySource, results: Results, progress: Progress
) -> None:
    """``plan.repeat`` cycles, each on a fresh directory under ``root`` (daemon logs and sockets
    under ``runs``); every recovery figure and the facts the report scales them by."""
    rig = _RecoveryRig(plan, runs, keys, results, progress)
    for r in range(plan.repeat):
        disk_dir = root / f"tier-recovery-{r}"
        try:
            rig.cycle(disk_dir)
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
    results.facts.update(
        recovery_block_bytes=rig.block,
        recovered_warm_blocks=rig.n,
        recovered_replay_blocks=2 * rig.n,
        replayed_journal_records=rig.n,
    )

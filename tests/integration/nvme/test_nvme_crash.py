"""Crash loop: a put workload against a real daemon, killed with SIGKILL at random moments.

Each round runs nvme_driver.py (next to this file) against the daemon (write-through, so blocks
become durable within milliseconds), kills the daemon after a delay drawn from a seeded RNG, and
restarts it on the same disk directory. Pass: every block the daemon reported durable, in any
round, is still there and reads back with identical bytes; every other block that was put is
absent or complete; no read, by the driver or by the test, ever returns other bytes. The disk
is large enough that nothing is evicted from it, so "durable" must mean "still there".

Reproduce a failure with the seed it prints: ``KVTIER_CRASH_SEED=<seed>``;
``KVTIER_CRASH_ROUNDS`` sets the number of rounds (20 by default).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from conftest import DaemonProcess
from nvme_driver import NAMESPACE, block, key

import kvtier

DRIVER = str(Path(__file__).with_name("nvme_driver.py"))
ROUNDS = int(os.environ.get("KVTIER_CRASH_ROUNDS", "20"))
KILL_WINDOW_S = 0.25  # the driver stores about 1,000 blocks/s on a 2-core machine
MAX_BLOCKS = 256  # per round (then it only reads), so that the disk (16,384 slots) never fills
SERVE = (
    "--host-bytes",
    "32MiB",
    "--slab-bytes",
    "1MiB",
    "--disk-bytes",
    "128MiB",
    "--write-policy",
    "write-through",
)
Block = tuple[int, int]  # (round, j)
T = TypeVar("T")


def chunks(items: Sequence[T], n: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def run_round(d: DaemonProcess, rnd: int, delay_s: float) -> tuple[set[Block], int, list[str]]:
    """Drive round ``rnd``, SIGKILL the daemon after ``delay_s``: (blocks reported durable,
    blocks put or in flight, BAD lines)."""
    driver = subprocess.Popen(
        [sys.executable, DRIVER, d.unix, str(rnd), str(MAX_BLOCKS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "READY"
        time.sleep(delay_s)  # sleep: the random kill moment is what this test draws, not an ordering
        d.kill()
        out, err = driver.communicate(timeout=30)
    finally:
        driver.kill()
        driver.wait()
    assert driver.returncode == 0, f"round {rnd}: the driver failed: {err}"
    durable: set[Block] = set()
    attempted = 0
    for line in out.splitlines():
        word, *rest = line.split() or [""]
        if word == "DURABLE":
            durable.update((rnd, int(j)) for j in rest)
        elif word == "PUT":
            attempted = int(rest[1])
    return durable, attempted, [line for line in out.splitlines() if line.startswith("BAD")]


def verify(
    d: DaemonProcess, rnd: int, durable: set[Block], attempted: int, rng: random.Random
) -> dict[str, Any]:
    """After the restart: every durable block is there; the round's blocks and a sample of
    older ones read back identical (durable) or absent/identical (in flight). Returns nvme stats."""
    with kvtier.Client.connect(d.unix, transport="shm", timeout_s=5.0, heartbeat=False) as client:
        ns = client.register(NAMESPACE)
        nvme = client.stats()["nvme"]
        everything = sorted(durable)
        for part in chunks(everything, 1024):
            found = ns.lookup_detail([key(r, j) for r, j in part])
            assert found.hits == len(part), (
                f"round {rnd}: block {part[found.hits]} was reported durable, now it is missing"
            )
            assert all(found.durable) and set(found.tiers) == {"nvme"}
        older = [b for b in everything if b[0] < rnd]
        sample = [(rnd, j) for j in range(attempted)] + rng.sample(older, min(64, len(older)))
        for part in chunks(sample, 512):
            for (r, j), got in zip(part, ns.get([key(r, j) for r, j in part]), strict=True):
                if (r, j) in durable:
                    assert got is not None, f"round {rnd}: durable block {(r, j)} unreadable"
                if got is not None:
                    assert bytes(got) == block(r, j), f"round {rnd}: block {(r, j)}: wrong bytes"
        return dict(nvme)


def test_sigkill_at_random_moments_loses_no_durable_block(daemon_factory: Any, tmp_path: Path) -> None:
    seed = int(os.environ.get("KVTIER_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"crash loop: KVTIER_CRASH_SEED={seed}, {ROUNDS} rounds")
    rng = random.Random(seed)
    serve = (*SERVE, "--disk-dir", str(tmp_path / "nvme"))
    run_dir = tmp_path / "run"
    d = daemon_factory(*serve, run_dir=run_dir)
    durable: set[Block] = set()
    kills_mid_flush = 0
    for rnd in range(ROUNDS):
        delay_s = rng.uniform(0.0, KILL_WINDOW_S)
        new, attempted, bad = run_round(d, rnd, delay_s)
        print(
            f"round {rnd}: killed after {delay_s:.3f}s, {attempted} blocks put or in flight, "
            f"{len(new)} reported durable"
        )
        assert bad == [], f"round {rnd} (seed {seed}): the driver read wrong bytes: {bad}"
        kills_mid_flush += attempted > len(new)
        durable |= new
        d = daemon_factory(*serve, run_dir=run_dir)
        nvme = verify(d, rnd, durable, attempted, rng)
        print(
            f"  restarted: {nvme['recovered_blocks']} blocks recovered "
            f"({nvme['recovery_mode']}) in {nvme['recovery_seconds']:.3f}s"
        )
        assert nvme["recovery_quarantined"] == 0, f"round {rnd} (seed {seed}): {nvme}"
        assert nvme["recovered_blocks"] >= len(durable)
        if new:
            assert nvme["recovery_mode"] == "replay"  # killed: the journal was replayed
    assert durable, "the workload never made a block durable"
    print(
        f"{len(durable)} blocks reported durable; {kills_mid_flush} of {ROUNDS} kills left blocks in flight"
    )
    # At the end, every block ever reported durable, byte for byte.
    with kvtier.Client.connect(d.unix, transport="shm", timeout_s=5.0, heartbeat=False) as client:
        ns = client.register(NAMESPACE)
        everything = sorted(durable)
        for part in chunks(everything, 512):
            got = ns.get([key(r, j) for r, j in part])
            wrong = [b for b, g in zip(part, got, strict=True) if g is None or bytes(g) != block(*b)]
            assert wrong == [], f"seed {seed}: durable blocks lost or changed: {wrong[:5]}"

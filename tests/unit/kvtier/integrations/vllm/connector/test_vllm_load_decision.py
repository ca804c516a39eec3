"""The vLLM planner's load-or-recompute decision (issue 30): figures in, the answer vLLM gets out.

The backend is a fake (no daemon): each prompt's first token says where its hit blocks are, so a
test sets the tiers of a hit. The figures go in the way the connector feeds them: the workers'
``StepReport``/``LoadReport`` through ``Planner.observe`` and the daemon's per-tier figures
through the backend's ``tier_figures`` (read on ``build``). The clock is injected.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.adaptive import Decider
from kvtier.integrations.vllm.connector.config import BASE, Variant
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome, Pin
from kvtier.integrations.vllm.connector.planner import (
    LoadReport,
    Planner,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    StepReport,
)
from kvtier.results import TierFigure

BS = 16
BB = 16384  # bytes of one block (one worker's slice, every layer)
HOST4_NVME4 = ["host"] * 4 + ["nvme"] * 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeBackend:
    """Hits by prompt: ``tiers_by_first_token[prompt[0]]`` lists the tier of each hit block."""

    def __init__(self, tiers_by_first_token: dict[int, list[str]]) -> None:
        self.tiers = tiers_by_first_token
        self.figures: dict[str, TierFigure] = {}
        self.promoted: list[bool] = []  # per lookup: whether it asked the daemon to promote

    def lookup(self, variant: Variant, token_ids: Sequence[int], *, promote: bool = True) -> LookupOutcome:
        self.promoted.append(promote)
        tiers = self.tiers.get(token_ids[0], [])
        keys = [[bytes([i % 256]) * 32 for i in range(len(token_ids) // BS)]]
        return LookupOutcome(keys, len(tiers), list(tiers), [])

    def release(self, pins: Sequence[Pin]) -> None:
        pass

    def tier_figures(self) -> dict[str, TierFigure]:
        return dict(self.figures)

    def close(self) -> None:
        pass


def planner(
    tiers: dict[int, list[str]],
    *,
    policy: str = "adaptive",
    budget: float | None = None,
    sync_s: float | None = None,
    load_async: bool = False,
) -> tuple[Planner, FakeBackend, Clock]:
    clock = Clock()
    backend = FakeBackend(tiers)
    p = Planner(
        block_size=BS,
        backend=backend,
        lookup_timeout_s=30,
        lookup_wait_s=10,
        decider=Decider(policy, probe_after_s=5.0, clock=clock),  # type: ignore[arg-type]
        block_bytes=BB,
        interference_budget=budget,
        sync_load_budget_s=sync_s,
        load_async=load_async,
        clock=clock,
    )
    return p, backend, clock


def ask(p: Planner, req_id: str, first_token: int, n_tokens: int = 12 * BS) -> int:
    """vLLM's question for a new request with nothing cached locally: tokens to load."""
    p.on_new_request(RequestInfo(req_id, [first_token] * n_tokens, BASE))
    got, _ = p.num_new_matched(req_id, 0, n_tokens)
    assert got is not None
    return got


def engine_steps(p: Planner) -> None:
    """The engine's measured steps: 1 ms per token computed, 9 ms fixed (16 ms per block)."""
    p.observe([StepReport(1, 1, 0.010), StepReport(2, 101, 0.110), StepReport(3, 1, 0.010)], [])


def tier_loads(p: Planner, *, nvme_s_per_block: float) -> None:
    """Loads the workers ran: host 0.25 ms per block, nvme as given."""
    p.observe(
        [],
        [
            LoadReport(("w0",), {"host": 4 * BB}, 0.001),
            LoadReport(("w1",), {"nvme": 4 * BB}, 4 * nvme_s_per_block),
        ],
    )


def test_a_slow_nvme_tier_is_cut_after_the_host_prefix() -> None:
    p, _, _ = planner({7: HOST4_NVME4})
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.2)  # 200 ms per block > 16 ms to recompute it
    assert ask(p, "r", 7) == 4 * BS  # the host prefix only
    assert p.num_new_matched("r", 0, 12 * BS) == (4 * BS, False)  # asked again: the same
    s = p.stats
    assert (s.decision_tokens_loaded, s.decision_tokens_recomputed_slower) == (4 * BS, 4 * BS)
    assert p.decider.stats.decisions == 1
    assert s.hit_blocks == 8  # what the lookup found; the answer is what pays off
    p.close()


def test_lookups_promote_nothing_while_decisions_cut_the_tiers_below_host() -> None:
    """A pinned lookup makes the daemon read NVMe hits into the host tier at once; while the
    decisions recompute them, that disk work is wasted (and competes with the engine), so the
    lookups hold them only (``Lookup.hold_only``) until a decision loads that tier again."""
    p, backend, clock = planner({7: HOST4_NVME4, 8: HOST4_NVME4, 9: HOST4_NVME4})
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.2)
    assert ask(p, "slow", 7) == 4 * BS  # nvme cut: the next lookups hold only
    assert ask(p, "held", 8) == 4 * BS
    assert backend.promoted == [True, False]
    tier_loads(p, nvme_s_per_block=0.0005)  # the disk recovered (a probe, or the daemon says)
    assert ask(p, "whole", 9) == 8 * BS
    ask(p, "after", 7)
    assert backend.promoted == [True, False, False, True]
    p.close()


def test_a_sync_load_is_cut_to_what_fits_the_steps_budget() -> None:
    """A synchronous load runs within ``step_budget_ms`` or fails there with its time wasted:
    the decision plans only what is predicted to fit (an async load has no such bound)."""
    for load_async, want in ((False, 5), (True, 8)):
        p, _, _ = planner({7: HOST4_NVME4}, sync_s=0.02, load_async=load_async)
        engine_steps(p)
        tier_loads(p, nvme_s_per_block=0.010)  # 10 ms a block: faster than recompute (16)...
        got = ask(p, "r", 7)
        assert got == want * BS, (load_async, got)  # ...but one fits in 20 ms beside the host
        p.close()


def test_a_fast_tier_is_loaded_whole_and_without_figures_everything_loads() -> None:
    p, _, _ = planner({7: HOST4_NVME4, 8: HOST4_NVME4})
    assert ask(p, "first", 7) == 8 * BS  # nothing measured yet: the load measures the tiers
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.002)  # 2 ms per block < 16 ms
    assert ask(p, "second", 8) == 8 * BS
    assert p.decider.stats.by_reason == {"no-figures": 1, "faster": 1}
    p.close()


def test_a_cut_tier_is_probed_and_comes_back_when_it_recovers() -> None:
    """An async engine probes by loading one block (a failed async load costs only it)."""
    p, _, clock = planner({7: HOST4_NVME4, 8: HOST4_NVME4, 9: HOST4_NVME4}, load_async=True)
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.2)
    assert ask(p, "slow", 7) == 4 * BS
    clock.now += 6.0  # past probe_after_s with nothing new about nvme: one block of it
    assert ask(p, "probe", 8) == 5 * BS
    assert p.stats.decision_probes == 1
    # the probe's load (host 4 blocks + nvme 1 block) was fast: the disk recovered
    p.observe([], [LoadReport(("probe",), {"host": 4 * BB, "nvme": BB}, 0.003)])
    assert ask(p, "back", 9) == 8 * BS
    p.close()


def test_a_sync_engine_probes_a_cut_tier_by_a_read_not_a_load() -> None:
    """A sync load that fails costs vLLM the step's forward (the request is recomputed from the
    failed block), so a sync engine never probes by loading: the next pinned lookups promote
    (the daemon reads the tier), and the daemon's figure of those reads brings the tier back."""
    p, backend, clock = planner({7: HOST4_NVME4, 8: HOST4_NVME4, 9: HOST4_NVME4, 10: HOST4_NVME4}, sync_s=0.1)
    engine_steps(p)
    backend.figures = {"nvme": TierFigure(latency_s=0.15, bytes_per_s=5e7, age_s=0.0, reads=4)}
    p.build(StepInput())
    tier_loads(p, nvme_s_per_block=0.2)  # 200 ms a block: cut
    assert ask(p, "slow", 7) == 4 * BS
    clock.now += 6.0  # a probe is due: nothing more is loaded, the next lookup promotes
    assert ask(p, "probe", 8) == 4 * BS
    assert p.stats.decision_probes == 1
    ask(p, "promotes", 9)
    assert backend.promoted == [True, False, True]  # (the first: nothing was cut yet)
    backend.figures = {"nvme": TierFigure(latency_s=0.0005, bytes_per_s=2e9, age_s=0.0, reads=8)}
    p.build(StepInput())  # the daemon read the disk fast: recovered
    assert ask(p, "back", 10) == 8 * BS
    p.close()


def test_the_daemons_figures_cut_a_tier_the_engine_never_loaded_from() -> None:
    p, backend, _ = planner({7: HOST4_NVME4})
    engine_steps(p)
    p.observe([], [LoadReport(("w0",), {"host": 4 * BB}, 0.001)])
    backend.figures = {"nvme": TierFigure(latency_s=0.25, bytes_per_s=1e9, age_s=0.0, reads=9)}
    p.build(StepInput())  # the scheduler's step reads them (no RPC)
    assert ask(p, "r", 7) == 4 * BS
    p.close()


def test_a_decision_reads_the_daemons_figures_that_arrived_while_the_engine_was_idle() -> None:
    """An idle engine builds no step; the daemon's figures its heartbeats brought meanwhile (a
    disk that slowed under other engines' reads) count from its next request's decision on,
    not from the step after it (the seed run's first slow-phase request loaded and failed)."""
    p, backend, clock = planner({7: HOST4_NVME4})
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.001)  # the disk was fast
    p.build(StepInput())
    clock.now += 10.0
    backend.figures = {"nvme": TierFigure(latency_s=0.25, bytes_per_s=1e9, age_s=0.0, reads=9)}
    assert ask(p, "r", 7) == 4 * BS  # no build in between
    p.close()


@pytest.mark.parametrize("policy, tokens", [("always", 8 * BS), ("never", 0)])
def test_pinned_policies(policy: str, tokens: int) -> None:
    """``always`` loads every hit (and its lookups promote, even from a slow tier); ``never``
    loads none, and its lookups never have the daemon read a disk for blocks it will not load."""
    p, backend, _ = planner({7: HOST4_NVME4, 8: HOST4_NVME4}, policy=policy)
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.2)
    assert ask(p, "r", 7) == tokens
    assert ask(p, "s", 8) == tokens
    assert p.stats.decision_tokens_loaded == 2 * tokens
    assert p.stats.decision_tokens_recomputed_policy == 2 * (8 * BS - tokens)
    assert backend.promoted == [policy == "always"] * 2
    p.close()


def test_a_load_while_another_request_decodes_is_cut_to_the_budget() -> None:
    p, _, _ = planner({5: [], 7: ["host"] * 8}, budget=0.25)
    engine_steps(p)  # recent step ~10-30 ms: the loads' share ~ a few ms
    p.observe([], [LoadReport(("w0",), {"host": 4 * BB}, 0.004)])  # 1 ms per host block
    assert ask(p, "decoding", 5) == 0
    p.build(StepInput([ScheduledRequest("decoding", [0], True, 12 * BS, 1)]))  # it decodes
    got = ask(p, "r", 7)
    budget_s = 0.25 * p.decisions.step_s  # type: ignore[operator]
    assert 0 < got < 8 * BS  # cut back to what fits...
    assert p.decider.figures.predict({"host": got // BS * BB}) <= budget_s  # type: ignore[operator]
    assert p.stats.decision_tokens_recomputed_budget == 8 * BS - got
    # without a decoding request in the step, the same hit loads whole
    p2, _, _ = planner({7: ["host"] * 8}, budget=0.25)
    engine_steps(p2)
    p2.observe([], [LoadReport(("w0",), {"host": 4 * BB}, 0.004)])
    assert ask(p2, "r", 7) == 8 * BS
    p.close()
    p2.close()


def test_the_load_job_carries_tiers_prediction_and_recompute_time_and_the_report_settles_it() -> None:
    p, _, _ = planner({7: HOST4_NVME4})
    engine_steps(p)
    tier_loads(p, nvme_s_per_block=0.2)
    assert ask(p, "r", 7) == 4 * BS
    p.after_alloc("r", list(range(12)), 4 * BS)
    plan = p.build(StepInput([ScheduledRequest("r", list(range(12)), True, 4 * BS, 8 * BS)]))
    (job,) = plan.loads
    assert job.tiers == ["host"] * 4 and job.predicted_s is not None
    # what recomputing the same 4 blocks would take: the sync load waits no longer
    spt = p.decider.prefill.seconds_per_token()
    assert spt is not None and job.recompute_s == pytest.approx(spt * 4 * BS)
    assert plan.tokens == 8 * BS and not plan.decoding
    before = p.stats.load_seconds_actual
    p.observe([], [LoadReport(("r",), {"host": 4 * BB}, 0.0015)])
    assert p.stats.load_seconds_actual == pytest.approx(before + 0.0015)
    assert p.stats.load_seconds_predicted == pytest.approx(job.predicted_s)
    p.close()

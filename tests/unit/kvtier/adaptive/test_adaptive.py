"""The load-or-recompute decision (kvtier.adaptive): figures in, prefix out (issue 30).

Scenarios on an injected clock: block_tokens 16, block_bytes 1 MiB, an engine that prefills at
1 ms per token (16 ms per block of recompute).
"""

from __future__ import annotations

import pytest

from kvtier.adaptive import (
    WORTH_FLOOR_S,
    Decider,
    FixedPrefillRate,
    InterferenceBudget,
    LinearFit,
    LoadFigures,
    PrefillRate,
    worth_waiting_s,
)
from kvtier.calls import MIN_RPC_S

MIB = 1 << 20
BT = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def engine(clock: Clock, decider: Decider, ms_per_token: float = 1.0) -> None:
    """Steps of 64..512 tokens at a fixed 5 ms overhead plus ``ms_per_token``."""
    for tokens in (64, 128, 256, 512, 1, 8):
        decider.step(tokens, 0.005 + tokens * ms_per_token / 1000)


def test_a_linear_fit_finds_overhead_and_slope() -> None:
    clock = Clock()
    fit = LinearFit(clock=clock)
    assert fit.predict(1) is None
    for x in (1, 2, 4, 8):
        fit.observe(x, 0.5 + 2 * x)
    a, b = fit.coefficients() or (0, 0)
    assert a == pytest.approx(0.5) and b == pytest.approx(2)


def test_a_single_point_fits_through_the_origin() -> None:
    fit = LinearFit(clock=Clock())
    fit.observe(4 * MIB, 0.004)
    assert fit.predict(8 * MIB) == pytest.approx(0.008)


def test_old_observations_fade() -> None:
    clock = Clock()
    fit = LinearFit(half_life_s=1.0, clock=clock)
    fit.observe(MIB, 1.0)  # slow
    clock.t += 20  # 20 half-lives later
    fit.observe(MIB, 0.001)  # fast again
    assert fit.predict(MIB) == pytest.approx(0.001, rel=1e-3)


def test_prefill_rate_is_the_slope_of_step_time() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    assert d.prefill.seconds_per_token() == pytest.approx(0.001)


def test_policies_always_and_never_ignore_figures() -> None:
    clock = Clock()
    for policy, want in (("always", 3), ("never", 0)):
        d = Decider(policy, clock=clock)  # type: ignore[arg-type]
        engine(clock, d)
        d.loaded({"nvme": MIB}, 10.0)  # a disk far slower than recompute
        assert d.decide(["host", "nvme", "nvme"], block_tokens=BT, block_bytes=MIB).load_blocks == want
    assert d.stats.tokens_recomputed_policy == 3 * BT


def test_unknown_policy_names_the_setting() -> None:
    with pytest.raises(ValueError, match="load_policy"):
        Decider("sometimes")  # type: ignore[arg-type]


def test_without_figures_it_loads_and_measures() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    got = d.decide(["host", "host"], block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (2, "no-figures")  # no prefill rate yet
    engine(clock, d)
    got = d.decide(["host", "nvme"], block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (2, "no-figures")  # no tier figure yet


def test_a_fast_tier_loads_the_whole_hit() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.loaded({"host": 4 * MIB}, 0.001)  # 4 GB/s: 0.25 ms a block against 16 ms of recompute
    got = d.decide(["host"] * 8, block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (8, "faster")
    assert got.predicted_s is not None and got.recompute_s is not None
    assert got.predicted_s < got.recompute_s


def test_a_slow_tier_is_cut_after_the_fast_prefix() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.loaded({"host": 4 * MIB}, 0.001)
    d.loaded({"nvme": 4 * MIB}, 0.400)  # 100 ms a block: slower than 16 ms of recompute
    got = d.decide(["host", "host", "nvme", "nvme", "nvme"], block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (2, "slower")
    assert d.stats.tokens_recomputed_slower == 3 * BT
    assert d.stats.tokens_loaded == 2 * BT


def test_a_fixed_latency_is_worth_paying_only_for_a_long_enough_prefix() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    for n in (1, 2, 4, 8):  # 50 ms a load, then 1 ms a block
        d.loaded({"nvme": n * MIB}, 0.050 + n * 0.001)
    one = d.decide(["nvme"] * 2, block_tokens=BT, block_bytes=MIB)  # 52 ms against 32
    many = d.decide(["nvme"] * 8, block_tokens=BT, block_bytes=MIB)  # 58 ms against 128
    assert (one.load_blocks, many.load_blocks) == (0, 8)


def test_a_mixed_load_blames_the_slow_tier_not_the_host_tier() -> None:
    clock = Clock()
    figures = LoadFigures(clock=clock)
    figures.observe({"host": MIB}, 0.001)
    figures.observe({"host": 2 * MIB, "nvme": 2 * MIB}, 0.302)
    assert figures.cost("host", MIB) == pytest.approx(0.001)
    assert figures.cost("nvme", 2 * MIB) == pytest.approx(0.300)


def test_a_daemon_report_fresher_than_our_loads_wins() -> None:
    clock = Clock()
    figures = LoadFigures(clock=clock)
    figures.observe({"host": MIB}, 0.001)
    figures.observe({"nvme": MIB}, 0.5)
    clock.t += 10
    figures.report("nvme", 0.0001, 2e9, age_s=1.0)
    assert figures.cost("nvme", MIB) == pytest.approx(0.5)  # ours is recent and slower: kept
    clock.t += 30  # ours is a half-life old
    figures.report("nvme", 0.0001, 2e9, age_s=1.0)  # the disk is fast again
    assert figures.cost("nvme", MIB) == pytest.approx(0.0001 + MIB / 2e9 + 0.001)
    figures.report("nvme", 9.0, 1.0, age_s=20.0)  # older than what we hold: ignored
    assert figures.cost("nvme", MIB) == pytest.approx(0.0001 + MIB / 2e9 + 0.001)


def test_a_tier_that_recovers_is_probed_and_loaded_again() -> None:
    clock = Clock()
    d = Decider(clock=clock, probe_after_s=5.0)
    engine(clock, d)
    d.loaded({"host": MIB}, 0.0003)
    d.loaded({"nvme": 2 * MIB}, 0.400)  # slow disk
    hits = ["host", "nvme", "nvme", "nvme"]
    assert d.decide(hits, block_tokens=BT, block_bytes=MIB).load_blocks == 1  # cut
    clock.t += 2
    assert d.decide(hits, block_tokens=BT, block_bytes=MIB).load_blocks == 1  # not due yet
    clock.t += 4  # nothing new about nvme for 6 s: one probe, one nvme block
    probe = d.decide(hits, block_tokens=BT, block_bytes=MIB)
    assert (probe.load_blocks, probe.reason) == (2, "probe")
    assert d.decide(hits, block_tokens=BT, block_bytes=MIB).reason == "slower"  # once
    clock.t += 1
    d.loaded({"host": MIB, "nvme": MIB}, 0.0008, predicted_s=probe.predicted_s)  # recovered
    got = d.decide(hits, block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (4, "faster")
    assert d.stats.probes == 1 and d.stats.loads_timed == 1


def test_the_budget_cuts_a_load_that_does_not_fit() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.loaded({"host": MIB}, 0.002)  # 2 ms a block, against 16 ms of recompute
    got = d.decide(["host"] * 8, block_tokens=BT, block_bytes=MIB, max_load_s=0.005)
    assert (got.load_blocks, got.reason) == (2, "budget")
    assert d.stats.tokens_recomputed_budget == 6 * BT


def test_the_budget_puts_loads_before_stores_and_drops_stores_when_spent() -> None:
    b = InterferenceBudget(0.25)
    assert b.admit_store(0.5)  # no step measured yet: nothing to bound against
    b.step(0.040)  # a first step: two steps' worth (20 ms) of transfer allowed
    b.charge_load(0.018)
    assert b.admit_store(0.004, nbytes=100)  # 2 ms left: admitted, goes 2 ms into debt
    assert not b.admit_store(0.001, nbytes=100)  # spent: dropped, counted
    assert (b.stats.stores_admitted, b.stats.stores_dropped, b.stats.bytes_dropped) == (2, 1, 100)
    for _ in range(10):
        b.step(0.040)
    assert b.balance == pytest.approx(0.020)  # capped at two steps' worth
    b.settle(0.004, 0.010)
    assert b.balance == pytest.approx(0.014)


def test_the_budget_bounds_transfer_time_over_a_run_of_steps() -> None:
    b = InterferenceBudget(0.1, burst_steps=1)
    for _ in range(100):
        b.step(0.030)
        while b.admit_store(0.002):
            pass
    # at most fraction x step time, plus one job past the last refill
    assert b.stats.store_s <= 0.1 * b.stats.step_s + 0.002 + 1e-12
    assert b.stats.stores_dropped >= 100


def test_no_budget_admits_everything() -> None:
    b = InterferenceBudget(None)
    assert all(b.admit_store(1.0) for _ in range(5))
    with pytest.raises(ValueError, match="interference_budget"):
        InterferenceBudget(1.5)


def test_a_change_of_regime_restarts_the_fit_and_jitter_does_not() -> None:
    fit = LinearFit(clock=Clock())
    for _ in range(5):
        fit.observe(MIB, 0.0002)
    fit.observe(MIB, 0.0007)  # 3.5x, and under a millisecond away: jitter, averaged in
    assert fit.predict(MIB) == pytest.approx((5 * 0.0002 + 0.0007) / 6)
    fit.observe(MIB, 0.200)  # the disk slowed down: what came before is dropped
    assert fit.predict(MIB) == pytest.approx(0.200)


def test_a_tier_that_stays_slow_is_probed_ever_less_often() -> None:
    clock = Clock()
    d = Decider(clock=clock, probe_after_s=5.0, probe_max_s=20.0)
    engine(clock, d)
    d.loaded({"nvme": MIB}, 0.5)
    hits = ["nvme"] * 4
    probes = []
    for _ in range(90):  # 90 s, one decision a second, the disk still slow after each probe
        clock.t += 1
        got = d.decide(hits, block_tokens=BT, block_bytes=MIB)
        if got.reason == "probe":
            probes.append(clock.t - 1000)
            d.loaded({"nvme": MIB}, 0.5)
    assert probes == [5.0, 15.0, 35.0, 55.0, 75.0]  # waits 5, 10, 20, 20, 20 after the news


def test_a_prefill_rate_keeps_its_slope_through_one_noisy_step() -> None:
    """A step 10x slower than the fit (the host busy for one step) would restart a load
    figure's fit; the prefill rate keeps its figures (issue 30: the Transformers prefix cache
    times a few noisy forwards per generate)."""
    rate = PrefillRate(clock=Clock())
    for tokens in (64, 1, 6, 1, 64, 1):
        rate.observe_step(tokens, 0.004 + tokens * 0.001)
    rate.observe_step(1, 0.05)  # one outlier step
    spt = rate.seconds_per_token()
    assert spt is not None and spt == pytest.approx(0.001, rel=0.3), spt


def test_an_operators_fixed_rate_weighs_loads_where_no_step_is_seen() -> None:
    """SGLang's storage backend sees no engine step: the operator's rate decides (issue 30)."""
    clock = Clock()
    rate = FixedPrefillRate(0.001)
    rate.observe_step(100, 5.0)  # ignored: the figure is the operator's
    assert rate.seconds_per_token() == 0.001 and rate.seconds_for(16) == pytest.approx(0.016)
    decider = Decider(prefill=rate, clock=clock)
    decider.loaded({"nvme": MIB}, 0.200)  # 200 ms a block against 16 ms of recompute
    assert decider.decide(["nvme"] * 4, block_tokens=BT, block_bytes=MIB).load_blocks == 0
    with pytest.raises(ValueError, match="prefill_seconds_per_token"):
        FixedPrefillRate(0.0)


def test_prefill_rate_holds_over_interleaved_decode_and_prefill_steps() -> None:
    # decode steps (1 token, the fixed cost) and prefill steps lie far apart on one line: neither
    # may restart the fit as a "new regime" (it did: the rate then swung with the last step)
    rate = PrefillRate(clock=Clock())
    for _ in range(3):
        rate.observe_step(1, 0.010)
        rate.observe_step(101, 0.110)
    assert rate.seconds_per_token() == pytest.approx(0.001)
    rate.observe_step(1, 0.010)  # a decode step last: the same rate
    assert rate.seconds_per_token() == pytest.approx(0.001)


def test_cut_tiers_name_the_tiers_the_latest_decisions_cut_back() -> None:
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.loaded({"host": MIB}, 0.0003)
    d.loaded({"nvme": MIB}, 0.300)
    assert d.decide(["host", "nvme"], block_tokens=BT, block_bytes=MIB).load_blocks == 1
    assert d.cut_tiers == {"nvme"}
    d.loaded({"nvme": MIB}, 0.0004)  # recovered
    assert d.decide(["host", "nvme"], block_tokens=BT, block_bytes=MIB).load_blocks == 2
    assert d.cut_tiers == set()


def test_an_unmeasured_tier_is_loaded_while_a_slow_one_behind_it_is_cut() -> None:
    """The host tier never measured (its first load was setup), NVMe known slow from the
    daemon: load the host prefix (it measures the host tier), recompute the NVMe blocks."""
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.report("nvme", 0.150, 50e6)  # 150 ms a read
    got = d.decide(["host", "host", "nvme", "nvme"], block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason, got.predicted_s) == (2, "slower", None)
    got = d.decide(["host", "host"], block_tokens=BT, block_bytes=MIB)
    assert (got.load_blocks, got.reason) == (2, "no-figures")


def test_a_daemon_figure_that_misses_what_the_engine_pays_does_not_win_over_a_recent_load() -> None:
    """The daemon fits its reads as latency + bytes / bandwidth; reads that run in parallel
    with the same sizes look like bandwidth (150 ms each, 4 at once: 'fast'). The engine's own
    load that ran out of its 100 ms step budget says one block takes longer: kept while recent
    (the seed experiment's slow tier planned 2-block loads that all failed before this)."""
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)
    d.loaded({"host": MIB}, 0.0003)
    d.report("nvme", 0.002, 4 * MIB / 0.150)  # 4 reads in 150 ms: about 38 ms a block
    hits = ["host", "nvme", "nvme", "nvme"]  # blocks of 128 tokens: 128 ms of recompute each
    assert d.decide(hits, block_tokens=128, block_bytes=MIB, max_load_s=0.1).load_blocks == 3
    d.loaded({"nvme": MIB}, 0.100)  # a load cut at the deadline: one block took >= 100 ms
    d.report("nvme", 0.002, 4 * MIB / 0.150)  # the daemon, fresher, says the same as before
    assert d.decide(hits, block_tokens=128, block_bytes=MIB, max_load_s=0.1).load_blocks == 1


def test_a_tier_the_daemon_sees_recover_wins_over_our_slow_load() -> None:
    """Our slow own load is kept over a faster daemon figure only while the daemon says what it
    said then: once other clients' reads show the tier 4x faster, the daemon's figure wins (a
    sync engine whose probes are rare sees the recovery within a heartbeat, not a half-life)."""
    clock = Clock()
    figures = LoadFigures(clock=clock)
    figures.observe({"host": MIB}, 0.001)
    figures.report("nvme", 0.150, 50e6)  # the slow disk, as the daemon measures it
    figures.observe({"nvme": MIB}, 0.400)  # and as we paid it
    clock.t += 1
    figures.report("nvme", 0.140, 50e6)  # still slow: ours is kept
    assert figures.cost("nvme", MIB) == pytest.approx(0.400)
    clock.t += 1
    figures.report("nvme", 0.0002, 2e9)  # the disk recovered, within our half-life
    assert figures.cost("nvme", MIB) == pytest.approx(0.0002 + MIB / 2e9 + 0.001)


def test_a_read_probe_loads_nothing_and_names_the_tier_to_read() -> None:
    """Where a failed load costs more than its block (a vLLM sync load: the step's forward is
    recomputed), a probe due reads the tier instead of loading it: the decision stays cut and
    the tier is named in ``probe_reads``; the daemon's figure of that read then brings it back."""
    clock = Clock()
    d = Decider(clock=clock, probe_after_s=5.0)
    engine(clock, d)
    d.loaded({"host": MIB}, 0.0003)
    d.report("nvme", 0.150, 50e6)
    d.loaded({"nvme": MIB}, 0.400)
    hits = ["host", "nvme", "nvme"]
    clock.t += 6  # a probe is due
    got = d.decide(hits, block_tokens=BT, block_bytes=MIB, read_probes=True)
    assert (got.load_blocks, got.reason) == (1, "slower")
    assert d.probe_reads == {"nvme"} and d.stats.probes == 1
    d.probe_reads.clear()
    assert d.decide(hits, block_tokens=BT, block_bytes=MIB, read_probes=True).load_blocks == 1
    assert d.probe_reads == set()  # not due again yet
    d.report("nvme", 0.0002, 2e9)  # the daemon read it: fast again
    got = d.decide(hits, block_tokens=BT, block_bytes=MIB, read_probes=True)
    assert (got.load_blocks, got.reason) == (3, "faster")


def test_a_decided_load_is_worth_waiting_for_as_long_as_recomputing_it() -> None:
    assert worth_waiting_s(0.09) == 0.09
    assert worth_waiting_s(0.0001) == WORTH_FLOOR_S
    # the floor lets the load's RPCs start: a client starts none with less than MIN_RPC_S left
    # (a shorter deadline would fail every load at once, and read the tier as slow)
    assert WORTH_FLOOR_S >= 2 * MIN_RPC_S
    assert worth_waiting_s(None) is None  # unknown: the owner's own limit
    clock = Clock()
    d = Decider(clock=clock)
    engine(clock, d)  # 1 ms a token
    for n in (1, 2, 4):
        d.loaded({"host": n * MIB}, 0.001 * n)
    got = d.decide(["host"] * 2, block_tokens=BT, block_bytes=MIB)
    assert got.reason == "faster" and got.recompute_s is not None
    assert got.recompute_s == pytest.approx(2 * BT * 0.001, rel=0.3)
    assert worth_waiting_s(got.recompute_s) == WORTH_FLOOR_S  # 32 ms to recompute: the floor

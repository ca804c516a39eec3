"""The daemon's per-tier read figures (kvtierd.cache.read_figures, issue 30), their Prometheus
families, and the test-only latency file that slows the NVMe tier while a daemon runs.

Clocks are injected: every time is a number written in the test, nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily

from kvtierd.cache.read_figures import MAX_BYTES_PER_S, ReadFigures
from kvtierd.metric_families import KvtierCollector
from kvtierd.testing.faults import LatencyFile
from kvtierd.testing.serve import _fault

MIB = 1 << 20


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_nothing_is_known_before_the_first_read() -> None:
    figs = ReadFigures(clock=Clock())
    assert figs.figure() is None
    figs.observe(0, 1.0, 1.0, 2.0)  # a batch that read nothing (every block failed)
    assert figs.figure() is None and figs.reads == 0


def test_one_read_splits_into_its_waiting_and_its_transfer() -> None:
    clock = Clock(10.0)
    figs = ReadFigures(clock=clock)
    # asked at 9.0, submitted at 9.5 (0.5 s waiting for room / the I/O pool), done at 10.0
    figs.observe(4 * MIB, 9.0, 9.5, 10.0)
    f = figs.figure()
    assert f is not None
    # one size only: the read's own time is the transfer, the rest the latency
    assert f.latency_s == pytest.approx(0.5)
    assert f.bytes_per_s == pytest.approx(8 * MIB)
    assert f.latency_s + 4 * MIB / f.bytes_per_s == pytest.approx(1.0)  # the batch's cost
    assert (f.age_s, f.reads) == (0.0, 1)
    clock.t = 12.5
    f2 = figs.figure()
    assert f2 is not None and f2.age_s == pytest.approx(2.5)
    assert f2.latency_s == f.latency_s  # no read since: the figure stays, only older


SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 2 * MIB]  # load sizes vary, as prompts' hits do


def test_a_fixed_cost_per_read_is_latency_and_the_rest_bandwidth() -> None:
    """A disk that takes 50 ms per read batch, then moves 1 GB/s: both figures are found, so
    ``latency + n / bandwidth`` predicts a batch of any size without counting it twice."""
    clock = Clock(0.0)
    figs = ReadFigures(clock=clock)
    for i in range(12):
        n = SIZES[i % len(SIZES)]
        t = clock.t
        clock.t += 0.050 + n / 1e9
        figs.observe(n, t, t, clock.t)  # the 50 ms are inside the read, as a slow disk's are
    f = figs.figure()
    assert f is not None
    assert f.latency_s == pytest.approx(0.050, rel=1e-6)
    assert f.bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert f.latency_s + 8 * MIB / f.bytes_per_s == pytest.approx(0.050 + 8 * MIB / 1e9)


def test_a_tier_that_slows_is_followed_within_a_few_reads_and_recovers_the_same_way() -> None:
    clock = Clock(0.0)
    figs = ReadFigures(weight=0.3, half_life_s=10.0, clock=clock)
    i = 0

    def read(fixed_s: float) -> float:
        """One read batch back to back with the previous one: ``fixed_s`` + 1 GB/s."""
        nonlocal i
        n = SIZES[i % len(SIZES)]
        i += 1
        start = clock.t
        clock.t += fixed_s + n / 1e9
        figs.observe(n, start, start, clock.t)
        f = figs.figure()
        assert f is not None
        return f.latency_s

    fast = [read(0.001) for _ in range(12)]
    assert fast[-1] == pytest.approx(0.001, rel=1e-3)
    slow = [read(0.050) for _ in range(8)]
    assert slow[0] > 0.01  # seen at the first slow read
    assert slow[-1] > 0.045  # eight reads on: nearly all of it
    back = [read(0.001) for _ in range(10)]
    assert back[0] < slow[-1] and back[-1] < 0.005  # recovered
    f = figs.figure()
    assert f is not None and f.reads == 30


def test_after_a_long_silence_one_read_outweighs_the_old_figures() -> None:
    clock = Clock(0.0)
    figs = ReadFigures(weight=0.3, half_life_s=1.0, clock=clock)
    for _ in range(20):  # each waited 50 ms before its 1 ms read
        figs.observe(MIB, clock.t, clock.t + 0.050, clock.t + 0.051)
        clock.t += 0.051
    clock.t += 10.0  # ten half-lives without a read
    figs.observe(MIB, clock.t - 0.002, clock.t - 0.001, clock.t)  # waited 1 ms
    f = figs.figure()
    assert f is not None
    # the past (~3.3 reads' weight) fades to 0.7 * 2**-10 of that: the new read is nearly all
    # of the figure (back to back, it would be 0.7 * 3.3 against 1: ~0.035 s)
    assert 0.001 <= f.latency_s < 0.0012


def test_the_slope_stays_between_zero_and_the_reads_own_rate() -> None:
    clock = Clock(0.0)
    # bigger batches were no slower (noise on a latency-bound tier): no bandwidth term
    flat = ReadFigures(weight=0.5, half_life_s=1e9, clock=clock)
    flat.observe(MIB, 0.0, 0.0, 0.060)
    flat.observe(8 * MIB, 1.0, 1.0, 1.050)
    f = flat.figure()
    assert f is not None and f.bytes_per_s == MAX_BYTES_PER_S
    assert f.latency_s == pytest.approx((0.5 * 0.060 + 0.050) / 1.5, rel=1e-3)  # mean cost
    # a steeper line than the reads themselves allow (the waiting grew with size): clamped
    steep = ReadFigures(weight=0.5, half_life_s=1e9, clock=clock)
    steep.observe(MIB, 0.0, 0.0, 0.010)  # 1 MiB in 10 ms
    steep.observe(8 * MIB, 1.0, 1.24, 1.30)  # 8 MiB in 60 ms, after waiting 240 ms
    f = steep.figure()  # (300 ms against 80 ms predicted: under 4x, one regime)
    assert f is not None
    rate = (0.5 * MIB + 8 * MIB) / (0.5 * 0.010 + 0.06)  # the reads' own, bytes-weighted
    assert f.bytes_per_s == pytest.approx(rate)
    assert f.latency_s >= 0.0


def test_the_collector_exposes_latency_and_bandwidth_per_tier() -> None:
    snap = _snapshot(
        tier_figures=[
            {"tier": 2, "latency_us": 52_000, "bytes_per_s": 80 * MIB, "age_ms": 3, "reads": 7},
            {"tier": 3, "latency_us": 1_500, "bytes_per_s": 400 * MIB, "age_ms": 9, "reads": 2},
        ]
    )
    families = {f.name: f for f in KvtierCollector(lambda: snap).collect()}
    lat, bw = families["kvtier_tier_read_latency_seconds"], families["kvtier_tier_read_bytes_per_second"]
    assert isinstance(lat, GaugeMetricFamily)
    assert {s.labels["tier"]: s.value for s in lat.samples} == {"nvme": 0.052, "cluster": 0.0015}
    assert {s.labels["tier"]: s.value for s in bw.samples} == {"nvme": 80 * MIB, "cluster": 400 * MIB}
    empty = {f.name: f for f in KvtierCollector(lambda: _snapshot()).collect()}
    assert empty["kvtier_tier_read_latency_seconds"].samples == []  # no read yet: no sample


def _snapshot(**extra: object) -> dict[str, object]:
    """The smallest snapshot the collector renders (the Stats reply of an idle daemon)."""
    from kvtier_contract.protoutil import to_dict
    from kvtier_contract.v1 import kvtier_pb2 as pb

    snap = to_dict(pb.StatsReply(boot_epoch=1))
    snap.update(rpc_errors={}, rpc_latency={}, **extra)
    return snap


def test_the_latency_file_is_read_at_most_every_refresh(tmp_path: Path) -> None:
    path = tmp_path / "read-latency-ms"
    clock = Clock(0.0)
    latency = LatencyFile(str(path), refresh_s=0.1, clock=clock)
    assert latency() == 0.0  # missing: no latency
    path.write_text("50\n")
    clock.t = 0.05
    assert latency() == 0.0  # not read again yet
    clock.t = 0.1
    assert latency() == pytest.approx(0.050)
    path.write_text("0")
    clock.t = 0.15
    assert latency() == pytest.approx(0.050)
    clock.t = 0.25
    assert latency() == 0.0  # recovered
    for text in ("", "  ", "fast", "-5", "nan", "inf"):
        path.write_text(text)
        clock.t += 1.0
        assert latency() == 0.0, text
    path.write_text("2.5")
    clock.t += 1.0
    assert latency() == pytest.approx(0.0025)


def test_the_launcher_takes_either_flag_and_passes_the_rest_on(tmp_path: Path) -> None:
    source, fixed, rest = _fault(["--read-latency-ms", "20", "serve", "--x"])
    assert (source, fixed, rest) == (None, 0.020, ["serve", "--x"])
    source, fixed, rest = _fault(["--read-latency-file", str(tmp_path / "f"), "serve"])
    assert isinstance(source, LatencyFile) and source.path == str(tmp_path / "f")
    assert (fixed, rest) == (0.0, ["serve"])
    assert _fault(["serve"]) == (None, 0.0, ["serve"])
    with pytest.raises(SystemExit, match="--read-latency-file needs a value"):
        _fault(["--read-latency-file"])


def test_kvtier_stats_prints_the_read_figures() -> None:
    from kvtier.cli import format_stats

    snap = _snapshot(
        tier_figures=[{"tier": 2, "latency_us": 52_000, "bytes_per_s": 80 * MIB, "age_ms": 1500, "reads": 7}]
    )
    snap.update(eviction_policy="lru")
    text = format_stats(snap)
    assert "reads into the host tier: nvme 52.0 ms, 80.0 MiB/s (7 reads, last 1.5s ago)" in text
    assert "reads into the host tier" not in format_stats({**snap, "tier_figures": []})


def test_parts_read_in_parallel_are_not_taken_for_bandwidth() -> None:
    """The NVMe link reads a promotion as ~4 MiB parts on the tier's I/O threads: 4 parts of
    150 ms at once take 150 ms for 16 MiB. A line through whole batches says 37.5 ms a part and
    no latency, so a load of one part (150 ms) would be predicted at 37.5 ms: the seed run's
    adaptive engine planned such loads and they failed. With the parts' own times, a part is
    predicted at what one took, and 4 at less than twice what they took (the safe side)."""
    clock = Clock(10.0)
    figs = ReadFigures(clock=clock)
    for _ in range(3):
        figs.observe(16 * MIB, 9.85, 9.85, 10.0, [(4 * MIB, 0.150)] * 4)
    fig = figs.figure()
    assert fig is not None
    one = fig.latency_s + 4 * MIB / fig.bytes_per_s
    four = fig.latency_s + 16 * MIB / fig.bytes_per_s
    assert one == pytest.approx(0.150)
    assert 0.150 < four < 0.300
    plain = ReadFigures(clock=clock)  # one part: unchanged (the part's share is its whole)
    plain.observe(4 * MIB, 9.85, 9.85, 10.0, [(4 * MIB, 0.150)])
    solo = plain.figure()
    assert solo is not None and solo.latency_s == pytest.approx(0.0)


def test_a_disk_that_slows_is_told_at_once_not_blended_in() -> None:
    """A batch 4x off the prediction restarts the figures (as the clients' fits do): after
    many fast reads, one read 150 ms slower is the figure at once, the change put on the
    latency (the slope kept), and recovery the same way. A blend that is still fast half-way
    made the seed run's adaptive engine plan a one-block load that then failed."""
    clock = Clock(0.0)
    figs = ReadFigures(clock=clock)
    for n in (MIB, 4 * MIB, 2 * MIB, 8 * MIB) * 3:  # 1 ms + 1 GB/s
        start = clock.t
        clock.t += 0.001 + n / 1e9
        figs.observe(n, start, start, clock.t)
    start = clock.t
    clock.t += 0.151 + 4 * MIB / 1e9
    figs.observe(4 * MIB, start, start, clock.t)
    f = figs.figure()
    assert f is not None
    assert f.bytes_per_s == pytest.approx(1e9, rel=1e-3)
    assert f.latency_s == pytest.approx(0.151, rel=1e-3)
    start = clock.t
    clock.t += 0.001 + 4 * MIB / 1e9
    figs.observe(4 * MIB, start, start, clock.t)  # recovered
    f = figs.figure()
    assert f is not None and f.latency_s == pytest.approx(0.001, rel=1e-3)

"""The daemon's per-tier read figures (kvtierd.cache.read_figures, issue 30), their Prometheus
families, and the test-only latency file that slows the NVMe tier while a daemon runs.

Clocks are injected: every time is a number written in the test, nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily

from kvtierd.cache.read_figures import ReadFigures
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


def test_one_read_gives_its_latency_bandwidth_and_age() -> None:
    clock = Clock(10.0)
    figs = ReadFigures(clock=clock)
    # asked at 9.0, submitted at 9.5 (0.5 s waiting for room / the I/O pool), done at 10.0
    figs.observe(4 * MIB, 9.0, 9.5, 10.0)
    f = figs.figure()
    assert f is not None
    assert f.latency_s == pytest.approx(1.0)  # queueing counts in the latency
    assert f.bytes_per_s == pytest.approx(8 * MIB)  # bandwidth over the read itself
    assert (f.age_s, f.reads) == (0.0, 1)
    clock.t = 12.5
    f2 = figs.figure()
    assert f2 is not None and f2.age_s == pytest.approx(2.5)
    assert f2.latency_s == f.latency_s  # no read since: the figure stays, only older


def test_a_tier_that_slows_is_followed_within_a_few_reads_and_recovers_the_same_way() -> None:
    clock = Clock(0.0)
    figs = ReadFigures(weight=0.3, half_life_s=10.0, clock=clock)

    def read(latency_s: float) -> float:
        """One 1 MiB read batch of ``latency_s`` back to back with the previous one."""
        start = clock.t
        clock.t += latency_s
        figs.observe(MIB, start, start, clock.t)
        f = figs.figure()
        assert f is not None
        return f.latency_s

    fast = [read(0.001) for _ in range(10)]
    assert fast[-1] == pytest.approx(0.001)
    slow = [read(0.050) for _ in range(6)]
    assert slow == sorted(slow)  # rising
    assert 0.015 < slow[0] < 0.02  # the first slow read weighs 0.3 of the figure
    assert slow[-1] > 0.04  # six reads on: nearly all of it
    back = [read(0.001) for _ in range(10)]
    assert back == sorted(back, reverse=True)
    assert back[-1] < 0.003  # recovered
    f = figs.figure()
    assert f is not None and f.reads == 26


def test_after_a_long_silence_one_read_outweighs_the_old_figures() -> None:
    clock = Clock(0.0)
    figs = ReadFigures(weight=0.3, half_life_s=1.0, clock=clock)
    for _ in range(20):
        figs.observe(MIB, clock.t, clock.t, clock.t + 0.050)
        clock.t += 0.050
    clock.t += 10.0  # ten half-lives without a read
    figs.observe(MIB, clock.t - 0.001, clock.t - 0.001, clock.t)
    f = figs.figure()
    assert f is not None
    # the past (~3.3 reads' weight) fades to 0.7 * 2**-10 of that: the new read is nearly all
    # of the figure (back to back, it would be 0.7 * 3.3 against 1: ~0.035 s)
    assert 0.001 < f.latency_s < 0.0012


def test_bandwidth_weighs_large_batches_by_their_bytes() -> None:
    clock = Clock(0.0)
    figs = ReadFigures(weight=1.0, clock=clock)  # no memory: the latest batch alone
    figs.observe(MIB, 0.0, 0.0, 1.0)
    figs.observe(3 * MIB, 1.0, 1.0, 2.0)
    f = figs.figure()
    assert f is not None and f.bytes_per_s == pytest.approx(3 * MIB)
    halves = ReadFigures(weight=0.5, half_life_s=1e9, clock=clock)
    halves.observe(MIB, 0.0, 0.0, 1.0)  # 1 MiB/s
    halves.observe(9 * MIB, 1.0, 1.0, 2.0)  # 9 MiB/s
    f = halves.figure()
    # (0.5 * 1 + 9) MiB over (0.5 * 1 + 1) s: the bigger batch dominates
    assert f is not None and f.bytes_per_s == pytest.approx(9.5 / 1.5 * MIB)


def test_the_collector_exposes_latency_and_bandwidth_per_tier() -> None:
    snap = _snapshot(tier_figures=[
        {"tier": 2, "latency_us": 52_000, "bytes_per_s": 80 * MIB, "age_ms": 3, "reads": 7},
        {"tier": 3, "latency_us": 1_500, "bytes_per_s": 400 * MIB, "age_ms": 9, "reads": 2},
    ])
    families = {f.name: f for f in KvtierCollector(lambda: snap).collect()}
    lat, bw = families["kvtier_tier_read_latency_seconds"], \
        families["kvtier_tier_read_bytes_per_second"]
    assert isinstance(lat, GaugeMetricFamily)
    assert {s.labels["tier"]: s.value for s in lat.samples} == {"nvme": 0.052, "cluster": 0.0015}
    assert {s.labels["tier"]: s.value for s in bw.samples} == {"nvme": 80 * MIB,
                                                               "cluster": 400 * MIB}
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

    snap = _snapshot(tier_figures=[
        {"tier": 2, "latency_us": 52_000, "bytes_per_s": 80 * MIB, "age_ms": 1500, "reads": 7}])
    snap.update(eviction_policy="lru")
    text = format_stats(snap)
    assert "reads into the host tier: nvme 52.0 ms, 80.0 MiB/s (7 reads, last 1.5s ago)" in text
    assert "reads into the host tier" not in format_stats({**snap, "tier_figures": []})

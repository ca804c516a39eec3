"""The daemon's per-tier read figures reach the SDK (issue 30): a real daemon whose NVMe tier is
slowed and un-slowed while it runs (``python -m kvtierd.testing.serve --read-latency-file F``,
test-only), a real client.

The host tier is 2 MiB (128 blocks of 16 KiB): of 256 blocks put, the first 128 are pushed out
to the NVMe tier, so a load of them is a promotion (an NVMe read into the host tier). The
client's lease is 0.6 s, so it heartbeats every 0.2 s; its ``tier_figures()`` follow the disk
within a heartbeat or two, over the control channel (the shm default) and over gRPC alike.
Load sizes vary (1 to 4 blocks), as prompts' hits do, so that the daemon can tell the fixed
cost of a read (latency) from its transfer (bandwidth; kvtierd.cache.read_figures).
A client that connects later has the figures from its OpenSession reply, before any heartbeat;
/metrics has them per tier.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SlowDiskDaemon, make_namespace, small_tiers
from tests_helpers import scrape_metrics, set_read_latency, wait_for

import kvtier
from kvtier.results import TierFigure
from kvtier_contract.v1 import kvtier_pb2 as pb

HOST_BLOCKS = 128
SLOW_MS = 50
SIZES = [1, 4, 2, 3]  # blocks per load, in turn: sizes vary, so latency and bandwidth part
# (at most 4: the NVMe tier's 4 I/O threads read them at once, each read SLOW_MS slower)


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[SlowDiskDaemon, Path]]:
    latency = tmp_path / "read-latency-ms"  # absent: no latency (the start reads the disk)
    d = SlowDiskDaemon(
        tmp_path / "run", *small_tiers(tmp_path, "2MiB", "1MiB", "16MiB", "write-back"), latency_file=latency
    ).start()
    try:
        yield d, latency
    finally:
        d.kill()


def nvme_latency(client: kvtier.Client) -> float | None:
    fig = client.tier_figures().get("nvme")
    return None if fig is None else fig.latency_s


@pytest.mark.parametrize("control_channel", [True, False], ids=["control", "grpc"])
def test_the_nvme_figure_follows_a_disk_that_slows_and_recovers(
    slow: tuple[SlowDiskDaemon, Path], control_channel: bool
) -> None:
    d, latency = slow
    with kvtier.Client.connect(
        d.unix, "shm", lease_ttl_s=0.6, local_lookups=False, control_channel=control_channel
    ) as client:
        assert (client.session.connection.control is not None) == control_channel
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2 * HOST_BLOCKS)))
        for i in range(0, len(keys), 16):
            data = [hashlib.shake_256(b"f%d" % j).digest(ns.block_bytes) for j in range(i, i + 16)]
            assert ns.put(keys[i : i + 16], data).stored == 16
        assert ns.lookup_detail(keys[:HOST_BLOCKS]).tiers == ["nvme"] * HOST_BLOCKS
        assert client.tier_figures() == {}  # nothing read from the disk yet
        loaded = 0

        def load() -> None:
            """One load of blocks held only on the NVMe tier (the next ones): a promotion."""
            nonlocal loaded
            n = SIZES[fig_reads() % len(SIZES)]
            got = ns.get(keys[loaded : loaded + n])
            assert len(got) == n and all(g is not None for g in got)
            loaded += n

        def fig_now() -> TierFigure:
            return client.tier_figures().get("nvme") or TierFigure(1.0, 1.0, 0.0)

        def fig_reads() -> int:
            reply = client.session.call("Heartbeat", pb.HeartbeatRequest())  # as the thread does
            return sum(f.reads for f in reply.tier_figures)

        set_read_latency(latency, SLOW_MS)
        took = 0.0
        for _ in range(4):
            t0 = time.monotonic()
            load()
            took = max(took, time.monotonic() - t0)
            assert time.monotonic() - t0 >= SLOW_MS / 1000  # the disk is slow: a load waits
        # (the loads' heartbeats brought some: wait for the thread's)
        client.session.connection.figures.forget()
        wait_for(
            "the slow NVMe figure", lambda: (nvme_latency(client) or 0) >= 0.9 * SLOW_MS / 1000, timeout=1.0
        )  # a heartbeat comes every 0.2 s
        fig = client.tier_figures()["nvme"]
        assert fig.reads == 4 and fig.bytes_per_s > 0 and fig.age_s < 1.0
        assert fig.latency_s <= took  # measured inside the daemon: less than end to end
        for n in SIZES:  # what the figures predict for a load is what one took
            assert SLOW_MS / 1000 * 0.9 < fig.latency_s + n * ns.block_bytes / fig.bytes_per_s <= took + 0.02

        reply = client.session.call("Heartbeat", pb.HeartbeatRequest())  # the same path as the loop
        assert [f.tier for f in reply.tier_figures] == [pb.TIER_NVME]
        assert reply.tier_figures[0].latency_us >= 0.9 * SLOW_MS * 1000
        if control_channel:
            ctl = client.session.connection.control
            assert ctl is not None and ctl.calls > 0

        set_read_latency(latency, 0)  # the disk recovers
        for _ in range(8):
            load()
        wait_for("the NVMe figure of all 12 loads", lambda: fig_now().reads == 12, timeout=1.0)
        assert fig_now().latency_s < 0.025  # fallen back

        # a client that connects now has the figures at once (its OpenSession reply)
        with kvtier.Client.connect(d.unix, "shm", heartbeat=False) as late:
            late_fig = late.tier_figures()["nvme"]
            assert late_fig.reads == 12 and late_fig.latency_s < 0.025

        status, text = scrape_metrics(d, None)
        assert status == 200
        line = next(
            ln for ln in text.splitlines() if ln.startswith('kvtier_tier_read_latency_seconds{tier="nvme"}')
        )
        assert 0 < float(line.split()[-1]) < 0.025
        assert 'kvtier_tier_read_bytes_per_second{tier="nvme"}' in text


def test_a_host_only_load_never_waits_on_the_slow_disk(slow: tuple[SlowDiskDaemon, Path]) -> None:
    """``host_only`` (a sync load planned from host hits, issue 30): blocks held only on a slow
    NVMe tier are misses at once, the breaker stays closed and nothing is promoted; the same
    load without it waits for the disk and gets them."""
    d, latency = slow
    with kvtier.Client.connect(d.unix, "shm", local_lookups=False) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2 * HOST_BLOCKS)))
        for i in range(0, len(keys), 16):
            data = [hashlib.shake_256(b"h%d" % j).digest(ns.block_bytes) for j in range(i, i + 16)]
            assert ns.put(keys[i : i + 16], data).stored == 16
        last = keys[-4:]  # still in the host tier
        wait_for(
            "the first blocks on NVMe only",
            lambda: ns.lookup_detail(keys[:4]).tiers == ["nvme"] * 4,
            timeout=10.0,
        )
        set_read_latency(latency, 500)
        bufs = [bytearray(ns.block_bytes) for _ in range(4)]
        t0 = time.monotonic()
        assert ns.get_into(keys[:4], bufs, host_only=True) == [False] * 4
        assert time.monotonic() - t0 < 0.25  # no 500 ms read waited for
        assert client.breaker.allows()
        assert ns.lookup_detail(keys[:4]).tiers == ["nvme"] * 4  # nothing promoted
        assert ns.get_into(last, bufs, host_only=True) == [True] * 4  # host hits load
        t0 = time.monotonic()
        assert ns.get_into(keys[:4], bufs) == [True] * 4  # without it: promoted, loaded
        assert time.monotonic() - t0 >= 0.45


@pytest.mark.parametrize("control_channel", [True, False], ids=["control", "grpc"])
def test_a_load_that_outlasts_its_deadline_on_a_slow_disk_is_answered_by_it(
    slow: tuple[SlowDiskDaemon, Path], control_channel: bool
) -> None:
    """A load whose blocks need NVMe reads longer than its deadline (a sync load in an engine
    step, issue 30): the daemon answers by the deadline (``deadline_cut``) with what the host
    tier holds, pins nothing it did not answer, lets the reads go on, and the client counts the
    load out of time and keeps its breaker closed (a slow tier is not a daemon away: lookups
    and stores go on). Before this, the deadline passed in silence and the breaker opened."""
    d, latency = slow
    with kvtier.Client.connect(d.unix, "shm", local_lookups=False, control_channel=control_channel) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2 * HOST_BLOCKS)))
        for i in range(0, len(keys), 16):
            data = [hashlib.shake_256(b"d%d" % j).digest(ns.block_bytes) for j in range(i, i + 16)]
            assert ns.put(keys[i : i + 16], data).stored == 16
        wait_for(
            "the first blocks on NVMe only",
            lambda: ns.lookup_detail(keys[:4]).tiers == ["nvme"] * 4,
            timeout=10.0,
        )
        set_read_latency(latency, 400)
        bufs = [bytearray(ns.block_bytes) for _ in range(4)]
        late = client.counters.out_of_time
        t0 = time.monotonic()
        assert ns.get_into(keys[:4], bufs, deadline=client.deadline(0.15)) == [False] * 4
        assert time.monotonic() - t0 < 0.15  # answered by the deadline, not after it
        assert client.breaker.allows() and client.breaker.trips == 0
        assert client.counters.out_of_time == late + 1
        assert client.stats()["pinned_blocks"] == 0  # nothing left pinned
        # the reads went on: the blocks reach the host tier, and a host-only load gets them
        wait_for("the promoted blocks", lambda: ns.lookup_detail(keys[:4]).tiers == ["host"] * 4, timeout=3.0)
        assert ns.get_into(keys[:4], bufs, host_only=True) == [True] * 4
        assert bufs[0] == hashlib.shake_256(b"d0").digest(ns.block_bytes)

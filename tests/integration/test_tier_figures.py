"""The daemon's per-tier read figures reach the SDK (issue 30): a real daemon whose NVMe tier is
slowed and un-slowed while it runs (``python -m kvtierd.testing.serve --read-latency-file F``,
test-only), a real client.

The host tier is 2 MiB (128 blocks of 16 KiB): of 256 blocks put, the first 128 are pushed out
to the NVMe tier, so a load of them is a promotion (an NVMe read into the host tier). The
client's lease is 0.6 s, so it heartbeats every 0.2 s; its ``tier_figures()`` follow the disk
within a heartbeat or two, over the control channel (the shm default) and over gRPC alike.
A client that connects later has the figures from its OpenSession reply, before any heartbeat;
/metrics has them per tier.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import scrape_metrics, wait_for

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb

HOST_BLOCKS = 128
SLOW_MS = 50
BATCH = 4  # blocks per load


class SlowDiskDaemon(DaemonProcess):
    """kvtierd whose NVMe reads sleep the milliseconds a file holds (test-only launcher)."""

    def __init__(self, run_dir: Path, latency_file: Path, *args: str) -> None:
        super().__init__(run_dir, *args)
        self.module = ("kvtierd.testing.serve", "--read-latency-file", str(latency_file))


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[SlowDiskDaemon, Path]]:
    latency = tmp_path / "read-latency-ms"  # absent: no latency (the start reads the disk)
    d = SlowDiskDaemon(tmp_path / "run", latency, "--host-bytes", "2MiB", "--slab-bytes", "1MiB",
                       "--disk-dir", str(tmp_path / "nvme"), "--disk-bytes", "16MiB",
                       "--write-policy", "write-back").start()
    try:
        yield d, latency
    finally:
        d.kill()


def nvme_latency(client: kvtier.Client) -> float | None:
    fig = client.tier_figures().get("nvme")
    return None if fig is None else fig.latency_s


@pytest.mark.parametrize("control_channel", [True, False], ids=["control", "grpc"])
def test_the_nvme_figure_follows_a_disk_that_slows_and_recovers(
        slow: tuple[SlowDiskDaemon, Path], control_channel: bool) -> None:
    d, latency = slow
    with kvtier.Client.connect(d.unix, "shm", lease_ttl_s=0.6, local_lookups=False,
                               control_channel=control_channel) as client:
        assert (client._control is not None) == control_channel
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2 * HOST_BLOCKS)))
        for i in range(0, len(keys), 16):
            data = [hashlib.shake_256(b"f%d" % j).digest(ns.block_bytes) for j in range(i, i + 16)]
            assert ns.put(keys[i : i + 16], data).stored == 16
        assert ns.lookup_detail(keys[:HOST_BLOCKS]).tiers == ["nvme"] * HOST_BLOCKS
        assert client.tier_figures() == {}  # nothing read from the disk yet
        batches = iter(range(0, HOST_BLOCKS, BATCH))

        def load() -> None:
            """One load of blocks held only on the NVMe tier: a promotion."""
            i = next(batches)
            got = ns.get(keys[i : i + BATCH])
            assert all(g is not None for g in got)

        latency.write_text(str(SLOW_MS))
        time.sleep(0.15)  # the daemon reads the file again at most every 100 ms
        t0 = time.monotonic()
        load()
        took = time.monotonic() - t0
        assert took >= SLOW_MS / 1000  # the disk is slow: a load waits for it
        wait_for("the slow NVMe figure", lambda: (nvme_latency(client) or 0) >= SLOW_MS / 1000,
                 timeout=1.0)  # a heartbeat comes every 0.2 s
        fig = client.tier_figures()["nvme"]
        assert fig.reads >= 1 and fig.bytes_per_s > 0 and fig.age_s < 1.0
        assert fig.latency_s <= took + 0.05  # measured inside the daemon: less than end to end

        reply = client._call("Heartbeat", pb.HeartbeatRequest())  # the same path as the loop
        assert [f.tier for f in reply.tier_figures] == [pb.TIER_NVME]
        assert reply.tier_figures[0].latency_us >= SLOW_MS * 1000
        if control_channel:
            assert client._control is not None and client._control.calls > 0

        latency.write_text("0")  # the disk recovers
        time.sleep(0.15)
        for _ in range(8):
            load()
        wait_for("the NVMe figure to fall back", lambda: (nvme_latency(client) or 1) < 0.025,
                 timeout=1.0)
        assert client.tier_figures()["nvme"].reads >= 9

        # a client that connects now has the figures at once (its OpenSession reply)
        with kvtier.Client.connect(d.unix, "shm", heartbeat=False) as late:
            late_fig = late.tier_figures()["nvme"]
            assert late_fig.reads >= 9 and late_fig.latency_s < 0.025

        status, text = scrape_metrics(d, None)
        assert status == 200
        line = next(ln for ln in text.splitlines()
                    if ln.startswith('kvtier_tier_read_latency_seconds{tier="nvme"}'))
        assert 0 < float(line.split()[-1]) < 0.025
        assert 'kvtier_tier_read_bytes_per_second{tier="nvme"}' in text

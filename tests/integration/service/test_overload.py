"""64 client threads calling lookups, puts and gets as fast as they can: the daemon keeps
answering health checks quickly, and every RPC gets OK or a fast RESOURCE_EXHAUSTED (never a
deadline). The measurement is ``kvtier bench overload``'s (client/kvtier/bench/overload.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from conftest import DaemonProcess, make_namespace

import kvtier
from kvtier.bench.overload import format_report, run_overload

HEALTH_P99_BOUND_MS = 1000.0  # generous: a shared 2-core machine; unbounded queueing is seconds


def test_health_stays_answering_under_64_client_threads(daemon: DaemonProcess) -> None:
    report = run_overload(daemon.unix, threads=64, duration_s=4.0, deadline_s=5.0)
    print(format_report(report))
    assert report.health_checks > 20 and not report.health_failures
    assert report.health_p99_ms < HEALTH_P99_BOUND_MS, format_report(report)
    assert report.lookups_per_s > 0 and report.puts_per_s > 0 and report.gets_per_s > 0
    unexpected = {
        m: {c: n for c, n in by.items() if c not in ("OK", "RESOURCE_EXHAUSTED")}
        for m, by in report.statuses.items()
    }
    assert not any(unexpected.values()), unexpected


def test_a_shed_request_is_a_miss_for_the_sdk_and_trips_nothing(daemon_factory: Any, tmp_path: Path) -> None:
    """With one request allowed in progress, gets that promote NVMe-only blocks (their handler
    waits on the disk) make the daemon shed concurrent lookups: the SDK counts them as
    ``overloaded`` misses, never raises, and its breaker stays closed."""
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text("max_inflight_rpcs = 1\n")
    d = daemon_factory(
        "--config",
        str(cfg),
        "--host-bytes",
        "2MiB",
        "--slab-bytes",
        "1MiB",
        "--disk-dir",
        str(tmp_path / "disk"),
        "--disk-bytes",
        "32MiB",
        "--write-policy",
        "write-through",
    )
    ns = make_namespace()
    keys = [i.to_bytes(32, "big") for i in range(512)]  # 8 MiB: most live on NVMe only
    blocks = [np.full(16384, i % 251, dtype=np.uint8) for i in range(len(keys))]
    with kvtier.Client.connect(d.unix, "shm") as loader:
        h = loader.register(ns)
        for i in range(0, len(keys), 64):  # the host tier holds 128: older ones demote
            assert h.put(keys[i : i + 64], blocks[i : i + 64]).stored == 64
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():  # the host tier holds 128 of 512: every get promotes
                for i in range(0, len(keys), 64):
                    h.get(keys[i : i + 64])  # PrepareLoad's handler waits on the disk

        # (over gRPC: a lookup answered from the published index never reaches the daemon)
        with kvtier.Client.connect(d.unix, "shm", local_lookups=False) as probe:
            hp = probe.register(ns)
            t = threading.Thread(target=load, daemon=True)
            t.start()
            try:
                deadline = time.monotonic() + 20
                while probe.counters.overloaded == 0 and time.monotonic() < deadline:
                    hp.lookup(keys[:64])  # never raises: a shed lookup is a miss
                assert probe.counters.overloaded > 0, probe.counters
                assert probe.breaker.allows()  # shed, not away: nothing tripped
            finally:
                stop.set()
                t.join(10)

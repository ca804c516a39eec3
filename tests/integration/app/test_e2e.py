"""End-to-end scenarios: a real daemon process and real client processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DaemonProcess, make_namespace

import kvtier

WORKER = str(Path(__file__).with_name("worker.py"))


def worker(*args: Any, timeout: float = 60) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def blocks(n: int, nbytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def test_round_trip_is_byte_exact(daemon: DaemonProcess, transport: str) -> None:
    import torch

    with kvtier.Client.connect(daemon.address(transport), transport=transport) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 6 + 5)))  # 6 full blocks; the 5 extra tokens: no key
        assert len(keys) == 6
        data = blocks(6, ns.block_bytes)
        mixed: list[Any] = [
            data[0],
            data[1].tobytes(),
            bytearray(data[2].tobytes()),
            torch.from_numpy(data[3].copy()),
            data[4].view(np.uint16),
            data[5],
        ]
        assert ns.lookup(keys) == 0
        assert ns.put(keys, mixed) == kvtier.PutResult(stored=6)
        assert ns.lookup(keys) == 6
        assert ns.lookup(keys[:3] + [b"\0" * 32] + keys[4:]) == 3  # longest prefix only
        got = ns.get(keys + [b"\1" * 32])
        assert [bytes(g) for g in got[:6] if g is not None] == [d.tobytes() for d in data]
        assert got[6] is None
        into = torch.zeros((6, ns.block_bytes // 2), dtype=torch.bfloat16)
        assert ns.get_into(keys, list(into)) == [True] * 6
        assert into.view(torch.uint8).numpy().tobytes() == b"".join(d.tobytes() for d in data)
        assert ns.put(keys, data) == kvtier.PutResult(already_present=6)
        stats = client.stats()
        moved = stats["total"][f"bytes_in_{transport}"]
        assert moved == 6 * ns.block_bytes
        assert stats["total"][f"bytes_out_{transport}"] == 2 * 6 * ns.block_bytes


def test_blocks_put_over_shm_by_one_process_are_read_over_tcp_by_another(daemon: DaemonProcess) -> None:
    put = worker("put", "shm", daemon.unix, 7, 20)
    assert put == {"stored": 20, "present": 0, "dropped": 0}
    via_tcp = worker("get", "tcp", daemon.grpc, 7, 20)
    via_shm = worker("get", "shm", daemon.unix, 7, 20)
    assert via_tcp["ok"] == via_tcp["lookup"] == 20
    assert via_tcp["digest"] == via_shm["digest"]


def test_several_client_processes_at_once(daemon: DaemonProcess) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "put", tr, daemon.address(tr), str(seed), "10"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed, tr in ((1, "shm"), (2, "tcp"), (3, "shm"), (4, "tcp"))
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert json.loads(out.splitlines()[-1])["stored"] == 10
    for seed, tr in ((1, "tcp"), (2, "shm"), (3, "tcp"), (4, "shm")):
        assert worker("get", tr, daemon.address(tr), seed, 10)["ok"] == 10


@pytest.mark.parametrize(
    "other",
    [
        {"model_revision": "rev2"},
        {"adapter_id": "x", "adapter_revision": "1"},
        {"cache_salt": "x"},
        {"tp_size": 2, "tp_rank": 1},
    ],
)
def test_namespaces_never_see_each_others_blocks(daemon: DaemonProcess, other: dict[str, Any]) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as client:
        a = client.register(make_namespace())
        b = client.register(make_namespace(**other))
        tokens = list(range(16 * 4))
        ka, kb = a.block_keys(tokens), b.block_keys(tokens)
        assert a.put(ka, blocks(4, a.block_bytes)).stored == 4
        assert b.lookup(kb) == 0
        assert b.lookup(ka) == 0  # even a's own keys are unknown inside b's namespace
        assert b.get(ka) == [None] * 4


def test_adapter_x_and_salt_x_are_different_namespaces(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as client:
        a = client.register(make_namespace(adapter_id="x", adapter_revision="r"))
        s = client.register(make_namespace(cache_salt="x"))
        assert a.namespace_id != s.namespace_id
        tokens = list(range(32))
        assert a.put(a.block_keys(tokens), blocks(2, a.block_bytes)).stored == 2
        assert s.lookup(s.block_keys(tokens)) == 0
        assert len(client.stats()["namespaces"]) == 2


def test_client_killed_mid_store_leaves_nothing_and_slots_come_back(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        before = client.stats()
        p = subprocess.Popen(
            [sys.executable, WORKER, "reserve", "shm", daemon.unix, "5", "8"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "RESERVED"
            mid = client.stats()
            assert mid["writing_blocks"] == 8
            assert mid["host_used_bytes"] > before["host_used_bytes"]
            from tests_helpers import worker_keys

            keys = worker_keys(ns, 5, 8)
            assert ns.lookup(keys) == 0  # WRITING entries are invisible
            assert ns.get(keys) == [None] * 8
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        deadline = time.monotonic() + 10
        while client.stats()["writing_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        expired = client.stats()
        assert expired["writing_blocks"] == 0
        # the slots are held back one more lease (the writer might be stalled, not dead)
        assert expired["limbo_blocks"] == 8 or expired["host_used_bytes"] == before["host_used_bytes"]
        while client.stats()["limbo_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = client.stats()
        assert after["limbo_blocks"] == 0
        assert after["host_used_bytes"] == before["host_used_bytes"]
        assert after["leases_expired"] >= 1
        assert after["total"]["stores_dropped"] == 8
        assert ns.lookup(keys) == 0
        assert ns.put(keys, blocks(8, ns.block_bytes)).stored == 8  # the slots are usable again


@pytest.mark.parametrize("transport_name", ["shm", "tcp"])
def test_daemon_restart_is_survived_without_user_action(
    daemon_factory: Any, tmp_path: Path, transport_name: str
) -> None:
    run_dir = tmp_path / "restart"
    d1 = daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
    client = kvtier.Client.connect(d1.unix, transport=transport_name, timeout_s=0.5, backoff_s=(0.05, 0.2))
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 4)))
    data = blocks(4, ns.block_bytes)
    assert ns.put(keys, data).stored == 4
    epoch1 = client.boot_epoch
    d1.kill()
    # Daemon away: a miss and a drop, each answered well within the deadline.
    t0 = time.monotonic()
    assert ns.lookup(keys) == 0
    assert ns.put(keys, data).dropped == 4
    assert ns.get(keys) == [None] * 4
    assert time.monotonic() - t0 < 3 * 0.5 + 0.5
    assert client.counters.lookups_failed >= 1 and client.counters.puts_dropped >= 4
    daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
    deadline = time.monotonic() + 10
    result = kvtier.PutResult()
    while time.monotonic() < deadline:
        result = ns.put(keys, data)
        if result.stored:
            break
        time.sleep(0.05)
    assert result.stored == 4
    assert client.boot_epoch != epoch1
    assert client.counters.epoch_changes >= 1
    assert [bytes(g) for g in ns.get(keys) if g] == [d.tobytes() for d in data]
    client.close()


def test_daemon_never_there_means_misses_and_drops_fast(tmp_path: Path) -> None:
    client = kvtier.Client.connect(
        f"unix://{tmp_path}/nothing.sock", transport="shm", timeout_s=0.3, lazy=True
    )  # (without lazy: an error)
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(32)))
    t0 = time.monotonic()
    for _ in range(50):
        assert ns.lookup(keys) == 0
        assert ns.put(keys, blocks(2, ns.block_bytes)).dropped == 2
    assert time.monotonic() - t0 < 2.0  # the breaker answers without waiting each time
    with pytest.raises(kvtier.errors.Unavailable):
        client.stats()
    client.close()


def test_async_client_round_trip(daemon: DaemonProcess, transport: str) -> None:
    import asyncio

    from kvtier.aio import AsyncClient

    async def scenario() -> None:
        async with await AsyncClient.connect(daemon.address(transport), transport=transport) as c:
            ns = await c.register(make_namespace())
            keys = ns.block_keys(list(range(16 * 3)))
            data = blocks(3, ns.block_bytes, seed=3)
            results = await asyncio.gather(ns.put(keys, data), ns.lookup(keys[:0]))
            assert results[0].stored == 3
            assert await ns.lookup(keys) == 3
            got = await ns.get(keys)
            assert [bytes(g) for g in got if g] == [d.tobytes() for d in data]
            assert (await c.stats())["total"]["stores_accepted"] == 3

    asyncio.run(scenario())


def test_metrics_and_stats_cli_show_the_same_figures(daemon: DaemonProcess) -> None:
    # (over gRPC, which knows each hit's tier; the published index path: test_lookup_paths)
    with kvtier.Client.connect(daemon.unix, transport="shm", local_lookups=False) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 3)))
        ns.put(keys, blocks(3, ns.block_bytes))
        ns.lookup(keys + [b"\0" * 32])
    text = urllib.request.urlopen(daemon.info["metrics"], timeout=5).read().decode()
    assert 'kvtier_lookup_blocks_hit_total{model="test/model"' in text
    assert any(
        line.startswith("kvtier_lookup_blocks_hit_total") and 'tier="host"' in line and line.endswith(" 3.0")
        for line in text.splitlines()
    )
    assert "kvtier_store_blocks_total{" in text and 'outcome="accepted"' in text
    assert 'kvtier_rpc_duration_seconds_bucket{le="+Inf",method="Lookup"}' in text
    assert "kvtier_host_capacity_bytes 6.7108864e+07" in text
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.unix, "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stats = json.loads(out)
    assert stats["total"]["blocks_hit_host"] == 3 and stats["total"]["blocks_missed"] == 1
    table = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", daemon.grpc],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "blocks hit (host)" in table and "test/model" in table and "75.0%" in table


def test_stats_cli_reports_an_absent_daemon(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "stats",
            "--address",
            f"unix://{tmp_path}/none.sock",
            "--timeout-s",
            "0.5",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "no socket file" in r.stderr and "kvtierd running" in r.stderr


def test_stats_cli_with_no_flags_reaches_the_default_daemon(daemon_factory: Any, tmp_path: Path) -> None:
    """``make serve`` starts the daemon on run/kvtier.sock under the repository; ``kvtier
    stats`` run there with no flags must reach it (its old default was not a valid target)."""
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "run")
    assert d.unix == f"unix://{tmp_path}/run/kvtier.sock"
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["boot_epoch"] == d.info["boot_epoch"]


def test_stats_cli_refuses_a_relative_unix_address_with_two_slashes(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", "unix://run/kvtier.sock"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "address" in r.stderr and "unix:///absolute" in r.stderr
    assert "Traceback" not in r.stderr


def test_sigterm_drains_and_exits_cleanly(daemon: DaemonProcess) -> None:
    sock = Path(daemon.unix.removeprefix("unix://"))
    assert sock.exists()
    assert daemon.stop(signal.SIGTERM) == 0
    assert not sock.exists()


def test_failed_transfer_aborts_its_reservation_at_once(daemon: DaemonProcess, transport: str) -> None:
    from kvtier_contract.errors import TransportError

    with kvtier.Client.connect(daemon.address(transport), transport=transport) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 3)))

        def broken(job_id: int, items: Any, **kw: Any) -> None:
            raise TransportError("cable pulled")

        client.session.data().write = broken  # type: ignore[method-assign]
        assert ns.put(keys, blocks(3, ns.block_bytes)).dropped == 3
        stats = client.stats()
        assert stats["writing_blocks"] == 0  # not left reserved until the lease ends
        assert stats["total"]["stores_dropped"] == 3
        # The client reattaches a fresh transport and the same keys store normally.
        deadline = time.monotonic() + 5
        while (r := ns.put(keys, blocks(3, ns.block_bytes))).stored == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.stored == 3


def test_a_load_whose_lease_lapsed_mid_copy_is_a_miss(daemon_factory: Any) -> None:
    d = daemon_factory("--host-bytes", "16MiB", "--slab-bytes", "1MiB")
    with kvtier.Client.connect(d.unix, transport="shm", lease_ttl_s=0.2, heartbeat=False) as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        assert ns.put(keys, blocks(2, ns.block_bytes)).stored == 2
        transport = client.session.data()
        assert transport is not None
        real_read = transport.read

        def stalled_read(job_id: int, items: Any, *args: Any) -> list[int]:
            bad = real_read(job_id, items, *args)
            deadline = time.monotonic() + 5  # the engine stalls past its lease
            while client.stats()["sessions"] and time.monotonic() < deadline:
                time.sleep(0.05)
            return bad

        transport.read = stalled_read  # type: ignore[method-assign]
        assert ns.get(keys) == [None, None]  # copied, but not confirmed under the pins
        assert client.counters.gets_failed == 1


def test_a_disconnect_never_unmaps_under_a_transfer_in_flight(daemon: DaemonProcess) -> None:
    """The heartbeat thread may trip the breaker while another thread copies into the arena:
    the mapping is closed when that transfer ends, not under it."""
    with kvtier.Client.connect(daemon.unix, "shm") as client:
        ns = client.register(make_namespace())
        transport = client.session.data()
        entered, release = threading.Event(), threading.Event()
        real_write = transport.write

        def slow_write(job_id: int, items: Any, **kw: Any) -> list[int] | None:
            entered.set()
            release.wait(10)
            return real_write(job_id, items, **kw)

        transport.write = slow_write  # type: ignore[method-assign]
        results: list[Any] = []
        keys = ns.block_keys(list(range(16)))
        worker = threading.Thread(target=lambda: results.append(ns.put(keys, [bytes(ns.block_bytes)])))
        worker.start()
        assert entered.wait(10)
        client.session.trip("daemon looked away")  # what the heartbeat thread does on a failure
        assert transport._view is not None  # still mapped: the copy is running
        release.set()
        worker.join(10)
        assert transport._view is None  # closed once the transfer ended
        assert results and results[0].dropped == 1  # its completion found the session gone


def test_kvtier_serve_and_fsck_are_aliases_of_the_daemons_command(tmp_path: Path) -> None:
    """``kvtier serve|fsck`` start ``python -m kvtierd`` (no import arrow from the SDK into the
    daemon): every argument, --help included, reaches the daemon's own command."""
    helped = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--help"], capture_output=True, text=True, timeout=30
    )
    assert helped.returncode == 0 and helped.stdout.startswith("usage: kvtierd serve")
    checked = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "fsck", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 2 and "kvtierd fsck" in checked.stdout + checked.stderr

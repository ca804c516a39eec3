"""``kvtier bench``: the quick suite runs end to end and reports every figure.

The quick suite starts its own kvtierd, moves a few MiB of 16 KiB and 64 KiB blocks over shm and
tcp (checking every round trip byte for byte), streams the same bytes through a raw loopback
socket, copies them with memcpy, and times lookups of a 1,000-key chain from one and from two
client processes. Every baseline touches as much distinct memory as the kvtier path it is held
against, and Redis is driven with hiredis and fresh keys per sample. The nvme suite, shrunk to a
few MiB, two rounds and 300 recovery blocks, demotes and promotes through a daemon with an NVMe
tier beside raw O_DIRECT I/O, and restarts it after SIGTERM and SIGKILL.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvtier.bench import baselines, nvme
from kvtier.bench.plan import NVME_IN_ALL, Plan, Results, Touches
from kvtier.bench.procs import RedisProc
from kvtier.bench.progress import Progress
from kvtier.bench.report import TARGETS, format_table, to_json
from kvtier.cli import build_parser

QUICK_SIZES = (16 << 10, 64 << 10)
THROUGHPUT_OPS = (
    "memcpy_put",
    "memcpy_get",
    "socket_put",
    "socket_get",
    "shm_put",
    "shm_get_into",
    "shm_get",
    "tcp_put",
    "tcp_get_into",
    "tcp_get",
)
NVME_OPS = (
    "nvme_raw_write_1t",
    "nvme_raw_write",
    "nvme_demote",
    "nvme_raw_read_1t",
    "nvme_raw_read",
    "nvme_promote_prefetch",
    "nvme_promote_prepare",
    "nvme_promote_get_into",
    "xxh3",
)
LOOKUP_FIGURES = (
    "lookup_p50_ms",
    "lookup_p99_ms",
    "lookups_per_s",
    "lookup_1key_p50_ms",
    "daemon_cpu_us_per_lookup",
)


def _bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_quick_suite_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "quick",
            "--no-progress",
            "--no-redis",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # --no-progress: nothing on stderr
    result = json.loads(out.read_text())

    got = {(t["op"], t["block_bytes"]): t["gbps"] for t in result["throughput"]}
    for op in THROUGHPUT_OPS:
        for size in QUICK_SIZES:
            assert got.get((op, size), 0) > 0, f"{op} at {size} B missing or not positive"
    assert not any(op.startswith("redis") for op, _ in got)  # --no-redis
    assert any("Redis comparison skipped" in note for note in result["notes"])

    for name in LOOKUP_FIGURES:
        assert result["lookup"][name]["value"] > 0, name
    assert result["lookup"]["lookup_p99_ms"]["value"] >= result["lookup"]["lookup_p50_ms"]["value"]

    # Each baseline reads and writes as much distinct memory as the kvtier path held against it
    # (a get that allocates writes fresh memory where its baseline fills one batch buffer).
    touched = {
        (t["op"], t["block_bytes"]): (t["distinct_src_bytes"], t["distinct_dst_bytes"])
        for t in result["throughput"]
    }
    batch, sample = 1 << 20, 4 << 20
    for t in TARGETS:
        if t.baseline.startswith(("redis", "nvme")) or "unverified" in t.baseline:
            continue  # --no-redis; no nvme in quick, nor the unverified paths (suite verify)
        for size in QUICK_SIZES:
            (op_src, op_dst), (base_src, base_dst) = touched[(t.op, size)], touched[(t.baseline, size)]
            assert base_src == op_src and max(base_src, base_dst) == sample, (t.name, size)
            assert base_dst == (op_dst if t.op.endswith(("_put", "_get_into")) else batch), t.name

    targets = {t["target"] for t in result["targets"]}
    assert any(t.startswith("shm put >=") for t in targets)
    assert any(t.startswith("tcp get (allocates) >=") for t in targets)
    assert any("lookup p50" in t for t in targets)
    assert result["machine"]["nproc"] >= 1
    assert "shm get_into" in run.stdout and "target" in run.stdout
    # its samples are too small for a verdict: every ratio says so, none says ok or NO
    assert "ratios indicative only" in run.stdout.splitlines()[0]  # the headline
    assert all(t["indicative"] for t in result["targets"])
    cells = re.findall(r" {2,}(\d+\.\d\dx \S+)", run.stdout)  # (not the targets' names)
    assert len(cells) >= 12 and set(c.split()[1] for c in cells) == {"indicative"}


def _ratio_results() -> Results:
    r = Results()
    for op, gbps in (("shm_put", 5.0), ("memcpy_put", 10.0)):
        for size in QUICK_SIZES:
            r.add_gbps(op, size, gbps)
    r.add_lookup("lookup_p50_ms", 0.9)
    return r


def test_quick_ratios_are_labelled_indicative_and_others_get_a_verdict() -> None:
    quick = format_table(Plan.from_args(_bench_args("quick")), _ratio_results())
    assert "indicative only" in quick and " NO" not in quick and "MISSED" not in quick
    assert "0.50x indicative" in quick
    full = format_table(Plan.from_args(_bench_args("shm", "--sizes", "16KiB,64KiB")), _ratio_results())
    assert "0.50x NO" in full and "MISSED" in full and "indicative" not in full


def test_verify_suite_measures_verified_beside_unverified(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "verify",
            "--sizes",
            "64KiB",
            "--total-mib",
            "4",
            "--batch-mib",
            "2",
            "--repeat",
            "1",
            "--no-progress",
            "--no-redis",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    got = {t["op"] for t in result["throughput"] if t["gbps"] > 0}
    assert got == {
        "shm_put",
        "shm_get_into",
        "tcp_put",
        "tcp_get_into",
        "shm_unverified_put",
        "shm_unverified_get_into",
        "tcp_unverified_put",
        "tcp_unverified_get_into",
        "shm_daemon_put",
    }
    ratios = {(t["op"], t["baseline"]) for t in result["targets"] if t.get("ratio")}
    assert ("shm_put", "shm_unverified_put") in ratios
    assert ("shm_get_into", "shm_unverified_get_into") in ratios
    assert "shm put, bytes not verified" in run.stdout


def test_quick_plan_is_a_few_mib_whatever_the_size_flags() -> None:
    plan = Plan.from_args(_bench_args("quick", "--sizes", "4MiB", "--total-mib", "4096"))
    assert plan.block_sizes == QUICK_SIZES
    assert plan.sample_bytes(16 << 10) == 4 << 20
    assert plan.host_bytes <= 128 << 20


def test_default_plan_fits_the_largest_sample_twice_in_the_host_tier() -> None:
    plan = Plan.from_args(_bench_args())
    assert plan.block_sizes == (256 << 10, 1 << 20, 4 << 20)
    assert plan.sample_bytes(4 << 20) == 512 << 20  # 8 batches of 16 blocks
    assert plan.host_bytes >= 2 * (512 << 20) and plan.host_bytes % plan.slab_bytes == 0


@pytest.mark.parametrize("argv", [["nosuch"], ["--sizes", ""], ["--repeat", "0"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    from kvtier.bench import run_bench

    assert run_bench(_bench_args(*argv)) == 2


def test_progress_bar_counts_to_its_total() -> None:
    stream = io.StringIO()
    bar = Progress(4, stream=stream, width=8)
    bar.step("a")
    bar.step("b", n=5)  # never past the total
    assert bar.done == 4
    assert "[########]   4/4" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")


def _small_nvme_plan(disk_dir: Path) -> Plan:
    plan = Plan.from_args(
        _bench_args(
            "nvme",
            "--sizes",
            "64KiB,256KiB",
            "--total-mib",
            "4",
            "--batch-mib",
            "1",
            "--repeat",
            "2",
            "--no-progress",
            "--disk-dir",
            str(disk_dir),
        )
    )
    return dataclasses.replace(plan, recovery_blocks=300)


def test_nvme_suite_reports_every_figure(tmp_path: Path) -> None:
    plan = _small_nvme_plan(tmp_path / "disk")
    results = Results()
    bench = Progress(nvme.steps(plan), enabled=False)
    with tempfile.TemporaryDirectory(prefix="kvb-") as runs:  # short: Unix socket paths
        nvme.bench_nvme(plan, Path(runs), results, bench)
    assert bench.done == bench.total

    for op in NVME_OPS:
        for size in plan.block_sizes:
            assert (results.gbps(op, size) or 0) > 0, f"{op} at {size} B missing or not positive"
    for name in nvme.RECOVERY_FIGURES:
        assert (results.seconds(name) or 0) > 0, name
    assert len(results.recovery["recovery_replay_s"].samples) == 2  # two crashes made alike, one replay each
    assert results.facts["recovered_warm_blocks"] == 300
    assert results.facts["recovered_replay_blocks"] == 600
    assert results.facts["filesystem"] != "?"
    assert list((tmp_path / "disk").iterdir()) == []  # its private directory is gone

    out = json.loads(json.dumps(to_json(plan, results)))
    assert out["recovery"]["recovery_warm_s"]["per_10k_blocks"] > 0
    assert any(t["target"].startswith("NVMe demote") for t in out["targets"])
    table = format_table(plan, results)
    assert "NVMe promote (get_into, end to end)" in table and "after kill -9" in table


def test_nvme_suite_refuses_to_fill_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda _p: shutil_usage(free=1 << 30))
    with pytest.raises(RuntimeError, match="GiB free"):
        nvme.bench_nvme(_small_nvme_plan(tmp_path), tmp_path, Results(), Progress(1, enabled=False))
    results = Results()  # under `all`, the other figures still count: a note instead
    nvme.bench_nvme(
        dataclasses.replace(_small_nvme_plan(tmp_path), suite="all"),
        tmp_path,
        results,
        Progress(1, enabled=False),
    )
    assert any("NVMe figures skipped" in n for n in results.notes)
    assert list(tmp_path.iterdir()) == []


def shutil_usage(free: int) -> object:
    return type("usage", (), {"free": free, "total": 2 * free, "used": free})()


def test_nvme_geometry_keeps_one_set_in_the_host_tier() -> None:
    plan = Plan.from_args(_bench_args("nvme"))
    for block in plan.block_sizes:
        g = nvme.Geometry(plan, block)
        assert g.n * block == plan.sample_bytes(block)
        assert g.n * block <= g.host_bytes < g.n * block + g.slab  # within a slab of one set
        assert g.disk_bytes >= 3 * plan.repeat * g.n * nvme.nvme_slot_bytes(block)
    assert nvme.disk_need(plan) < 8 << 30


def test_suites_that_run_nvme() -> None:
    assert Plan.from_args(_bench_args("nvme")).wants("nvme")
    assert not Plan.from_args(_bench_args("quick")).wants("nvme")
    assert not Plan.from_args(_bench_args("shm")).wants("nvme")
    assert Plan.from_args(_bench_args()).wants("nvme") == NVME_IN_ALL
    assert _bench_args("nvme", "--disk-dir", "/x").disk_dir == "/x"


def test_gpu_suite_dry_run_on_cpu(tmp_path: Path) -> None:
    """``kvtier bench gpu --device cpu``: the GPU benchmark's code path, byte-checked, on CPU."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "gpu",
            "--device",
            "cpu",
            "--gpu-blocks",
            "12",
            "--gpu-shape",
            "4,2,64,16",
            "--repeat",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["byte_exact"] and report["blocks"] == 12 and report["block_bytes"] == 4 * 8192
    assert set(report["gbps"]) == {
        "copy_ host->device",
        "copy_ device->host",
        "shm put_blocks (device->daemon)",
        "shm get_blocks (daemon->device)",
        "shm put_blocks, not verified (device->daemon)",
        "shm get_blocks, not verified (daemon->device)",
    }
    assert set(report["verified_to_unverified"]) == {
        "shm put_blocks (device->daemon)",
        "shm get_blocks (daemon->device)",
    }
    assert "shm put_blocks" in proc.stdout and "/ not verified" in proc.stdout
    assert report["notes"] == ["cuda_ipc: skipped, needs a CUDA device"]


def _small_plan(**kw: object) -> Plan:
    plan = Plan.from_args(
        _bench_args("--sizes", "64KiB", "--batch-mib", "1", "--total-mib", "8", "--repeat", "2")
    )
    return dataclasses.replace(plan, **kw)  # type: ignore[arg-type]


def test_memcpy_baselines_copy_through_a_whole_sample_of_distinct_memory() -> None:
    plan, block = _small_plan(), 64 << 10
    batch, sample = plan.batch_bytes, plan.sample_bytes(block)
    assert sample == 8 * batch
    put, get = baselines.memcpy_ops(plan, block)
    assert (put.name, put.touches) == ("memcpy_put", Touches(src=batch, dst=sample))  # as shm put
    assert (get.name, get.touches) == ("memcpy_get", Touches(src=sample, dst=batch))  # as get_into
    for op in (put, get):
        op.run()
        assert op.check is not None
        op.check()  # put: every batch of the sample-sized destination holds the source batch


def test_distinct_bytes_counts_a_reused_buffer_once() -> None:
    buf = baselines.prefaulted(4 << 10)
    views = baselines.block_views(buf, 1 << 10, 4)
    assert baselines.distinct_bytes(views) == 4 << 10
    assert baselines.distinct_bytes(views * 8) == 4 << 10
    assert baselines.distinct_bytes(views[:1] * 8) == 1 << 10


def test_socket_baselines_stream_a_whole_sample_of_distinct_memory() -> None:
    plan, block = _small_plan(), 64 << 10
    batch, sample = plan.batch_bytes, plan.sample_bytes(block)
    with baselines.SocketStream() as stream:
        put, get = stream.ops(plan, block)
        assert (put.name, put.touches) == ("socket_put", Touches(src=batch, dst=sample))
        assert (get.name, get.touches) == ("socket_get", Touches(src=sample, dst=batch))
        put.run()  # each raises unless the sink reports it touched `sample` distinct bytes
        get.run()


@pytest.mark.skipif(RedisProc.available() is None, reason="redis-server is not on PATH")
def test_redis_baseline_uses_hiredis_and_fresh_keys_per_sample(tmp_path: Path) -> None:
    from redis._parsers import _HiredisParser

    plan, block = _small_plan(), 64 << 10
    keys_per_sample = plan.sample_bytes(block) // block
    with RedisProc(tmp_path / "redis") as server:
        client = baselines.redis_client(server.port)
        assert isinstance(client.connection_pool.make_connection()._parser, _HiredisParser)
        put, get = baselines.redis_ops(plan, server.port, block)
        assert put.touches == Touches(src=plan.batch_bytes, dst=plan.sample_bytes(block))
        for sample in range(1, plan.repeat + 3):  # warm-up, rounds, and one more than planned
            put.run()
            assert client.dbsize() == sample * keys_per_sample  # nothing overwritten
            get.run()
        assert get.check is not None
        get.check()


def test_daemon_args_reach_every_daemon_the_suite_starts(tmp_path: Path) -> None:
    """``--daemon-args``: one string, split as a shell would, given to the suite's daemons (a
    setting the daemon refuses makes the run fail naming it; none given: no extra argument)."""
    plan = Plan.from_args(_bench_args("shm", "--daemon-args", "--eviction-policy prefix"))
    assert plan.daemon_args == ("--eviction-policy", "prefix")
    assert Plan.from_args(_bench_args("shm")).daemon_args == ()
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "quick", "--no-progress", "--no-redis"]
        + ["--daemon-args", "--eviction-policy nope"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 1
    assert "kvtierd did not start" in run.stderr and "eviction" in run.stderr, run.stderr

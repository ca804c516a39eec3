"""``kvtier bench``: the quick suite runs end to end and reports every figure.

The quick suite starts its own kvtierd, moves a few MiB of 16 KiB and 64 KiB blocks over shm and
tcp (checking every round trip byte for byte), streams the same bytes through a raw loopback
socket, copies them with memcpy, and times lookups of a 1,000-key chain from one and from two
client processes.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.plan import Plan
from kvtier.bench.progress import Progress
from kvtier.cli import build_parser

QUICK_SIZES = (16 << 10, 64 << 10)
THROUGHPUT_OPS = ("memcpy", "socket", "shm_put", "shm_get_into", "shm_get", "tcp_put",
                  "tcp_get_into", "tcp_get")
LOOKUP_FIGURES = ("lookup_p50_ms", "lookup_p99_ms", "lookups_per_s", "lookup_1key_p50_ms",
                  "daemon_cpu_us_per_lookup")


def _bench_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_quick_suite_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "quick", "--no-progress",
                          "--no-redis", "--json", str(out)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
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

    targets = {t["target"] for t in result["targets"]}
    assert any(t.startswith("shm put >=") for t in targets)
    assert any(t.startswith("tcp get (allocates) >=") for t in targets)
    assert any("lookup p50" in t for t in targets)
    assert result["machine"]["nproc"] >= 1
    assert "shm get_into" in run.stdout and "target" in run.stdout


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

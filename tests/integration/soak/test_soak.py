"""The one-minute soak (``kvtier bench soak``): clients killed at random, the daemon stays flat.

Four worker processes (two over shm, two over tcp, three namespaces whose key ranges overflow
the 64 MiB host tier) run lookups, puts and byte-checked gets for 60 s; each is SIGKILLed with a
chance of 10 % per second and restarted. Workers lease for 1 s, so what a killed one held goes
within about two seconds. Bounds (``SoakLimits``, the command's own verdict): after a 10 s
warm-up the daemon's anonymous RSS grows by less than 16 MiB from the first third to the last,
fds by at most 4 and threads by at most 2; once the workers are gone and the leases lapsed, no
session, pin, reservation or limbo block is left and fds and threads are back within 4 and 2
of the baseline; no worker ever read a wrong byte. Run the same with ``kvtier bench soak``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.soak import SoakConfig, SoakLimits, format_report, run_soak


@pytest.mark.slow
def test_one_minute_of_killed_clients_leaves_the_daemon_flat() -> None:
    cfg = SoakConfig(duration_s=60.0, clients=4)
    report = run_soak(cfg)
    print(format_report(report, SoakLimits()))
    assert report.kills > 0, "no client was killed: the run tested nothing"
    assert report.work["lookups"] > 0 and report.work["stores_accepted"] > 0
    assert report.work["evictions"] > 0, "the workload never filled the host tier"
    assert report.problems(SoakLimits()) == []
    assert report.settled["sessions"] == 0 and report.settled["writing"] == 0
    assert report.settled["pinned"] == 0 and report.settled["limbo"] == 0


def test_the_command_prints_the_table_and_json(tmp_path: Path) -> None:
    """``kvtier bench soak`` end to end, briefly: a table with a verdict, and every sample in
    the JSON file."""
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "soak",
            "--duration",
            "4",
            "--clients",
            "2",
            "--no-progress",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "verdict:" in run.stdout, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert len(data["samples"]) >= 3 and set(data["growth"]) == {"rss_mib", "anon_mib", "fds", "threads"}
    assert run.returncode == (1 if data["problems"] else 0)

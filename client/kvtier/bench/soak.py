"""``kvtier bench soak``: a mixed workload with clients killed at random; is the daemon flat?

One run starts a fresh kvtierd (``procs.DaemonProc``, short leases), then ``clients`` worker
processes (this module run as ``python -m kvtier.bench.soak worker ...``), half over shm and half
over tcp, spread over a few namespaces. Each worker loops over a key range of its namespace:
lookup a batch, put the missing blocks, get the hits and check every byte (a block's bytes
follow from its key). The key ranges hold more than the host tier, so blocks are evicted all
along. Every second each worker is SIGKILLed with probability ``kill_per_s`` and restarted at
once: its session, reservations and pins are left for the lease to collect.

Every second the daemon is sampled: RSS (and its anonymous part: the arena is a shared memfd,
so the anonymous part is what a leak grows), open fds (``/proc/PID/fd``), threads
(``/proc/PID/task``), and from Stats the sessions and the arena's use (used bytes, pinned,
writing and limbo blocks). After the workload the workers are stopped and, once two leases have
passed, one more sample shows what the killed clients left behind (``settled``).

Verdict (``SoakLimits``): after the warm-up, the mean of the last third of the samples against
the mean of the first third (flat means healthy), and the settled figures against the baseline
taken before the first client: no session, pin, reservation or limbo block left, fds and threads
back near where they started, no worker that saw wrong bytes.

One module a little over 400 lines: the worker program is this module run as a script, so the
worker, the sampler and the command stay together.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier_contract.identity import Namespace
    from kvtier_contract.protoutil import TransportName

SAMPLE_FIELDS = (
    "rss_mib",
    "anon_mib",
    "fds",
    "threads",
    "sessions",
    "used_mib",
    "pinned",
    "writing",
    "limbo",
)
GROWTH_FIELDS = ("rss_mib", "anon_mib", "fds", "threads")
MiB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
    """What one soak run does. Defaults: the one-minute run of ``kvtier bench soak``."""

    duration_s: float = 60.0
    """Seconds of workload (the settle wait comes after)."""
    clients: int = 4
    """Worker processes at any time; even ones use shm, odd ones tcp."""
    namespaces: int = 3
    """Namespaces the workers spread over (worker i uses namespace i mod n)."""
    keys_per_namespace: int = 1536
    """Key range of one namespace; 3 x 1536 blocks of 16 KiB = 72 MiB > the host tier."""
    batch: int = 32
    """Keys per lookup / put / get."""
    rounds_per_s: float = 20.0
    """Most lookup-put-get rounds one worker runs per second (paced: the machine may be small)."""
    kill_per_s: float = 0.1
    """Chance per second that a given worker is SIGKILLed (and restarted at once)."""
    lease_ttl_s: float = 1.0
    """Workers' session lease; a killed worker's pins and reservations go after it."""
    host_bytes: int = 64 * MiB
    """The daemon's host tier."""
    warmup_s: float = 10.0
    """Samples before this are left out of the growth comparison."""
    settle_timeout_s: float = 20.0
    """Most seconds to wait after the workload for the leases and limbo to clear."""
    seed: int = 1


@dataclass(frozen=True)
class SoakLimits:
    """Bounds of a healthy run (``check``); the test of ``make test`` asserts them."""

    anon_growth_mib: float = 16.0
    """Last third against first third of the steady state, anonymous RSS."""
    rss_growth_mib: float = 24.0
    fd_growth: float = 4.0
    thread_growth: float = 2.0
    settled_fds_over_baseline: int = 4
    settled_threads_over_baseline: int = 2


@dataclass
class SoakReport:
    """Samples and figures of one run; ``to_json`` for ``--json``."""

    config: SoakConfig
    baseline: dict[str, float] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list)
    settled: dict[str, float] = field(default_factory=dict)
    kills: int = 0
    worker_failures: list[str] = field(default_factory=list)  # exits we did not cause
    work: dict[str, int] = field(default_factory=dict)  # Stats counters moved by the workload

    def thirds(self) -> tuple[dict[str, float], dict[str, float]]:
        """Mean of each figure over the first and the last third of the steady state."""
        steady = [s for s in self.samples if s["t"] >= self.config.warmup_s] or self.samples
        n = max(1, len(steady) // 3)
        return _mean(steady[:n]), _mean(steady[-n:])

    def growth(self) -> dict[str, float]:
        first, last = self.thirds()
        return {k: round(last[k] - first[k], 2) for k in GROWTH_FIELDS}

    def problems(self, limits: SoakLimits) -> list[str]:
        """What went wrong; empty when the daemon stayed flat and cleaned up after the kills."""
        out: list[str] = [f"worker failed: {w}" for w in self.worker_failures]
        g = self.growth()
        for name, bound in (
            ("anon_mib", limits.anon_growth_mib),
            ("rss_mib", limits.rss_growth_mib),
            ("fds", limits.fd_growth),
            ("threads", limits.thread_growth),
        ):
            if g[name] > bound:
                out.append(f"{name} grew by {g[name]} (bound {bound})")
        s, b = self.settled, self.baseline
        for name in ("sessions", "pinned", "writing", "limbo"):
            if s.get(name, 1):
                out.append(f"settled {name} = {s.get(name)} (expected 0)")
        if s.get("fds", 1e9) > b["fds"] + limits.settled_fds_over_baseline:
            out.append(
                f"settled fds {s.get('fds')} > baseline {b['fds']} + {limits.settled_fds_over_baseline}"
            )
        if s.get("threads", 1e9) > b["threads"] + limits.settled_threads_over_baseline:
            out.append(
                f"settled threads {s.get('threads')} > baseline {b['threads']} "
                f"+ {limits.settled_threads_over_baseline}"
            )
        return out

    def to_json(self, limits: SoakLimits) -> dict[str, Any]:
        first, last = self.thirds()
        return {
            "config": asdict(self.config),
            "limits": asdict(limits),
            "baseline": self.baseline,
            "samples": self.samples,
            "settled": self.settled,
            "kills": self.kills,
            "work": self.work,
            "worker_failures": self.worker_failures,
            "first_third": first,
            "last_third": last,
            "growth": self.growth(),
            "problems": self.problems(limits),
        }


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(sum(r[k] for r in rows) / max(1, len(rows)), 2) for k in SAMPLE_FIELDS}


# ---- the daemon's figures ----------------------------------------------------------------------


def proc_figures(pid: int) -> dict[str, float]:
    """RSS and its anonymous part (MiB), open fds and threads of process ``pid``."""
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        status[name] = value.split()
    kib = {k: int(status.get(k, ["0"])[0]) for k in ("VmRSS", "RssAnon")}
    return {
        "rss_mib": round(kib["VmRSS"] / 1024, 1),
        "anon_mib": round(kib["RssAnon"] / 1024, 1),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


class _Stats:
    """A raw Stats stub (no session of its own, so the daemon's session count is the workers')."""

    def __init__(self, target: str) -> None:
        import grpc

        from kvtier.addresses import address_target
        from kvtier_contract.v1 import kvtier_pb2 as pb
        from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

        self._pb = pb
        self.channel = grpc.insecure_channel(address_target(target))
        self.stub = pb_grpc.KvtierStub(self.channel)

    def figures(self) -> tuple[dict[str, float], dict[str, int]]:
        """The arena and session gauges, and the workload counters."""
        from kvtier_contract.protoutil import to_dict

        s = to_dict(self.stub.Stats(self._pb.StatsRequest(), timeout=5.0))
        gauges = {
            "sessions": int(s["sessions"]),
            "used_mib": round(int(s["host_used_bytes"]) / MiB, 1),
            "pinned": int(s["pinned_blocks"]),
            "writing": int(s["writing_blocks"]),
            "limbo": int(s["limbo_blocks"]),
        }
        t = s["total"]
        work = {
            k: int(t.get(k, 0))
            for k in ("lookups", "stores_accepted", "stores_dropped", "loads", "evictions")
        }
        return gauges, work


# ---- the run -----------------------------------------------------------------------------------


class _Workers:
    """The worker processes; owns them (killed on exit)."""

    def __init__(self, cfg: SoakConfig, unix: str, grpc_addr: str, logs: Path) -> None:
        self.cfg, self.unix, self.grpc_addr, self.logs = cfg, unix, grpc_addr, logs
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * cfg.clients
        self.log_of: list[Path | None] = [None] * cfg.clients
        self.started = 0
        self.failures: list[str] = []

    def start(self, i: int) -> None:
        transport = "shm" if i % 2 == 0 else "tcp"
        address = self.unix if transport == "shm" else self.grpc_addr
        log = self.logs / f"worker-{i}-{self.started}.log"
        self.started += 1
        self.log_of[i] = log
        with open(log, "wb") as err:
            self.procs[i] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvtier.bench.soak",
                    "worker",
                    address,
                    transport,
                    json.dumps(
                        {
                            **asdict(self.cfg),
                            "seed": self.cfg.seed * 1000 + self.started,
                            "namespace": i % self.cfg.namespaces,
                        }
                    ),
                ],
                stdout=subprocess.PIPE,
                stderr=err,
            )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every worker has connected and registered (its READY line): on a busy machine
        starting a process takes seconds, and the clock should not run meanwhile."""
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(self.procs):
            assert p is not None and p.stdout is not None
            line = p.stdout.readline()  # blocks; a dead worker gives b""
            if line.strip() != b"READY" or time.monotonic() > deadline:
                raise RuntimeError(f"soak worker {i} did not start: {self.log_of[i]}")

    def check(self) -> None:
        """Restart workers that exited by themselves, recording why."""
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                log = self.log_of[i]
                tail = log.read_text(errors="replace")[-300:] if log else ""
                self.failures.append(f"worker {i} exited {p.returncode}: {tail}")
                _reap(p)
                self.start(i)

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i`` and start its successor at once."""
        p = self.procs[i]
        if p is not None:
            p.kill()
            _reap(p)
        self.start(i)

    def stop(self) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
        for p in self.procs:
            if p is not None:
                _reap(p)


def _reap(p: subprocess.Popen[bytes]) -> None:
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _config(tmp: Path, cfg: SoakConfig) -> str:
    """The daemon's config file: published indexes nobody reads are retired after one lease
    (not the default 30 s), so the settled sample sees what the killed clients left behind."""
    path = tmp / "kvtierd.json"
    path.write_text(json.dumps({"publish_index_idle_s": cfg.lease_ttl_s}))
    return str(path)


def run_soak(cfg: SoakConfig, progress: bool = False) -> SoakReport:
    """One soak run in a private temporary directory (see the module docstring)."""
    from kvtier.bench.procs import DaemonProc

    report = SoakReport(cfg)
    rng = random.Random(cfg.seed)
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp,
        DaemonProc(
            Path(tmp),
            cfg.host_bytes,
            MiB,
            [
                "--lease-ttl-s",
                str(cfg.lease_ttl_s),  # (the last flag wins)
                "--config",
                _config(Path(tmp), cfg),
            ],
        ) as daemon,
    ):
        assert daemon.proc is not None
        pid = daemon.proc.pid
        stats = _Stats(daemon.grpc)
        workers = _Workers(cfg, daemon.unix, daemon.grpc, Path(tmp))
        try:
            gauges, work0 = stats.figures()  # (its own connection is in the baseline)
            report.baseline = {**proc_figures(pid), **gauges}
            _workload(cfg, pid, stats, workers, rng, report, progress)
            workers.stop()
            work1 = stats.figures()[1]
            report.work = {k: work1[k] - work0[k] for k in work1}
            report.settled = _settle(cfg, pid, stats)
        finally:
            workers.stop()
            report.worker_failures = workers.failures
            stats.channel.close()
    return report


def _workload(
    cfg: SoakConfig,
    pid: int,
    stats: _Stats,
    workers: _Workers,
    rng: random.Random,
    report: SoakReport,
    progress: bool,
) -> None:
    """Run the workers for ``duration_s``, one sample and one round of kills per second."""
    for i in range(cfg.clients):
        workers.start(i)
    workers.wait_ready()
    t0 = time.monotonic()
    tick = t0
    while (now := time.monotonic()) - t0 < cfg.duration_s:
        tick += 1.0
        time.sleep(max(0.0, tick - now))
        workers.check()
        for i in range(cfg.clients):
            if rng.random() < cfg.kill_per_s:
                workers.kill(i)
                report.kills += 1
        sample = {
            "t": round(time.monotonic() - t0, 1),
            **proc_figures(pid),
            **stats.figures()[0],
            "kills": report.kills,
        }
        report.samples.append(sample)
        if progress:
            print(
                f"\rsoak {sample['t']:5.0f}s  rss {sample['rss_mib']:7.1f} MiB  fds "
                f"{sample['fds']:4.0f}  threads {sample['threads']:3.0f}  kills {report.kills}",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if progress:
        print(file=sys.stderr)


def _settle(cfg: SoakConfig, pid: int, stats: _Stats) -> dict[str, float]:
    """Wait for the killed workers' leases (and the limbo after them) to clear; the last sample."""
    deadline = time.monotonic() + cfg.settle_timeout_s
    time.sleep(2 * cfg.lease_ttl_s)
    while True:
        sample = {**proc_figures(pid), **stats.figures()[0]}
        clear = not any(sample[k] for k in ("sessions", "pinned", "writing", "limbo"))
        if clear or time.monotonic() > deadline:
            sample["settle_s"] = round(cfg.settle_timeout_s - (deadline - time.monotonic()), 1)
            return sample
        time.sleep(0.25)


# ---- the worker process ------------------------------------------------------------------------


def worker_main(address: str, transport: TransportName, params: dict[str, Any]) -> int:
    """Say READY once registered, then loop until killed: lookup a batch, put the missing
    blocks, get the hits, check their bytes.

    Exit 3 when a get returned other bytes than were put (never expected)."""
    from kvtier.client import Client

    rng = random.Random(params["seed"])
    ns_spec = _worker_namespace(params["namespace"])
    n, batch = int(params["keys_per_namespace"]), int(params["batch"])
    keys = [hashlib.sha256(b"soak %d %d" % (params["namespace"], k)).digest() for k in range(n)]
    period = 1.0 / float(params["rounds_per_s"])
    with Client.connect(
        address,
        transport,
        lease_ttl_s=float(params["lease_ttl_s"]),
        timeout_s=2.0,
        client_name=f"soak-{transport}",
    ) as client:
        ns = client.register(ns_spec)
        reps = ns.block_bytes // 32
        print("READY", flush=True)
        while True:
            t = time.monotonic()
            start = rng.randrange(n - batch)
            ks = keys[start : start + batch]
            hits = ns.lookup(ks)
            if hits < len(ks):
                ns.put(ks[hits:], [k * reps for k in ks[hits:]])
            for k, got in zip(ks[:hits], ns.get(ks[:hits]), strict=True):
                if got is not None and bytes(got) != k * reps:
                    print(f"BAD bytes for key {k!r}", file=sys.stderr, flush=True)
                    return 3
            time.sleep(max(0.0, period - (time.monotonic() - t)))


def _worker_namespace(index: int) -> Namespace:
    """The soak's namespace number ``index``: every worker given that number registers it."""
    from kvtier_contract.identity import Namespace

    return Namespace(
        model_id=f"soak/{index}",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="bfloat16",
        layout="contiguous",
        tokens_per_block=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )


# ---- the command -------------------------------------------------------------------------------


def format_report(report: SoakReport, limits: SoakLimits, rows: int = 12) -> str:
    """A table of samples (about ``rows`` of them), the thirds, the settled figures, a verdict."""
    cols = ("t", *SAMPLE_FIELDS, "kills")
    lines = ["  ".join(f"{c:>9}" for c in cols)]
    step = max(1, len(report.samples) // rows)
    shown = report.samples[::step]
    if report.samples and shown[-1] is not report.samples[-1]:
        shown.append(report.samples[-1])
    for s in [dict(report.baseline, t=0, kills=0), *shown]:
        lines.append("  ".join(f"{s.get(c, 0):>9g}" for c in cols))
    first, last = report.thirds()
    growth = report.growth()
    lines += [
        "",
        "steady state (after the warm-up): first third -> last third",
        *(f"  {k:<9} {first[k]:>9g} -> {last[k]:<9g} ({growth[k]:+g})" for k in GROWTH_FIELDS),
        "after the workload, once the leases lapsed (baseline before the first client):",
        "  "
        + "  ".join(
            f"{k} {report.settled.get(k, '?')} (was {report.baseline.get(k, '?')})"
            for k in ("sessions", "pinned", "writing", "limbo", "fds", "threads")
        ),
        f"  settled after {report.settled.get('settle_s', '?')} s",
        f"workload: {report.kills} clients SIGKILLed and restarted; "
        + ", ".join(f"{k} {v:,}" for k, v in report.work.items()),
    ]
    problems = report.problems(limits)
    lines.append(
        "verdict: FLAT (healthy)" if not problems else "verdict: GROWTH / LEAK\n  " + "\n  ".join(problems)
    )
    return "\n".join(lines)


def bench_soak(args: argparse.Namespace) -> int:
    """``kvtier bench soak [--duration S] [--clients N] [--json FILE]``: 0 when healthy."""
    duration = args.duration if args.duration is not None else SoakConfig.duration_s
    cfg = SoakConfig(
        duration_s=duration, clients=args.clients, warmup_s=min(SoakConfig.warmup_s, duration / 4)
    )
    if cfg.duration_s < 3 or cfg.clients < 1:
        print("kvtier bench soak: --duration must be >= 3 s and --clients >= 1", file=sys.stderr)
        return 2
    limits = SoakLimits()
    report = run_soak(cfg, progress=not args.no_progress)
    print(format_report(report, limits))
    if args.json_out:
        out = json.dumps(report.to_json(limits), indent=2)
        if args.json_out == "-":
            print(out)
        else:
            Path(args.json_out).write_text(out + "\n")
    return 0 if not report.problems(limits) else 1


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(KeyboardInterrupt):
            tp: TransportName = "tcp" if sys.argv[3] == "tcp" else "shm"
            raise SystemExit(worker_main(sys.argv[2], tp, json.loads(sys.argv[4])))
    raise SystemExit("usage: python -m kvtier.bench.soak worker ADDRESS TRANSPORT PARAMS_JSON")

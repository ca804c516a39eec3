"""``kvtier bench overload``: many client threads against one fresh daemon; does it stay responsive?

Each client thread has its own gRPC channel and session, as one engine worker would, and calls
the control plane in a fixed rotation: a lookup of 32 keys, a put (PrepareStore + CompleteStore of
8 fresh keys), a get (PrepareLoad + CompleteLoad of 8 keys it stored). No block bytes move: the
RPCs are what an overloaded daemon has to queue or refuse. A separate thread, on a channel of its
own, calls ``grpc.health.v1.Health/Check`` every 10 ms and times it.

Reported: puts, gets and lookups per second, the status of every RPC by method (OK,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ...), and health latency p50 / p99 / max. A daemon that
queues without bound shows it in the health latency and in deadlines; a bounded one answers
RESOURCE_EXHAUSTED fast and keeps health quick.

``run_overload`` is the measurement (also used by tests/integration/service/test_overload.py);
``bench_overload`` starts the daemon, runs it and prints the report.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.bench.lookups import percentile
from kvtier.bench.transfers import KeySource, bench_namespace
from kvtier_contract.protoutil import namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

LOOKUP_KEYS = 32
BATCH = 8  # keys per put and per get
BLOCK = 4096
HEALTH_EVERY_S = 0.01
DAEMON_HOST_BYTES = 256 << 20
DAEMON_SLAB_BYTES = 4 << 20


@dataclass
class OverloadReport:
    """What one run saw. ``statuses``: method -> status name -> count."""

    threads: int
    duration_s: float
    lookups_per_s: float = 0.0
    puts_per_s: float = 0.0
    gets_per_s: float = 0.0
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    health_checks: int = 0
    health_failures: dict[str, int] = field(default_factory=dict)
    health_p50_ms: float = 0.0
    health_p99_ms: float = 0.0
    health_max_ms: float = 0.0
    rpc_p99_ms: float = 0.0

    def count(self, status: str) -> int:
        return sum(by.get(status, 0) for by in self.statuses.values())


class _Tally:
    """Counts shared by the client threads (under one lock; touched once per RPC)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.ops: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []

    def rpc(self, method: str, code: str, seconds: float) -> None:
        with self.lock:
            self.statuses[method][code] += 1
            self.latencies.append(seconds)


class _Worker:
    """One client thread: a channel, a session, a namespace; lookup, put, get in turn."""

    def __init__(self, address: str, wid: int, tally: _Tally, deadline_s: float) -> None:
        self.tally, self.deadline_s, self.wid = tally, deadline_s, wid
        self.channel = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
        self.stub = pb_grpc.KvtierStub(self.channel)
        self.keys = KeySource()
        self.stored: collections.deque[list[bytes]] = collections.deque(maxlen=64)
        self.chain = self.keys.take(LOOKUP_KEYS)
        self.session_id = 0
        self.ns_id = 0

    def call(self, method: str, request: Any) -> Any:
        t0 = time.perf_counter()
        try:
            reply = getattr(self.stub, method)(request, timeout=self.deadline_s)
            code = "OK"
        except grpc.RpcError as e:
            reply, code = None, e.code().name
        self.tally.rpc(method, code, time.perf_counter() - t0)
        return reply

    def setup(self) -> bool:
        ns = bench_namespace(BLOCK, name="kvtier-bench-overload")
        for _ in range(50):  # the daemon may refuse while the others set up too
            s = self.call(
                "OpenSession",
                pb.OpenSessionRequest(
                    client_name=f"overload-{self.wid}", lease_ttl_ms=120_000, transport=pb.TRANSPORT_SHM
                ),
            )
            r = s and self.call(
                "RegisterNamespace", pb.RegisterNamespaceRequest(spec=namespace_spec(ns), digest=ns.digest)
            )
            if s and r:
                self.session_id, self.ns_id = s.session_id, r.namespace_id
                return True
            time.sleep(0.05)
        return False

    def lookup(self) -> None:
        if (
            self.call(
                "Lookup",
                pb.LookupRequest(
                    session_id=self.session_id, namespace_id=self.ns_id, keys=b"".join(self.chain)
                ),
            )
            is not None
        ):
            self.tally.ops["lookup"] += 1

    def put(self) -> None:
        keys = self.keys.take(BATCH)
        prep = self.call(
            "PrepareStore",
            pb.PrepareStoreRequest(
                session_id=self.session_id,
                namespace_id=self.ns_id,
                keys=b"".join(keys),
                transport=pb.TRANSPORT_SHM,
            ),
        )
        if prep is None:
            return
        if (
            prep.job_id
            and self.call(
                "CompleteStore",
                pb.CompleteStoreRequest(session_id=self.session_id, job_id=prep.job_id, ok=True),
            )
            is None
        ):
            return
        self.stored.append(keys)
        self.tally.ops["put"] += 1

    def get(self) -> None:
        if not self.stored:
            return
        keys = self.stored[len(self.stored) // 2]
        prep = self.call(
            "PrepareLoad",
            pb.PrepareLoadRequest(
                session_id=self.session_id,
                namespace_id=self.ns_id,
                keys=b"".join(keys),
                transport=pb.TRANSPORT_SHM,
            ),
        )
        if prep is None:
            return
        if (
            prep.job_id
            and self.call(
                "CompleteLoad", pb.CompleteLoadRequest(session_id=self.session_id, job_id=prep.job_id)
            )
            is None
        ):
            return
        self.tally.ops["get"] += 1

    def run(self, start: threading.Event, stop: threading.Event) -> None:
        try:
            if not self.setup():
                return
            start.wait()
            while not stop.is_set():
                self.lookup()
                self.put()
                self.get()
        finally:
            self.channel.close()


def _health(
    address: str,
    start: threading.Event,
    stop: threading.Event,
    out: list[float],
    failures: collections.Counter[str],
    deadline_s: float,
) -> None:
    """Health.Check every HEALTH_EVERY_S from its own channel; latencies into ``out``."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected before timing
        start.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=deadline_s)
            except grpc.RpcError as e:
                failures[e.code().name] += 1
            out.append(time.perf_counter() - t0)
            stop.wait(HEALTH_EVERY_S)


def run_overload(
    address: str, *, threads: int = 64, duration_s: float = 20.0, deadline_s: float = 5.0
) -> OverloadReport:
    """Drive the daemon at ``address`` with ``threads`` client threads for ``duration_s`` (after
    every thread has its session) while a health thread times Health.Check."""
    tally = _Tally()
    start, stop = threading.Event(), threading.Event()
    workers = [_Worker(address, i, tally, deadline_s) for i in range(threads)]
    health: list[float] = []
    failures: collections.Counter[str] = collections.Counter()
    pool = [
        threading.Thread(target=w.run, args=(start, stop), name=f"overload-{w.wid}", daemon=True)
        for w in workers
    ]
    pool.append(
        threading.Thread(
            target=_health,
            name="overload-health",
            daemon=True,
            args=(address, start, stop, health, failures, deadline_s),
        )
    )
    for t in pool:
        t.start()
    deadline = time.monotonic() + 60
    while sum(1 for w in workers if w.session_id) < threads and time.monotonic() < deadline:
        time.sleep(0.05)
    with tally.lock:
        tally.statuses.clear()
        tally.ops.clear()
        tally.latencies.clear()
    start.set()
    t0 = time.perf_counter()
    time.sleep(duration_s)
    stop.set()
    elapsed = time.perf_counter() - t0
    for t in pool:
        t.join(deadline_s + 10)
    return _report(tally, health, failures, threads, elapsed)


def _report(
    tally: _Tally, health: list[float], failures: collections.Counter[str], threads: int, elapsed: float
) -> OverloadReport:
    """The figures of a run of ``elapsed`` seconds: what the workers tallied, the health
    checks' latencies and failures."""
    report = OverloadReport(threads=threads, duration_s=elapsed)
    with tally.lock:
        report.lookups_per_s = tally.ops["lookup"] / elapsed
        report.puts_per_s = tally.ops["put"] / elapsed
        report.gets_per_s = tally.ops["get"] / elapsed
        report.statuses = {m: dict(c) for m, c in sorted(tally.statuses.items())}
        lat = sorted(tally.latencies)
    if lat:
        report.rpc_p99_ms = percentile(lat, 99) * 1e3
    report.health_checks = len(health)
    report.health_failures = dict(failures)
    if health:
        h = sorted(health)
        report.health_p50_ms = statistics.median(h) * 1e3
        report.health_p99_ms = percentile(h, 99) * 1e3
        report.health_max_ms = h[-1] * 1e3
    return report


def format_report(r: OverloadReport) -> str:
    lines = [
        f"overload: {r.threads} client threads for {r.duration_s:.1f} s",
        f"  lookups/s {r.lookups_per_s:10,.0f}   puts/s {r.puts_per_s:10,.0f}   "
        f"gets/s {r.gets_per_s:10,.0f}   (puts and gets of {BATCH} blocks; "
        f"lookups of {LOOKUP_KEYS} keys)",
        f"  RPC latency p99 {r.rpc_p99_ms:.1f} ms",
        f"  health: {r.health_checks} checks, p50 {r.health_p50_ms:.1f} ms, "
        f"p99 {r.health_p99_ms:.1f} ms, max {r.health_max_ms:.1f} ms, "
        f"failures {r.health_failures or 'none'}",
        "  statuses:",
    ]
    for method, by in r.statuses.items():
        lines.append(f"    {method:<16}" + "  ".join(f"{k} {v:,}" for k, v in sorted(by.items())))
    return "\n".join(lines)


def bench_overload(args: argparse.Namespace) -> int:
    """``kvtier bench overload``: a fresh daemon, ``--overload-threads`` clients for
    ``--duration``; prints the report (and writes it as JSON with ``--json``)."""
    from kvtier.bench.procs import DaemonProc

    threads = int(getattr(args, "overload_threads", 64))
    duration = 20.0 if args.duration is None else float(args.duration)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
        try:
            with DaemonProc(Path(tmp) / "kvtierd-overload", DAEMON_HOST_BYTES, DAEMON_SLAB_BYTES) as daemon:
                report = run_overload(daemon.unix, threads=threads, duration_s=duration)
        except (RuntimeError, OSError) as e:
            print(f"kvtier bench overload: failed: {e}", file=sys.stderr)
            return 1
    print(format_report(report))
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0

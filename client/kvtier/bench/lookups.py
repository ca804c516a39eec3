"""Lookup latency (one client, sequential) and lookups/s (several client processes at once).

Every lookup asks for the same ``plan.lookup_keys``-key chain (real chained keys of one token
sequence), all of them hits, over the daemon's gRPC Unix socket as a same-host engine would.
Two diagnostics come with them: the p50 of a 1-key lookup (the round-trip floor that every
lookup pays) and the daemon's CPU time per lookup while the clients run (its ceiling).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from multiprocessing.synchronize import Barrier
from typing import Any

from kvtier.bench.plan import Plan, Results
from kvtier.bench.progress import Progress
from kvtier.bench.transfers import bench_namespace
from kvtier.client import Client, NamespaceHandle

LOOKUP_BLOCK = 4096  # block size of the lookup namespace (bytes do not matter to a lookup)
_TIMEOUT_S = 10.0


def _connect(address: str, keys_n: int, name: str) -> tuple[Client, NamespaceHandle, list[bytes]]:
    # transport "tcp": lookups never move bytes, and it spares each client mapping the arena.
    client = Client.connect(address, "tcp", timeout_s=_TIMEOUT_S, client_name=name)
    if not client.connected:
        raise RuntimeError(f"cannot connect to kvtierd at {address}: {client.counters.last_error}")
    ns = client.register(bench_namespace(LOOKUP_BLOCK, name="kvtier-bench-lookup"))
    tpb = ns.namespace.tokens_per_block
    return client, ns, ns.block_keys(list(range(keys_n * tpb)))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in [0, 100])."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_lookup(plan: Plan, address: str, daemon_pid: int, results: Results,
                 progress: Progress) -> None:
    client, ns, keys = _connect(address, plan.lookup_keys, "bench-lookup")
    try:
        zero = bytes(LOOKUP_BLOCK)
        res = ns.put(keys, [zero] * len(keys))
        if res.stored + res.already_present != len(keys):
            raise RuntimeError(f"could not store the lookup chain: {res}")
        for _ in range(min(50, plan.lookup_samples)):  # warm-up
            ns.lookup(keys)
        for _ in range(plan.repeat):
            progress.show("lookup latency")
            lat = sorted(_timed_lookups(ns, keys, plan.lookup_samples))
            results.add_lookup("lookup_p50_ms", statistics.median(lat) * 1e3)
            results.add_lookup("lookup_p99_ms", percentile(lat, 99) * 1e3)
            one = _timed_lookups(ns, keys[:1], plan.lookup_samples)
            results.add_lookup("lookup_1key_p50_ms", statistics.median(one) * 1e3)
            progress.step("lookup latency")
    finally:
        client.close()
    _concurrent(plan, address, daemon_pid, results, progress)


def _timed_lookups(ns: NamespaceHandle, keys: list[bytes], n: int) -> list[float]:
    out = []
    perf = time.perf_counter
    for _ in range(n):
        t0 = perf()
        hit = ns.lookup(keys)
        out.append(perf() - t0)
        if hit != len(keys):
            raise RuntimeError(f"lookup found {hit} of {len(keys)} blocks (expected all)")
    return out


def _lookup_worker(address: str, keys_n: int, rounds: int, seconds: float, barrier: Barrier,
                   out: Any, wid: int) -> None:
    """Child process: ``rounds`` times, wait for the others, then look up for ``seconds``."""
    client, ns, keys = _connect(address, keys_n, f"bench-lookup-{wid}")
    try:
        for _ in range(3):
            ns.lookup(keys)
        for _ in range(rounds):
            barrier.wait()
            count, misses = 0, 0
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                misses += ns.lookup(keys) != keys_n
                count += 1
            out.put((wid, count, misses))
    finally:
        client.close()


def _result(out: Any, procs: list[Any], timeout_s: float) -> tuple[int, int, int]:
    """The next worker's (id, count, misses); RuntimeError as soon as a worker died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)  # type: ignore[no-any-return]
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"lookup client {dead[0].name} exited with "
                                   f"{dead[0].exitcode}") from None
    raise RuntimeError("lookup clients did not report in time")


def _concurrent(plan: Plan, address: str, daemon_pid: int, results: Results,
                progress: Progress) -> None:
    ctx = mp.get_context("spawn")
    n = plan.lookup_clients
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_lookup_worker, daemon=True, name=f"kvtier-bench-lookup-{i}",
                         args=(address, plan.lookup_keys, plan.repeat, plan.lookup_seconds,
                               barrier, out, i)) for i in range(n)]
    progress.show(f"lookups/s, {n} client processes (starting)")
    for p in procs:
        p.start()
    cpu0 = cpu_seconds(daemon_pid)
    try:
        for _ in range(plan.repeat):
            progress.show(f"lookups/s, {n} client processes")
            got = [_result(out, procs, plan.lookup_seconds + 120) for _ in range(n)]
            cpu1 = cpu_seconds(daemon_pid)
            if any(m for _w, _c, m in got):
                raise RuntimeError("a concurrent lookup missed blocks that were stored")
            count = sum(c for _w, c, _m in got)
            results.add_lookup("lookups_per_s", count / plan.lookup_seconds)
            # (the first window also holds the clients' registration and three warm-up lookups)
            results.add_lookup("daemon_cpu_us_per_lookup", (cpu1 - cpu0) / count * 1e6)
            cpu0 = cpu1
            progress.step(f"lookups/s, {n} client processes")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()

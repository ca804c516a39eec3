"""Lookup latency (one client, sequential) and lookups/s (several client processes at once).

Every lookup asks for the same ``plan.lookup_keys``-key chain (real chained keys of one token
sequence), all of them hits, as a same-host engine would: by default from the daemon's
published index (``lookup_*``, ``lookups_per_s``: the SDK's default path, checked to be the one
that answered), on a control channel of the TCP data port (``*_control*``: the path a client on
another host, or with ``local_lookups=False``, takes), and over the gRPC Unix socket
(``*_grpc*``: ``control_channel=False``; the bare gRPC floor) in the same run. Diagnostics: the
p50 of a 1-key lookup on the control channel and over gRPC (the round-trip floor each path
pays) and the daemon's CPU time per lookup while the clients run (its ceiling), per path. The
paths alternate, round by round.
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


# (path, figure-name suffix), in the order run
PATHS = (("local", ""), ("control", "_control"), ("grpc", "_grpc"))


def _connect(
    address: str, keys_n: int, name: str, path: str = "local"
) -> tuple[Client, NamespaceHandle, list[bytes]]:
    # transport "tcp": lookups never move bytes, and it spares each client mapping the arena.
    client = Client.connect(
        address,
        "tcp",
        timeout_s=_TIMEOUT_S,
        client_name=name,
        local_lookups=path == "local",
        control_channel=path != "grpc",
    )
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


def bench_lookup(plan: Plan, address: str, daemon_pid: int, results: Results, progress: Progress) -> None:
    opened = {
        path: _connect(address, plan.lookup_keys, f"bench-lookup-{path}", path) for path, _suffix in PATHS
    }
    client, ns, keys = opened["local"]
    try:
        zero = bytes(LOOKUP_BLOCK)
        res = ns.put(keys, [zero] * len(keys))
        if res.stored + res.already_present != len(keys):
            raise RuntimeError(f"could not store the lookup chain: {res}")
        for _ in range(min(50, plan.lookup_samples)):  # warm-up
            for _c, handle, _k in opened.values():
                handle.lookup(keys)
        base = _until_local(ns, keys)
        for _ in range(plan.repeat):
            progress.show("lookup latency")
            for path, suffix in PATHS:
                lat = sorted(_timed_lookups(opened[path][1], keys, plan.lookup_samples))
                results.add_lookup(f"lookup{suffix}_p50_ms", statistics.median(lat) * 1e3)
                results.add_lookup(f"lookup{suffix}_p99_ms", percentile(lat, 99) * 1e3)
            for path, name in (("grpc", "lookup_1key_p50_ms"), ("control", "lookup_1key_control_p50_ms")):
                one = _timed_lookups(opened[path][1], keys[:1], plan.lookup_samples)
                results.add_lookup(name, statistics.median(one) * 1e3)
            progress.step("lookup latency")
        _check_local(client, base)
        control = opened["control"][0].session.connection.control
        if control is None or not control.calls:
            raise RuntimeError("the control-channel path's lookups went over gRPC")
    finally:
        for c, _h, _k in opened.values():
            c.close()
    _concurrent(plan, address, daemon_pid, results, progress)


def _until_local(ns: NamespaceHandle, keys: list[bytes]) -> tuple[int, int]:
    """Look up until the published index answers (the SDK fetches it in the background);
    the client's (lookups, lookups_local) then."""
    c = ns.client.counters
    deadline = time.monotonic() + _TIMEOUT_S
    while True:
        before = c.lookups_local
        ns.lookup(keys)
        if c.lookups_local > before:
            return c.lookups, c.lookups_local
        if time.monotonic() > deadline:
            raise RuntimeError(
                "the published index never answered (is the daemon's "
                "publish_index off, or the daemon on another host?)"
            )
        time.sleep(0.001)


def _check_local(client: Client, base: tuple[int, int]) -> None:
    """The default path's figures are the published index's: it answered (at least 99 % of)
    the lookups since ``base``. A few may go over gRPC honestly (a daemon whose loop stalled
    past the stamp's 1 s under load is not trusted for that moment); they only slow the figure."""
    c = client.counters
    total, local = c.lookups - base[0], c.lookups_local - base[1]
    if local < 0.99 * total:
        raise RuntimeError(f"{total - local} of {total} lookups were not answered from the published index")


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


def _lookup_worker(
    address: str, keys_n: int, rounds: int, seconds: float, barrier: Barrier, out: Any, wid: int
) -> None:
    """Child process: ``rounds`` times, for each path, wait for the others, then look up for
    ``seconds``."""
    handles = {}
    clients = []
    for path, _suffix in PATHS:
        client, ns, keys = _connect(address, keys_n, f"bench-lookup-{wid}-{path}", path)
        clients.append(client)
        handles[path] = ns
    try:
        for ns in handles.values():
            for _ in range(3):
                ns.lookup(keys)
        base = _until_local(handles["local"], keys)
        for _ in range(rounds):
            for path, _suffix in PATHS:
                ns = handles[path]
                barrier.wait()
                count, misses = 0, 0
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    misses += ns.lookup(keys) != keys_n
                    count += 1
                out.put((wid, path, count, misses))
        _check_local(clients[0], base)
    finally:
        for client in clients:
            client.close()


def _result(out: Any, procs: list[Any], timeout_s: float) -> tuple[int, str, int, int]:
    """The next worker's (id, path, count, misses); RuntimeError as soon as a worker died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)  # type: ignore[no-any-return]
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"lookup client {dead[0].name} exited with {dead[0].exitcode}") from None
    raise RuntimeError("lookup clients did not report in time")


def _concurrent(plan: Plan, address: str, daemon_pid: int, results: Results, progress: Progress) -> None:
    ctx = mp.get_context("spawn")
    n = plan.lookup_clients
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(
            target=_lookup_worker,
            daemon=True,
            name=f"kvtier-bench-lookup-{i}",
            args=(address, plan.lookup_keys, plan.repeat, plan.lookup_seconds, barrier, out, i),
        )
        for i in range(n)
    ]
    progress.show(f"lookups/s, {n} client processes (starting)")
    for p in procs:
        p.start()
    try:
        for _ in range(plan.repeat):
            for path, suffix in PATHS:
                progress.show(f"lookups/s, {n} client processes, {path}")
                cpu0 = cpu_seconds(daemon_pid)
                got = [_result(out, procs, plan.lookup_seconds + 120) for _ in range(n)]
                cpu1 = cpu_seconds(daemon_pid)
                if any(m for _w, _p, _c, m in got) or any(p != path for _w, p, _c, _m in got):
                    raise RuntimeError("a concurrent lookup missed blocks that were stored")
                count = sum(c for _w, _p, c, _m in got)
                results.add_lookup(f"lookups{suffix}_per_s", count / plan.lookup_seconds)
                # (the first window also holds the clients' registration and warm-up lookups)
                results.add_lookup(f"daemon_cpu_us_per_lookup{suffix}", (cpu1 - cpu0) / count * 1e6)
            progress.step(f"lookups/s, {n} client processes")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()

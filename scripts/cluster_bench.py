"""The cluster tier's throughput and lookup latency, against redis-py on the same cluster.

One run starts a real Redis Cluster (3 masters, 3 replicas on loopback: tests/redis_cluster.py)
and two daemons using it (node A stores, node B imports), then measures, in interleaved rounds
(each round its own fresh keys; every other round runs the baselines first, the rest last):

* ``cluster write``: A's shm put of N blocks until A's ``stats()["cluster"]["writes"]`` has grown
  by N (polled every 5 ms): the put, then the background ``SET NX PX`` pipelines.
* ``import shm`` / ``import tcp``: B's ``get_into`` of N blocks only the cluster holds (stored by
  A and waited for): ``EXISTS`` + ``GET`` pipelines, xxh3 check, copy into B's host arena, then
  the transfer to the client.
* ``local shm`` / ``local tcp``: the same get on B again (the blocks now in B's host tier).
* baselines: redis-py ``RedisCluster.pipeline()`` (hiredis parser; commands grouped per master)
  ``SET NX PX`` of N fresh values of 96 + block bytes, then ``GET`` of those N values.
* lookups: B's ``lookup_detail`` of a 64-key chain that only the cluster holds, and of one held
  in B's host tier, and redis-py's pipelined ``EXISTS`` of the first chain's keys, in turn
  (p50 / p90 over ``--lookups`` samples each).

GB/s counts the N blocks' payload bytes (the baselines move 96 more bytes per value, as kvtier's
values hold a 96-byte header). "x baseline" is the median over rounds of each round's ratio
(baseline time / kvtier time: above 1 is faster than the baseline; the pairs run in the same
round, so the box's noise hits both). CPU columns: mean CPU ms per operation of node B, node A,
the six redis-servers together and this process (the client side), from /proc (10 ms ticks:
hence the mean); a daemon's is split into its main thread (the event loop serving clients) and
its other threads (mostly the cluster tier's, which runs every Redis socket). "redis pipeline
ms": the longest per-master sum of the daemon's pipeline times (its ``latency_seconds_sum``)
during the operation. Between timed operations the run waits for every replica to catch up
with its master, so no operation shares the box with the replication of the one before.

``--profile-b FILE``: record node B with py-spy (``PY_SPY`` or on PATH) during the rounds, as
collapsed stacks per thread (``py-spy record --format raw --threads``).

Run: ``.venv/bin/python scripts/cluster_bench.py [--block-kib 256] [--blocks 256] [--rounds 3]
[--lookups 200] [--json out.json]``. Every process it starts (daemons, redis-servers) is killed
on exit, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import redis.utils  # noqa: E402
from conftest import DaemonProcess, make_namespace  # noqa: E402
from redis_cluster import RedisCluster, available  # noqa: E402

import kvtier  # noqa: E402
from kvtier.bench.lookups import cpu_seconds  # noqa: E402
from kvtierd.tiers.cluster.format import HEADER_BYTES  # noqa: E402
from kvtierd.tiers.cluster.format import redis_key as realm_key  # noqa: E402
from kvtierd.tiers.cluster.keys import FleetKeys  # noqa: E402

LAYER_BYTES = 16 * 2 * 64 * 2 * 2  # one layer of the test namespace: K and V, 8 KiB
POLL_S = 0.005
CHAIN = 64  # keys of a lookup chain
WAIT_S = 120.0
FLEET_KEY = os.urandom(32)  # the two daemons' fleet key (one per run)
CLUSTER_REALM = "cluster-bench"  # the two daemons' cluster_realm (no tenants file)
REALM = FleetKeys(FLEET_KEY).untenanted(CLUSTER_REALM)


def redis_key(digest: bytes, key: bytes) -> bytes:
    """The Redis key the daemons (no tenants) use for a block."""
    return realm_key(REALM, digest, key)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", type=int, default=256, help="block size (a multiple of 8 KiB)")
    p.add_argument("--blocks", type=int, default=256, help="blocks per operation (N)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lookups", type=int, default=200, help="lookup samples of each kind")
    p.add_argument("--json", type=Path, help="write every sample and the summary here")
    p.add_argument(
        "--profile-b", type=Path, help="py-spy node B during the rounds (collapsed stacks to this file)"
    )
    args = p.parse_args(argv)
    if args.block_kib <= 0 or (args.block_kib * 1024) % LAYER_BYTES:
        p.error(f"--block-kib must be a positive multiple of {LAYER_BYTES // 1024}")
    if args.blocks < 1 or args.rounds < 1 or args.lookups < 1:
        p.error("--blocks, --rounds and --lookups must be >= 1")
    return args


# -- processes ------------------------------------------------------------------------------------


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def start_node(
    run_dir: Path, name: str, url: str, host_bytes: int, slab_bytes: int, queue_bytes: int
) -> DaemonProcess:
    cfg = run_dir / f"{name}.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    fleet = run_dir / "fleet.key"
    fleet.write_text(FLEET_KEY.hex() + "\n")
    cfg.write_text(
        f'cluster = "{url}"\n'
        f'cluster_fleet_key_file = "{fleet}"\n'
        f'cluster_realm = "{CLUSTER_REALM}"\n'
        "cluster_lookup_timeout_ms = 1000\n"
        "cluster_fetch_timeout_ms = 5000\n"
        "cluster_write_timeout_ms = 10000\n"
        f"cluster_queue_bytes = {queue_bytes}\n"
    )
    return DaemonProcess(
        run_dir / name,
        "--config",
        str(cfg),
        "--host-bytes",
        str(host_bytes),
        "--slab-bytes",
        str(slab_bytes),
        "--lease-ttl-s",
        "60",
    ).start(60)


@contextlib.contextmanager
def daemon(stack: list[DaemonProcess], *args: Any) -> Iterator[DaemonProcess]:
    d = start_node(*args)
    stack.append(d)
    yield d


@contextlib.contextmanager
def profile(out: Path | None, d: DaemonProcess) -> Iterator[Callable[[], None]]:
    """py-spy recording ``d`` from now until the yielded stop() (or the exit) is called."""
    if out is None:
        yield lambda: None
        return
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not exe:
        raise RuntimeError("--profile-b: py-spy not found (set PY_SPY or put it on PATH)")
    assert d.proc is not None
    proc = subprocess.Popen(
        [
            exe,
            "record",
            "--pid",
            str(d.proc.pid),
            "--rate",
            "250",
            "--format",
            "raw",
            "--threads",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    time.sleep(1.0)  # py-spy attaches
    try:
        yield stop
    finally:
        stop()


def kill_all(daemons: list[DaemonProcess]) -> None:
    for d in daemons:
        with contextlib.suppress(Exception):
            d.kill()
        with contextlib.suppress(Exception):
            d.stderr.close()


# -- measuring ------------------------------------------------------------------------------------


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of the main thread of ``pid`` (Python names no OS thread: the main one is
    the task whose id is the pid)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cpu:
    """CPU seconds of the parties of an operation (read from /proc before and after). "B loop"
    is node B's main thread (the daemon's event loop); "B other" its other threads, mostly the
    cluster tier's (its own event loop: every Redis socket); the same for A."""

    def __init__(self, a: int, b: int, redis_pids: list[int]) -> None:
        self.a, self.b, self.redis = a, b, redis_pids

    def read(self) -> dict[str, float]:
        b, b_loop = cpu_seconds(self.b), main_thread_cpu(self.b)
        a, a_loop = cpu_seconds(self.a), main_thread_cpu(self.a)
        return {
            "B": b,
            "B loop": b_loop,
            "B other": b - b_loop,
            "A": a,
            "A loop": a_loop,
            "A other": a - a_loop,
            "redis": sum(cpu_seconds(p) for p in self.redis),
            "client": time.process_time(),
        }

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: after[k] - before[k] for k in before}


class Samples:
    """Per operation: seconds, CPU deltas, extra figures, one entry per sample."""

    def __init__(self) -> None:
        self.ops: dict[str, list[dict[str, Any]]] = {}

    def add(self, op: str, seconds: float, cpu: dict[str, float], **extra: Any) -> None:
        self.ops.setdefault(op, []).append({"s": seconds, "cpu": cpu, **extra})


def timed(samples: Samples, cpu: Cpu, op: str, fn: Callable[[], Any], **extra: Any) -> Any:
    c0 = cpu.read()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    samples.add(op, dt, Cpu.delta(c0, cpu.read()), **extra)
    return out


def cluster_figures(client: kvtier.Client) -> dict[str, Any]:
    out: dict[str, Any] = client.stats()["cluster"]
    return out


def wait_writes(client: kvtier.Client, target: int, t0: float, drops: int) -> float:
    """Seconds from ``t0`` until the daemon counted ``target`` cluster writes (polled); raises
    when it counts more write drops than ``drops`` instead."""
    while True:
        fig = cluster_figures(client)
        if fig.get("writes", 0) >= target:
            return time.perf_counter() - t0
        if fig.get("write_drops", 0) > drops:
            raise RuntimeError(f"cluster writes dropped: {fig.get('write_drops', 0) - drops}")
        if time.perf_counter() - t0 > WAIT_S:
            raise RuntimeError(
                f"cluster writes stuck at {fig.get('writes', 0)} of {target} "
                f"(drops {fig.get('write_drops', 0)})"
            )
        time.sleep(POLL_S)


def settle(rc: RedisCluster, timeout: float = 10.0) -> None:
    """Wait (untimed) until every replica has applied its master's stream: a timed operation
    never shares the box with the replication of the one before."""
    deadline = time.monotonic() + timeout
    for m in rc.masters():
        c = rc.client(m)
        while time.monotonic() < deadline:
            info = c.info("replication")
            want = int(info.get("master_repl_offset", 0))
            replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            if all(int(r.get("offset", 0)) >= want for r in replicas):
                break
            time.sleep(0.01)


def node_time(before: dict[str, Any], after: dict[str, Any]) -> tuple[float, int]:
    """(the longest per-master pipeline time, pipelines) between two ``cluster`` figures."""
    was = {n["address"]: n for n in before.get("nodes", [])}
    longest, requests = 0.0, 0
    for n in after.get("nodes", []):
        b = was.get(n["address"], {})
        longest = max(longest, n.get("latency_seconds_sum", 0.0) - b.get("latency_seconds_sum", 0.0))
        requests += n.get("requests", 0) - b.get("requests", 0)
    return longest, requests


# -- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    block = args.block_kib * 1024
    n = args.blocks
    layers = block // LAYER_BYTES
    spec = make_namespace(num_layers=layers)
    small = make_namespace(model_revision="lookups")  # 16 KiB blocks for the lookup chains
    op_bytes = n * block
    slab = max(8 << 20, block)
    # B holds two operations per round (shm, tcp) plus the lookup chains; A one at a time.
    host = max(1 << 30, 4 * op_bytes + (64 << 20))
    host = -(-host // slab) * slab
    queue = max(256 << 20, 2 * op_bytes)
    samples = Samples()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with it ignored
    daemons: list[DaemonProcess] = []
    print(
        f"redis-py {redis.__version__}, hiredis parser: {redis.utils.HIREDIS_AVAILABLE}; "
        f"block {args.block_kib} KiB x {n} blocks = {op_bytes / 2**20:.0f} MiB per operation, "
        f"{args.rounds} rounds",
        flush=True,
    )
    with RedisCluster(tmp / "redis") as rc, contextlib.ExitStack() as stack:
        stack.callback(kill_all, daemons)
        print(f"redis cluster up in {rc.startup_s:.1f} s: {rc.url}", flush=True)
        a = stack.enter_context(daemon(daemons, tmp, "a", rc.url, host, slab, queue))
        b = stack.enter_context(daemon(daemons, tmp, "b", rc.url, host, slab, queue))
        assert a.proc is not None and b.proc is not None
        redis_pids = [int(rc.client(p).info("server")["process_id"]) for p in rc.ports]
        cpu = Cpu(a.proc.pid, b.proc.pid, redis_pids)
        base: Any = rc.cluster_client()  # redis-py: untyped
        ttl_ms = 86_400_000

        ca = stack.enter_context(kvtier.Client.connect(a.unix, "shm", timeout_s=60))
        cb = {t: stack.enter_context(kvtier.Client.connect(b.unix, t, timeout_s=60)) for t in ("shm", "tcp")}
        na = ca.register(spec)
        nb = {t: c.register(spec) for t, c in cb.items()}

        dest = bytearray(op_bytes)  # the engine's side of a get, reused (prefaulted)
        dest[:] = b"\x5a" * op_bytes
        dviews = [memoryview(dest)[i * block : (i + 1) * block] for i in range(n)]
        rng = os.urandom

        def fresh() -> tuple[list[bytes], list[bytes]]:
            keys = na.block_keys(list(range(16 * n)), parent=rng(32))
            return keys, [rng(block) for _ in range(n)]

        def kvtier_write(keys: list[bytes], data: list[bytes], r: int) -> None:
            before = cluster_figures(ca)
            c0 = cpu.read()
            t0 = time.perf_counter()
            res = na.put(keys, data)
            put_s = time.perf_counter() - t0
            if res.stored != n:
                raise RuntimeError(f"A stored {res.stored} of {n}")
            dt = wait_writes(ca, before["writes"] + n, t0, before["write_drops"])
            after = cluster_figures(ca)
            longest, reqs = node_time(before, after)
            samples.add(
                "cluster write",
                dt,
                Cpu.delta(c0, cpu.read()),
                round=r,
                put_s=put_s,
                redis_s=longest,
                pipelines=reqs,
                drops=after["write_drops"] - before["write_drops"],
            )
            settle(rc)

        def kvtier_get(op: str, t: str, keys: list[bytes], data: list[bytes], r: int) -> None:
            before = cluster_figures(cb[t])
            found = timed(samples, cpu, op, lambda: nb[t].get_into(keys, dviews), round=r)
            after = cluster_figures(cb[t])
            longest, reqs = node_time(before, after)
            s = samples.ops[op][-1]
            settle(rc)
            s.update(
                redis_s=longest,
                pipelines=reqs,
                hits=sum(found),
                wrong=sum(1 for f, v, d in zip(found, dviews, data, strict=True) if f and v != d),
            )
            if s["wrong"]:
                raise RuntimeError(f"{op}: {s['wrong']} blocks came back with wrong bytes")

        def baseline(r: int) -> None:
            bkeys = [b"kvb1:%s" % rng(32).hex().encode() for _ in range(n)]
            values = [rng(HEADER_BYTES + block) for _ in range(n)]

            def set_all() -> list[Any]:
                p = base.pipeline()
                for k, v in zip(bkeys, values, strict=True):
                    p.set(k, v, nx=True, px=ttl_ms)
                out: list[Any] = p.execute()
                return out

            def get_all() -> list[Any]:
                p = base.pipeline()
                for k in bkeys:
                    p.get(k)
                out: list[Any] = p.execute()
                return out

            ok = timed(samples, cpu, "redis-py SET", set_all, round=r)
            if not all(ok):
                raise RuntimeError("baseline SET failed")
            settle(rc)
            got = timed(samples, cpu, "redis-py GET", get_all, round=r)
            if got != values:
                raise RuntimeError("baseline GET returned other bytes")
            delete(bkeys)
            settle(rc)

        def delete(rkeys: list[bytes]) -> None:
            p = base.pipeline()
            for k in rkeys:
                p.delete(k)
            p.execute()

        def forget(keys: list[bytes]) -> None:
            delete([redis_key(spec.digest, k) for k in keys])

        # warm-up (connections, slot maps, first-touch of the arenas): not measured
        wk, wd = fresh()
        before = cluster_figures(ca)
        na.put(wk, wd)
        wait_writes(ca, before["writes"] + n, time.perf_counter(), before["write_drops"])
        for t in ("shm", "tcp"):
            nb[t].get_into(wk, dviews)
        forget(wk)
        settle(rc)
        profiler = stack.enter_context(profile(args.profile_b, b))

        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            k1, d1 = fresh()
            k2, d2 = fresh()
            if r % 2 == 0:
                baseline(r)
            kvtier_write(k1, d1, r)
            kvtier_get("import shm", "shm", k1, d1, r)
            kvtier_get("local shm", "shm", k1, d1, r)
            kvtier_write(k2, d2, r)
            kvtier_get("import tcp", "tcp", k2, d2, r)
            kvtier_get("local tcp", "tcp", k2, d2, r)
            if r % 2 == 1:
                baseline(r)
            forget(k1 + k2)
            settle(rc)

        profiler()
        lookups = measure_lookups(args, ca, cb["shm"], small, base)
    return summarize(args, samples, lookups)


def measure_lookups(
    args: argparse.Namespace, ca: kvtier.Client, cbs: kvtier.Client, small: kvtier.Namespace, base: Any
) -> dict[str, Any]:
    """B's lookup_detail of a cluster-only chain vs an all-local one, and redis-py's pipelined
    EXISTS of the cluster-only chain's keys, in turn."""
    na, nb = ca.register(small), cbs.register(small)
    blocks = [os.urandom(small.block_bytes) for _ in range(CHAIN)]
    remote = na.block_keys(list(range(16 * CHAIN)), parent=os.urandom(32))
    local = nb.block_keys(list(range(16 * CHAIN)), parent=os.urandom(32))
    before = cluster_figures(ca)
    if na.put(remote, blocks).stored != CHAIN or nb.put(local, blocks).stored != CHAIN:
        raise RuntimeError("could not store the lookup chains")
    wait_writes(ca, before["writes"] + CHAIN, time.perf_counter(), before["write_drops"])
    out: dict[str, Any] = {}
    rkeys = [redis_key(small.digest, k) for k in remote]
    kinds = ("cluster", "local", "redis-py")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    short = dict.fromkeys(kinds, 0)
    want_tier = {"cluster": "cluster", "local": "host"}

    def exists() -> int:
        p = base.pipeline()
        for k in rkeys:
            p.exists(k)
        return sum(p.execute())

    for i in range(args.lookups * len(kinds)):
        kind = kinds[(i + i // len(kinds)) % len(kinds)]  # rotated: none always first
        t0 = time.perf_counter()
        if kind == "redis-py":
            hits = exists()
            times[kind].append(time.perf_counter() - t0)
            short[kind] += hits != CHAIN
            continue
        res = nb.lookup_detail(remote if kind == "cluster" else local)
        times[kind].append(time.perf_counter() - t0)
        if res.hits != CHAIN or set(res.tiers) != {want_tier[kind]}:
            short[kind] += 1
    for kind, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        out[kind] = {
            "p50_ms": statistics.median(ts) * 1e3,
            "p90_ms": q[-1] * 1e3,
            "samples": len(ts),
            "short_or_wrong_tier": short[kind],
            "all_s": ts,
        }
    return out


# -- the report -----------------------------------------------------------------------------------


def median_of(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(args: argparse.Namespace, samples: Samples, lookups: dict[str, Any]) -> dict[str, Any]:
    block = args.block_kib * 1024
    op_bytes = args.blocks * block
    baseline_of = {
        "cluster write": "redis-py SET",
        "import shm": "redis-py GET",
        "import tcp": "redis-py GET",
        "local shm": "redis-py GET",
        "local tcp": "redis-py GET",
    }
    order = [
        "cluster write",
        "redis-py SET",
        "import shm",
        "import tcp",
        "redis-py GET",
        "local shm",
        "local tcp",
    ]
    rows: list[dict[str, Any]] = []
    for op in order:
        ss = samples.ops.get(op, [])
        if not ss:
            continue
        gbps = [op_bytes / s["s"] / 1e9 for s in ss]
        row: dict[str, Any] = {
            "op": op,
            "gbps": median_of(gbps),
            "ms": median_of([s["s"] * 1e3 for s in ss]),
            "samples": len(ss),
        }
        ref = baseline_of.get(op)
        if ref:
            by_round = {s["round"]: s["s"] for s in samples.ops.get(ref, [])}
            ratios = [by_round[s["round"]] / s["s"] for s in ss if s["round"] in by_round]
            row["x_baseline"] = median_of(ratios)
            row["baseline"] = ref
        for party in ("B", "B loop", "B other", "A", "A loop", "A other", "redis", "client"):
            row[f"cpu_{party}_ms"] = statistics.fmean([s["cpu"][party] * 1e3 for s in ss])
        if "redis_s" in ss[0]:
            row["redis_pipeline_ms"] = median_of([s["redis_s"] * 1e3 for s in ss])
            row["pipelines"] = median_of([float(s["pipelines"]) for s in ss])
        if "put_s" in ss[0]:
            row["put_ms"] = median_of([s["put_s"] * 1e3 for s in ss])
        if "hits" in ss[0]:
            row["min_hits"] = min(s["hits"] for s in ss)
        rows.append(row)
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "hiredis": bool(redis.utils.HIREDIS_AVAILABLE),
        "block_bytes": block,
        "op_bytes": op_bytes,
        "rows": rows,
        "lookups": lookups,
        "samples": samples.ops,
    }


def fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, spec)


def cpu_ms(x: float) -> str:
    """A mean of 10 ms ticks; the split of a process into threads reads two counters at
    slightly different times, so a thread's share may come out a little below 0."""
    return fmt(max(0.0, x), ".0f")


def print_report(summary: dict[str, Any]) -> None:
    a = summary["args"]
    print(
        f"\n### cluster tier: {a['blocks']} x {a['block_kib']} KiB blocks "
        f"({summary['op_bytes'] / 2**20:.0f} MiB) per operation, median of {a['rounds']} rounds\n"
    )
    print(
        "| operation | GB/s | ms | x baseline | B cpu ms (loop / other threads) "
        "| A cpu ms (loop / other threads) | redis cpu ms | client cpu ms | redis pipeline ms "
        "| notes |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in summary["rows"]:
        notes = []
        if "baseline" in r:
            notes.append(f"vs {r['baseline']}")
        if "put_ms" in r:
            notes.append(f"put returned at {r['put_ms']:.1f} ms")
        if "min_hits" in r and r["min_hits"] != a["blocks"]:
            notes.append(f"MISSES: min hits {r['min_hits']}")
        if "pipelines" in r:
            notes.append(f"{r['pipelines']:.0f} pipelines")
        b_cpu = f"{cpu_ms(r['cpu_B_ms'])} ({cpu_ms(r['cpu_B loop_ms'])} / {cpu_ms(r['cpu_B other_ms'])})"
        a_cpu = f"{cpu_ms(r['cpu_A_ms'])} ({cpu_ms(r['cpu_A loop_ms'])} / {cpu_ms(r['cpu_A other_ms'])})"
        print(
            f"| {r['op']} | {fmt(r['gbps'])} | {fmt(r['ms'], '.1f')} "
            f"| {fmt(r.get('x_baseline'))} | {b_cpu} "
            f"| {a_cpu} | {cpu_ms(r['cpu_redis_ms'])} "
            f"| {cpu_ms(r['cpu_client_ms'])} | {fmt(r.get('redis_pipeline_ms'), '.1f')} "
            f"| {'; '.join(notes)} |"
        )
    lk = summary["lookups"]
    print(
        f"\n| lookup of a {CHAIN}-key chain (lookup_detail on node B) | p50 ms | p90 ms "
        "| samples | x local p50 |"
    )
    print("|---|---:|---:|---:|---:|")
    label = {
        "local": "kvtier, all in B's host tier",
        "cluster": "kvtier, cluster only",
        "redis-py": "redis-py pipeline EXISTS of the cluster-only chain",
    }
    for kind in ("local", "cluster", "redis-py"):
        x = lk[kind]
        ratio = x["p50_ms"] / lk["local"]["p50_ms"]
        bad = f" ({x['short_or_wrong_tier']} short)" if x["short_or_wrong_tier"] else ""
        print(
            f"| {label[kind]} | {x['p50_ms']:.2f} | {x['p90_ms']:.2f} | {x['samples']}{bad} | {ratio:.1f} |"
        )
    print(
        f"\ncluster part of a lookup: {lk['cluster']['p50_ms'] - lk['local']['p50_ms']:.2f} ms "
        f"(p50 difference) vs redis-py's EXISTS pipeline {lk['redis-py']['p50_ms']:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not available():
        print("redis-server / redis-cli not on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvtier-cluster-bench-") as tmp:
        summary = run(args, Path(tmp))
    print_report(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

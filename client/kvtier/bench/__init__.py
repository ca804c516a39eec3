"""``kvtier bench``: kvtier's data paths against memcpy, a raw loopback stream and Redis.

One run, one process tree: this process starts its own kvtierd (``procs.DaemonProc``, a fresh
one per block size) and, unless ``--no-redis``, a redis-server; it is itself the engine-side
client for put/get (a process apart from the daemon, as an engine is), and spawns a socket sink
and the concurrent lookup clients.

The machine may be shared and noisy, so every figure of one block size is measured in
interleaved rounds (memcpy as put and as get, shm put/get_into/get, socket as put and as get,
Redis SET/GET, tcp put/get_into/get, then again), after one warm-up each, and the best of
``--repeat`` rounds is kept: a figure and its baseline see the same conditions. Every baseline
touches as much distinct memory as the kvtier path it is held against (``baselines``).

Modules: ``plan`` (what to measure, results), ``baselines`` (memcpy, socket, Redis),
``transfers`` (kvtier put/get/get_into), ``lookups``, ``nvme`` (the NVMe tier against raw
O_DIRECT I/O, and recovery; suite ``nvme``, with ``nvme_daemon``, ``rawdisk`` and ``recovery``),
``report`` (table, targets, JSON), ``procs`` (daemon and Redis processes), ``progress`` (the
stderr bar). Suites with commands of their own (``kvtier.cli`` starts them, not ``run_bench``):
``gpu``, ``overload``, ``soak``, and ``trace`` (request traces of ``traces`` replayed against a
daemon per eviction policy, issue 42).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.bench.plan import GB, Op, Plan, Results, size_label, timed
from kvtier.bench.progress import Progress

if TYPE_CHECKING:
    from kvtier.bench.baselines import SocketStream
    from kvtier.bench.transfers import KeySource

__all__ = ["run_bench"]
_BENCH_EXTRA = "the kvtier wheel's bench extra; in a checkout: pip install -e '.[bench]'"


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite named by ``args`` (see ``kvtier bench --help``); 0 when every figure was
    measured and every round trip was byte-exact, 1 otherwise, 2 for bad arguments."""
    try:
        plan = Plan.from_args(args)
    except ValueError as e:
        print(f"kvtier bench: {e}", file=sys.stderr)
        return 2
    results = Results()
    progress = Progress(_steps(plan), enabled=plan.progress)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as tmp:
            _run(plan, Path(tmp), results, progress)
    except (RuntimeError, AssertionError, OSError) as e:
        progress.close()
        print(f"kvtier bench: failed: {e}", file=sys.stderr)
        return 1
    progress.close()
    from kvtier.bench.report import format_table, write_json

    print(format_table(plan, results))
    if plan.suite == "all" and not plan.wants("nvme"):
        print(
            "hint: the NVMe tier has a suite of its own (~2 min, several GiB of disk I/O): "
            "kvtier bench nvme [--disk-dir DIR]"
        )
    if plan.json_out:
        write_json(plan.json_out, plan, results)
    return 0


def _steps(plan: Plan) -> int:
    per_size = 0
    if plan.wants("shm"):
        per_size += 5  # memcpy as put and as get, shm put, get_into, get
    if plan.wants("tcp"):
        per_size += 5 + (2 if plan.redis and not plan.wants("tls") else 0)  # socket x2, tcp x3
    if plan.wants("tls"):
        per_size += 3  # tcp over TLS x3
    if plan.wants("verify"):
        per_size += 9  # shm and tcp put, get_into, verified and not; shm put hashed by the daemon
    lookups = 2 if plan.wants("lookup") else 0
    steps = plan.repeat * (per_size * len(plan.block_sizes) + lookups)
    if plan.wants("nvme"):
        from kvtier.bench.nvme import steps as nvme_steps

        steps += nvme_steps(plan)
    return steps


def measure(plan: Plan, block: int, ops: list[Op], results: Results, progress: Progress) -> None:
    """Warm every op up once, then ``plan.repeat`` interleaved rounds; then the byte checks."""
    for op in ops:
        progress.show(f"{op.label} (warm-up)")
        op.run()
    nbytes = plan.sample_bytes(block)
    for op in ops:
        if op.touches is not None:
            results.touches[(op.name, block)] = op.touches
    for _ in range(plan.repeat):
        for op in ops:
            progress.show(op.label)
            results.add_gbps(op.name, block, nbytes / timed(op.run) / GB)
            progress.step(op.label)
    for op in ops:
        if op.check is not None:
            op.check()


def _run(plan: Plan, tmp: Path, results: Results, progress: Progress) -> None:
    from kvtier.bench.baselines import SocketStream
    from kvtier.bench.lookups import bench_lookup
    from kvtier.bench.procs import DaemonProc

    with contextlib.ExitStack() as stack:
        stream: SocketStream | None = None
        redis_port: int | None = None
        if plan.wants("tcp"):
            progress.show("starting the socket sink and Redis")
            stream = stack.enter_context(SocketStream())
            if not plan.wants("tls"):
                redis_port = _redis(plan, tmp, results, stack)
        if plan.wants("shm") or plan.wants("tcp"):
            for block in plan.block_sizes:
                _one_size(plan, tmp, block, stream, redis_port, results, progress)
        if plan.wants("verify"):
            for block in plan.block_sizes:
                _verify_size(plan, tmp, block, results, progress)
    if plan.wants("lookup"):
        progress.show("starting kvtierd for lookups")
        with DaemonProc(tmp / "kvtierd-lookup", 64 << 20, 4 << 20, list(plan.daemon_args)) as daemon:
            assert daemon.proc is not None
            bench_lookup(plan, daemon.unix, daemon.proc.pid, results, progress)
    if plan.wants("nvme"):
        from kvtier.bench.nvme import bench_nvme

        bench_nvme(plan, tmp, results, progress)


def _one_size(
    plan: Plan,
    tmp: Path,
    block: int,
    stream: SocketStream | None,
    redis_port: int | None,
    results: Results,
    progress: Progress,
) -> None:
    """All throughput figures of one block size, against a fresh daemon: each size starts
    from an empty arena of its own, whatever the sizes before it left behind."""
    from kvtier.bench.baselines import memcpy_ops, redis_ops
    from kvtier.bench.procs import DaemonProc
    from kvtier.bench.transfers import KeySource, connect, transfer_ops

    progress.show(f"starting kvtierd for {size_label(block)} blocks")
    keys = KeySource()
    with (
        DaemonProc(
            tmp / f"kvtierd-{block}", plan.host_bytes, plan.slab_bytes, list(plan.daemon_args)
        ) as daemon,
        contextlib.ExitStack() as clients,
    ):
        ops: list[Op] = []
        if plan.wants("shm"):
            shm = clients.enter_context(contextlib.closing(connect(daemon.unix, "shm")))
            ops += memcpy_ops(plan, block) + transfer_ops(plan, shm, block, keys)
        if plan.wants("tcp"):
            assert stream is not None
            ops += stream.ops(plan, block)
            if redis_port is not None:
                ops += redis_ops(plan, redis_port, block)
            tcp = clients.enter_context(contextlib.closing(connect(daemon.grpc, "tcp")))
            ops += transfer_ops(plan, tcp, block, keys)
        if plan.wants("tls"):
            ops += _tls_ops(plan, tmp, block, keys, clients)
        measure(plan, block, ops, results, progress)


def _tls_ops(plan: Plan, tmp: Path, block: int, keys: KeySource, stack: contextlib.ExitStack) -> list[Op]:
    """The ``tcp_tls`` figures: a second daemon with a self-signed certificate, and a tcp client
    that trusts it; both are entered on ``stack`` (closed with the size's other clients)."""
    from kvtier.bench.procs import DaemonProc, self_signed
    from kvtier.bench.transfers import connect, transfer_ops

    cert, key = self_signed(tmp / f"tls-{block}")
    tls_daemon = stack.enter_context(
        DaemonProc(
            tmp / f"kvtierd-tls-{block}",
            plan.host_bytes,
            plan.slab_bytes,
            ["--tls-cert", str(cert), "--tls-key", str(key), *plan.daemon_args],
        )
    )
    tls = stack.enter_context(contextlib.closing(connect(tls_daemon.grpc, "tcp", tls_ca=str(cert))))
    return transfer_ops(plan, tls, block, keys, name="tcp_tls")


def _verify_size(plan: Plan, tmp: Path, block: int, results: Results, progress: Progress) -> None:
    """Bytes verified end to end against the unverified path (docs/security.md), interleaved:
    a daemon as configured by default (shm clients hash their puts, every get_into checks),
    one with ``--no-verify-bytes`` and clients with ``verify_bytes=False``, and one with
    ``--verify-store daemon`` (the daemon hashes shm slots at CompleteStore). Each daemon has
    an arena of its own, fresh for this block size."""
    from kvtier.bench.procs import DaemonProc
    from kvtier.bench.transfers import KeySource, connect, transfer_ops

    progress.show(f"starting three kvtierd for {size_label(block)} blocks")
    keys = KeySource()
    daemons: dict[str, list[str]] = {
        "": [],
        "_unverified": ["--no-verify-bytes"],
        "_daemon": ["--verify-store", "daemon"],
    }
    with contextlib.ExitStack() as stack:
        ops: list[Op] = []
        for suffix, extra in daemons.items():
            d = stack.enter_context(
                DaemonProc(
                    tmp / f"kvtierd-verify{suffix}-{block}",
                    plan.host_bytes,
                    plan.slab_bytes,
                    [*extra, *plan.daemon_args],
                )
            )
            for transport, address in (("shm", d.unix), ("tcp", d.grpc)):
                if suffix == "_daemon" and transport == "tcp":
                    continue  # tcp stores are hashed as they arrive, whatever verify_store
                client = stack.enter_context(
                    contextlib.closing(connect(address, transport, verify_bytes=suffix != "_unverified"))
                )
                name = transport + suffix
                keep = (
                    {f"{name}_put"} if suffix == "_daemon" else {f"{name}_put", f"{name}_get_into"}
                )  # (a get's cost is get_into's and more)
                ops += [op for op in transfer_ops(plan, client, block, keys, name=name) if op.name in keep]
        measure(plan, block, ops, results, progress)


def _redis(plan: Plan, tmp: Path, results: Results, stack: contextlib.ExitStack) -> int | None:
    """Start redis-server for the comparison, or say in a note why it is skipped."""
    from kvtier.bench.procs import RedisProc

    if not plan.redis:
        results.notes.append("Redis comparison skipped (--no-redis)")
        return None
    if RedisProc.available() is None:
        results.notes.append("Redis comparison skipped: redis-server is not on PATH")
        return None
    try:
        import redis  # noqa: F401
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        results.notes.append(f"Redis comparison skipped: redis-py is not installed ({_BENCH_EXTRA})")
        return None
    if not HIREDIS_AVAILABLE:  # redis-py's own parser would make GET a poor baseline
        results.notes.append(f"Redis comparison skipped: hiredis is not installed ({_BENCH_EXTRA})")
        return None
    return stack.enter_context(RedisProc(tmp / "redis")).port

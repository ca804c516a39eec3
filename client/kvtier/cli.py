"""The ``kvtier`` command: ``stats``, ``prefix``, ``bench``, and ``serve`` / ``fsck`` (aliases of
``kvtierd``).

The SDK's only place that reads the environment and files (with the modules it is made of:
:mod:`kvtier.cli_daemon`, the address and credential flags of the commands that talk to a
daemon; :mod:`kvtier.cli_prefix`, ``kvtier prefix``). What ``stats`` prints is made by
:mod:`kvtier.stats_format`; the benchmarks live in :mod:`kvtier.bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from kvtier.cli_daemon import add_daemon_flags, as_flags, call_daemon
from kvtier.cli_prefix import add_prefix_parser, run_prefix
from kvtier.stats_format import format_stats, stats_json
from kvtier_contract.version import __version__

__all__ = ["DAEMON_COMMANDS", "as_flags", "build_parser", "format_stats", "main", "stats_json"]

DAEMON_COMMANDS = ("serve", "fsck")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache server for LLM serving")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    # Aliases of the daemon's own command, run as a new process (no import arrow into kvtierd).
    for name, what in (
        ("serve", "run the kvtierd daemon: alias of `kvtierd serve`"),
        ("fsck", "verify an NVMe tier directory offline: alias of `kvtierd fsck`"),
    ):
        alias = sub.add_parser(name, help=what, add_help=False)
        alias.add_argument("daemon_args", nargs=argparse.REMAINDER)

    _stats_args(sub.add_parser("stats", help="print the daemon's statistics"))
    add_prefix_parser(sub)
    _bench_args(sub.add_parser("bench", help="throughput and latency benchmark (see docs/benchmarks.md)"))
    return p


def _stats_args(st: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier stats``."""
    st.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output (keys: docs/metrics.md, `kvtier stats --json`)",
    )
    add_daemon_flags(st, "Stats")


def _bench_args(b: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench``."""
    b.add_argument(
        "suite",
        nargs="?",
        default="all",
        help="all | shm | tcp | lookup | nvme | quick | tls | verify | gpu | overload | soak | trace",
    )
    b.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="block sizes")
    b.add_argument("--batch-mib", type=int, default=64, help="bytes per batch, MiB")
    b.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement, MiB")
    b.add_argument("--repeat", type=int, default=3, help="measurements per figure (best is kept)")
    b.add_argument("--lookup-clients", type=int, default=4)
    b.add_argument("--json", dest="json_out", help="also write results to this file")
    b.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument(
        "--daemon-args",
        default="",
        help="shm, tcp, tls, verify, lookup suites: more kvtierd serve arguments for their daemons "
        "(one string, e.g. '--eviction-policy prefix')",
    )
    _suite_args(b)


def _suite_args(b: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench`` that only some suites read (nvme, gpu, overload, soak; trace:
    ``_trace_args``)."""
    b.add_argument(
        "--disk-dir",
        help="nvme suite: where its tier and raw files go (a private "
        "subdirectory, removed after; default: the temp dir)",
    )
    b.add_argument("--device", default="cuda", help="gpu suite: cuda[:N], or cpu for a dry run")
    b.add_argument("--gpu-blocks", type=int, default=256, help="gpu suite: blocks per transfer")
    b.add_argument(
        "--gpu-transports",
        default="shm,cuda_ipc",
        help="gpu suite: transports to measure (cuda_ipc needs cupy and CUDA)",
    )
    b.add_argument(
        "--gpu-shape",
        default="32,8,128,16",
        help="gpu suite: layers,kv_heads,head_dim,tokens_per_block (Llama-3-8B)",
    )
    b.add_argument(
        "--overload-threads", type=int, default=64, help="overload suite: concurrent client threads"
    )
    b.add_argument(
        "--duration",
        type=float,
        default=None,
        help="overload, soak suites: seconds of load (default 20 and 60)",
    )
    b.add_argument(
        "--clients", type=int, default=4, help="soak suite: client processes, killed and restarted at random"
    )
    _trace_args(b)


def _trace_args(b: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench trace`` (docs/benchmarks.md, "Trace replay")."""
    b.add_argument(
        "--policies",
        default="lru,arc",
        help="trace suite: eviction policies, one daemon each (one refused at start: unavailable)",
    )
    b.add_argument("--traces", default="conversation,agentic", help="trace suite: synthesized traces")
    b.add_argument("--trace-file", help="trace suite: replay this Mooncake-format JSONL instead")
    b.add_argument(
        "--requests",
        type=int,
        default=None,
        help="trace suite: requests per trace (default 600; a file's all)",
    )
    b.add_argument("--seed", type=int, default=0, help="trace suite: seed of the synthesized traces")
    b.add_argument("--trace-host-bytes", default="2MiB", help="trace suite: the daemon's host tier")
    b.add_argument("--trace-disk-bytes", default="4MiB", help="trace suite: the daemon's NVMe tier")
    b.add_argument("--pods", type=int, default=0, help="trace suite: also route each trace over N daemons")
    b.add_argument(
        "--router-indexer",
        help="trace suite: route by Dynamo's KV indexer, this Python's (make dynamo-env: .venv-dynamo)",
    )
    b.add_argument("--route-gap-ms", type=int, default=50, help="trace suite: time between routed requests")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Output cut short by its reader (``kvtier stats | head -1``) ends the
    command quietly with status 141 (128 + SIGPIPE, as a shell reports it), no traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DAEMON_COMMANDS:  # every argument, --help included, is the daemon's
        return _daemon(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "stats":
        return _stats(args)
    if args.command == "prefix":
        return run_prefix(args)
    if args.suite == "gpu":
        from kvtier.bench.gpu import bench_gpu  # torch; imported only for this suite

        return bench_gpu(args)
    if args.suite == "overload":
        from kvtier.bench.overload import bench_overload

        return bench_overload(args)
    if args.suite == "soak":
        from kvtier.bench.soak import bench_soak

        return bench_soak(args)
    if args.suite == "trace":
        from kvtier.bench.trace import bench_trace

        return bench_trace(args)
    from kvtier.bench import run_bench  # heavy; imported only for bench

    return int(run_bench(args))


def _daemon(command: str, daemon_args: list[str]) -> int:
    """``kvtier serve|fsck ARGS``: replace this process with ``python -m kvtierd COMMAND ARGS``
    (signals reach the daemon itself, as under ``kvtierd`` directly)."""
    import importlib.util

    if importlib.util.find_spec("kvtierd") is None:  # an SDK-only install (the kvtier wheel)
        print(
            f"kvtier {command}: the daemon is not installed here (the kvtier wheel is the SDK "
            f"only): install the kvtierd wheel of the same version, or run kvtierd where it "
            f"is (README.md, Install)",
            file=sys.stderr,
        )
        return 2
    argv = [sys.executable, "-m", "kvtierd", command, *daemon_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 127  # not reached


def _stats(args: argparse.Namespace) -> int:
    status, stats = call_daemon("kvtier stats", args, lambda client: client.stats())
    if status:
        return status
    if args.json:
        print(json.dumps(stats_json(stats), indent=2, sort_keys=True))
    else:
        print(format_stats(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

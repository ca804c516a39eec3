"""``kvtier bench trace``: request traces replayed against a daemon, once per eviction policy (issue 42).

One run, one process tree: for every trace (``bench.traces``: a multi-turn conversation trace and
an agentic trace, synthesized from ``--seed``, or a Mooncake-format ``--trace-file``) and every
policy of ``--policies``, this process starts a fresh kvtierd (``procs.DaemonProc``) with a small
fixed host tier, an NVMe tier of a small fixed size below it (so blocks leave the cache) and
``eviction_policy`` set in a config file, and replays the trace through the SDK as one engine
would, request by request, in arrival order (as fast as it can: timestamps give only the order).
A policy the daemon refuses at start is reported ``unavailable`` and the run goes on.

Per request (:class:`~kvtier.bench.replay.Replayer`): the prompt's block keys
(``handle.block_keys`` over tokens derived from each hash id, chained from the head as an
engine's are), a lookup (the longest
prefix held, on any tier), ``get_into`` of that prefix with every block checked against the
bytes stored for it (derived from its hash id), and a ``put`` of the missed blocks with the
parent key of the first of them. At the end every block ever stored is probed alone (a 1-key
lookup): held blocks whose parent chain is broken are *orphaned* (no prefix lookup can reach
them).

Figures per (trace, policy), :class:`~kvtier.bench.replay.ReplayReport`: hit tokens (blocks ×
tokens per block), recomputed tokens (every prompt token not hit), eviction-induced recomputed
tokens (misses of blocks stored before), orphaned blocks; and, when both ran, prefix / lru of
the eviction-induced recomputed tokens. With ``--pods N``, each trace again over N daemons
routed by a real router's index or at random (:mod:`kvtier.bench.routing`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from kvtier.bench.replay import Replayer, ReplayReport, TraceSettings
from kvtier.bench.routing import RoutedReport, run_routed
from kvtier.bench.traces import TraceRequest, parents
from kvtier_contract.units import format_bytes

__all__ = ["TraceSettings", "bench_trace", "format_reports", "format_routed", "run_replay"]


def run_replay(
    settings: TraceSettings, name: str, trace: list[TraceRequest], policy: str, root: Path
) -> ReplayReport:
    """Replay ``trace`` against a fresh daemon with ``policy`` under ``root``; the figures, or
    a report ``unavailable`` when the daemon refuses the policy at start. RuntimeError when the
    daemon fails otherwise."""
    from kvtier.bench.procs import DaemonProc
    from kvtier.bench.transfers import bench_namespace, connect

    run_dir = root / f"{name}-{policy}"
    run_dir.mkdir(parents=True)
    config = run_dir / "kvtierd.toml"
    config.write_text(f"eviction_policy = {json.dumps(policy)}\n")
    extra = ["--config", str(config), "--disk-dir", str(run_dir / "disk")]
    extra += ["--disk-bytes", str(settings.disk_bytes), "--write-policy", settings.write_policy]
    report = ReplayReport(trace=name, policy=policy)
    try:
        daemon = DaemonProc(run_dir, settings.host_bytes, settings.slab_bytes, extra).__enter__()
    except RuntimeError as e:
        if "eviction_policy" not in str(e):
            raise
        report.status, report.reason = "unavailable", _refusal(str(e))
        return report
    try:
        with contextlib.closing(connect(daemon.unix, "shm", local_lookups=False)) as client:
            ns = client.register(bench_namespace(settings.block_bytes, name=f"kvtier-bench-trace-{name}"))
            replayer = Replayer(ns, parents(trace), report)
            t0 = time.perf_counter()
            for req in trace:
                replayer.request(req)
            replayer.probe_orphans()
            report.seconds = round(time.perf_counter() - t0, 3)
    finally:
        daemon.__exit__(None, None, None)
    return report


def _refusal(message: str) -> str:
    """The daemon's line about ``eviction_policy`` out of its log tail."""
    lines = [ln.strip() for ln in message.splitlines() if "eviction_policy" in ln]
    return lines[-1] if lines else message.strip().splitlines()[-1]


_COLUMNS = (
    ("trace", "trace", 14),
    ("policy", "policy", 8),
    ("requests", "requests", 9),
    ("tokens", "total_tokens", 10),
    ("hit", "hit_tokens", 10),
    ("recomputed", "recomputed_tokens", 11),
    ("evict-recomp", "eviction_recomputed_tokens", 13),
    ("orphaned", "orphaned_blocks", 9),
    ("held", "held_blocks", 6),
    ("s", "seconds", 7),
)


def format_reports(
    settings: TraceSettings, traces: dict[str, list[TraceRequest]], reports: list[ReplayReport]
) -> str:
    """The table of every (trace, policy), then the prefix / lru ratios where both ran."""
    tokens = 16  # bench_namespace's tokens per block
    lines = [
        f"trace replay: {format_bytes(settings.block_bytes)} blocks of {tokens} tokens; host tier "
        f"{format_bytes(settings.host_bytes)}, NVMe tier {format_bytes(settings.disk_bytes)} "
        f"({settings.write_policy}); seed {settings.seed}"
    ]
    for name, trace in traces.items():
        blocks = len(parents(trace))
        lines.append(
            f"  {name}: {len(trace)} requests, {blocks} distinct blocks "
            f"({format_bytes(blocks * settings.block_bytes)})"
        )
    tw = max([_COLUMNS[0][2], *(len(r.trace) + 2 for r in reports)])  # a file's name may be long
    columns = (("trace", "trace", tw), *_COLUMNS[1:])
    lines.append(
        "".join(f"{head:>{w}}" if i > 1 else f"{head:<{w}}" for i, (head, _f, w) in enumerate(columns))
    )
    for r in reports:
        if r.status != "ok":
            lines.append(f"{r.trace:<{tw}}{r.policy:<8}  unavailable: {r.reason}")
            continue
        row = {**asdict(r), "seconds": f"{r.seconds:.2f}"}
        lines.append(
            "".join(
                f"{row[f]:<{w}}" if i <= 1 else f"{row[f]:>{w}}" if f == "seconds" else f"{row[f]:>{w},}"
                for i, (_h, f, w) in enumerate(columns)
            )
        )
    for name, ratio in ratios(reports).items():
        lines.append(f"prefix/lru eviction-induced recomputed tokens, {name}: {ratio}")
    return "\n".join(lines)


def ratios(reports: list[ReplayReport]) -> dict[str, float | str]:
    """Trace -> prefix / lru of eviction-induced recomputed tokens, where both policies ran."""
    out: dict[str, float | str] = {}
    ok = {(r.trace, r.policy): r for r in reports if r.status == "ok"}
    for (trace, policy), lru in ok.items():
        prefix = ok.get((trace, "prefix"))
        if policy != "lru" or prefix is None:
            continue
        lru_n, prefix_n = lru.eviction_recomputed_tokens, prefix.eviction_recomputed_tokens
        out[trace] = round(prefix_n / lru_n, 3) if lru_n else ("n/a (lru: 0)" if prefix_n else 1.0)
    return out


def format_routed(routed: list[RoutedReport]) -> str:
    """One line per (trace, arm): hits over the pods, and how often the router's index was right."""
    lines = []
    for r in routed:
        share = r.hit_tokens / r.total_tokens if r.total_tokens else 0.0
        line = (
            f"routed {r.trace} over {r.pods} pods ({r.policy}), {r.arm}: {r.requests} requests, "
            f"hit {r.hit_tokens:,} of {r.total_tokens:,} tokens ({share:.1%})"
        )
        if r.arm == "indexer":
            line += (
                f"; the index predicted the lookup's hit for {r.predicted} "
                f"({r.predicted / max(r.requests, 1):.1%}), off by {r.mispredicted_blocks} blocks in all"
            )
        lines.append(line)
    return "\n".join(lines)


def bench_trace(args: argparse.Namespace) -> int:
    """``kvtier bench trace``: 0 when every available policy replayed every trace, 1 when a run
    failed, 2 for bad arguments."""
    try:
        settings = TraceSettings.from_args(args)
        traces = settings.load()
        for trace in traces.values():
            parents(trace)
    except (ValueError, OSError) as e:
        print(f"kvtier bench trace: {e}", file=sys.stderr)
        return 2
    reports: list[ReplayReport] = []
    routed: list[RoutedReport] = []
    arms = (["indexer"] if settings.router_indexer else []) + ["random"] if settings.pods else []
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-trace-") as tmp:
            for name, trace in traces.items():
                for policy in settings.policies:
                    if settings.progress:
                        print(f"replaying {name} ({len(trace)} requests) with {policy}", file=sys.stderr)
                    reports.append(run_replay(settings, name, trace, policy, Path(tmp)))
                for arm in arms:
                    if settings.progress:
                        print(f"routing {name} over {settings.pods} pods: {arm}", file=sys.stderr)
                    routed.append(run_routed(settings, name, trace, arm, Path(tmp)))
    except (RuntimeError, AssertionError, OSError) as e:
        print(f"kvtier bench trace: failed: {e}", file=sys.stderr)
        return 1
    print(format_reports(settings, traces, reports))
    if routed:
        print(format_routed(routed))
    if settings.json_out:
        doc = {
            "settings": settings.describe(),
            "runs": [asdict(r) for r in reports],
            "ratios": ratios(reports),
            "routed": [asdict(r) for r in routed],
        }
        Path(settings.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0

"""The bench's output: a table of GB/s, the targets as ratios, and the same as JSON.

Plain functions over a finished run's ``Plan`` and ``Results`` (no state, no threads). What each
op is called and the bar each target sets live in bench.targets (``TARGETS``, ``target_rows``);
this module renders them, with the machine, the lookup and the recovery figures.
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

from kvtier.bench.plan import Plan, Results, size_label
from kvtier.bench.targets import OP_LABELS, OP_ORDER, TARGETS, target_rows
from kvtier_contract.cores import usable_cores
from kvtier_contract.units import format_bytes

RECOVERY_LABELS = {
    "ready_empty_s": "start -> KVTIERD_READY, empty directory",
    "ready_warm_s": "start -> KVTIERD_READY after SIGTERM",
    "recovery_warm_s": "nvme.recovery_seconds after SIGTERM (warm)",
    "ready_replay_s": "start -> KVTIERD_READY after kill -9",
    "recovery_replay_s": "nvme.recovery_seconds after kill -9 (replay)",
}
IO_THREADS = 4  # the daemon's default io_threads (bench.nvme uses as many for the raw figures)


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "nproc": usable_cores(),
        "memory_bytes": mem,
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


INDICATIVE = "indicative"


def to_json(plan: Plan, results: Results) -> dict[str, Any]:
    throughput = [
        {
            "op": op,
            "block_bytes": block,
            "gbps": fig.best,
            "samples": fig.samples,
            **_touches(results, op, block),
        }
        for (op, block), fig in sorted(results.throughput.items(), key=lambda kv: (kv[0][1], kv[0][0]))
    ]
    lookup = {
        name: {"value": fig.best, "unit": fig.unit, "samples": fig.samples}
        for name, fig in results.lookup.items()
    }
    out = {
        "machine": machine(),
        "plan": plan.describe(),
        "throughput": throughput,
        "lookup": lookup,
        "targets": target_rows(plan, results),
        "notes": results.notes,
    }
    if results.recovery or results.facts:
        out["recovery"] = {
            name: {
                "value": fig.best,
                "unit": fig.unit,
                "samples": fig.samples,
                "per_10k_blocks": per_10k(results, name),
            }
            for name, fig in results.recovery.items()
        }
        out["facts"] = results.facts
    return out


def _touches(results: Results, op: str, block: int) -> dict[str, int]:
    t = results.touches.get((op, block))
    return {} if t is None else {"distinct_src_bytes": t.src, "distinct_dst_bytes": t.dst}


def per_10k(results: Results, name: str) -> float | None:
    """A recovery figure scaled to 10,000 blocks (None for the start-up figures)."""
    blocks = results.facts.get(
        {"recovery_warm_s": "recovered_warm_blocks", "recovery_replay_s": "recovered_replay_blocks"}.get(
            name, ""
        )
    )
    value = results.seconds(name)
    return value * 10_000 / blocks if value is not None and blocks else None


def write_json(path: str, plan: Plan, results: Results) -> None:
    with open(path, "w") as f:
        json.dump(to_json(plan, results), f, indent=2)
        f.write("\n")


def _cell(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


_W = 56  # width of the label column


def format_table(plan: Plan, results: Results) -> str:
    """The human report: machine, GB/s per path and block size, targets as ratios, lookups."""
    m = machine()
    warm = "" if plan.suite == "nvme" else " after a warm-up"
    label = f" (ratios {INDICATIVE} only)" if plan.indicative else ""
    head = [
        f"kvtier bench: suite {plan.suite}{label}, best of {plan.repeat} interleaved rounds{warm}, "
        f"{format_bytes(plan.total_bytes)} per sample in "
        f"{format_bytes(plan.batch_bytes)} batches",
        f"machine: {m['nproc']} CPUs ({m['cpu']}), {format_bytes(m['memory_bytes'])} RAM, "
        f"{m['platform']}, Python {m['python']}",
    ]
    if results.touches:
        head.append(
            f"baselines touch as much distinct memory as kvtier: one "
            f"{format_bytes(plan.batch_bytes)} batch on the engine's side, the whole sample "
            "on the other (docs/benchmarks.md §13)"
        )
    if "filesystem" in results.facts:
        f = results.facts
        direct = "O_DIRECT" if f.get("tier_direct_io") and f.get("raw_direct_io") else "NO O_DIRECT"
        head.append(
            f"nvme: {f['filesystem']} at {f['mount']} ({direct}), write-through, "
            f"{IO_THREADS} I/O threads; no warm-up (every round writes fresh slots)"
        )
    if plan.indicative:
        head.append(
            f"{INDICATIVE}: the quick suite moves {format_bytes(plan.total_bytes)} per "
            "sample in one round, too little for a verdict; run `kvtier bench` (suite "
            "all) for verdicts against the targets (docs/benchmarks.md)"
        )
    rows = target_rows(plan, results)
    body = _throughput_lines(plan, results) + _target_lines(plan, rows)
    body += _lookup_lines(plan, results, rows) + _recovery_lines(results)
    return "\n".join(head + body + [f"note: {n}" for n in results.notes])


def _throughput_lines(plan: Plan, results: Results) -> list[str]:
    if not results.throughput:
        return []
    sizes = plan.block_sizes
    lines = ["", f"{'GB/s':<{_W}}" + "".join(f"{size_label(s):>12}" for s in sizes)]
    for op in OP_ORDER:
        vals = [results.gbps(op, s) for s in sizes]
        if any(v is not None for v in vals):
            lines.append(f"{OP_LABELS[op]:<{_W}}" + "".join(f"{_cell(v):>12}" for v in vals))
    return lines


def _target_lines(plan: Plan, rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    shown = [t for t in TARGETS if any(r["target"] == t.name for r in rows)]
    cw = 18 if plan.indicative else 12  # "0.91x indicative"
    w = max([_W] + [len(t.name) + 1 for t in shown])
    for t in shown:
        cells = {r["block_bytes"]: r for r in rows if r["target"] == t.name}
        lines.append(
            f"{t.name:<{w}}"
            + "".join(f"{_ratio_cell(cells.get(s), plan.indicative):>{cw}}" for s in plan.block_sizes)
        )
    if not lines:
        return []
    title = f"target: ratio, {INDICATIVE} only" if plan.indicative else "target: ratio, ok?"
    return ["", f"{title:<{w}}" + "".join(f"{size_label(s):>{cw}}" for s in plan.block_sizes)] + lines


def _lookup_lines(plan: Plan, results: Results, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{r['target']:<{_W}}{_num(r['value']):>12} {_unit(r['op'])} "
        f"{INDICATIVE if plan.indicative else 'ok' if r['met'] else 'MISSED'}"
        for r in rows
        if "value" in r
    ]
    k = plan.lookup_keys
    for name, text in (
        ("lookup_p99_ms", f"{k}-key lookup p99"),
        ("daemon_cpu_us_per_lookup", "daemon CPU time per lookup"),
        ("lookup_control_p50_ms", f"{k}-key lookup p50, control channel"),
        ("lookup_control_p99_ms", f"{k}-key lookup p99, control channel"),
        ("lookups_control_per_s", f"lookups/s, control channel, {plan.lookup_clients} clients"),
        ("daemon_cpu_us_per_lookup_control", "daemon CPU time per control-channel lookup"),
        ("lookup_1key_control_p50_ms", "1-key control-channel lookup p50"),
        ("lookup_grpc_p50_ms", f"{k}-key lookup p50 over gRPC"),
        ("lookup_grpc_p99_ms", f"{k}-key lookup p99 over gRPC"),
        ("lookups_grpc_per_s", f"lookups/s over gRPC, {plan.lookup_clients} clients"),
        ("daemon_cpu_us_per_lookup_grpc", "daemon CPU time per gRPC lookup"),
        ("lookup_1key_p50_ms", "1-key gRPC lookup p50 (the round-trip floor)"),
    ):
        v = results.lookup_best(name)
        if v is not None:
            lines.append(f"{text:<{_W}}{_num(v):>12} {_unit(name)}")
    return [""] + lines if lines else []


def _recovery_lines(results: Results) -> list[str]:
    if not results.recovery:
        return []
    f = results.facts
    title = (
        f"recovery, {f.get('recovered_warm_blocks', 0):,} blocks of "
        f"{size_label(f.get('recovery_block_bytes', 1))} (best)"
    )
    lines = ["", f"{title:<{_W}}{'seconds':>12}{'per 10,000':>12}"]
    for name, text in RECOVERY_LABELS.items():
        v = results.seconds(name)
        if v is not None:
            lines.append(f"{text:<{_W}}{v:>12.3f}{_cell(per_10k(results, name), '{:.3f}'):>12}")
    if "recovered_replay_blocks" in f:
        lines.append(
            f"(after kill -9: {f['recovered_replay_blocks']:,} blocks recovered, "
            f"{f['replayed_journal_records']:,} of them from the journal; every slot "
            "header is read back)"
        )
    return lines


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _unit(name: str) -> str:
    return {
        "lookups_per_s": "/s",
        "lookups_grpc_per_s": "/s",
        "lookups_control_per_s": "/s",
        "daemon_cpu_us_per_lookup": "us",
        "daemon_cpu_us_per_lookup_grpc": "us",
        "daemon_cpu_us_per_lookup_control": "us",
    }.get(name, "ms")


def _ratio_cell(row: dict[str, Any] | None, indicative: bool = False) -> str:
    """``0.93x ok`` / ``0.71x NO``; for the quick suite ``0.71x indicative``: no verdict."""
    if row is None or row["ratio"] is None:
        return "-"
    return f"{row['ratio']:.2f}x {INDICATIVE if indicative else 'ok' if row['met'] else 'NO'}"

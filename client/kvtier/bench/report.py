"""The bench's output: a table of GB/s, the targets as ratios, and the same as JSON.

Targets (DESIGN.md §5 and the bench brief): shm put and get >= 0.8x memcpy; tcp put and get
>= 0.8x a raw loopback stream, tcp get >= 1x Redis GET, tcp put >= 2x Redis SET; a 1,000-key
lookup p50 <= 1 ms and >= 5,000 lookups/s from several client processes.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from typing import Any

from kvtier.bench.plan import Plan, Results, size_label
from kvtier.units import format_bytes

OP_LABELS = {
    "memcpy": "memcpy (numpy.copyto)", "socket": "raw loopback TCP stream",
    "redis_set": "Redis SET (pipelined)", "redis_get": "Redis GET (pipelined)",
    "shm_put": "shm put", "shm_get_into": "shm get_into", "shm_get": "shm get (allocates)",
    "tcp_put": "tcp put", "tcp_get_into": "tcp get_into", "tcp_get": "tcp get (allocates)",
}
OP_ORDER = ("memcpy", "socket", "redis_set", "redis_get", "shm_put", "shm_get_into", "shm_get",
            "tcp_put", "tcp_get_into", "tcp_get")


@dataclass(frozen=True)
class Target:
    """``op`` must reach ``goal`` x ``baseline`` (throughput, per block size)."""

    op: str
    baseline: str
    goal: float

    @property
    def name(self) -> str:
        return f"{OP_LABELS[self.op]} >= {self.goal:g}x {OP_LABELS[self.baseline]}"


TARGETS = (
    Target("shm_put", "memcpy", 0.8), Target("shm_get_into", "memcpy", 0.8),
    Target("shm_get", "memcpy", 0.8),
    Target("tcp_put", "socket", 0.8), Target("tcp_get_into", "socket", 0.8),
    Target("tcp_get", "socket", 0.8),
    Target("tcp_get", "redis_get", 1.0), Target("tcp_put", "redis_set", 2.0),
)
LOOKUP_P50_MS_MAX = 1.0
LOOKUPS_PER_S_MIN = 5000.0


def machine() -> dict[str, Any]:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"nproc": os.cpu_count(), "memory_bytes": mem, "cpu": _cpu_model(),
            "platform": platform.platform(), "python": platform.python_version()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def target_rows(plan: Plan, results: Results) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in TARGETS:
        for block in plan.block_sizes:
            a, b = results.gbps(t.op, block), results.gbps(t.baseline, block)
            if a is None and b is None:
                continue
            ratio = a / b if a is not None and b else None
            rows.append({"target": t.name, "op": t.op, "baseline": t.baseline,
                         "block_bytes": block, "goal": t.goal, "ratio": ratio,
                         "met": None if ratio is None else ratio >= t.goal})
    p50, rate = results.lookup_best("lookup_p50_ms"), results.lookup_best("lookups_per_s")
    if p50 is not None:
        rows.append({"target": f"{plan.lookup_keys}-key lookup p50 <= {LOOKUP_P50_MS_MAX:g} ms",
                     "op": "lookup_p50_ms", "value": p50, "goal": LOOKUP_P50_MS_MAX,
                     "met": p50 <= LOOKUP_P50_MS_MAX})
    if rate is not None:
        rows.append({"target": f"lookups/s from {plan.lookup_clients} clients >= "
                               f"{LOOKUPS_PER_S_MIN:,.0f}", "op": "lookups_per_s", "value": rate,
                     "goal": LOOKUPS_PER_S_MIN, "met": rate >= LOOKUPS_PER_S_MIN})
    return rows


def to_json(plan: Plan, results: Results) -> dict[str, Any]:
    throughput = [{"op": op, "block_bytes": block, "gbps": fig.best, "samples": fig.samples}
                  for (op, block), fig in sorted(results.throughput.items(),
                                                 key=lambda kv: (kv[0][1], kv[0][0]))]
    lookup = {name: {"value": fig.best, "unit": fig.unit, "samples": fig.samples}
              for name, fig in results.lookup.items()}
    return {"machine": machine(), "plan": plan.describe(), "throughput": throughput,
            "lookup": lookup, "targets": target_rows(plan, results), "notes": results.notes}


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
    head = [f"kvtier bench: suite {plan.suite}, best of {plan.repeat} interleaved rounds after a "
            f"warm-up, {format_bytes(plan.total_bytes)} per sample in "
            f"{format_bytes(plan.batch_bytes)} batches",
            f"machine: {m['nproc']} CPUs ({m['cpu']}), {format_bytes(m['memory_bytes'])} RAM, "
            f"{m['platform']}, Python {m['python']}"]
    rows = target_rows(plan, results)
    body = _throughput_lines(plan, results) + _target_lines(plan, rows)
    body += _lookup_lines(plan, results, rows)
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
    for t in TARGETS:
        cells = {r["block_bytes"]: r for r in rows if r["target"] == t.name}
        if cells:
            lines.append(f"{t.name:<{_W}}" + "".join(f"{_ratio_cell(cells.get(s)):>12}"
                                                     for s in plan.block_sizes))
    if not lines:
        return []
    return ["", f"{'target: ratio, ok?':<{_W}}" + "".join(f"{size_label(s):>12}"
                                                          for s in plan.block_sizes)] + lines


def _lookup_lines(plan: Plan, results: Results, rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{r['target']:<{_W}}{_num(r['value']):>12} {_unit(r['op'])} "
             f"{'ok' if r['met'] else 'MISSED'}" for r in rows if "value" in r]
    for name, text in (("lookup_p99_ms", f"{plan.lookup_keys}-key lookup p99"),
                       ("lookup_1key_p50_ms", "1-key lookup p50 (the round-trip floor)"),
                       ("daemon_cpu_us_per_lookup", "daemon CPU time per lookup")):
        v = results.lookup_best(name)
        if v is not None:
            lines.append(f"{text:<{_W}}{_num(v):>12} {_unit(name)}")
    return [""] + lines if lines else []


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _unit(name: str) -> str:
    return {"lookups_per_s": "/s", "daemon_cpu_us_per_lookup": "us"}.get(name, "ms")


def _ratio_cell(row: dict[str, Any] | None) -> str:
    if row is None or row["ratio"] is None:
        return "-"
    return f"{row['ratio']:.2f}x {'ok' if row['met'] else 'NO'}"

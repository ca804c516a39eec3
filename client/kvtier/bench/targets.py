"""What the bench compares and the bar each comparison must reach: op labels, ``TARGETS``, verdicts.

Targets (docs/benchmarks.md; issue 16): shm put and get_into >= 0.9x memcpy, shm
get >= 0.8x; tcp put and get_into >= 0.9x a raw loopback stream, tcp get >= 0.8x (each against
the baseline that touches the same distinct memory: "as put" or "as get", bench.baselines); tcp
get >= 1x Redis GET, tcp put >= 2x Redis SET; a 1,000-key lookup p50 <= 0.5 ms and >= 5,000
lookups/s from several client processes (issue 16; the SDK's default path, the published index,
with the gRPC path beside it); NVMe demote and promote >= 0.8x raw O_DIRECT write+fdatasync /
read of the same bytes (4 threads, as the tier). ``target_rows`` turns a run's ``Results`` into
one row per target and block size (plain data: bench.report renders them as text and JSON).
Immutable tables and pure functions: no state, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.bench.plan import Plan, Results

OP_LABELS = {
    "memcpy_put": "memcpy into fresh memory (as put)",
    "memcpy_get": "memcpy from distinct memory (as get)",
    "socket_put": "loopback stream into fresh memory (as put)",
    "socket_get": "loopback stream from distinct memory (as get)",
    "redis_set": "Redis SET, fresh keys (pipelined, hiredis)",
    "redis_get": "Redis GET (pipelined, hiredis)",
    "shm_put": "shm put",
    "shm_get_into": "shm get_into",
    "shm_get": "shm get (allocates)",
    "tcp_put": "tcp put",
    "tcp_get_into": "tcp get_into",
    "tcp_get": "tcp get (allocates)",
    "tcp_tls_put": "tcp put over TLS",
    "tcp_tls_get_into": "tcp get_into over TLS",
    "tcp_tls_get": "tcp get over TLS (allocates)",
    "shm_unverified_put": "shm put, bytes not verified",
    "shm_unverified_get_into": "shm get_into, bytes not verified",
    "shm_daemon_put": "shm put, verify_store = daemon",
    "tcp_unverified_put": "tcp put, bytes not verified",
    "tcp_unverified_get_into": "tcp get_into, bytes not verified",
    "nvme_raw_write_1t": "raw O_DIRECT write+fdatasync, 1 thread",
    "nvme_raw_write": "raw O_DIRECT write+fdatasync, 4 threads",
    "nvme_raw_read_1t": "raw O_DIRECT read, 1 thread",
    "nvme_raw_read": "raw O_DIRECT read, 4 threads",
    "nvme_demote": "NVMe demote (put -> durable)",
    "nvme_promote_prefetch": "NVMe promote (prefetch, daemon)",
    "nvme_promote_prepare": "NVMe promote (get_into's PrepareLoad)",
    "nvme_promote_get_into": "NVMe promote (get_into, end to end)",
    "xxh3": "xxh3_64 checksum, 1 thread",
}
OP_ORDER = (
    "memcpy_put",
    "memcpy_get",
    "socket_put",
    "socket_get",
    "redis_set",
    "redis_get",
    "shm_put",
    "shm_get_into",
    "shm_get",
    "tcp_put",
    "tcp_get_into",
    "tcp_get",
    "tcp_tls_put",
    "tcp_tls_get_into",
    "tcp_tls_get",
    "shm_unverified_put",
    "shm_daemon_put",
    "shm_unverified_get_into",
    "tcp_unverified_put",
    "tcp_unverified_get_into",
    "nvme_raw_write_1t",
    "nvme_raw_write",
    "nvme_demote",
    "nvme_raw_read_1t",
    "nvme_raw_read",
    "nvme_promote_prefetch",
    "nvme_promote_prepare",
    "nvme_promote_get_into",
    "xxh3",
)


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
    # issue 16 raised the shm put / get_into and tcp put / get_into bars from 0.8 to 0.9
    Target("shm_put", "memcpy_put", 0.9),
    Target("shm_get_into", "memcpy_get", 0.9),
    Target("shm_get", "memcpy_get", 0.8),
    Target("tcp_put", "socket_put", 0.9),
    Target("tcp_get_into", "socket_get", 0.9),
    Target("tcp_get", "socket_get", 0.8),
    Target("tcp_get", "redis_get", 1.0),
    Target("tcp_put", "redis_set", 2.0),
    # issue 11: verified bytes cost at most 15% of an shm put and get (suite verify)
    Target("shm_put", "shm_unverified_put", 0.85),
    Target("shm_get_into", "shm_unverified_get_into", 0.85),
    Target("shm_daemon_put", "shm_unverified_put", 0.85),
    Target("tcp_put", "tcp_unverified_put", 0.85),
    Target("tcp_get_into", "tcp_unverified_get_into", 0.85),
    Target("nvme_demote", "nvme_raw_write", 0.8),
    Target("nvme_promote_prefetch", "nvme_raw_read", 0.8),
    Target("nvme_promote_prepare", "nvme_raw_read", 0.8),
    Target("nvme_promote_get_into", "nvme_raw_read", 0.8),
)
LOOKUP_P50_MS_MAX = 0.5
LOOKUPS_PER_S_MIN = 5000.0


def target_rows(plan: Plan, results: Results) -> list[dict[str, Any]]:
    """Each target's figure per block size; ``met`` is the verdict, ``indicative`` (quick)
    says that the sample was too small for one."""
    rows = _ratio_rows(plan, results) + _lookup_rows(plan, results)
    for r in rows:
        r["indicative"] = plan.indicative
    return rows


def _ratio_rows(plan: Plan, results: Results) -> list[dict[str, Any]]:
    """One row per throughput target and block size: ``op`` over ``baseline`` against ``goal``."""
    rows: list[dict[str, Any]] = []
    for t in TARGETS:
        for block in plan.block_sizes:
            a, b = results.gbps(t.op, block), results.gbps(t.baseline, block)
            if a is None and b is None or (plan.suite == "verify" and (a is None or b is None)):
                continue  # (the verify suite measures no baseline)
            ratio = a / b if a is not None and b else None
            rows.append(
                {
                    "target": t.name,
                    "op": t.op,
                    "baseline": t.baseline,
                    "block_bytes": block,
                    "goal": t.goal,
                    "ratio": ratio,
                    "met": None if ratio is None else ratio >= t.goal,
                }
            )
    return rows


def _lookup_rows(plan: Plan, results: Results) -> list[dict[str, Any]]:
    """The lookup targets (p50 latency, lookups/s) that the run measured, with their ``value``."""
    rows: list[dict[str, Any]] = []
    p50, rate = results.lookup_best("lookup_p50_ms"), results.lookup_best("lookups_per_s")
    if p50 is not None:
        rows.append(
            {
                "target": f"{plan.lookup_keys}-key lookup p50 <= {LOOKUP_P50_MS_MAX:g} ms",
                "op": "lookup_p50_ms",
                "value": p50,
                "goal": LOOKUP_P50_MS_MAX,
                "met": p50 <= LOOKUP_P50_MS_MAX,
            }
        )
    if rate is not None:
        rows.append(
            {
                "target": f"lookups/s from {plan.lookup_clients} clients >= {LOOKUPS_PER_S_MIN:,.0f}",
                "op": "lookups_per_s",
                "value": rate,
                "goal": LOOKUPS_PER_S_MIN,
                "met": rate >= LOOKUPS_PER_S_MIN,
            }
        )
    return rows

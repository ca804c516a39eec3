"""The classes vLLM requires beside the ``KvtierConnector``: its metadata, stats and metrics.

``KvtierConnectorMetadata`` carries one step's plan from the scheduler to every worker (pickled
by vLLM); ``KvtierWorkerMeta`` carries what the workers measured back to the scheduler
(``build_connector_worker_meta`` -> ``update_connector_output``); ``KvtierConnectorStats``
sums the counters over workers and the scheduler; ``KvtierPromMetrics`` turns them into
``vllm:kvtier_<key>_total`` in vLLM's own /metrics (``PROM_COUNTERS``). ``adapter``
re-exports every name.

Ownership and concurrency: values, each owned by the vLLM call that made it; no locks (vLLM
calls them on one thread per process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvtier.integrations.vllm.connector.plans import LoadReport, StepPlan, StepReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, pickled from the scheduler to every worker."""

    plan: StepPlan


@dataclass
class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers measured in one step, for the scheduler's load-or-recompute decision
    (vLLM's worker -> scheduler channel, ``update_connector_output``): the step's forward
    seconds and the loads that ended. Workers of one engine (tp ranks) run the same step and
    each load its own slice of the same blocks: aggregated, a step or a load counts once, with
    the slowest rank's seconds."""

    steps: list[StepReport]
    loads: list[LoadReport]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvtierWorkerMeta):
            return self
        steps = {r.step: r for r in self.steps}
        for s in other.steps:
            if s.step not in steps or s.seconds > steps[s.step].seconds:
                steps[s.step] = s
        loads = {r.req_ids: r for r in self.loads}
        for r in other.loads:
            if r.req_ids not in loads or r.seconds > loads[r.req_ids].seconds:
                loads[r.req_ids] = r
        return KvtierWorkerMeta(list(steps.values()), list(loads.values()))


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counters (tokens, blocks, bytes, seconds) summed over workers and the scheduler."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        for direction in ("loaded", "stored"):
            secs = self.data.get(f"{'load' if direction == 'loaded' else 'store'}_seconds", 0.0)
            if secs:
                out[f"{direction}_GBps"] = round(self.data.get(f"{direction}_bytes", 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# Counters exported to vLLM's Prometheus registry as vllm:kvtier_<key>_total (per engine).
PROM_COUNTERS = {
    "loaded_tokens": "Prompt tokens loaded from kvtier into the KV cache",
    "loaded_bytes": "KV bytes loaded from kvtier",
    "load_failed_blocks": "Blocks whose load failed (vLLM recomputed them)",
    "stored_tokens": "Tokens (prompt and generated) stored into kvtier",
    "stored_bytes": "KV bytes stored into kvtier",
    "store_dropped_blocks": "Blocks not stored (daemon away, full, or queue full)",
    "sched_lookups": "kvtier lookups issued by the scheduler",
    "sched_lookup_timeouts": "kvtier lookups answered as a miss after lookup_timeout_ms",
    "sched_hit_blocks": "Blocks vLLM was told it can load from kvtier",
    "sched_shared_hit_blocks": "Of sched_hit_blocks, blocks of a prefix one of the tenant's groups published",
    "sched_store_shared_skipped_blocks": "Blocks of a group not stored: the group's publishers store them",
    # the load-or-recompute decision (scheduler) and the interference budget (workers)
    "decision_tokens_loaded": "Hit tokens the load-or-recompute decision chose to load",
    "decision_tokens_recomputed_slower": "Hit tokens recomputed because loading them was slower",
    "decision_tokens_recomputed_budget": "Hit tokens recomputed to keep the interference budget",
    "decision_tokens_recomputed_policy": "Hit tokens recomputed because load_policy is never",
    "decision_probes": "Loads of one block of a cut-back tier to measure it again",
    "load_seconds_predicted": "Predicted seconds of the decided loads that reported back",
    "load_seconds_actual": "Measured seconds of the same loads",
    "budget_steps": "Engine steps in which a request decodes (the budget's steps)",
    "budget_step_seconds": "Forward seconds of steps in which a request decodes",
    "budget_store_jobs": "Store jobs admitted in those steps",
    "budget_load_seconds": "Seconds of loads issued in those steps",
    "budget_store_seconds": "Seconds of stores admitted in those steps",
    "store_dropped_budget_blocks": "Blocks not stored: the interference budget was spent",
    "store_dropped_budget_bytes": "KV bytes not stored: the interference budget was spent",
}
# Planner counters exported under their own name (the others as sched_<name>).
_UNPREFIXED = ("decision_", "load_seconds_")


def scheduler_stat_name(key: str) -> str:
    """The name planner counter ``key`` is exported under: ``sched_<key>``, but for the
    decision's counters, which keep their own."""
    return key if key.startswith(_UNPREFIXED) else f"sched_{key}"


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's own /metrics (front-end process)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{key}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, doc in PROM_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)

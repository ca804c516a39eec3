"""vLLM's configuration and scheduler output, translated into the connector's plain terms.

``engine_identity`` reads every engine-wide namespace field from ``VllmConfig`` and the KV cache
config (``ConfigError`` for what this connector cannot move), ``step_input`` turns a
``SchedulerOutput`` into the planner's ``StepInput`` and ``layer_order`` sorts the attention
layers by index. No vLLM import at run time (its types only for checking); ``adapter``
re-exports every name.

Ownership and concurrency: pure functions over the values vLLM hands in.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvtier.integrations.vllm.config import ConfigError, resolve_model_revision, resolve_tokenizer_digest
from kvtier.integrations.vllm.connector.config import ConnectorConfig, EngineIdentity
from kvtier.integrations.vllm.connector.plans import ScheduledRequest, StepInput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig


def step_input(so: SchedulerOutput) -> StepInput:
    """The planner's view of one ``SchedulerOutput``."""
    step = StepInput(preempted=set(so.preempted_req_ids or ()))
    n_sched = so.num_scheduled_tokens
    for new in so.scheduled_new_reqs:
        step.scheduled.append(
            ScheduledRequest(
                new.req_id, list(new.block_ids[0]), True, new.num_computed_tokens, n_sched.get(new.req_id, 0)
            )
        )
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        groups = cached.new_block_ids[i]
        step.scheduled.append(
            ScheduledRequest(
                req_id,
                list(groups[0]) if groups else None,
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i],
                n_sched.get(req_id, 0),
            )
        )
    return step


def engine_identity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ConnectorConfig
) -> EngineIdentity:
    """Every engine-wide namespace field, from vLLM's configuration; ``ConfigError`` when one is
    missing or the engine's KV is not something this connector can move."""
    groups = kv_cache_config.kv_cache_groups
    spec, head, dtype = _kv_spec(kv_cache_config)
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise ConfigError(
            "parallel_config.pipeline_parallel_size",
            "pipeline parallelism is not supported by the kvtier connector yet",
        )
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if not layout:
        raise ConfigError("cache_config.kv_cache_layout", "not resolved by vLLM")
    model_id, revision, tokenizer_digest = _model_fields(vllm_config, cfg)
    return EngineIdentity(
        model_id=model_id,
        model_revision=revision,
        tokenizer_digest=tokenizer_digest,
        kv_dtype=dtype,
        layout=f"vllm.{layout}",
        tokens_per_block=spec.block_size,
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=head,
        tp_size=par.tensor_parallel_size,
        tenant=cfg.tenant,
    )


def _model_fields(vllm_config: VllmConfig, cfg: ConnectorConfig) -> tuple[str, str, str]:
    """The model's namespace fields (model id, revision, tokenizer digest) from vLLM's model
    config and the extra config; ``ConfigError`` when the revision or tokenizer digest cannot
    be resolved."""
    mc = vllm_config.model_config
    served = mc.served_model_name
    served = served[0] if isinstance(served, (list, tuple)) and served else served
    revision = resolve_model_revision(cfg.model_revision, mc.revision, str(mc.model))
    tokenizer = str(mc.tokenizer or mc.model)
    tok_revision = getattr(mc, "tokenizer_revision", None)
    tok_revision = (
        getattr(tok_revision, "resolved", None)
        or tok_revision
        or (revision if tokenizer == str(mc.model) else None)
    )
    tokenizer_digest = resolve_tokenizer_digest(
        cfg.tokenizer_digest, mc.skip_tokenizer_init, tokenizer, str(tok_revision or "") or None
    )
    return cfg.model_id or str(served or mc.model), revision, tokenizer_digest


def _kv_spec(kv_cache_config: KVCacheConfig) -> tuple[Any, int, str]:
    """The one KV cache group's spec, head size and dtype name; ``ConfigError`` unless it is
    full attention with K and V of one head size in unpadded pages."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            "kv_cache_groups",
            f"{len(groups)} KV cache groups; kvtier supports one (run without the hybrid KV cache manager)",
        )
    spec = groups[0].kv_cache_spec
    head = getattr(spec, "head_size", None)
    if head is None or type(spec).__name__.startswith("MLA") or getattr(spec, "head_size_v", head) != head:
        raise ConfigError(
            "kv_cache_spec",
            f"{type(spec).__name__} is not supported (needs K and V "
            "of one head size: full attention, no MLA)",
        )
    dtype = str(spec.dtype).removeprefix("torch.")
    expected_page = 2 * spec.num_kv_heads * spec.block_size * head * spec.dtype.itemsize
    if spec.page_size_bytes != expected_page:
        raise ConfigError(
            "kv_cache_spec",
            f"page of {spec.page_size_bytes} B, expected "
            f"{expected_page} B (padded or quantized pages are not supported)",
        )
    return spec, head, dtype


def layer_order(names: list[str]) -> list[str]:
    """Layer names by their layer index (``model.layers.12.self_attn.attn`` -> 12)."""

    def index(name: str) -> tuple[int, str]:
        m = re.search(r"\.(\d+)\.", name)
        return (int(m.group(1)) if m else 0, name)

    return sorted(names, key=index)

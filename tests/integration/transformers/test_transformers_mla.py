"""Transformers prefix caching of MLA models (DeepSeek-V2/V3, MiniCPM3) through a real daemon.

Transformers caches an MLA layer as one "head" of the compressed latent (``kv_lora_rank`` wide,
the cache's keys) and one of the rotated shared key (``qk_rope_head_dim`` wide, the cache's
values), not ``num_key_value_heads`` heads of ``head_dim`` (which those configs set to the rope
dim). The peer finding of issue 28: ``generate`` raised after generating and the output was lost.
Tiny randomly initialised models are built from the real config classes, on CPU."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import DaemonProcess  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvtier.integrations.transformers import LAYOUT_MLA, ConfigError, KvtierPrefixCache  # noqa: E402

pytestmark = pytest.mark.timeout(180)

T = 16
REV = "0123456789abcdef0123456789abcdef01234567"
GEN = dict(max_new_tokens=8, do_sample=False)
# Small MLA shapes: 4 heads, a 32-wide latent and an 8-wide rope key per token and layer.
MLA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def deepseek_v3() -> Any:
    cfg = transformers.DeepseekV3Config(
        **MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    )
    return transformers.DeepseekV3ForCausalLM(cfg)


def deepseek_v2() -> Any:
    cfg = transformers.DeepseekV2Config(
        **MLA,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    )
    return transformers.DeepseekV2ForCausalLM(cfg)


def minicpm3() -> Any:
    fields = {**MLA, "q_lora_rank": 16}
    return transformers.MiniCPM3ForCausalLM(transformers.MiniCPM3Config(**fields))


BUILDERS = {"deepseek_v3": deepseek_v3, "deepseek_v2": deepseek_v2, "minicpm3": minicpm3}


def build(name: str) -> Any:
    torch.manual_seed(0)
    return BUILDERS[name]().eval()


def prompt(n: int, seed: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (1, n), generator=g)


def prefix_cache(address: str, model: Any, **options: Any) -> KvtierPrefixCache:
    options = {
        "model_revision": REV,
        "tokenizer_digest": "none",
        "model_id": "test/tiny-mla",
        "tokens_per_block": T,
        # What is checked is what loads and stores: every hit loaded (whether loading beats a
        # recompute is test_transformers_adaptive.py's subject, and a tiny model on a loaded
        # box recomputes faster), and deadlines a loaded 2-core CI box meets.
        "load_policy": "always",
        "request_timeout_ms": 5000,
        **options,
    }
    return KvtierPrefixCache(address, model, **options)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_mla_models_store_and_restore_the_latent_the_cache_holds(daemon: DaemonProcess, name: str) -> None:
    model = build(name)
    ids = prompt(70)
    with torch.no_grad():
        expected = model.generate(ids, **GEN)
    with prefix_cache(daemon.unix, model) as pc:
        ns = pc.namespace
        # One latent row per token and layer: (32 + 8) fp32 values = 2 x 1 head x 20.
        assert (ns.layout, ns.num_kv_heads, ns.head_dim) == (LAYOUT_MLA, 1, 20)
        assert ns.bytes_per_token == 2 * 40 * 4
        cold = pc.generate(ids, **GEN)  # used to raise here, after generating
        assert torch.equal(cold, expected)
        assert pc.counters.blocks_stored == 4 and pc.counters.store_failures == 0
        warm = pc.generate(ids, **GEN)  # 64 tokens restored from the daemon
        assert torch.equal(warm, expected)
        assert pc.counters.restored_tokens == 64

        # Bit-identical latent and rope key, as the model's own cache holds them.
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        restored, n = pc.restore(ids)
        assert n == 64
        for mine, theirs in zip(restored.layers, cache.layers, strict=True):
            assert tuple(mine.keys.shape) == (1, 1, 64, 32)
            assert tuple(mine.values.shape) == (1, 1, 64, 8)
            assert torch.equal(mine.keys, theirs.keys[:, :, :64])
            assert torch.equal(mine.values, theirs.values[:, :, :64])


def test_an_odd_latent_row_is_refused_at_construction() -> None:
    torch.manual_seed(0)
    fields = {**MLA, "kv_lora_rank": 31, "q_lora_rank": 16}
    model = transformers.MiniCPM3ForCausalLM(transformers.MiniCPM3Config(**fields))
    with pytest.raises(ConfigError, match=r"config\.kv_lora_rank.*odd"):
        prefix_cache("unix:/nonexistent/kvtier.sock", model)


def test_a_store_failing_after_generate_logs_and_returns_the_output(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever goes wrong storing after generate (here: a cache of another geometry than the
    one derived at construction, as an architecture kvtier does not know could produce), the
    generated output is returned and the failure is logged with its reason."""
    model = build("deepseek_v3")
    ids = prompt(40)
    with torch.no_grad():
        expected = model.generate(ids, **GEN)
    with prefix_cache(daemon.unix, model) as pc:
        # What a geometry derived wrongly for an unknown architecture looks like.
        pc.geometry = dataclasses.replace(pc.geometry, key_dim=pc.geometry.key_dim + 2)
        caplog.set_level(logging.WARNING, logger="kvtier.integrations.transformers")
        for _ in range(2):
            assert torch.equal(pc.generate(ids, **GEN), expected)
        assert pc.counters.store_failures == 2 and pc.counters.blocks_stored == 0
    said = [r.getMessage() for r in caplog.records if r.name == "kvtier.integrations.transformers"]
    assert len(said) == 1 and "not stored" in said[0] and "expected" in said[0], said

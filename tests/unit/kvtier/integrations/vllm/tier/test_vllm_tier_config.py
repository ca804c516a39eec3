"""The vLLM secondary tier's settings, namespace and key derivation (no vLLM, no daemon)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvtier.integrations.vllm.tier.config import (
    ConfigError,
    PoolGeometry,
    TierConfig,
    offload_block_key,
    tier_namespace,
)

GEOMETRY = PoolGeometry(
    row_bytes=131072,
    chunk_tokens=128,
    kv_dtype="bfloat16",
    kv_layout="LBHNC",
    canonical=False,
    portable=False,
    tp_size=1,
    pp_size=1,
    world_size=1,
    groups="[(0, 128, ('l0', 'l1'))]",
    hash_algo="sha256",
)
CFG = TierConfig.from_tier({"socket": "/run/k.sock", "model_revision": "rev-a", "tokenizer_digest": "none"})
OFFLOAD_KEY = hashlib.sha256(b"block").digest() + (0).to_bytes(4, "big")


def ns_digest(cfg: TierConfig = CFG, geometry: PoolGeometry = GEOMETRY) -> bytes:
    return tier_namespace(cfg, geometry, model="/models/tiny").digest


def test_defaults_socket_shorthand_and_one_block_per_pool_row() -> None:
    assert CFG.address == "unix:/run/k.sock" and CFG.transport == "shm"
    ns = tier_namespace(CFG, GEOMETRY, model="/models/tiny")
    assert ns.block_bytes == GEOMETRY.row_bytes  # a kvtier block is one row of vLLM's pool
    assert ns.tokens_per_block == 128 and ns.model_id == "/models/tiny"
    assert ns.layout.startswith("vllm.offload.LBHNC.rows.")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"colour": 1}, "secondary_tiers.kvtier.colour"),
        ({"transport": "cuda_ipc"}, "secondary_tiers.kvtier.transport"),
        ({"job_timeout_ms": 0}, "secondary_tiers.kvtier.job_timeout_ms"),
        ({"adapter_id": "a"}, "secondary_tiers.kvtier.adapter_revision"),
        ({"socket": "/s", "address": "unix:/t"}, "secondary_tiers.kvtier.socket"),
        ({"store": "yes"}, "secondary_tiers.kvtier.store"),
        ({"model_revision": "main"}, "secondary_tiers.kvtier.model_revision"),
        ({"tokenizer_digest": "sha256:" + "0" * 64}, "secondary_tiers.kvtier.tokenizer_digest"),
    ],
)
def test_bad_settings_name_their_key(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        TierConfig.from_tier(kwargs)
    assert e.value.field == field


def test_identity_is_fail_closed_and_named_by_the_tiers_key() -> None:
    with pytest.raises(ConfigError) as e:  # no revision given, not a Hugging Face snapshot
        tier_namespace(TierConfig(tokenizer_digest="none"), GEOMETRY, model="/models/tiny")
    assert e.value.field == "secondary_tiers.kvtier.model_revision"
    with pytest.raises(ConfigError) as e:  # no tokenizer files and none configured
        tier_namespace(TierConfig(model_revision="rev-a"), GEOMETRY, model="/nonexistent")
    assert e.value.field == "secondary_tiers.kvtier.tokenizer_digest"
    skipped = tier_namespace(
        TierConfig(model_revision="rev-a"), GEOMETRY, model="/nonexistent", skip_tokenizer=True
    )
    assert skipped.tokenizer_digest == "none"


@pytest.mark.parametrize(
    "change",
    [
        {"model_revision": "rev-b"},
        {"adapter_id": "lora-x", "adapter_revision": "r1"},
        {"cache_salt": "deploy-2"},
        {"tenant": "team-b"},
        {"tokenizer_digest": "sha256:" + hashlib.sha256(b"tokenizer").hexdigest()},
    ],
)
def test_every_identity_field_changes_the_key(change: dict[str, str]) -> None:
    other = dataclasses.replace(CFG, **change)
    assert offload_block_key(ns_digest(other), OFFLOAD_KEY) != offload_block_key(ns_digest(), OFFLOAD_KEY)


@pytest.mark.parametrize(
    "change",
    [
        {"kv_layout": "LBNHC"},
        {"kv_dtype": "float16"},
        {"canonical": True},
        {"tp_size": 2},
        {"world_size": 2},
        {"hash_algo": "xxhash"},
        {"chunk_tokens": 256},
    ],
)
def test_every_row_format_field_changes_the_key(change: dict[str, object]) -> None:
    other = dataclasses.replace(GEOMETRY, **change)
    assert ns_digest(geometry=other) != ns_digest()


def test_canonical_portable_rows_share_a_namespace_across_tensor_parallel_sizes() -> None:
    canon = dataclasses.replace(GEOMETRY, canonical=True, portable=True)
    assert ns_digest(geometry=canon) == ns_digest(geometry=dataclasses.replace(canon, tp_size=4))


def test_key_is_deterministic_namespaced_and_keyed_by_tenant() -> None:
    digest = ns_digest()
    key = offload_block_key(digest, OFFLOAD_KEY)
    expected = hashlib.sha256(
        b"kvtier/vllm-offload/v1" + digest + (36).to_bytes(4, "little") + OFFLOAD_KEY
    ).digest()
    assert key == expected and len(key) == 32
    other_group = OFFLOAD_KEY[:-4] + (1).to_bytes(4, "big")  # another KV cache group
    assert offload_block_key(digest, other_group) != key
    assert offload_block_key(digest, OFFLOAD_KEY, b"tenant-secret") != key


def test_rows_that_do_not_split_into_tokens_are_refused() -> None:
    with pytest.raises(ConfigError):
        tier_namespace(CFG, dataclasses.replace(GEOMETRY, row_bytes=131072 + 4096 + 1), model="/models/tiny")

"""The connector's settings and identity resolution (no vLLM): fail-closed, fields named."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.integrations.vllm.config import (
    ConfigError,
    files_digest,
    resolve_model_revision,
    resolve_tokenizer_digest,
)
from kvtier.integrations.vllm.connector.config import (
    BASE,
    ConnectorConfig,
    EngineIdentity,
    Variant,
    adapter_variant,
)
from kvtier_contract.errors import InvalidArgument

IDENTITY = EngineIdentity(
    model_id="m",
    model_revision="r1",
    tokenizer_digest="none",
    kv_dtype="bfloat16",
    layout="vllm.LBHNC",
    tokens_per_block=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    tp_size=2,
)


def test_defaults_and_socket_shorthand() -> None:
    cfg = ConnectorConfig.from_extra(None)
    assert cfg.address == "unix:run/kvtier.sock" and cfg.transport == "shm"
    assert (cfg.step_budget_ms, cfg.probe_timeout_ms) == (100, 250)
    assert (cfg.load_mode, cfg.async_load_timeout_ms) == ("sync", 10000)
    assert ConnectorConfig.from_extra({"load_mode": "async"}).load_mode == "async"
    assert ConnectorConfig.from_extra({"step_budget_ms": 40}).step_budget_ms == 40
    assert ConnectorConfig.from_extra({"socket": "/run/k.sock"}).address == "unix:/run/k.sock"
    assert (cfg.load_policy, cfg.interference_budget, cfg.probe_after_s) == ("adaptive", 0.25, 5.0)
    pinned = ConnectorConfig.from_extra(
        {"load_policy": "always", "interference_budget": None, "probe_after_s": 2}
    )
    assert (pinned.load_policy, pinned.interference_budget, pinned.probe_after_s) == ("always", None, 2)
    assert ConnectorConfig.from_extra({"interference_budget": 1}).interference_budget == 1
    for transport in ("shm", "tcp", "cuda_ipc"):
        assert ConnectorConfig.from_extra({"transport": transport}).transport == transport
    assert cfg.event_token_ids is None  # as the daemon publishes events
    assert ConnectorConfig.from_extra({"event_token_ids": False}).event_token_ids is False


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"adress": "x"}, "adress"),
        ({"transport": "rdma"}, "transport"),
        ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
        ({"lookup_timeout_ms": True}, "lookup_timeout_ms"),
        ({"step_budget_ms": 0}, "step_budget_ms"),
        ({"probe_timeout_ms": 2.5}, "probe_timeout_ms"),
        ({"model_revision": ""}, "model_revision"),
        ({"adapter_revisions": {"a": 3}}, "adapter_revisions"),
        ({"store": "yes"}, "store"),
        ({"store_generated": 1}, "store_generated"),
        ({"load_mode": "later"}, "load_mode"),
        ({"async_load_timeout_ms": 0}, "async_load_timeout_ms"),
        ({"lookup_wait_ms": -1}, "lookup_wait_ms"),
        ({"lookup_wait_ms": 1001}, "lookup_wait_ms"),
        ({"lookup_wait_ms": 0.5}, "lookup_wait_ms"),
        ({"load_policy": "sometimes"}, "load_policy"),
        ({"load_policy": None}, "load_policy"),
        ({"interference_budget": 0}, "interference_budget"),
        ({"interference_budget": 1.5}, "interference_budget"),
        ({"interference_budget": True}, "interference_budget"),
        ({"interference_budget": "0.25"}, "interference_budget"),
        ({"probe_after_s": 0}, "probe_after_s"),
        ({"probe_after_s": float("inf")}, "probe_after_s"),
        ({"probe_after_s": "5"}, "probe_after_s"),
        ({"unix_login": "yes"}, "unix_login"),
        ({"event_token_ids": "auto"}, "event_token_ids"),
        ({"event_token_ids": 1}, "event_token_ids"),
        ({"unix_login": True, "token_file": "/t"}, "unix_login"),
        ({"unix_login": True, "address": "127.0.0.1:50051"}, "unix_login"),
    ],
)
def test_bad_settings_name_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.from_extra(extra)
    assert e.value.field == f"kv_connector_extra_config.{key}"


def test_model_revision_is_never_invented(tmp_path: Path) -> None:
    assert resolve_model_revision("abc", "def", "/m") == "abc"
    assert resolve_model_revision(None, "def", "/m") == "def"

    class Revision(str):  # vLLM's revision string carries the commit it resolved to
        resolved = "f" * 40

    assert resolve_model_revision(None, Revision("main"), "/m") == "f" * 40
    with pytest.raises(ConfigError, match="model_revision"):
        resolve_model_revision(None, "main", "/m")  # a branch names no fixed weights
    snap = tmp_path / "models--org--m" / "snapshots" / ("0123456789" * 4)
    snap.mkdir(parents=True)
    assert resolve_model_revision(None, None, str(snap)) == "0123456789" * 4
    with pytest.raises(ConfigError, match="model_revision"):
        resolve_model_revision(None, None, str(tmp_path))


def test_tokenizer_digest(tmp_path: Path) -> None:
    assert resolve_tokenizer_digest(None, True, str(tmp_path)) == "none"
    with pytest.raises(ConfigError, match="tokenizer_digest"):
        resolve_tokenizer_digest(None, False, str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"v": 1}')
    d1 = resolve_tokenizer_digest(None, False, str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"v": 2}')
    d2 = resolve_tokenizer_digest(None, False, str(tmp_path))
    assert d1.startswith("sha256:") and d1 != d2
    commit = "a" * 40
    assert resolve_tokenizer_digest(None, False, "Qwen/Qwen3-0.6B", commit) == f"hf:Qwen/Qwen3-0.6B@{commit}"
    with pytest.raises(ConfigError, match="tokenizer_digest"):
        resolve_tokenizer_digest(None, False, "Qwen/Qwen3-0.6B", "main")


def test_adapter_revision_from_config_or_files(tmp_path: Path) -> None:
    cfg = ConnectorConfig(adapter_revisions={"sql": "v7"})
    assert adapter_variant(cfg, "sql", None, None, {}) == Variant("sql", "v7", None)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w" * 10)
    memo: dict[str, str] = {}
    v = adapter_variant(ConnectorConfig(), "chat", str(tmp_path), "s", memo)
    assert v.adapter_revision == files_digest(tmp_path, ("adapter_config.json", "adapter_model.safetensors"))
    assert v.cache_salt == "s" and memo
    with pytest.raises(ConfigError, match="adapter_revisions.x"):
        adapter_variant(ConnectorConfig(), "x", str(tmp_path / "missing"), None, {})


def test_variants_and_ranks_are_distinct_namespaces() -> None:
    digests = {
        IDENTITY.namespace(v, r).digest
        for v in (
            BASE,
            Variant(cache_salt="a"),
            Variant(cache_salt="b"),
            Variant("sql", "v1"),
            Variant("sql", "v2"),
            Variant("sql", "v1", "a"),
        )
        for r in (0, 1)
    }
    assert len(digests) == 12
    with pytest.raises(InvalidArgument, match="tp_rank"):
        IDENTITY.namespace(BASE, 2)

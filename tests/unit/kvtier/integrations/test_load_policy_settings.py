"""The load-or-recompute settings of the engine integrations (issue 30): defaults, and a bad
value refused with the integration's own error naming the key (no engine import needed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.integrations.sglang.config import BackendConfig
from kvtier.integrations.sglang.config import ConfigError as SglangError
from kvtier.integrations.transformers.identity import ConfigError as TransformersError
from kvtier.integrations.transformers.identity import PrefixCacheOptions
from kvtier.integrations.vllm.config import ConfigError as VllmError
from kvtier.integrations.vllm.tier.config import TierConfig

REV = "0123456789abcdef0123456789abcdef01234567"
BAD = [
    ("load_policy", "sometimes"),
    ("load_policy", None),
    ("probe_after_s", 0),
    ("probe_after_s", -1.0),
    ("probe_after_s", True),
    ("probe_after_s", float("nan")),
]


def transformers(**kw: Any) -> PrefixCacheOptions:
    return PrefixCacheOptions(model_revision=REV, tokenizer_digest="none", **kw)


def test_defaults_are_adaptive() -> None:
    t, s, v = transformers(), BackendConfig.from_extra({}), TierConfig.from_tier({})
    assert (t.load_policy, t.probe_after_s) == ("adaptive", 5.0)
    assert (s.load_policy, s.probe_after_s, s.prefill_seconds_per_token) == ("adaptive", 5.0, None)
    assert (v.load_policy, v.probe_after_s, v.interference_budget, v.prefill_seconds_per_token) == (
        "adaptive",
        5.0,
        0.25,
        None,
    )
    for policy in ("always", "never", "adaptive"):
        assert transformers(load_policy=policy).load_policy == policy
        assert BackendConfig.from_extra({"load_policy": policy}).load_policy == policy
        assert TierConfig.from_tier({"load_policy": policy}).load_policy == policy


@pytest.mark.parametrize(("key", "value"), BAD)
def test_transformers_refuses_a_bad_value_by_name(key: str, value: Any) -> None:
    with pytest.raises(TransformersError, match=r": must be ") as e:
        transformers(**{key: value})
    assert e.value.field == key


@pytest.mark.parametrize(
    ("key", "value"), BAD + [("prefill_seconds_per_token", 0), ("prefill_seconds_per_token", "fast")]
)
def test_sglang_refuses_a_bad_value_by_name(key: str, value: Any) -> None:
    with pytest.raises(SglangError, match=r": must be ") as e:  # (not "unknown key")
        BackendConfig.from_extra({key: value})
    assert e.value.field == f"extra_config.{key}"


@pytest.mark.parametrize(
    ("key", "value"),
    BAD
    + [
        ("interference_budget", 0),
        ("interference_budget", 1.5),
        ("interference_budget", "x"),
        ("prefill_seconds_per_token", -0.001),
    ],
)
def test_vllm_tier_refuses_a_bad_value_by_name(key: str, value: Any) -> None:
    with pytest.raises(VllmError, match=rf"^secondary_tiers\.kvtier\.{key}: must be "):
        TierConfig.from_tier({key: value})


def test_vllm_tier_takes_no_budget_and_an_operator_rate() -> None:
    cfg = TierConfig.from_tier({"interference_budget": None, "prefill_seconds_per_token": 2e-4})
    assert cfg.interference_budget is None and cfg.prefill_seconds_per_token == 2e-4
    assert TierConfig.from_tier({"interference_budget": 1}).interference_budget == 1

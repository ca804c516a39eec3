"""One identity rule for revisions and tokenizer digests (issue 29, item 16): the SDK's Namespace
(so the daemon's RegisterNamespace too) and every engine integration refuse the same values with
the same words, and accept the same values, whose hashes do not change."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.integrations.lmcache.config import ConfigError as LMCacheError
from kvtier.integrations.lmcache.config import ModelIdentity
from kvtier.integrations.sglang.config import BackendConfig
from kvtier.integrations.sglang.config import ConfigError as SGLangError
from kvtier.integrations.transformers.identity import ConfigError as HFError
from kvtier.integrations.transformers.identity import PrefixCacheOptions
from kvtier.integrations.vllm.config import ConfigError as VllmError
from kvtier.integrations.vllm.config import resolve_model_revision
from kvtier.integrations.vllm.connector.config import ConnectorConfig
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace, revision_problem, tokenizer_digest_problem
from kvtierd.cache.chain import TierLink
from kvtierd.domain import TierId
from kvtierd.policies import LruPolicy
from kvtierd.tiers.base import Recovered
from kvtierd.tiers.nvme.tier import NvmeTier

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "hashing_golden.json"
BASE: dict[str, Any] = dict(
    model_id="m",
    model_revision="c1899de289a04d12100db370d81485cdf75e47ca",
    tokenizer_digest="none",
    kv_dtype="float16",
    layout="contiguous",
    tokens_per_block=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
)

MOVING = [
    "main",
    "master",
    "HEAD",
    "head",
    "Latest",
    "trunk",
    "develop",
    "dev",
    "refs/heads/v2",
    "origin/main",
    # git's symbolic refs and expressions relative to a ref (no ref name holds ~, ^ or @{)
    "HEAD~1",
    "HEAD^",
    "main~3",
    "v1.0^2",
    "FETCH_HEAD",
    "ORIG_HEAD",
    "@",
    "@{u}",
    "main@{1}",
    "refs/remotes/origin/main",
    "upstream/main",
]
PLACEHOLDERS = [
    "<commit>",
    "<commit sha>",
    "...",
    "\u2026",
    "0" * 40,
    "0000000",
    "sha1:0000000",
    "TODO",
    "None",
    "null",
]
GOOD_REVISIONS = [
    "c1899de289a04d12100db370d81485cdf75e47ca",
    "r0",
    "v1.2.0",
    "rev-b",
    "sha256:" + "ab" * 32,
    "1",
    # real names that end in zeros: only seven or more zeros are a digest nobody computed
    "0",
    "00",
    "000000",
    "run:0",
    "2024-05-01T12:00",
    "snapshot-2024-01-01T00:00:00",
    "refs/tags/v1.0",
]
BAD_DIGESTS = [
    "sha256:" + "0" * 64,
    "sha256:00",
    "sha256:",
    "<digest>",
    "hf:Qwen/Qwen3-8B@<sha>",
    "None",
    "NULL",
    "\u2026",
]
GOOD_DIGESTS = ["none", "sha256:" + "2f" * 32, "sha256:2f1c6b0e", "hf:Qwen/Qwen3-8B@" + "a" * 40]


@pytest.mark.parametrize("value", MOVING + PLACEHOLDERS)
def test_a_moving_ref_or_placeholder_is_refused_as_any_revision(value: str) -> None:
    problem = revision_problem(value)
    assert problem and repr(value) in problem and "commit hash" in problem
    with pytest.raises(InvalidArgument) as e:
        Namespace(**{**BASE, "model_revision": value})
    assert e.value.field == "namespace.model_revision" and problem in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        Namespace(**BASE, adapter_id="lora", adapter_revision=value)
    assert e.value.field == "namespace.adapter_revision"


def test_moving_refs_say_to_pin_a_commit() -> None:
    assert "moving ref" in str(revision_problem("main")) and "pin the commit hash" in str(
        revision_problem("main")
    )


@pytest.mark.parametrize("value", BAD_DIGESTS)
def test_a_placeholder_tokenizer_digest_is_refused(value: str) -> None:
    problem = tokenizer_digest_problem(value)
    assert problem and "'none'" in problem
    with pytest.raises(InvalidArgument) as e:
        Namespace(**{**BASE, "tokenizer_digest": value})
    assert e.value.field == "namespace.tokenizer_digest"


@pytest.mark.parametrize("revision", GOOD_REVISIONS)
@pytest.mark.parametrize("digest", GOOD_DIGESTS)
def test_immutable_revisions_and_real_digests_are_taken(revision: str, digest: str) -> None:
    assert revision_problem(revision) is None and tokenizer_digest_problem(digest) is None
    Namespace(
        **{**BASE, "model_revision": revision, "tokenizer_digest": digest},
        adapter_id="a",
        adapter_revision=revision,
    )


def test_every_golden_identity_is_still_valid_and_hashes_the_same() -> None:
    cases = json.loads(GOLDEN.read_text())["namespaces"]
    assert cases
    for case in cases:
        assert Namespace.from_dict(case["fields"]).digest.hex() == case["digest"], case["name"]


# Each integration's own setting for a model revision / tokenizer digest, refused by its key.
def vllm(revision: str, digest: str) -> None:
    ConnectorConfig.from_extra({"model_revision": revision, "tokenizer_digest": digest})


def sglang(revision: str, digest: str) -> None:
    BackendConfig.from_extra({"model_revision": revision, "tokenizer_digest": digest})


def transformers(revision: str, digest: str) -> None:
    PrefixCacheOptions(model_revision=revision, tokenizer_digest=digest)


def lmcache(revision: str, digest: str) -> None:
    ModelIdentity.from_params(
        "m",
        {
            "model_revision": revision,
            "tokenizer_digest": digest,
            "kv_dtype": "bfloat16",
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_dim": 64,
        },
    )


INTEGRATIONS: list[tuple[Callable[[str, str], None], type[Exception]]] = [
    (vllm, VllmError),
    (sglang, SGLangError),
    (transformers, HFError),
    (lmcache, LMCacheError),
]


@pytest.mark.parametrize(("configure", "error"), INTEGRATIONS)
def test_every_integration_applies_the_same_rule(
    configure: Callable[[str, str], None], error: type[Exception]
) -> None:
    for value in ("main", "<commit>", "0" * 40):
        with pytest.raises(error) as e:
            configure(value, "none")
        assert str(e.value).split(": ", 1)[0].endswith("model_revision")
        assert str(revision_problem(value)) in str(e.value)
    with pytest.raises(error) as e:
        configure(GOOD_REVISIONS[0], "sha256:" + "0" * 64)
    assert str(e.value).split(": ", 1)[0].endswith("tokenizer_digest")
    configure(GOOD_REVISIONS[0], "none")  # what the rule takes, every integration takes


def test_vllm_takes_no_moving_ref_from_the_engine() -> None:
    for ref in ("main", "master", "latest", "HEAD"):
        with pytest.raises(VllmError, match="model_revision: required"):
            resolve_model_revision(None, ref, "/not/a/snapshot")
    assert resolve_model_revision(None, "v1.0", "/m") == "v1.0"
    with pytest.raises(VllmError, match="adapter_revisions.sql"):
        ConnectorConfig.from_extra({"adapter_revisions": {"sql": "main"}})


class RecoveredTier:
    """An NVMe tier's ``open()`` after an upgrade: blocks of namespaces whose revisions the rule
    now refuses (written by a daemon that took them). Records what the link frees."""

    id = TierId.NVME
    name = "nvme"
    columns = NvmeTier.columns  # where the link counts (kvtierd.tiers.base.StorageColumns)

    def __init__(self, revisions: list[str], blocks_each: int) -> None:
        self.rec = Recovered()
        for i, revision in enumerate(revisions):
            digest = bytes([i + 1]) * 32
            self.rec.namespaces[digest] = {**BASE, "model_revision": revision}
            self.rec.blocks += [(digest, bytes([i, b]) * 16, (i, b)) for b in range(blocks_each)]
        self.released: list[Any] = []

    def open(self) -> Recovered:
        return self.rec

    def release(self, loc: Any, digest: bytes, key: bytes) -> None:
        self.released.append(loc)


def test_a_warm_restart_drops_refused_namespaces_in_one_summary_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = RecoveredTier(["main", "HEAD~1", "latest", "dev"], blocks_each=3)
    residency = SimpleNamespace(policy=LruPolicy())  # (what the link reads of it here)
    link = TierLink(residency, tier, None, lambda: [])  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvtierd.chain"):
        assert link.restore(lambda ns: pytest.fail(f"registered {ns}")) == 0
    assert len(tier.released) == 12  # every block of a refused namespace is freed
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "4 recovered namespaces not restored, their 12 blocks freed" in lines[0]
    assert "model_revision: 'HEAD~1' is a moving ref" in lines[0]

"""Options and model identity for the Transformers prefix cache, as plain data.

No torch or transformers import: the model's config is read by duck typing (``to_dict()`` and
attributes), so this module is tested and imported without either.

``PrefixCacheOptions`` holds every setting (validated once; a bad one is a ``ConfigError`` naming
it). ``model_namespace(config, ...)`` builds the kvtier ``Namespace`` of a model: model id,
immutable revision, tokenizer digest, KV dtype, the layout (``hf.dynamic.LKHTD``, or
``hf.dynamic.mla.LKTD`` for MLA models), block size and the KV geometry the model's cache
holds, plus a digest of the config (``config_digest``) carried in the namespace's
``cache_salt`` field, so two models of the same shape whose configs differ (rope settings, norm
epsilon, activation, ...) never share a block.

Fail-closed: nothing here invents an identity field. No revision, a moving ref (``main``...) or
a placeholder as revision (``kvtier_contract.identity.revision_problem``, the rule every
integration and the SDK share), no tokenizer digest, no model id, or a config whose KV geometry
cannot be read is a ``ConfigError``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.adaptive.decision import LOAD_POLICIES, LoadPolicy
from kvtier.integrations.vllm.config import TOKENIZER_FILES, files_digest
from kvtier_contract import defaults
from kvtier_contract.identity import (
    KV_DTYPES,
    MAX_STR_CHARS,
    Namespace,
    revision_problem,
    tokenizer_digest_problem,
)
from kvtier_contract.protoutil import TransportName

DEFAULT_ADDRESS = defaults.ADDRESS
LAYOUT = "hf.dynamic.LKHTD"
"""Block bytes: for each layer in order, K then V, each ``[kv_heads, tokens, head_dim]`` C order
(batch row 0 of ``DynamicCache.layers[i].keys/values``), in the model's KV dtype."""
LAYOUT_MLA = "hf.dynamic.mla.LKTD"
"""MLA block bytes: for each layer in order, the latent ``[tokens, kv_lora_rank]`` (the cache's
keys) then the rotated key ``[tokens, qk_rope_head_dim]`` (the cache's values), C order, batch
row 0, in the model's KV dtype; the namespace says 1 head of ``(kv_lora_rank +
qk_rope_head_dim) / 2``."""

CONFIG_SALT_PREFIX = "hf-config:"
# Config keys that do not change the KV a model computes for given token ids (the weights are
# named by model id and revision; the dtype is its own namespace field). Every other key,
# including unknown ones, goes into the config digest: a key left in only costs sharing.
IGNORED_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tie_word_embeddings",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_experts_implementation",
        "tokenizer_class",
        "task_specific_params",
        "finetuning_task",
        "prefix",
        "chunk_size_feed_forward",
    }
)


class ConfigError(ValueError):
    """A prefix-cache setting or identity field is missing or malformed; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, kw_only=True)
class PrefixCacheOptions:
    """The ``KvtierPrefixCache`` keyword options (docs/transformers.md §2 explains each)."""

    model_revision: str
    """Immutable model revision (a commit hash); required, a branch name is refused."""
    tokenizer_digest: str
    """Digest of the tokenizer files (``tokenizer_files_digest``) or the explicit ``"none"``."""
    model_id: str | None = None
    """Model name in the namespace; default ``config._name_or_path`` (refused when empty)."""
    tokens_per_block: int = 16
    """Tokens per kvtier block; only full blocks are stored and restored."""
    transport: TransportName = "shm"
    """Data transport when the cache connects by address: ``"shm"`` (same host) or ``"tcp"``."""
    request_timeout_ms: int = 1000
    """Deadline of each RPC of a client the cache connects itself."""
    op_timeout_ms: int = 5000
    """Overall deadline of one restore or one store (all its RPCs and transfers)."""
    load: bool = True
    """False: ``restore`` always misses (a write-only cache)."""
    store: bool = True
    """False: nothing is stored (a read-only cache)."""
    store_generated: bool = True
    """``generate`` also stores the full blocks of the generated tokens, not just the prompt's."""
    cache_salt: str | None = None
    """Optional salt: caches with different salts never share blocks."""
    tenant: str | None = None
    """The namespace's tenant (required by a daemon with tenants)."""
    token_file: str | None = None
    """File whose first line is the tenant's bearer token (a client the cache connects itself)."""
    load_policy: LoadPolicy = "adaptive"
    """``"adaptive"``: restore only the stored prefix that arrives before the model would have
    recomputed it (measured load figures against the model's measured prefill rate);
    ``"always"``: restore every stored block; ``"never"``: restore nothing (stores still run)."""
    probe_after_s: float = 5.0
    """A tier cut back by ``adaptive`` is loaded one block again after this many seconds without
    news of it, so a tier that recovered is seen."""
    shared_prefixes: bool = True
    """A prompt that begins with a prefix one of the tenant's groups published is keyed in the
    group's scope up to it (``kvtier.shared_scopes``; docs/transformers.md §3)."""
    prefix_refresh_ms: int = 5000
    """How often the list of published prefixes is fetched from the daemon."""

    def __post_init__(self) -> None:
        """``ConfigError`` naming the first option refused: identity fields first, then the
        cache's settings."""
        self._check_identity()
        self._check_settings()

    def _check_identity(self) -> None:
        """The namespace's fields: the required revision and tokenizer digest (and the one
        identity rule on them), the optional strings, the salt's length."""
        for key in ("model_revision", "tokenizer_digest"):
            value = getattr(self, key)
            _need(
                isinstance(value, str) and bool(value.strip()),
                key,
                "required: a non-empty string (fail-closed, no default)",
            )
        # The one identity rule (kvtier_contract.identity): no moving ref, no placeholder.
        _need(
            revision_problem(self.model_revision) is None,
            "model_revision",
            str(revision_problem(self.model_revision)),
        )
        _need(
            tokenizer_digest_problem(self.tokenizer_digest) is None,
            "tokenizer_digest",
            str(tokenizer_digest_problem(self.tokenizer_digest)),
        )
        for key in ("model_id", "cache_salt", "tenant", "token_file"):
            value = getattr(self, key)
            _need(
                value is None or (isinstance(value, str) and bool(value.strip())),
                key,
                "must be None or a non-empty string",
            )
        _need(self.cache_salt is None or len(self.cache_salt) <= 160, "cache_salt", "at most 160 characters")

    def _check_settings(self) -> None:
        """The cache's settings: positive integers, transport, flags, load policy."""
        for key in ("tokens_per_block", "request_timeout_ms", "op_timeout_ms", "prefix_refresh_ms"):
            value = getattr(self, key)
            _need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                key,
                "must be a positive integer",
            )
        _need(self.transport in ("shm", "tcp"), "transport", "must be 'shm' or 'tcp'")
        for key in ("load", "store", "store_generated", "shared_prefixes"):
            _need(isinstance(getattr(self, key), bool), key, "must be True or False")
        _need(
            self.load_policy in LOAD_POLICIES,
            "load_policy",
            f"must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}",
        )
        _need(
            isinstance(self.probe_after_s, (int, float))
            and not isinstance(self.probe_after_s, bool)
            and math.isfinite(self.probe_after_s)
            and self.probe_after_s > 0,
            "probe_after_s",
            f"must be a positive number of seconds, got {self.probe_after_s!r}",
        )


def _need(ok: bool, key: str, message: str) -> None:
    """``ConfigError`` naming ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, message)


def tokenizer_files_digest(directory: str) -> str:
    """``sha256:<hex>`` over the tokenizer files in ``directory`` (``tokenizer.json``,
    ``tokenizer_config.json``, ...; the same digest the vLLM connector computes), e.g.
    ``tokenizer_files_digest(tokenizer.name_or_path)`` for a local tokenizer directory.
    ``ConfigError`` when none of those files exists there."""
    digest = files_digest(directory, TOKENIZER_FILES)
    if digest is None:
        raise ConfigError("tokenizer_digest", f"no tokenizer files found in {directory!r}")
    return digest


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _strip(v) for k, v in value.items() if k not in IGNORED_CONFIG_KEYS}
    if isinstance(value, list | tuple):
        return [_strip(v) for v in value]
    return value


def config_digest(config: Any) -> str:
    """SHA-256 (hex) of the model config's ``to_dict()`` without ``IGNORED_CONFIG_KEYS`` (at any
    depth), as canonical JSON (sorted keys; values JSON cannot encode are written with str)."""
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise ConfigError("config", f"expected a transformers PretrainedConfig, got {type(config).__name__}")
    canonical = json.dumps(
        _strip(to_dict()), sort_keys=True, separators=(",", ":"), default=str, ensure_ascii=True
    )
    return hashlib.sha256(b"kvtier/hf-config/v1\0" + canonical.encode()).hexdigest()


@dataclass(frozen=True)
class KvGeometry:
    """What one token's KV looks like in a ``DynamicCache`` of the model: per layer,
    ``num_kv_heads`` heads of ``key_dim`` keys and of ``value_dim`` values. Equal dims for
    multi-head / grouped-query attention; for MLA (``latent``) one head of the compressed latent
    (the cache's keys, ``kv_lora_rank`` wide) and one of the rotated shared key (the cache's
    values, ``qk_rope_head_dim`` wide)."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    latent: bool = False

    @property
    def head_dim(self) -> int:
        """The namespace's ``head_dim``: K and V widths averaged (the namespace counts a token
        as 2 x heads x head_dim values), so ``block_bytes`` is the block's bytes exactly."""
        return (self.key_dim + self.value_dim) // 2

    @property
    def layout(self) -> str:
        return LAYOUT_MLA if self.latent else LAYOUT


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.{name}", f"expected a positive integer, got {value!r}")
    return value


def kv_geometry(config: Any) -> KvGeometry:
    """Layers, KV heads and K/V widths of what the model's ``DynamicCache`` holds, from the
    decoder's text config (``ConfigError`` naming the field when one is missing or not a
    positive integer).

    A config with ``kv_lora_rank`` is MLA (DeepSeek-V2/V3, MiniCPM3, GLM-4 MoE Lite, ...):
    Transformers caches the latent as keys ``[batch, 1, seq, kv_lora_rank]`` and the rotated
    key as values ``[batch, 1, seq, qk_rope_head_dim]``; their config's ``head_dim`` is the
    rope dim and ``num_key_value_heads`` the attention heads, neither of which is cached. An
    odd latent row (``kv_lora_rank + qk_rope_head_dim``) has no namespace geometry and is
    refused."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text(decoder=True) if callable(get_text) else config
    layers = _positive("num_hidden_layers", getattr(text, "num_hidden_layers", None))
    if getattr(text, "kv_lora_rank", None) is not None:
        latent = _positive("kv_lora_rank", text.kv_lora_rank)
        rope = _positive("qk_rope_head_dim", getattr(text, "qk_rope_head_dim", None))
        if (latent + rope) % 2:
            raise ConfigError(
                "config.kv_lora_rank",
                f"MLA latent row kv_lora_rank + "
                f"qk_rope_head_dim = {latent} + {rope} is odd; kvtier stores "
                f"rows of even width only",
            )
        return KvGeometry(layers, 1, latent, rope, latent=True)
    heads = _positive("num_attention_heads", getattr(text, "num_attention_heads", None))
    kv_heads = getattr(text, "num_key_value_heads", None)
    kv_heads = heads if kv_heads is None else _positive("num_key_value_heads", kv_heads)
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None:
        hidden = _positive("hidden_size", getattr(text, "hidden_size", None))
        if hidden % heads:
            raise ConfigError(
                "config.head_dim", f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    head_dim = _positive("head_dim", head_dim)
    return KvGeometry(layers, kv_heads, head_dim, head_dim)


def _model_id(options: PrefixCacheOptions, config: Any) -> str:
    if options.model_id:
        return options.model_id
    name = getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            "model_id",
            "required: the model's config has no _name_or_path (a model built in code); pass model_id",
        )
    return name


def config_salt(config: Any) -> str:
    """``hf-config:<sha256 hex>``: the part of a namespace's ``cache_salt`` that names the
    model config (every scope of the model keeps it: a group's too)."""
    return CONFIG_SALT_PREFIX + config_digest(config)


def _salt(options: PrefixCacheOptions, config: Any) -> str:
    salt = config_salt(config)
    if options.cache_salt is not None:
        salt += ";salt:" + options.cache_salt
    assert len(salt) <= MAX_STR_CHARS
    return salt


def model_namespace(config: Any, kv_dtype: str, options: PrefixCacheOptions) -> Namespace:
    """The namespace of a model with ``config`` computing KV in ``kv_dtype`` (e.g.
    ``"bfloat16"``). The config digest and the optional ``options.cache_salt`` form the
    namespace's ``cache_salt``: ``hf-config:<sha256 hex>[;salt:<cache_salt>]``."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(
            "dtype", f"KV dtype {kv_dtype!r} is not one kvtier stores ({', '.join(sorted(KV_DTYPES))})"
        )
    geo = kv_geometry(config)
    return Namespace(
        model_id=_model_id(options, config),
        model_revision=options.model_revision,
        tokenizer_digest=options.tokenizer_digest,
        kv_dtype=kv_dtype,
        layout=geo.layout,
        tokens_per_block=options.tokens_per_block,
        num_layers=geo.num_layers,
        num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim,
        cache_salt=_salt(options, config),
        tenant=options.tenant,
    )


_TORCH_DTYPE = re.compile(r"^torch\.")


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (by its str, without importing torch)."""
    return _TORCH_DTYPE.sub("", str(dtype))

"""The vLLM secondary tier's settings, namespace and keys, as plain data (no vLLM import).

``TierConfig.from_tier(kwargs)`` validates the keys of one ``secondary_tiers`` entry (an unknown
key or a wrong type is a ``ConfigError`` naming ``secondary_tiers.kvtier.<key>``).
``PoolGeometry`` is what vLLM's offloading config says about the CPU pool's rows; with the
operator's identity fields it makes the tier's one ``Namespace`` (``tier_namespace``).

Keys. vLLM's tier API hands the tier vLLM's own ``OffloadKey`` (the chunk's block hash, whose chain
already covers every earlier token, the request's ``cache_salt`` and its LoRA adapter, plus the
KV cache group index), never token ids. kvtier therefore derives its 32-byte block key from it,
deterministically and inside the namespace::

    key = H("kvtier/vllm-offload/v1" || namespace_digest || u32le(len(k)) || k)

H is SHA-256, or HMAC-SHA-256 keyed with the tenant's key (as for token keys, DESIGN §3). The
namespace digest carries model id and revision, tokenizer, the configured adapter and salt, the
pool's row format (vLLM KV layout, dtype, canonical or per-rank rows, chunk tokens, parallel
slice) and vLLM's prefix-hash algorithm; two engines share a block only when all of those and the
token chain agree.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.adaptive.decision import LOAD_POLICIES, LoadPolicy
from kvtier.integrations.vllm.config import (
    DEFAULT_ADDRESS,
    ConfigError,
    Need,
    check_client_fields,
    needs,
    resolve_model_revision,
    resolve_tokenizer_digest,
    settings_from,
)
from kvtier_contract.identity import Namespace, revision_problem
from kvtier_contract.protoutil import TransportName

PREFIX = "secondary_tiers.kvtier"
_DOMAIN = b"kvtier/vllm-offload/v1"


@dataclass(frozen=True)
class TierConfig:
    """The ``secondary_tiers`` entry's keys beside ``type`` and ``module_path`` (docs/vllm.md)."""

    address: str = DEFAULT_ADDRESS
    """The daemon's address (``unix:/path`` or ``host:port``)."""
    transport: TransportName = "shm"
    """``shm`` on the daemon's host (the client copies into its arena), ``tcp`` from another."""
    model_id: str | None = None
    """Model name in the namespace; default: vLLM's model name."""
    model_revision: str | None = None
    """Immutable model revision; default: a Hugging Face snapshot directory's commit (else an
    error: no silent default)."""
    tokenizer_digest: str | None = None
    """Tokenizer digest; default: the digest of the tokenizer files beside the model, or
    ``"none"`` when vLLM skips the tokenizer."""
    adapter_id: str | None = None
    """An adapter merged into the served weights (per-request LoRA is in vLLM's hashes)."""
    adapter_revision: str | None = None
    """Its immutable revision; given exactly when ``adapter_id`` is."""
    cache_salt: str | None = None
    """A salt isolating this deployment's blocks (per-request ``cache_salt`` is in vLLM's
    hashes)."""
    tenant: str | None = None
    """The tenant whose namespace this is (a daemon with a tenants file)."""
    token_file: str | None = None
    """The tenant's bearer token file (first line; never logged)."""
    unix_login: bool = False
    """No token: log in as this process's Unix user (a Unix socket address only)."""
    lookup_timeout_ms: int = 300
    """A lookup not answered by then is a miss (it runs off the scheduler thread)."""
    request_timeout_ms: int = 1000
    """Each RPC's deadline."""
    job_timeout_ms: int = 5000
    """A load or store job's overall deadline: what is not moved by then failed / was dropped."""
    probe_timeout_ms: int = 250
    """The breaker's probe deadline while the daemon is away."""
    lease_ttl_ms: int = 10000
    """The session's lease on the daemon."""
    load: bool = True
    """Look blocks up and load them (false: store only)."""
    store: bool = True
    """Store blocks (false: load only)."""
    locality: str | None = None
    """vLLM's ``locality`` of this tier (``LOCAL`` / ``REMOTE``), for per-request tier filters."""
    load_policy: LoadPolicy = "adaptive"
    """How many held chunks a lookup answers HIT for: ``adaptive`` (the prefix whose load beats
    recomputing it), ``always`` (every held chunk) or ``never`` (none; stores still run)."""
    probe_after_s: float = 5.0
    """``adaptive``: a tier that was cut back is loaded one chunk again after this long."""
    interference_budget: float | None = 0.25
    """The fraction of each engine step the tier's transfers may add; a store job beyond it is
    dropped (counted). None: no budget."""
    prefill_seconds_per_token: float | None = None
    """The engine's prefill cost per token, set by the operator; None: measured from the
    scheduler's steps and the chunks vLLM stores (``decisions``)."""
    enable_kv_events: bool = False
    """Emit vLLM's offloading events (``BlockStored`` of the chunks each store job left in the
    daemon), as vLLM's file tier does under the same key; effective only when vLLM publishes
    KV cache events (``--kv-events-config``)."""

    @classmethod
    def from_tier(cls, kwargs: Mapping[str, Any]) -> TierConfig:
        return settings_from(cls, kwargs, PREFIX)

    def validate(self) -> None:
        """``ConfigError`` naming the first key whose value is refused (checked in this order:
        the shared client fields, the load policy's numbers, transport, then revisions)."""
        need = needs(PREFIX)
        check_client_fields(
            self,
            need,
            positive=(
                "lookup_timeout_ms",
                "request_timeout_ms",
                "job_timeout_ms",
                "probe_timeout_ms",
                "lease_ttl_ms",
            ),
            strings=(
                "model_id",
                "model_revision",
                "tokenizer_digest",
                "adapter_id",
                "adapter_revision",
                "cache_salt",
                "tenant",
                "token_file",
                "locality",
            ),
            flags=("load", "store", "unix_login", "enable_kv_events"),
        )
        self._check_policy(need)
        need(
            self.transport in ("shm", "tcp"),
            "transport",
            "must be 'shm' or 'tcp' (the tier moves bytes of vLLM's CPU pool)",
        )
        self._check_revisions(need)

    def _check_revisions(self, need: Need) -> None:
        """An adapter's id and revision together, then the one identity rule on each
        revision (kvtier_contract.identity)."""
        need(
            (self.adapter_id is None) == (self.adapter_revision is None),
            "adapter_revision",
            "adapter_id and adapter_revision go together",
        )
        for key in ("model_revision", "adapter_revision"):  # the one identity rule
            value = getattr(self, key)
            problem = revision_problem(value) if value else None
            need(problem is None, key, str(problem))

    def _check_policy(self, need: Need) -> None:
        """The load policy and its numbers: probe delay, interference budget, prefill cost."""
        need(
            self.load_policy in LOAD_POLICIES,
            "load_policy",
            f"must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}",
        )
        need(
            _positive(self.probe_after_s),
            "probe_after_s",
            f"must be a positive number of seconds, got {self.probe_after_s!r}",
        )
        need(
            self.interference_budget is None
            or (_positive(self.interference_budget) and self.interference_budget <= 1),
            "interference_budget",
            f"must be in (0, 1] or null, got {self.interference_budget!r}",
        )
        need(
            self.prefill_seconds_per_token is None or _positive(self.prefill_seconds_per_token),
            "prefill_seconds_per_token",
            f"must be a positive number or null, got {self.prefill_seconds_per_token!r}",
        )


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@dataclass(frozen=True)
class PoolGeometry:
    """What fixes the bytes of one row of vLLM's CPU pool (one offloaded chunk, all ranks)."""

    row_bytes: int  # the row stride of the pool (every rank's slice, page-aligned)
    chunk_tokens: int  # tokens of one chunk (tokens per block x blocks per chunk)
    kv_dtype: str  # vLLM's KV cache dtype name
    kv_layout: str  # vLLM's resolved KV cache layout name (e.g. LBHNC)
    canonical: bool  # rows in vLLM's canonical (parallelism-free) layout
    portable: bool  # canonical rows identical under any parallel config
    tp_size: int
    pp_size: int
    world_size: int
    groups: str  # the KV cache groups' layer names and block sizes, as one string
    hash_algo: str  # vLLM's prefix-caching hash algorithm (and seed source)

    def layout_name(self) -> str:
        """The namespace's layout field: readable head, digest of everything else."""
        form = "canonical" if self.canonical else "rows"
        desc = repr((self.kv_dtype, self.world_size, self.groups, self.hash_algo, self.row_bytes))
        digest = hashlib.sha256(desc.encode()).hexdigest()[:16]
        return f"vllm.offload.{self.kv_layout}.{form}.{digest}"


def hash_algo_name(algo: str | None) -> str:
    """vLLM's hash algorithm (``unknown`` where the scheduler has no current vLLM config) and
    where its seed comes from: the cryptographic ones use a fixed seed unless PYTHONHASHSEED is
    set; xxhash's is random per process without it. (Different algorithms or seeds give
    different hashes anyway; this only makes the namespace say which ones its keys came from.)"""
    seed = os.environ.get("PYTHONHASHSEED")
    return f"{algo or 'unknown'}:seed={seed if seed is not None else 'default'}"


def tier_namespace(
    cfg: TierConfig,
    geometry: PoolGeometry,
    *,
    model: str,
    engine_revision: Any = None,
    skip_tokenizer: bool = False,
    tokenizer: str | None = None,
) -> Namespace:
    """The tier's namespace: one block = one pool row, stored as opaque bytes (kv_dtype uint8,
    one layer, one head of ``row_bytes / (2 x chunk_tokens)``); the row's real format is in
    ``layout``. ``ConfigError`` when an identity field cannot be resolved."""
    if geometry.row_bytes % (2 * geometry.chunk_tokens):
        raise ConfigError(
            f"{PREFIX}.row_bytes",
            f"pool rows of {geometry.row_bytes} B do not split into {geometry.chunk_tokens} tokens x K,V",
        )
    revision, tokenizer_digest = _resolve_identity(
        cfg, model, engine_revision, skip_tokenizer, tokenizer or model
    )
    shared = geometry.canonical and geometry.portable  # canonical rows fit every topology
    return Namespace(
        model_id=cfg.model_id or model,
        model_revision=revision,
        tokenizer_digest=tokenizer_digest,
        kv_dtype="uint8",
        layout=geometry.layout_name(),
        tokens_per_block=geometry.chunk_tokens,
        num_layers=1,
        num_kv_heads=1,
        head_dim=geometry.row_bytes // (2 * geometry.chunk_tokens),
        tp_size=1 if shared else geometry.tp_size,
        pp_size=1 if shared else geometry.pp_size,
        adapter_id=cfg.adapter_id,
        adapter_revision=cfg.adapter_revision,
        cache_salt=cfg.cache_salt,
        tenant=cfg.tenant,
    )


def _resolve_identity(
    cfg: TierConfig, model: str, engine_revision: Any, skip_tokenizer: bool, tokenizer: str
) -> tuple[str, str]:
    """The model revision and tokenizer digest by the connector's rules, a ``ConfigError``
    naming this tier's key instead of the connector's."""
    try:
        revision = resolve_model_revision(cfg.model_revision, engine_revision, model)
        tokenizer_digest = resolve_tokenizer_digest(cfg.tokenizer_digest, skip_tokenizer, tokenizer, revision)
    except ConfigError as e:  # the same rule as the connector's, named by this tier's key
        key = e.field.rsplit(".", 1)[-1]
        raise ConfigError(f"{PREFIX}.{key}", str(e).split(": ", 1)[1]) from None
    return revision, tokenizer_digest


def offload_block_key(namespace_digest: bytes, offload_key: bytes, tenant_key: bytes | None = None) -> bytes:
    """kvtier's block key for vLLM's ``OffloadKey`` (module docstring)."""
    msg = _DOMAIN + namespace_digest + len(offload_key).to_bytes(4, "little") + offload_key
    if tenant_key:
        return hmac.new(tenant_key, msg, hashlib.sha256).digest()
    return hashlib.sha256(msg).digest()

"""The connector's settings and engine identity, as plain data (no vLLM import).

``ConnectorConfig.from_extra(kv_connector_extra_config)`` validates the operator's keys (an unknown
key or a wrong type is a ``ConfigError`` naming ``kv_connector_extra_config.<key>``).
``EngineIdentity`` holds every namespace field the engine decides (model, revision, tokenizer,
dtype, layout, geometry, parallel slice); ``EngineIdentity.namespace(variant, tp_rank)`` adds the
per-request fields (``Variant``: LoRA adapter and cache salt). The vLLM adapter fills both from
``VllmConfig``; the planner and the worker only ever see these classes. What the connector and
the secondary tier share (``ConfigError``, the settings checks, the revision and tokenizer rules)
is in ``kvtier.integrations.vllm.config``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.adaptive import LOAD_POLICIES, LoadPolicy
from kvtier.integrations.vllm.config import (
    DEFAULT_ADDRESS,
    ConfigError,
    Need,
    check_client_fields,
    files_digest,
    needs,
    settings_from,
)
from kvtier_contract.identity import Namespace, revision_problem
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ConnectorConfig:
    """The ``kv_connector_extra_config`` keys (see docs/vllm.md for each one)."""

    address: str = DEFAULT_ADDRESS
    transport: TransportName = "shm"
    lookup_timeout_ms: int = 300
    lookup_wait_ms: int = 2  # per engine step, the scheduler thread's wait for lookups
    request_timeout_ms: int = 1000
    lease_ttl_ms: int = 10000
    model_id: str | None = None
    model_revision: str | None = None
    tokenizer_digest: str | None = None
    adapter_revisions: Mapping[str, str] = field(default_factory=dict)
    tenant: str | None = None
    token_file: str | None = None  # the tenant's bearer token (first line; never logged)
    unix_login: bool = False  # no token: log in as this Unix user (docs/security.md)
    load: bool = True
    store: bool = True
    store_generated: bool = True
    # Send stored blocks' token ids (and a job's parent key) for the daemon's KV events: None
    # (the default) when the daemon says it publishes events of this engine's blocks.
    event_token_ids: bool | None = None
    pin_release_steps: int = 4
    step_budget_ms: int = 100
    probe_timeout_ms: int = 250
    load_mode: str = "sync"  # "sync": before the step's forward; "async": on the load thread
    async_load_timeout_ms: int = 10000
    # Load or recompute (issue 30, docs/vllm.md "Load or recompute"): "adaptive" loads the hit
    # prefix that arrives before recomputing it would finish, "always" every hit, "never" none.
    load_policy: LoadPolicy = "adaptive"
    # Fraction of an engine step kvtier's transfers may add (loads first; stores past it are
    # dropped and counted); None: no budget.
    interference_budget: float | None = 0.25
    probe_after_s: float = 5.0  # a tier cut back is tried again (one block) after this long
    # A request that begins with a prefix one of the tenant's groups published keys it in the
    # group's scope (issue 43, docs/vllm.md "Shared prefixes"); the list is fetched this often.
    shared_prefixes: bool = True
    prefix_refresh_ms: int = 5000

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        return settings_from(cls, extra, "kv_connector_extra_config")

    def validate(self) -> None:
        """``ConfigError`` naming the first key whose value is refused (checked in this order:
        the shared client fields, transport, revisions, then the load settings)."""
        need = needs("kv_connector_extra_config")
        check_client_fields(
            self,
            need,
            positive=(
                "lookup_timeout_ms",
                "request_timeout_ms",
                "lease_ttl_ms",
                "pin_release_steps",
                "step_budget_ms",
                "probe_timeout_ms",
                "async_load_timeout_ms",
                "prefix_refresh_ms",
            ),
            strings=("model_id", "model_revision", "tokenizer_digest", "tenant", "token_file"),
            flags=("load", "store", "store_generated", "unix_login", "shared_prefixes"),
        )
        need(
            self.event_token_ids is None or isinstance(self.event_token_ids, bool),
            "event_token_ids",
            "must be true, false or null (as the daemon publishes events)",
        )
        need(self.transport in TRANSPORT_NAMES.values(), "transport", "must be 'shm', 'tcp' or 'cuda_ipc'")
        self._check_revisions(need)
        self._check_loading(need)

    def _check_revisions(self, need: Need) -> None:
        """``adapter_revisions``' shape, then the one identity rule (kvtier_contract.identity)
        on every configured revision, refused by its key's name."""
        need(
            isinstance(self.adapter_revisions, Mapping)
            and all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in self.adapter_revisions.items()
            ),
            "adapter_revisions",
            "must map adapter names to revision strings",
        )
        revisions = {
            "model_revision": self.model_revision,
            **{f"adapter_revisions.{k}": v for k, v in self.adapter_revisions.items()},
        }
        for key, value in revisions.items():
            problem = revision_problem(value) if value else None
            need(problem is None, key, str(problem))

    def _check_loading(self, need: Need) -> None:
        """The load settings: mode, policy, interference budget, probe delay, lookup wait."""
        need(self.load_mode in ("sync", "async"), "load_mode", "must be 'sync' or 'async'")
        need(
            self.load_policy in LOAD_POLICIES,
            "load_policy",
            f"must be one of {', '.join(repr(p) for p in LOAD_POLICIES)}",
        )
        budget = self.interference_budget
        need(
            budget is None or (_real(budget) and 0 < budget <= 1),
            "interference_budget",
            "must be a fraction in (0, 1] of an engine step, or null for no budget",
        )
        need(
            _real(self.probe_after_s) and 0 < self.probe_after_s < math.inf,
            "probe_after_s",
            "must be a positive number of seconds",
        )
        need(
            isinstance(self.lookup_wait_ms, int)
            and not isinstance(self.lookup_wait_ms, bool)
            and 0 <= self.lookup_wait_ms <= 1000,
            "lookup_wait_ms",
            "must be an integer from 0 (never wait: answers come a step later) to 1000",
        )


def _real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Variant:
    """The per-request part of a namespace: LoRA adapter and cache salt (both optional), or
    the group whose scope holds a published prefix (``group``: no salt, no tenant; the
    connector's ``DaemonBackend`` keys a request's shared prefix in it)."""

    adapter_id: str | None = None
    adapter_revision: str | None = None
    cache_salt: str | None = None
    group: str | None = None

    def shared(self, group: str) -> Variant:
        """This variant's adapter in ``group``'s scope (the scope of a prefix the group
        published)."""
        return replace(self, cache_salt=None, group=group)


BASE = Variant()


@dataclass(frozen=True, kw_only=True)
class EngineIdentity:
    """Namespace fields fixed by the engine's configuration; one per engine (all ranks)."""

    model_id: str
    model_revision: str
    tokenizer_digest: str
    kv_dtype: str
    layout: str
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    tenant: str | None = None

    def namespace(self, variant: Variant = BASE, tp_rank: int = 0) -> Namespace:
        """The namespace of one tensor-parallel slice for requests of ``variant`` (the fields of
        both classes are Namespace fields of the same names; a group's namespace has no tenant)."""
        fields = asdict(self)
        if variant.group is not None:
            fields["tenant"] = None
        return Namespace(**fields, **asdict(variant), tp_rank=tp_rank)


def adapter_variant(
    cfg: ConnectorConfig, name: str, path: str | None, cache_salt: str | None, digests: dict[str, str]
) -> Variant:
    """The variant of a request with LoRA adapter ``name`` at ``path``: the configured revision,
    else the digest of the adapter files (memoised in ``digests`` by path). ``ConfigError`` when
    neither exists: such requests are neither looked up nor stored."""
    revision = cfg.adapter_revisions.get(name)
    if revision is None and path:
        revision = digests.get(path)
        if revision is None and os.path.isdir(path):
            revision = files_digest(path, ADAPTER_FILES)
            if revision is not None:
                digests[path] = revision
    if revision is None:
        raise ConfigError(
            f"kv_connector_extra_config.adapter_revisions.{name}",
            "no revision configured and no adapter files to digest",
        )
    return Variant(adapter_id=name, adapter_revision=revision, cache_salt=cache_salt)

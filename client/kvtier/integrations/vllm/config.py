"""Connector configuration and engine identity, as plain data (no vLLM import).

``ConnectorConfig.from_extra(kv_connector_extra_config)`` validates the operator's keys (an unknown
key or a wrong type is a ``ConfigError`` naming ``kv_connector_extra_config.<key>``).
``EngineIdentity`` holds every namespace field the engine decides (model, revision, tokenizer,
dtype, layout, geometry, parallel slice); ``EngineIdentity.namespace(variant, tp_rank)`` adds the
per-request fields (``Variant``: LoRA adapter and cache salt). The vLLM adapter fills both from
``VllmConfig``; the planner and the worker only ever see these classes.

Fail-closed: nothing here invents an identity field. A model revision comes from the extra config,
from vLLM's ``--revision`` or from a Hugging Face snapshot directory name (``.../snapshots/<sha>``);
otherwise the connector refuses to start. The tokenizer digest is the SHA-256 of the tokenizer
files, the explicit ``"none"`` when vLLM skips the tokenizer, or the extra config's value.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtier.adaptive import LOAD_POLICIES, LoadPolicy
from kvtier_contract import defaults
from kvtier_contract.identity import (
    Namespace,
    is_mutable_revision,
    revision_problem,
    tokenizer_digest_problem,
)
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName

DEFAULT_ADDRESS = defaults.ADDRESS
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Files whose bytes define a Hugging Face tokenizer (whichever of them exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class ConfigError(ValueError):
    """A connector setting is missing or malformed; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


_S = TypeVar("_S")
Need = Callable[[bool, str, str], None]


def settings_from(cls: type[_S], extra: Mapping[str, Any] | None, prefix: str) -> _S:
    """``cls(**extra)`` of a settings dataclass (the connector's or the tier's), validated:
    ``socket`` is the short form of a Unix ``address``; an unknown key is refused by name
    (``<prefix>.<key>``), as is what the class's ``validate`` refuses."""
    extra = dict(extra or {})
    if "socket" in extra:  # the short form a sidecar uses
        if "address" in extra:
            raise ConfigError(f"{prefix}.socket", "give either socket or address, not both")
        sock = str(extra.pop("socket"))
        extra["address"] = sock if sock.startswith("unix:") else f"unix:{sock}"
    known = set(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    for key in extra:
        if key not in known:
            raise ConfigError(
                f"{prefix}.{key}", f"unknown key; known: {', '.join(sorted(known | {'socket'}))}"
            )
    cfg = cls(**extra)
    cfg.validate()  # type: ignore[attr-defined]
    return cfg


def needs(prefix: str) -> Need:
    """``need(ok, key, message)``: ConfigError ``<prefix>.<key>: message`` unless ``ok``."""

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{prefix}.{key}", message)

    return need


def check_client_fields(
    cfg: Any, need: Need, *, positive: Sequence[str], strings: Sequence[str], flags: Sequence[str]
) -> None:
    """The checks the connector's and the tier's settings share: the address, positive integer
    ``positive``, non-empty-or-absent ``strings``, boolean ``flags``, the tokenizer digest rule,
    and a Unix login (a Unix address, no token file)."""
    need(isinstance(cfg.address, str) and bool(cfg.address), "address", "must be a non-empty string")
    for key in positive:
        value = getattr(cfg, key)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            key,
            "must be a positive integer",
        )
    for key in strings:
        value = getattr(cfg, key)
        need(value is None or (isinstance(value, str) and bool(value)), key, "must be a non-empty string")
    problem = tokenizer_digest_problem(cfg.tokenizer_digest) if cfg.tokenizer_digest else None
    need(problem is None, "tokenizer_digest", str(problem))
    for key in flags:
        need(isinstance(getattr(cfg, key), bool), key, "must be true or false")
    need(not (cfg.unix_login and cfg.token_file), "unix_login", "give token_file or unix_login, not both")
    need(
        not cfg.unix_login or cfg.address.startswith("unix:"),
        "unix_login",
        "needs a Unix socket address (socket or unix: address)",
    )


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
    event_token_ids: bool = False  # send stored blocks' token ids for the daemon's KV events
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
            ),
            strings=("model_id", "model_revision", "tokenizer_digest", "tenant", "token_file"),
            flags=("load", "store", "store_generated", "event_token_ids", "unix_login"),
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
    """The per-request part of a namespace: LoRA adapter and cache salt (both optional)."""

    adapter_id: str | None = None
    adapter_revision: str | None = None
    cache_salt: str | None = None


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
        both classes are Namespace fields of the same names)."""
        return Namespace(**asdict(self), **asdict(variant), tp_rank=tp_rank)


def resolve_model_revision(configured: str | None, engine_revision: str | None, model_path: str) -> str:
    """The model's immutable revision: the extra config's, the commit vLLM resolved its
    ``--revision`` to (``engine_revision.resolved`` where vLLM provides it), an explicit
    ``--revision`` other than a branch default, or the commit of a Hugging Face snapshot
    directory. Anything else is a ``ConfigError`` (no silent default; vLLM reports ``"main"`` for
    a hub model served without ``--revision``, which names no fixed weights)."""
    if configured:
        return configured
    resolved = getattr(engine_revision, "resolved", None)
    if isinstance(resolved, str) and _COMMIT.fullmatch(resolved):
        return resolved
    if engine_revision and not is_mutable_revision(str(engine_revision)):
        return str(engine_revision)
    m = _SNAPSHOT.search(os.path.abspath(model_path) + "/")
    if m:
        return m.group(1)
    raise ConfigError(
        "kv_connector_extra_config.model_revision",
        f"required: the model {model_path!r} is not a Hugging Face snapshot and vLLM was given no "
        "--revision; set the model's immutable revision (e.g. its commit hash)",
    )


def files_digest(directory: str | os.PathLike[str], names: tuple[str, ...]) -> str | None:
    """``sha256:<hex>`` over (name, length, bytes) of those of ``names`` that exist in
    ``directory``, in the given order; None when none exists."""
    h = hashlib.sha256(b"kvtier/files/v1")
    found = False
    base = Path(directory)
    for name in names:
        path = base / name
        if not path.is_file():
            continue
        found = True
        data = path.read_bytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return f"sha256:{h.hexdigest()}" if found else None


def resolve_tokenizer_digest(
    configured: str | None, skipped: bool, tokenizer_path: str, hub_revision: str | None = None
) -> str:
    """``"none"`` when the engine runs without a tokenizer (token ids in, token ids out), the
    configured digest, the digest of the tokenizer files in a local directory, or, for a hub id
    at a commit, ``hf:<id>@<commit>`` (the files at a commit never change); else ``ConfigError``."""
    if configured:
        return configured
    if skipped:
        return "none"
    if os.path.isdir(tokenizer_path):
        digest = files_digest(tokenizer_path, TOKENIZER_FILES)
        if digest is not None:
            return digest
    elif hub_revision and _COMMIT.fullmatch(hub_revision):
        return f"hf:{tokenizer_path}@{hub_revision}"
    raise ConfigError(
        "kv_connector_extra_config.tokenizer_digest",
        f"required: no tokenizer files found in {tokenizer_path!r} and no commit to name them by",
    )


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

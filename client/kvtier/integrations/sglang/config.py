"""Backend configuration, engine identity and page keys, as plain data (no SGLang import).

``BackendConfig.from_extra(extra_config, model_name)`` validates the kvtier keys of SGLang's
``--hicache-storage-backend-extra-config`` (an unknown key or a wrong type is a ``ConfigError``
naming ``extra_config.<key>``) and resolves the identity fields that do not depend on the host
pool: model id, immutable model revision and tokenizer digest. Fail-closed: nothing here invents
an identity field; a missing one stops SGLang at startup with a message that names the key.

``page_key(namespace_digest, sglang_key, tenant_key)``: the 32-byte kvtier key of one SGLang page.
SGLang's key is its own chained SHA-256 over the token ids of the prefix up to and including the
page (seeded by the request's ``extra_key`` / ``cache_salt`` when it has one); it says nothing of
the model, the parallel slice or the byte layout, so the kvtier key binds it to the namespace:
``SHA-256("kvtier/sglang/page/v1" ‖ namespace_digest ‖ u32le(len) ‖ utf8(sglang_key))``, or
HMAC-SHA-256 with the tenant key when the client has one (docs/sglang.md, "Identity").
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.adaptive.decision import LOAD_POLICIES, LoadPolicy
from kvtier_contract import defaults
from kvtier_contract.identity import revision_problem, tokenizer_digest_problem
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName

_PAGE_DOMAIN = b"kvtier/sglang/page/v1"
_U32 = struct.Struct("<I")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
# Keys SGLang itself reads from the same JSON (the dynamic loader's and the controller's).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


class ConfigError(ValueError):
    """A backend setting is missing or malformed; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class BackendConfig:
    """The kvtier keys of the extra config (docs/sglang.md lists each one and its default)."""

    address: str = defaults.ADDRESS
    """The daemon: ``unix:<path>`` or ``host:port``."""
    transport: TransportName = "shm"
    """How page bytes move: ``shm`` (same host, mapped arena), ``tcp`` or ``cuda_ipc``."""
    model_id: str | None = None
    """Model name in the namespace; default SGLang's ``model_name`` (its model path)."""
    model_revision: str | None = None
    """Immutable model revision (commit); default: the commit of a Hugging Face snapshot path."""
    tokenizer_digest: str | None = None
    """Tokenizer identity; default: SHA-256 of the tokenizer files in the model directory."""
    cache_salt: str | None = None
    """Opaque salt that separates this deployment's pages from an otherwise identical one."""
    tenant: str | None = None
    """Tenant name (multi-tenant daemons); ``token_file`` holds its bearer token."""
    token_file: str | None = None
    """File whose first line is the tenant's bearer token (never logged)."""
    request_timeout_ms: int = 1000
    """Deadline of one RPC; a daemon that does not answer in time is a miss / dropped store."""
    op_timeout_ms: int = 5000
    """Bound on one batch call (all its RPCs and copies) from SGLang's storage threads."""
    lease_ttl_ms: int = 10000
    """Session lease: the daemon drops this client's reservations after this long silent."""
    probe_timeout_ms: int = 250
    """Deadline of the breaker's reconnect probe while the daemon is away."""
    load_policy: LoadPolicy = "adaptive"
    """How many held pages ``batch_exists`` reports: ``adaptive`` (the prefix whose load beats
    recomputing it, once ``prefill_seconds_per_token`` is set), ``always`` or ``never``."""
    probe_after_s: float = 5.0
    """``adaptive``: a tier that was cut back is loaded one page again after this long."""
    prefill_seconds_per_token: float | None = None
    """The engine's prefill cost per token, set by the operator (the storage interface sees no
    engine step to measure it from); None: ``adaptive`` reports every held page."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> BackendConfig:
        extra = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
        known = set(cls.__dataclass_fields__)
        for key in extra:
            if key not in known:
                raise ConfigError(f"extra_config.{key}", f"unknown key; known: {', '.join(sorted(known))}")
        cfg = cls(**extra)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"extra_config.{key}", message)

        need(isinstance(self.address, str) and bool(self.address), "address", "must be a non-empty string")
        need(self.transport in TRANSPORT_NAMES.values(), "transport", "must be 'shm', 'tcp' or 'cuda_ipc'")
        for key in ("request_timeout_ms", "op_timeout_ms", "lease_ttl_ms", "probe_timeout_ms"):
            value = getattr(self, key)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                key,
                "must be a positive integer",
            )
        need(
            self.load_policy in LOAD_POLICIES,
            "load_policy",
            f"must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}",
        )
        need(
            _positive_number(self.probe_after_s),
            "probe_after_s",
            f"must be a positive number of seconds, got {self.probe_after_s!r}",
        )
        need(
            self.prefill_seconds_per_token is None or _positive_number(self.prefill_seconds_per_token),
            "prefill_seconds_per_token",
            f"must be a positive number or null, got {self.prefill_seconds_per_token!r}",
        )
        for key in ("model_id", "model_revision", "tokenizer_digest", "cache_salt", "tenant", "token_file"):
            value = getattr(self, key)
            need(value is None or (isinstance(value, str) and bool(value)), key, "must be a non-empty string")
        # The one identity rule (kvtier_contract.identity), refused here by its key's name.
        problem = revision_problem(self.model_revision) if self.model_revision else None
        need(problem is None, "model_revision", str(problem))
        problem = tokenizer_digest_problem(self.tokenizer_digest) if self.tokenizer_digest else None
        need(problem is None, "tokenizer_digest", str(problem))


def _positive_number(value: Any) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@dataclass(frozen=True)
class ModelIdentity:
    """The namespace fields fixed by the model (the host pool adds the layout and geometry)."""

    model_id: str
    model_revision: str
    tokenizer_digest: str


def resolve_identity(cfg: BackendConfig, model_name: str | None) -> ModelIdentity:
    """Model id, revision and tokenizer digest, or ``ConfigError`` naming the missing key."""
    model_id = cfg.model_id or model_name
    if not model_id:
        raise ConfigError("extra_config.model_id", "required: SGLang gave the backend no model_name")
    revision = cfg.model_revision
    if revision is None and model_name:
        m = _SNAPSHOT.search(model_name.rstrip("/") + "/")
        revision = m.group(1) if m else None
    if revision is None:
        raise ConfigError(
            "extra_config.model_revision",
            f"required: {model_name!r} is not a Hugging Face snapshot path; set the "
            "model's immutable revision (e.g. its commit hash)",
        )
    digest = cfg.tokenizer_digest
    if digest is None and model_name:
        from kvtier.integrations.vllm.config import TOKENIZER_FILES, files_digest

        digest = files_digest(model_name, TOKENIZER_FILES)
    if digest is None:
        raise ConfigError(
            "extra_config.tokenizer_digest",
            f"required: no tokenizer files found in {model_name!r}; set a digest of "
            'the tokenizer (or "none" when requests carry token ids only)',
        )
    return ModelIdentity(model_id, revision, digest)


def page_key(namespace_digest: bytes, sglang_key: str, tenant_key: bytes | None = None) -> bytes:
    """The 32-byte kvtier key of SGLang page ``sglang_key`` in the namespace (module docstring)."""
    raw = sglang_key.encode("utf-8")
    data = b"".join((_PAGE_DOMAIN, namespace_digest, _U32.pack(len(raw)), raw))
    if tenant_key:
        return hmac.digest(tenant_key, data, "sha256")
    return hashlib.sha256(data).digest()

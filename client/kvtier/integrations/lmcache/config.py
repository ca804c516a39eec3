"""The adapter's settings (LMCache's ``adapter_params``) and model identities, as plain data.

``AdapterConfig.from_params(adapter_params)`` validates every key once, when LMCache builds the
adapter: an unknown key, a wrong type or a missing identity field is a ``ConfigError`` naming
``adapter_params.<key>`` (LMCache then refuses to start the server). No LMCache import here.

Identity is fail-closed. LMCache's object key names a model only by the string the engine
registered (``ObjectKey.model_name``); everything else that makes KV bytes interchangeable
(immutable revision, tokenizer, KV dtype and geometry of one rank's slice) comes from
``adapter_params.models[<model_name>]``, where every field is required. A key for a model that
is not listed is never stored and never looked up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_contract import defaults
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import KV_DTYPES, Namespace
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName

# LMCache chunk hash algorithms whose digests are collision-resistant and the same in every
# process. ``builtin`` (Python's hash(), 64 bits, seeded per process) is refused: two prefixes
# with one 64-bit hash would share a key, and a key must never name two different byte strings.
HASH_ALGORITHMS = ("blake3", "sha256_cbor")


class ConfigError(ValueError):
    """An adapter setting is missing or malformed; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """Namespace fields that LMCache's key does not carry, for one ``model_name``: all required.

    Geometry is one kv rank's slice (what one LMCache object holds per token): a chunk of
    ``chunk_tokens`` tokens is ``2 x num_layers x chunk_tokens x num_kv_heads x head_dim``
    values of ``kv_dtype`` (LMCache's ``[2, L, T, hidden]`` layout, hidden = heads x head_dim).
    """

    model_revision: str
    """Immutable model revision (a commit hash)."""
    tokenizer_digest: str
    """Digest of the tokenizer the engines use (LMCache hashes token ids), or ``"none"``."""
    kv_dtype: str
    """KV dtype, one of ``kvtier_contract.identity.KV_DTYPES``."""
    num_layers: int
    """Layers in one LMCache object."""
    num_kv_heads: int
    """KV heads in one kv rank's slice."""
    head_dim: int
    """Elements per head."""

    @classmethod
    def from_params(cls, model: str, d: object) -> ModelIdentity:
        where = f"adapter_params.models.{model}"
        if not isinstance(d, Mapping):
            raise ConfigError(where, "must be an object of identity fields")
        known = set(cls.__dataclass_fields__)
        for key in d:
            if key not in known:
                raise ConfigError(f"{where}.{key}", f"unknown key; known: {', '.join(sorted(known))}")
        for key in sorted(known):
            if key not in d:
                raise ConfigError(f"{where}.{key}", "required (identity is never defaulted)")
        ident = cls(**dict(d))
        try:
            ident.namespace(
                model_id=model, chunk_tokens=1, world_size=1, rank=0, group=0, cache_salt=None, tenant=None
            )
        except InvalidArgument as e:  # the Namespace's own checks, named by our key
            name = (e.field or "").removeprefix("namespace.")
            raise ConfigError(f"{where}.{name}", str(e).split(": ", 1)[-1]) from None
        return ident

    def namespace(
        self,
        *,
        model_id: str,
        chunk_tokens: int,
        world_size: int,
        rank: int,
        group: int,
        cache_salt: str | None,
        tenant: str | None,
        opaque_rank: bool = False,
    ) -> Namespace:
        """The kvtier namespace of one (kv rank, object group, cache salt) of this model;
        ``opaque_rank``: the one namespace of every kv rank that names no slice (``keys``)."""
        return Namespace(
            model_id=model_id,
            model_revision=self.model_revision,
            tokenizer_digest=self.tokenizer_digest,
            kv_dtype=self.kv_dtype,
            layout=f"lmcache.mp.2LTD/group{group}" + ("/opaque-rank" if opaque_rank else ""),
            tokens_per_block=chunk_tokens,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tp_size=world_size,
            tp_rank=rank,
            cache_salt=cache_salt,
            tenant=tenant,
        )


@dataclass(frozen=True)
class AdapterConfig:
    """The ``adapter_params`` keys (docs/lmcache.md §2 describes each one)."""

    models: Mapping[str, ModelIdentity]
    """LMCache ``model_name`` -> its identity. Required, at least one model."""
    chunk_tokens: int
    """Tokens per LMCache chunk: the server's ``--chunk-size``. Required."""
    hash_algorithm: str
    """The server's ``--hash-algorithm`` (``blake3`` or ``sha256_cbor``). Required."""
    address: str = defaults.ADDRESS
    """The daemon: ``unix:<socket path>`` or ``host:port``."""
    transport: TransportName = "shm"
    """How bytes move: ``shm`` (same host), ``tcp`` (another host)."""
    tenant: str | None = None
    """The tenant the namespaces belong to (a daemon with tenants also needs ``token_file``)."""
    token_file: str | None = None
    """File whose first line is the tenant's bearer token (never logged)."""
    request_timeout_ms: int = 1000
    """Deadline of each RPC to the daemon."""
    op_timeout_ms: int = 10000
    """Bound on one store or load task, all its RPCs and copies together."""
    lease_ttl_ms: int = 10000
    """Session lease: the daemon frees this adapter's locks this long after it vanished."""
    workers: int = 2
    """Threads that run the adapter's tasks (LMCache's threads only submit and poll)."""
    min_chunk_hash_bytes: int = 16
    """Shortest chunk hash accepted (1..32). LMCache's ``blake3`` and ``sha256_cbor`` hashes
    are 32 bytes. Its conformance tool (``basic_check --mode test_l2_adapter``) and unit tests
    build 4-byte test hashes: set 4 to run those, never to serve (two prompts whose short hashes
    collide would share a block)."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> AdapterConfig:
        if not isinstance(params, Mapping):
            raise ConfigError("adapter_params", "must be an object")
        d = dict(params)
        if "socket" in d:  # the short form a sidecar uses
            if "address" in d:
                raise ConfigError("adapter_params.socket", "give either socket or address")
            sock = str(d.pop("socket"))
            d["address"] = sock if sock.startswith("unix:") else f"unix:{sock}"
        known = set(cls.__dataclass_fields__)
        for key in d:
            if key not in known:
                raise ConfigError(
                    f"adapter_params.{key}", f"unknown key; known: {', '.join(sorted(known | {'socket'}))}"
                )
        for key in ("models", "chunk_tokens", "hash_algorithm"):
            if key not in d:
                raise ConfigError(f"adapter_params.{key}", "required")
        models = d["models"]
        if not isinstance(models, Mapping) or not models:
            raise ConfigError("adapter_params.models", "must map each LMCache model_name to its identity")
        d["models"] = {
            str(name): ModelIdentity.from_params(str(name), ident) for name, ident in models.items()
        }
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """``ConfigError`` naming the first key refused: the models and chunk settings, then
        the client's."""
        self._check_chunks()
        self._check_client()

    def _check_chunks(self) -> None:
        """Model names, the positive integers, the chunk hash's length and algorithm."""
        for name in self.models:
            _need(
                bool(name.strip()) and "@" not in name,
                f"models.{name}",
                "model names are non-empty and have no '@' (LMCache's rule)",
            )
        for key in (
            "chunk_tokens",
            "request_timeout_ms",
            "op_timeout_ms",
            "lease_ttl_ms",
            "workers",
            "min_chunk_hash_bytes",
        ):
            value = getattr(self, key)
            _need(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                key,
                "must be a positive integer",
            )
        _need(
            self.min_chunk_hash_bytes <= 32,
            "min_chunk_hash_bytes",
            "at most 32 (LMCache's hashes are 32 bytes)",
        )
        _need(
            self.hash_algorithm in HASH_ALGORITHMS,
            "hash_algorithm",
            f"must be one of {', '.join(HASH_ALGORITHMS)} (a 64-bit builtin hash could name "
            "two prefixes alike)",
        )

    def _check_client(self) -> None:
        """The daemon's address, the transport, the tenant and its token file."""
        _need(isinstance(self.address, str) and bool(self.address), "address", "must be a non-empty string")
        _need(
            self.transport in TRANSPORT_NAMES.values() and self.transport != "cuda_ipc",
            "transport",
            "must be 'shm' or 'tcp'",
        )
        for key in ("tenant", "token_file"):
            value = getattr(self, key)
            _need(
                value is None or (isinstance(value, str) and bool(value)), key, "must be a non-empty string"
            )

    def block_bytes(self, model: str) -> int:
        """Bytes of one chunk of ``model`` (one kvtier block)."""
        ident = self.models[model]
        return (
            2
            * ident.num_layers
            * ident.num_kv_heads
            * ident.head_dim
            * KV_DTYPES[ident.kv_dtype]
            * self.chunk_tokens
        )


def _need(ok: bool, key: str, message: str) -> None:
    """``ConfigError`` naming ``adapter_params.<key>`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"adapter_params.{key}", message)


@dataclass
class AdapterCounters:
    """Owned by one adapter; incremented by its worker threads (plain ints, no lock: a lost
    increment under a race only blurs a statistic)."""

    stored: int = 0  # chunks the daemon took (or already had)
    store_dropped: int = 0  # chunks not stored: daemon away, out of time, refused for room
    refused: int = 0  # chunks whose key or size does not fit a configured identity
    last_refusal: str = field(default="", repr=False)  # why the last refused chunk was
    lookups: int = 0
    locked: int = 0  # keys reported found (and pinned)
    locked_past_gap: int = 0  # of those, keys found after a missing one (PrepareLoad's answer)
    loaded: int = 0
    load_missed: int = 0
    unlocks: int = 0
    pins_released: int = 0
    errors: int = 0  # unexpected exceptions caught at the task boundary
    last_error: str = field(default="", repr=False)

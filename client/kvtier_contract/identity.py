"""Namespace identity and block keys (DESIGN.md §3; byte-exact spec in ``docs/hashing.md``).

Primitives:

* ``Namespace``: every field that makes KV bytes interchangeable, validated at construction
  (fail closed: a missing identity field is a ``TypeError``, a malformed one ``InvalidArgument``).
* ``namespace_digest(ns)``: 32 bytes, SHA-256 over a typed, length-prefixed encoding of every field.
* ``block_keys(...)``: chained 32-byte keys for the full blocks of a token sequence.
* ``revision_problem(value)`` / ``tokenizer_digest_problem(value)``: the one rule for what may
  name a revision (model or adapter) and a tokenizer (:mod:`kvtier_contract.revisions`, names
  kept here for callers), used by ``Namespace`` and by every engine integration.

Everything here is a pure function of its arguments: no ``hash()``, no PYTHONHASHSEED, no process
or host state, so every process on every host computes the same digests and keys. Pure Python
(hashlib, hmac, struct); numpy arrays and torch tensors are accepted by duck typing (``.tolist()``)
without importing either. Thread-safe: no shared mutable state.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, NoReturn

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.revisions import (
    MUTABLE_REVISIONS,
    is_mutable_revision,
    revision_problem,
    tokenizer_digest_problem,
)

__all__ = [
    "KV_DTYPES",
    "MUTABLE_REVISIONS",
    "Namespace",
    "block_key",
    "block_keys",
    "is_mutable_revision",
    "namespace_digest",
    "revision_problem",
    "tokenizer_digest_problem",
]

# KV dtype name -> item size in bytes.
KV_DTYPES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

DIGEST_BYTES = 32
MAX_STR_CHARS = 256
MAX_TOKENS_PER_BLOCK = 65536
MAX_INT_FIELD = 2**31 - 1  # every integer field also fits an int32 on the wire
MAX_TOKEN_ID = 2**32 - 1

_NS_DOMAIN = b"kvtier/ns/v1"
_BLOCK_DOMAIN = b"kvtier/block/v1"
_ZERO_PARENT = bytes(DIGEST_BYTES)

_Digest = Callable[[bytes], bytes]

# One namespace field record: tag (u8), type (u8), value length (u32le). Then the value bytes.
_FIELD_HEADER = struct.Struct("<BBI")
_TYPE_ABSENT, _TYPE_STR, _TYPE_INT, _TYPE_GROUP = 0, 1, 2, 3
_I64 = struct.Struct("<q")  # integer field value
_U32 = struct.Struct("<I")  # extra length prefix

_REQUIRED_STR = ("model_id", "model_revision", "tokenizer_digest", "kv_dtype", "layout")
_POSITIVE_INT = ("tokens_per_block", "num_layers", "num_kv_heads", "head_dim", "tp_size", "pp_size")
_OPTIONAL_STR = ("adapter_id", "adapter_revision", "cache_salt", "tenant", "group")
_HASHED_FIELDS = 17  # records 1..17; ``group`` is record 17 with its own type (``_TYPE_GROUP``)


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything that makes KV bytes interchangeable between two engines.

    Immutable and validated once in ``__post_init__``; two namespaces with equal fields have
    equal ``digest``. Field order is part of the hashing spec (tags 1..17 in declaration order,
    ``group`` sharing tag 17 with ``tenant`` under its own type): never reorder, insert or remove
    a field without a new domain tag (``kvtier/ns/v2``).
    """

    model_id: str
    """Model name, e.g. ``"Qwen/Qwen3-0.6B"``."""
    model_revision: str
    """Immutable model revision (a commit hash), never a moving ref (``revision_problem``)."""
    tokenizer_digest: str
    """Digest of the tokenizer files, or the explicit string ``"none"`` when the engine skips it
    (never a placeholder: ``tokenizer_digest_problem``)."""
    kv_dtype: str
    """KV cache dtype, one of ``KV_DTYPES``."""
    layout: str
    """Engine layout name of the block bytes, e.g. ``"vllm.LBNHC"`` or ``"contiguous"``."""
    tokens_per_block: int
    """Tokens per block, 1..65536."""
    num_layers: int
    """Attention layers held by this parallel slice."""
    num_kv_heads: int
    """KV heads held by this parallel slice."""
    head_dim: int
    """Elements per head."""
    tp_size: int = 1
    """Tensor-parallel world size."""
    tp_rank: int = 0
    """Tensor-parallel rank of this slice, in [0, tp_size)."""
    pp_size: int = 1
    """Pipeline-parallel world size."""
    pp_rank: int = 0
    """Pipeline-parallel rank of this slice, in [0, pp_size)."""
    adapter_id: str | None = None
    """LoRA/adapter id, or None for the base model; requires ``adapter_revision``."""
    adapter_revision: str | None = None
    """Immutable adapter revision (``revision_problem``); given exactly when ``adapter_id`` is."""
    cache_salt: str | None = None
    """Opaque salt that isolates otherwise identical namespaces, or None."""
    tenant: str | None = None
    """Tenant name, or None for a single-tenant deployment."""
    group: str | None = None
    """Group of tenants that owns this namespace (a shared scope: docs/hashing.md §7), or None;
    never together with ``tenant``. Not a 18th record: it is hashed as record 17 of type 3
    (``group``), so every namespace without a group keeps its digest."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidArgument(field="namespace.<name>")`` for the first malformed field."""
        for name in _REQUIRED_STR:
            _check_str(name, getattr(self, name), optional=False)
        for name in _OPTIONAL_STR:
            _check_str(name, getattr(self, name), optional=True)
        for name in (*_POSITIVE_INT, "tp_rank", "pp_rank"):
            _check_int(name, getattr(self, name), minimum=1 if name in _POSITIVE_INT else 0)
        for name in ("model_revision", "adapter_revision"):
            value = getattr(self, name)
            problem = None if value is None else revision_problem(value)
            if problem:
                _fail(name, problem)
        problem = tokenizer_digest_problem(self.tokenizer_digest)
        if problem:
            _fail("tokenizer_digest", problem)
        if self.kv_dtype not in KV_DTYPES:
            allowed = ", ".join(sorted(KV_DTYPES))
            _fail("kv_dtype", f"unknown dtype {self.kv_dtype!r}; allowed: {allowed}")
        if self.tokens_per_block > MAX_TOKENS_PER_BLOCK:
            _fail("tokens_per_block", f"must be <= {MAX_TOKENS_PER_BLOCK}")
        if self.tp_rank >= self.tp_size:
            _fail("tp_rank", f"must be in [0, tp_size={self.tp_size})")
        if self.pp_rank >= self.pp_size:
            _fail("pp_rank", f"must be in [0, pp_size={self.pp_size})")
        if self.tenant is not None and self.group is not None:
            _fail("group", "a namespace belongs to a tenant or to a group, not both")
        if (self.adapter_id is None) != (self.adapter_revision is None):
            missing = "adapter_revision" if self.adapter_revision is None else "adapter_id"
            _fail(missing, "adapter_id and adapter_revision must be given together")

    @property
    def owner(self) -> str | None:
        """Whose blocks these are: the tenant, else the group, else None (single-tenant)."""
        return self.tenant if self.group is None else self.group

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in this slice: 2 (K, V) x layers x heads x head_dim x itemsize."""
        itemsize = KV_DTYPES[self.kv_dtype]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        """Fixed size in bytes of one block of this namespace."""
        return self.bytes_per_token * self.tokens_per_block

    @cached_property
    def digest(self) -> bytes:
        """32-byte namespace digest (``namespace_digest``), computed once."""
        return namespace_digest(self)

    @property
    def namespace_id(self) -> int:
        """First 8 digest bytes as unsigned little-endian, masked to 63 bits (fits int64)."""
        return int.from_bytes(self.digest[:8], "little") & (2**63 - 1)

    def to_dict(self) -> dict[str, str | int | None]:
        """The 17 hashed fields by name, in declaration order (JSON-ready), and ``group`` only
        when set (so a reader that predates groups reads every namespace without one)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in d.items() if k != "group" or v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Namespace:
        """Build from a mapping; an unknown key or a missing no-default key is ``InvalidArgument``.

        Keys with a default (tp_*, pp_*, adapter_*, cache_salt, tenant) may be omitted, exactly as
        in the constructor.
        """
        if not isinstance(d, Mapping):
            raise InvalidArgument("must be a mapping", field="namespace")
        known = {f.name: f for f in fields(cls)}
        for key in d:
            if key not in known:
                _fail(str(key), "unknown field")
        for name in _NO_DEFAULT:
            if name not in d:
                _fail(name, "required")
        return cls(**dict(d))

    def block_keys(
        self,
        token_ids: Sequence[int],
        *,
        parent: bytes | None = None,
        extras: Sequence[bytes] | None = None,
        tenant_key: bytes | None = None,
    ) -> list[bytes]:
        """``block_keys`` with this namespace's digest and tokens_per_block."""
        return block_keys(
            self.digest, token_ids, self.tokens_per_block, parent=parent, extras=extras, tenant_key=tenant_key
        )


_NO_DEFAULT = (*_REQUIRED_STR, "tokens_per_block", "num_layers", "num_kv_heads", "head_dim")


def _fail(name: str, message: str) -> NoReturn:
    raise InvalidArgument(message, field=f"namespace.{name}")


def _check_str(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        _fail(name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        _fail(name, "must be None or non-empty" if optional else "required (empty)")
    if len(value) > MAX_STR_CHARS:
        _fail(name, f"longer than {MAX_STR_CHARS} characters")
    if "\x00" in value:
        _fail(name, "contains NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _fail(name, "not encodable as UTF-8")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_INT_FIELD:
        _fail(name, f"must be in [{minimum}, {MAX_INT_FIELD}], got {value}")


def _encode_field(tag: int, value: str | int | None) -> bytes:
    if value is None:
        return _FIELD_HEADER.pack(tag, _TYPE_ABSENT, 0)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _FIELD_HEADER.pack(tag, _TYPE_STR, len(raw)) + raw
    return _FIELD_HEADER.pack(tag, _TYPE_INT, _I64.size) + _I64.pack(value)


def namespace_digest(ns: Namespace) -> bytes:
    """SHA-256 of ``b"kvtier/ns/v1"`` then every field as (tag, type, u32le length, value).

    Tags are 1..17 in declaration order; a ``group`` is record 17 (``tenant``'s tag) of type 3.
    See ``docs/hashing.md``. Returns 32 bytes.
    """
    h = hashlib.sha256(_NS_DOMAIN)
    for tag, f in enumerate(fields(ns)[: _HASHED_FIELDS - 1], start=1):
        h.update(_encode_field(tag, getattr(ns, f.name)))
    record = _encode_field(_HASHED_FIELDS, ns.tenant if ns.group is None else ns.group)
    if ns.group is not None:  # the same record, typed a group's
        record = record[:1] + bytes([_TYPE_GROUP]) + record[2:]
    h.update(record)
    return h.digest()


def block_keys(
    namespace_digest: bytes,
    token_ids: Sequence[int],
    tokens_per_block: int,
    *,
    parent: bytes | None = None,
    extras: Sequence[bytes] | None = None,
    tenant_key: bytes | None = None,
) -> list[bytes]:
    """Chained 32-byte keys, one per FULL block of ``token_ids`` (a partial tail gets none).

    ``key_i = H(b"kvtier/block/v1" ‖ namespace_digest ‖ key_{i-1} ‖ u32le(tokens of block i)
    ‖ u32le(len(extra_i)) ‖ extra_i)``, with ``key_{-1} = parent`` (default 32 zero bytes).
    H is SHA-256, or HMAC-SHA-256 keyed with ``tenant_key``. ``extras`` has one entry per full
    block (``b""`` allowed). ``token_ids`` may be a list, a numpy array or a torch tensor (anything
    with ``.tolist()``); every id must be an int in [0, 2**32). Keys of a prefix are a prefix of
    the keys. Raises ``InvalidArgument`` naming the bad argument.
    """
    _check_bytes32("namespace_digest", namespace_digest)
    if parent is not None:
        _check_bytes32("parent", parent)
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
        raise InvalidArgument("must be an int", field="tokens_per_block")
    if tokens_per_block < 1:
        raise InvalidArgument("must be >= 1", field="tokens_per_block")
    ids = _as_int_list(token_ids)
    n_full = len(ids) // tokens_per_block
    blocks = _pack_blocks(ids, tokens_per_block, n_full)
    suffixes = _extra_suffixes(extras, n_full)
    prefix = _BLOCK_DOMAIN + namespace_digest
    digest = _hash_fn(tenant_key)
    keys: list[bytes] = []
    prev = _ZERO_PARENT if parent is None else bytes(parent)
    for packed, suffix in zip(blocks, suffixes, strict=True):
        prev = digest(b"".join((prefix, prev, packed, suffix)))
        keys.append(prev)
    return keys


def block_key(
    namespace_digest: bytes,
    parent: bytes | None,
    block_tokens: Sequence[int],
    *,
    extra: bytes = b"",
    record: bytes = b"",
    tenant_key: bytes | None = None,
) -> bytes:
    """The key of one full block (its tokens given), as :func:`block_keys` computes it, with
    ``record`` hashed after ``u32le(len(extra)) ‖ extra`` (the boundary record of a salt region
    inside the block, docs/hashing.md §7; empty: exactly ``block_keys``' key)."""
    _check_bytes32("namespace_digest", namespace_digest)
    (packed,) = _pack_blocks(_as_int_list(block_tokens), len(block_tokens), 1)
    (suffix,) = _extra_suffixes([extra], 1)
    prev = _ZERO_PARENT if parent is None else bytes(parent)
    return _hash_fn(tenant_key)(b"".join((_BLOCK_DOMAIN, namespace_digest, prev, packed, suffix, record)))


def _check_bytes32(name: str, value: object) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != DIGEST_BYTES:
        raise InvalidArgument(f"must be exactly {DIGEST_BYTES} bytes", field=name)


def _as_int_list(token_ids: Sequence[int]) -> list[int]:
    """Token ids as a flat list (calls ``.tolist()`` on arrays and tensors)."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise InvalidArgument("must be a sequence of ints", field="token_ids")
    tolist = getattr(token_ids, "tolist", None)
    ids = tolist() if callable(tolist) else token_ids
    if isinstance(ids, list):
        return ids
    try:
        return list(ids)
    except TypeError:
        raise InvalidArgument("must be a sequence of ints", field="token_ids") from None


def _pack_blocks(ids: list[int], tokens_per_block: int, n_full: int) -> list[bytes]:
    """u32le bytes of each full block; the partial tail is validated but not returned."""
    fmt = struct.Struct(f"<{tokens_per_block}I")
    end = n_full * tokens_per_block
    try:
        packed = [fmt.pack(*ids[i : i + tokens_per_block]) for i in range(0, end, tokens_per_block)]
        struct.pack(f"<{len(ids) - end}I", *ids[end:])
    except struct.error:
        raise InvalidArgument(
            f"every token id must be an int in [0, {MAX_TOKEN_ID}]", field="token_ids"
        ) from None
    return packed


def _extra_suffixes(extras: Sequence[bytes] | None, n_full: int) -> list[bytes]:
    """``u32le(len(extra_i)) ‖ extra_i`` for each full block."""
    if extras is None:
        return [_U32.pack(0)] * n_full
    if isinstance(extras, (bytes, bytearray)) or len(extras) != n_full:
        raise InvalidArgument(f"must have one entry per full block ({n_full})", field="extras")
    out: list[bytes] = []
    for extra in extras:
        if not isinstance(extra, (bytes, bytearray)) or len(extra) > MAX_TOKEN_ID:
            raise InvalidArgument("every entry must be bytes", field="extras")
        out.append(_U32.pack(len(extra)) + bytes(extra))
    return out


def _hash_fn(tenant_key: bytes | None) -> _Digest:
    """SHA-256, or HMAC-SHA-256 keyed with a non-empty ``tenant_key``."""
    if tenant_key is None:
        return lambda data: hashlib.sha256(data).digest()
    if not isinstance(tenant_key, (bytes, bytearray)) or not tenant_key:
        raise InvalidArgument("must be non-empty bytes", field="tenant_key")
    key = bytes(tenant_key)
    return lambda data: hmac.digest(key, data, "sha256")

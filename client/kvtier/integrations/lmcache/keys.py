"""LMCache object keys -> kvtier namespaces and 32-byte block keys (no LMCache import).

An LMCache ``ObjectKey`` is ``(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``:

* ``chunk_hash``: LMCache's chained hash of the prompt's tokens up to the end of this chunk
  (``--hash-algorithm``: blake3 or sha256_cbor, 32 bytes), so it covers the whole prefix;
* ``model_name``: the name the engine registered; its identity comes from ``adapter_params``;
* ``kv_rank``: ``world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank``,
  the slice of the KV this object holds; ``0`` (no world size packed: what LMCache's own tests
  and its conformance tool build) is the one slice of an unsharded model, world size 1, rank 0;
  any other value that packs no world size (``lmcache bench l2`` numbers its keys' ranks
  0, 1, 2, ...) names no parallel slice: it is an opaque rank (below);
* ``object_group_id``: the object group (a hybrid model's KV groups), 0 otherwise;
* ``cache_salt``: LMCache's per-user isolation salt ("" for none).

Each (model, world size, rank, group, salt) is one kvtier namespace (``ModelIdentity.namespace``:
world size and global rank go to ``tp_size``/``tp_rank``, the group to the layout name, the
salt to ``cache_salt``). The block key is

    SHA-256(b"kvtier/lmcache/v1" ‖ namespace_digest ‖ u8 len(hash_algorithm) ‖ hash_algorithm
            ‖ u32le len(chunk_hash) ‖ chunk_hash [‖ b"rank" ‖ u32le kv_rank])

An opaque rank is kept whole, never read as a slice nor defaulted to one: its objects go to one
namespace per (model, group, salt) whose layout says ``opaque-rank`` (world size 1, rank 0:
never the namespace of a packed rank), and the raw ``kv_rank`` is bound into the block key (the
bracketed part, only there), so objects of two ranks never share a block, as in LMCache's own
adapters, whose keys carry ``kv_rank`` whole; and the daemon's namespaces do not grow with the
number of ranks.

(HMAC-SHA-256 with the tenant key when the client has one), so the same chunk hash under another
model, revision, rank, group, salt or hash algorithm never names the same block (nor the same
bytes under a hash of another length). A key that does not fit (unknown model, malformed rank, a
chunk hash shorter than ``min_chunk_hash_bytes``) is refused: ``refusal`` says why, ``resolve``
answers None and the adapter logs the reason once and reports a miss or a dropped store.

Thread-safety: ``KeyMapper.resolve`` may be called from any thread; its cache is a dict
filled under a lock.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.lmcache.config import AdapterConfig
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace

KEY_DOMAIN = b"kvtier/lmcache/v1"
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class Slice:
    """Where one LMCache object belongs in kvtier: the fields that select its namespace."""

    model: str
    world_size: int
    rank: int
    group: int
    cache_salt: str
    opaque_rank: bool = False
    """``kv_rank`` packs no world size (and is not 0): it names no parallel slice."""


def is_opaque_rank(kv_rank: int) -> bool:
    """A 32-bit ``kv_rank`` other than 0 that packs no world size (``lmcache bench l2``'s key
    index): it names no parallel slice (module docstring)."""
    return (
        isinstance(kv_rank, int)
        and not isinstance(kv_rank, bool)
        and 0 < kv_rank < 1 << 24  # the world size byte is 0
    )


def decode_kv_rank(kv_rank: int) -> tuple[int, int]:
    """``(world_size, global_rank)`` of LMCache's packed kv rank; ``0`` (the unsharded rank
    LMCache's tests and conformance tool use) is ``(1, 0)``; InvalidArgument when the rank is
    neither that nor one LMCache's ``ObjectKey.ComputeKVRank`` makes (an opaque rank,
    ``is_opaque_rank``, included: the caller keeps it whole)."""
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 0 <= kv_rank < 1 << 32:
        raise InvalidArgument(f"not a packed kv rank: {kv_rank!r}", field="kv_rank")
    if kv_rank == 0:
        return 1, 0
    world_size, rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    if world_size < 1 or rank >= world_size:
        raise InvalidArgument(f"rank {rank} of world size {world_size}", field="kv_rank")
    return world_size, rank


def block_key(
    namespace_digest: bytes,
    hash_algorithm: str,
    chunk_hash: bytes,
    tenant_key: bytes | None = None,
    opaque_rank: int | None = None,
) -> bytes:
    """The 32-byte kvtier key of one LMCache chunk (module docstring); ``opaque_rank``: the
    raw ``kv_rank`` of an object in an opaque-rank namespace."""
    algo = hash_algorithm.encode()
    rank = b"" if opaque_rank is None else b"rank" + _U32.pack(opaque_rank)
    data = b"".join(
        (
            KEY_DOMAIN,
            namespace_digest,
            bytes((len(algo),)),
            algo,
            _U32.pack(len(chunk_hash)),
            chunk_hash,
            rank,
        )
    )
    if tenant_key:
        return hmac.digest(tenant_key, data, "sha256")
    return hashlib.sha256(data).digest()


class KeyMapper:
    """Maps LMCache object keys to (namespace, kvtier key); owns the namespace cache."""

    def __init__(self, cfg: AdapterConfig, tenant_key: bytes | None = None) -> None:
        self._cfg = cfg
        self._tenant_key = tenant_key
        self._namespaces: dict[Slice, Namespace] = {}
        self._lock = threading.Lock()

    def slice_of(self, key: Any) -> Slice | str:
        """The slice of an ``ObjectKey`` (duck-typed), or why it fits no identity."""
        try:
            model = key.model_name
            chunk_hash = key.chunk_hash
            group = key.object_group_id
            salt = key.cache_salt
        except AttributeError as e:
            return f"not an LMCache ObjectKey ({e})"
        if model not in self._cfg.models:
            return (
                f"model_name {model!r} is not in adapter_params.models "
                f"({', '.join(sorted(self._cfg.models))})"
            )
        opaque = is_opaque_rank(key.kv_rank)
        try:
            world_size, rank = (1, 0) if opaque else decode_kv_rank(key.kv_rank)
        except InvalidArgument as e:
            return str(e)
        least = self._cfg.min_chunk_hash_bytes
        if not isinstance(chunk_hash, bytes) or len(chunk_hash) < least:
            got = f"{len(chunk_hash)} bytes" if isinstance(chunk_hash, bytes) else type(chunk_hash).__name__
            return (
                f"chunk_hash of {got}, shorter than adapter_params.min_chunk_hash_bytes "
                f"{least}: a short hash could name two prefixes alike"
            )
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            return f"object_group_id {group!r} is not a group index"
        if not isinstance(salt, str):
            return f"cache_salt {salt!r} is not a string"
        return Slice(model, world_size, rank, group, salt, opaque)

    def namespace(self, s: Slice) -> Namespace | str:
        """The namespace of a slice (built once), or why the Namespace refuses it."""
        ns = self._namespaces.get(s)
        if ns is not None:
            return ns
        try:
            ns = self._cfg.models[s.model].namespace(
                model_id=s.model,
                chunk_tokens=self._cfg.chunk_tokens,
                world_size=s.world_size,
                rank=s.rank,
                group=s.group,
                cache_salt=s.cache_salt or None,
                tenant=self._cfg.tenant,
                opaque_rank=s.opaque_rank,
            )
        except InvalidArgument as e:
            return str(e)
        with self._lock:
            return self._namespaces.setdefault(s, ns)

    def resolve_or_why(self, key: Any) -> tuple[Namespace, bytes] | str:
        """(namespace, kvtier key) of an ``ObjectKey``, or why it is refused."""
        s = self.slice_of(key)
        if isinstance(s, str):
            return s
        ns = self.namespace(s)
        if isinstance(ns, str):
            return ns
        rank = key.kv_rank if s.opaque_rank else None
        return ns, block_key(ns.digest, self._cfg.hash_algorithm, key.chunk_hash, self._tenant_key, rank)

    def resolve(self, key: Any) -> tuple[Namespace, bytes] | None:
        """(namespace, kvtier key) of an ``ObjectKey``, or None when it is refused."""
        got = self.resolve_or_why(key)
        return None if isinstance(got, str) else got

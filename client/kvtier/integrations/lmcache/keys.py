"""LMCache object keys -> kvtier namespaces and 32-byte block keys (no LMCache import).

An LMCache ``ObjectKey`` is ``(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)``:

* ``chunk_hash``: LMCache's chained hash of the prompt's tokens up to the end of this chunk
  (``--hash-algorithm``: blake3 or sha256_cbor, 32 bytes), so it covers the whole prefix;
* ``model_name``: the name the engine registered; its identity comes from ``adapter_params``;
* ``kv_rank``: ``world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank``,
  the slice of the KV this object holds;
* ``object_group_id``: the object group (a hybrid model's KV groups), 0 otherwise;
* ``cache_salt``: LMCache's per-user isolation salt ("" for none).

Each (model, world size, rank, group, salt) is one kvtier namespace (``ModelIdentity.namespace``:
world size and global rank go to ``tp_size``/``tp_rank``, the group to the layout name, the
salt to ``cache_salt``). The block key is

    SHA-256(b"kvtier/lmcache/v1" ‖ namespace_digest ‖ u8 len(hash_algorithm) ‖ hash_algorithm
            ‖ u32le len(chunk_hash) ‖ chunk_hash)

(HMAC-SHA-256 with the tenant key when the client has one), so the same chunk hash under another
model, revision, rank, group, salt or hash algorithm never names the same block. A key that does
not fit (unknown model, malformed rank, a chunk hash shorter than ``MIN_CHUNK_HASH_BYTES``) is
refused: ``resolve`` answers None and the adapter reports a miss or a dropped store.

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
MIN_CHUNK_HASH_BYTES = 16  # a shorter hash (a 64-bit builtin one) could name two prefixes alike
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class Slice:
    """Where one LMCache object belongs in kvtier: the fields that select its namespace."""

    model: str
    world_size: int
    rank: int
    group: int
    cache_salt: str


def decode_kv_rank(kv_rank: int) -> tuple[int, int]:
    """``(world_size, global_rank)`` of LMCache's packed kv rank; InvalidArgument when the
    rank is not one LMCache's ``ObjectKey.ComputeKVRank`` makes."""
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int) or not 0 <= kv_rank < 1 << 32:
        raise InvalidArgument(f"not a packed kv rank: {kv_rank!r}", field="kv_rank")
    world_size, rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    if world_size < 1 or rank >= world_size:
        raise InvalidArgument(f"rank {rank} of world size {world_size}", field="kv_rank")
    return world_size, rank


def block_key(namespace_digest: bytes, hash_algorithm: str, chunk_hash: bytes,
              tenant_key: bytes | None = None) -> bytes:
    """The 32-byte kvtier key of one LMCache chunk (module docstring)."""
    algo = hash_algorithm.encode()
    data = b"".join((KEY_DOMAIN, namespace_digest, bytes((len(algo),)), algo,
                     _U32.pack(len(chunk_hash)), chunk_hash))
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

    def slice_of(self, key: Any) -> Slice | None:
        """The slice of an ``ObjectKey`` (duck-typed), or None when it fits no identity."""
        try:
            model = key.model_name
            chunk_hash = key.chunk_hash
            group = key.object_group_id
            salt = key.cache_salt
            world_size, rank = decode_kv_rank(key.kv_rank)
        except (AttributeError, InvalidArgument):
            return None
        if model not in self._cfg.models or not isinstance(chunk_hash, bytes) or \
                len(chunk_hash) < MIN_CHUNK_HASH_BYTES or not isinstance(group, int) or \
                group < 0 or not isinstance(salt, str):
            return None
        return Slice(model, world_size, rank, group, salt)

    def namespace(self, s: Slice) -> Namespace | None:
        """The namespace of a slice (built once), or None when the Namespace refuses it."""
        ns = self._namespaces.get(s)
        if ns is not None:
            return ns
        try:
            ns = self._cfg.models[s.model].namespace(
                model_id=s.model, chunk_tokens=self._cfg.chunk_tokens, world_size=s.world_size,
                rank=s.rank, group=s.group, cache_salt=s.cache_salt or None,
                tenant=self._cfg.tenant)
        except InvalidArgument:
            return None
        with self._lock:
            return self._namespaces.setdefault(s, ns)

    def resolve(self, key: Any) -> tuple[Namespace, bytes] | None:
        """(namespace, kvtier key) of an ``ObjectKey``, or None when it is refused."""
        s = self.slice_of(key)
        ns = None if s is None else self.namespace(s)
        if ns is None:
            return None
        return ns, block_key(ns.digest, self._cfg.hash_algorithm, key.chunk_hash,
                             self._tenant_key)

"""What both halves read and write in the protobuf messages, stated once.

* :func:`to_dict`: a message as a plain dict, every field present and integers kept as ints;
* :func:`pack_keys` / :func:`split_keys`: the ``keys`` field of Lookup, PrepareStore, PrepareLoad
  and Prefetch, ``KEY_BYTES``-byte block keys back to back (the SDK packs, the daemon splits);
* :func:`namespace_spec` / :func:`namespace_from_spec`: a :class:`Namespace` as the
  ``NamespaceSpec`` of RegisterNamespace and back (same field names; a None field is unset);
* :data:`TRANSPORT_NAMES`: the name of each ``Transport`` value, as the SDK's ``transport=``
  argument and the daemon's per-transport counters spell it.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvtier_contract.errors import InvalidArgument, ResourceExhausted
from kvtier_contract.identity import DIGEST_BYTES, Namespace
from kvtier_contract.v1 import kvtier_pb2 as pb

KEY_BYTES = DIGEST_BYTES  # a block key is a SHA-256 digest (identity.block_keys)

TransportName = Literal["shm", "tcp", "cuda_ipc"]
TRANSPORT_NAMES: dict[int, TransportName] = {
    pb.TRANSPORT_SHM: "shm",
    pb.TRANSPORT_TCP: "tcp",
    pb.TRANSPORT_CUDA_IPC: "cuda_ipc",
}

_OPTIONAL_SPEC = ("adapter_id", "adapter_revision", "cache_salt", "tenant", "group")
_SPEC_FIELDS = tuple(f.name for f in pb.NamespaceSpec.DESCRIPTOR.fields)


def to_dict(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if f.is_repeated:
                out[f.name] = [to_dict(v) for v in value]
            else:
                out[f.name] = to_dict(value)
        elif f.is_repeated:
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Block keys -> the packed ``keys`` field; InvalidArgument unless each is KEY_BYTES bytes."""
    try:
        packed = b"".join(keys)
    except TypeError:
        raise InvalidArgument(f"every block key must be {KEY_BYTES} bytes", field="keys") from None
    # n keys of KEY_BYTES bytes in all, none longer: then each is exactly KEY_BYTES (C speed,
    # ~3x cheaper than checking every key's type and length; it is on every lookup's path)
    if len(packed) != KEY_BYTES * len(keys) or (keys and max(map(len, keys)) != KEY_BYTES):
        raise InvalidArgument(f"every block key must be {KEY_BYTES} bytes", field="keys")
    return packed


@functools.lru_cache(maxsize=256)
def _key_splitter(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * n)


def split_keys(data: bytes, max_keys: int) -> Sequence[bytes]:
    """Packed keys -> sequence; checks length and count before slicing anything.

    One struct unpack (~20 µs for 1,000 keys) instead of 1,000 slices (~180 µs).
    """
    if len(data) % KEY_BYTES:
        raise InvalidArgument(f"length {len(data)} is not a multiple of {KEY_BYTES}", field="keys")
    n = len(data) // KEY_BYTES
    if n > max_keys:
        raise ResourceExhausted(f"{n} keys exceed the batch limit of {max_keys}", field="keys")
    return _key_splitter(n).unpack(data) if n else ()


def namespace_spec(ns: Namespace) -> pb.NamespaceSpec:
    """``ns`` as a NamespaceSpec message (its None fields left unset)."""
    return pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})


def namespace_from_spec(spec: pb.NamespaceSpec) -> Namespace:
    """The Namespace a NamespaceSpec names (validated: InvalidArgument for a malformed field)."""
    values: dict[str, Any] = {}
    for name in _SPEC_FIELDS:
        if name in _OPTIONAL_SPEC:
            values[name] = getattr(spec, name) if spec.HasField(name) else None
        else:
            values[name] = getattr(spec, name)
    return Namespace(**values)

"""What the cluster tier stores, stated once: key names and the value format (docs/cluster.md).

One Redis key per block, no hash tag (a model's blocks spread over every shard)::

    kvt1:<namespace digest, 64 hex>:<block key, 64 hex>

The value is a 96-byte header, then the raw block::

    magic "KVC1" | version u16 | flags u16 (0) | payload_len u64 |
    namespace_digest 32s | key 32s | payload_digest 16s (xxh3_128 of the payload, big-endian)

The key and namespace digest are echoed so that a value copied under another key (another
namespace's, another block's) is refused, not served; the length and digest refuse a truncated,
torn or altered payload. Values are written with ``SET … NX PX ttl``: blocks are immutable, and
the first writer wins.

Primitives: ``redis_key(digest, key)``; ``encode_header(digest, key, payload)``;
``verify(value, digest, key, payload_len)`` -> the payload view, or raises :class:`CorruptValue`
naming the reason; ``verify_parts(header, payload, digest, key)`` checks a value received in two
parts (the payload straight into a host slot: kvtierd.tiers.cluster.bulk). Pure functions,
thread-safe; xxh3 releases the GIL on large inputs.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier_contract.errors import KvtierError

MAGIC = b"KVC1"
VERSION = 1
HEADER = struct.Struct("<4sHHQ32s32s16s")
HEADER_BYTES = HEADER.size  # 96
KEY_PREFIX = b"kvt1:"
KEY_BYTES = len(KEY_PREFIX) + 64 + 1 + 64


class CorruptValue(KvtierError):
    """A cluster value that must not be served (``reason``: which check failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cluster value refused: {reason}")
        self.reason = reason


def redis_key(namespace_digest: bytes, key: bytes) -> bytes:
    """The Redis key of one block (ASCII, 134 bytes)."""
    return b"%s%s:%s" % (KEY_PREFIX, namespace_digest.hex().encode(), key.hex().encode())


def payload_digest(payload: bytes | memoryview) -> bytes:
    """xxh3_128 of the payload, 16 bytes big-endian."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace_digest: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The 96-byte header that precedes ``payload`` in its value."""
    n = memoryview(payload).nbytes
    return HEADER.pack(MAGIC, VERSION, 0, n, namespace_digest, key, payload_digest(payload))


def verify(value: bytes | memoryview, namespace_digest: bytes, key: bytes,
           payload_len: int) -> memoryview:
    """The payload of ``value`` if it is exactly the block ``key`` of ``namespace_digest`` with
    ``payload_len`` bytes; otherwise :class:`CorruptValue`."""
    v = memoryview(value)
    if v.nbytes < HEADER_BYTES:
        raise CorruptValue(f"short value ({v.nbytes} bytes)")
    if v.nbytes != HEADER_BYTES + payload_len:
        n = HEADER.unpack_from(v)[3]
        raise CorruptValue(f"length {v.nbytes - HEADER_BYTES} (header {n}), "
                           f"expected {payload_len}")
    payload = v[HEADER_BYTES:]
    verify_parts(v[:HEADER_BYTES], payload, namespace_digest, key)
    return payload


def verify_parts(header: bytes | memoryview, payload: bytes | memoryview,
                 namespace_digest: bytes, key: bytes) -> None:
    """Check a value read as its 96-byte header and its payload (already the expected length,
    e.g. received straight into a host slot); :class:`CorruptValue` if it is not exactly the
    block ``key`` of ``namespace_digest``."""
    magic, version, _flags, n, digest, echoed, pdigest = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptValue("bad magic")
    if version != VERSION:
        raise CorruptValue(f"unknown version {version}")
    if digest != namespace_digest or echoed != key:
        raise CorruptValue("stored under another block's key")
    if n != memoryview(payload).nbytes:
        raise CorruptValue(f"length {memoryview(payload).nbytes} (header {n})")
    if payload_digest(payload) != pdigest:
        raise CorruptValue("payload digest mismatch")

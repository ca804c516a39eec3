"""What the cluster tier stores, stated once: key names and the value format (docs/cluster.md).

One Redis key per block, no hash tag (a model's blocks spread over every shard), under the
prefix of its realm (a tenant, or untenanted daemons: kvtierd.tiers.cluster.keys)::

    kvt2:<realm tag, 16 hex>:<namespace digest, 64 hex>:<block key, 64 hex>

The value is a 128-byte header, then the raw block::

    magic "KVC1" | version u16 (2) | flags u16 (0) | payload_len u64 |
    namespace_digest 32s | key 32s | payload_digest 16s (BLAKE3 of the payload, 128 bits) |
    mac 32s (BLAKE2b-256 under the realm's key of the 96 bytes before it)

The key and namespace digest are echoed so that a value copied under another key (another
namespace's, another block's) is refused, not served; the length and digest refuse a truncated,
torn or altered payload. The MAC covers the payload through that digest, which is why the
digest is a cryptographic one (BLAKE3): with a fast non-cryptographic hash (xxh3, whose secret is
public) someone with write access could pair an authentic header with another payload of the
same digest. The MAC says who wrote it: anyone who can write to the cluster can
compute a digest, but only a daemon holding the fleet key can compute the MAC of a realm, and a
realm's MAC does not verify in another's. A value of version 1 (no MAC) is refused. Values are
written with a plain ``SET … PX ttl``: a value planted before the real store is overwritten by
it (blocks are content-addressed: an authentic value of a key is an equivalent block).

Primitives: ``redis_key(realm, digest, key)``; ``encode_header(realm, digest, key, payload)``;
``verify(value, realm, digest, key, payload_len)`` -> the payload view, or raises
:class:`CorruptValue` naming the reason (``forged`` when the MAC failed);
``verify_parts(header, payload, realm, digest, key)`` checks a value received in two parts (the
payload straight into a host slot: kvtierd.tiers.cluster.bulk). Pure functions, thread-safe;
BLAKE3 releases the GIL on large inputs.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import blake3

from kvtier_contract.errors import KvtierError
from kvtierd.tiers.cluster.keys import MAC_BYTES, Realm

MAGIC = b"KVC1"
VERSION = 2
SIGNED = struct.Struct("<4sHHQ32s32s16s")  # what the MAC covers
HEADER = struct.Struct(f"<4sHHQ32s32s16s{MAC_BYTES}s")
HEADER_BYTES = HEADER.size  # 128
KEY_BYTES = len(b"kvt2:") + 16 + 1 + 64 + 1 + 64
_MAC_PERSON = b"kvtier/cluster/2"  # BLAKE2b personalisation (16 bytes): this use of the key


class CorruptValue(KvtierError):
    """A cluster value that must not be served (``reason``: which check failed; ``forged``:
    its MAC did not verify, so no daemon of this realm wrote it)."""

    def __init__(self, reason: str, *, forged: bool = False) -> None:
        super().__init__(f"cluster value refused: {reason}")
        self.reason = reason
        self.forged = forged


def redis_key(realm: Realm, namespace_digest: bytes, key: bytes) -> bytes:
    """The Redis key of one block of ``realm`` (ASCII, 151 bytes)."""
    return b"%s%s:%s" % (realm.prefix, namespace_digest.hex().encode(), key.hex().encode())


def payload_digest(payload: bytes | memoryview) -> bytes:
    """BLAKE3 of the payload, 16 bytes (second preimages cost 2**128: only a MAC's holder can
    make a header, and no one can find another payload for it)."""
    return blake3.blake3(payload).digest(16)


def mac(realm: Realm, signed: bytes | memoryview) -> bytes:
    """The MAC of a header's first 96 bytes under ``realm``'s key."""
    return hashlib.blake2b(signed, key=realm.mac_key, digest_size=MAC_BYTES, person=_MAC_PERSON).digest()


def encode_header(realm: Realm, namespace_digest: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The 128-byte header that precedes ``payload`` in its value."""
    n = memoryview(payload).nbytes
    signed = SIGNED.pack(MAGIC, VERSION, 0, n, namespace_digest, key, payload_digest(payload))
    return signed + mac(realm, signed)


def verify(
    value: bytes | memoryview, realm: Realm, namespace_digest: bytes, key: bytes, payload_len: int
) -> memoryview:
    """The payload of ``value`` if it is exactly the block ``key`` of ``namespace_digest`` with
    ``payload_len`` bytes, written by a daemon of ``realm``; otherwise :class:`CorruptValue`."""
    v = memoryview(value)
    if v.nbytes < HEADER_BYTES:
        raise CorruptValue(f"short value ({v.nbytes} bytes)")
    if v.nbytes != HEADER_BYTES + payload_len:
        n = HEADER.unpack_from(v)[3]
        raise CorruptValue(f"length {v.nbytes - HEADER_BYTES} (header {n}), expected {payload_len}")
    payload = v[HEADER_BYTES:]
    verify_parts(v[:HEADER_BYTES], payload, realm, namespace_digest, key)
    return payload


def verify_parts(
    header: bytes | memoryview, payload: bytes | memoryview, realm: Realm, namespace_digest: bytes, key: bytes
) -> None:
    """Check a value read as its 128-byte header and its payload (already the expected length,
    e.g. received straight into a host slot); :class:`CorruptValue` if it is not exactly the
    block ``key`` of ``namespace_digest`` as a daemon of ``realm`` wrote it. The MAC is checked
    (in constant time) before the payload is hashed: a forged value costs no pass over it."""
    magic, version, _flags, n, digest, echoed, pdigest, tag = HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptValue("bad magic")
    if version != VERSION:
        raise CorruptValue(f"unknown version {version}")
    if digest != namespace_digest or echoed != key:
        raise CorruptValue("stored under another block's key")
    if n != memoryview(payload).nbytes:
        raise CorruptValue(f"length {memoryview(payload).nbytes} (header {n})")
    if not hmac.compare_digest(mac(realm, memoryview(header)[: SIGNED.size]), tag):
        raise CorruptValue("bad MAC (not written by a daemon of this fleet and realm)", forged=True)
    if payload_digest(payload) != pdigest:
        raise CorruptValue("payload digest mismatch")

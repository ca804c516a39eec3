"""The published index: one namespace's READY keys in shared memory, stated once (both sides).

The daemon (sole writer) keeps, per namespace that a same-host client asked for, a read-only
copy of the set of keys a lookup would find, in a sealed memfd; the client maps it read-only and
answers ``lookup`` without a round trip (docs/published_index.md). A lookup stays advisory: a
load still pins, and a block gone since is a miss.

Segment layout (little endian)::

    header  (64 bytes) = magic:4s ("KVX1") version:u32 boot_epoch:u64 namespace_id:u64
                         generation:u64 capacity:u64 max_probe:u32 flags:u32 stamp:u64 retired:u64
    slots   (capacity x u64)  fingerprints, in capacity / BUCKET buckets

Slots are grouped in buckets of ``BUCKET`` (4 slots, 32 bytes). A key (32 bytes, a SHA-256
digest) is its fingerprint ``fp`` = bytes 0..8 as u64 with bit 1 set (so never 0 or 1, which
mean EMPTY and TOMBSTONE), stored in the first EMPTY or TOMBSTONE slot of the buckets from
``home`` = bytes 8..16 as u64 masked by ``buckets - 1`` on (linear probing over buckets, at
most ``max_probe`` buckets). A reader checks a whole bucket at once: the key is there if a slot
holds ``fp``, absent if the bucket still has an EMPTY slot (a key goes to the next bucket only
when this one was full, and slots become EMPTY again only in a new segment), else it reads the
next bucket. A key that finds no slot within ``max_probe`` buckets is not published (a lookup
misses it). Removal writes TOMBSTONE over the slot. Two keys of one namespace share a
fingerprint with odds of about 2^-63 per pair (an advisory false hit: the load finds nothing
and the engine recomputes). Slots are written with aligned 8-byte stores, one at a time, so a
reader never sees a torn slot and needs no lock: it may see a key a moment early (committed,
not yet answered) or late (gone a moment ago), which an advisory lookup allows.

``stamp`` is the daemon's CLOCK_MONOTONIC in ns, rewritten every ``STAMP_INTERVAL_S`` while
the daemon runs (a reader that finds it more than ``STALE_AFTER_S`` old stops trusting the
segment: the daemon froze or died); ``retired`` = 1 once the daemon replaced the segment
(grown or compacted: ask for the new one) or shut down. Each is one aligned u64 word
(``STAMP_WORD``, ``RETIRED_WORD`` of the header), written with one aligned 8-byte store and read
with one aligned 8-byte load, never byte by byte (``struct`` on the mapping: a reader then sees
a stamp half-written, or 0, as ``struct.pack_into`` zero-fills before it writes).
``generation`` counts a namespace's segments within one boot. ``flags``: ``FLAG_SHARED_TIER`` =
the daemon has a cluster tier that may hold blocks this table does not list, so a lookup that
is not a full hit must ask the daemon (over gRPC); a full hit is still answered here.
"""

from __future__ import annotations

import struct

MAGIC = b"KVX1"
VERSION = 1
HEADER = struct.Struct("<4sIQQQQIIQQ")
assert HEADER.size == 64
HEADER_BYTES = 64
STAMP_OFFSET = 48  # u64 stamp, then u64 retired
STAMP_RETIRED = struct.Struct("<QQ")  # their layout; read and written as words, never with it
STAMP_WORD = STAMP_OFFSET // 8  # the header as u64 words (memoryview.cast("Q")): the stamp's
RETIRED_WORD = STAMP_WORD + 1
SLOT_BYTES = 8
EMPTY = 0
TOMBSTONE = 1
FP_BIT = 2
BUCKET = 4
MAX_PROBE = 8  # buckets
MIN_CAPACITY = 4096
LOAD_DIVISOR = 2
"""The table is grown (or compacted) once used slots (keys + tombstones) pass capacity / 2;
a new one is built at most a quarter full. Then nearly every key sits in its home bucket and a
reader's lookup is one vectorized gather."""
FLAG_SHARED_TIER = 1
STAMP_INTERVAL_S = 0.1
STALE_AFTER_S = 1.0

# the index handshake on the shm Unix socket (docs/shm_transport.md); the connection then stays
# open as the session's index channel, each further request in the same form. The session's data
# secret (OpenSessionReply.data_secret, 32 bytes) is in every request; ``KVI1`` (without it) is
# refused by name:
#   client -> daemon:  INDEX_MAGIC session_id:u64le namespace_id:u64le data_secret:32s
#   daemon -> client:  INDEX_MAGIC segment_bytes:u64le boot_epoch:u64le generation:u64le
#                      + a read-only fd of the segment (SCM_RIGHTS)
#                  or  SHM_REFUSED utf-8 message
INDEX_MAGIC = b"KVI2"
INDEX_MAGIC_V1 = b"KVI1"  # without the data secret: refused
INDEX_REQUEST = struct.Struct("<4sQQ32s")  # magic, session_id, namespace_id, data_secret
INDEX_REPLY = struct.Struct("<4sQQQ")


_KEY_HEAD = struct.Struct("<QQ")  # a key's bytes 0..8 and 8..16


def fingerprint(key: bytes) -> tuple[int, int]:
    """(fp, home) of one key; home is not yet masked by the bucket count."""
    fp, home = _KEY_HEAD.unpack_from(key)
    return fp | FP_BIT, home


def capacity_for(keys: int) -> int:
    """The table size (slots) for ``keys`` keys: a power of two with keys at most a quarter of
    it (room to grow to the half-full threshold before the next rebuild)."""
    cap = MIN_CAPACITY
    while cap < keys * 2 * LOAD_DIVISOR:
        cap <<= 1
    return cap


def segment_bytes(capacity: int) -> int:
    return HEADER_BYTES + capacity * SLOT_BYTES

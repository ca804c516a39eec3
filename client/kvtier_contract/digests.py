"""Block digests: what "bytes verified end to end" compares (docs/security.md).

Every block gets one digest when it is committed: xxh3_64 (seed 0) of its payload bytes, the
same function as the NVMe tier's payload checksum (kvtierd.tiers.nvme.format), so a block's
NVMe header carries its digest unchanged. Computed where the bytes are at the commit: by an shm
client from the bytes it copies into a slot (sent in ``CompleteStoreRequest.digests``),
by the daemon for what it received over tcp, or by the daemon from the slot at CompleteStore
(cuda_ipc, clients that send none, ``verify_store = "daemon"``). Checked by the client on every
``get_into`` (the digests come in ``PrepareLoadReply.digests``).

xxhash releases the GIL while it hashes, so a daemon thread or a client's RPC threads keep
running during a hash of a large block.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

Buffer = memoryview | bytes | bytearray


def block_digest(payload: Buffer) -> int:
    """xxh3_64 (seed 0) of ``payload``: a block's digest (an unsigned 64-bit integer)."""
    return xxhash.xxh3_64_intdigest(payload)


def block_digests(payloads: Sequence[Buffer]) -> list[int]:
    """The digest of each payload (one call: a thread's share of a transfer)."""
    h = xxhash.xxh3_64_intdigest
    return [h(p) for p in payloads]


def mismatches(views: Sequence[Buffer], digests: Sequence[int]) -> list[int]:
    """Positions of ``views`` whose digest differs from ``digests`` (same length)."""
    h = xxhash.xxh3_64_intdigest
    return [i for i, (v, d) in enumerate(zip(views, digests, strict=True)) if h(v) != d]

"""Where a data connection's payload bytes go: arena segments of a store job, and the scratch
buffer for bytes that are discarded.

Role: the destination half of :class:`kvtierd.transports.tcp_protocol.DataChannelProtocol`
(which parses frames and feeds bytes in): ``plan_segments`` asks the cache's job table once per
WRITE / WRITE_RUN frame where the run's blocks go and merges adjacent slots into one
:class:`PayloadSegment` each; a segment hashes its bytes piece by piece as they arrive. Ownership: a segment
is a view of arena bytes the job owns; the scratch buffer is module-wide. Concurrency:
event-loop thread only (the scratch buffer is written by any connection and never read, so
sharing it is harmless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier_contract.digests import block_digest
from kvtierd.cache import StoreJob, TieredCache

SCRATCH_BYTES = 1 << 20
_discard: memoryview | None = None


def scratch() -> memoryview:
    """Where discarded payload bytes go: one buffer for every connection, made on first use.
    Nothing ever reads it, so sharing it (even between threads) is harmless."""
    global _discard
    if _discard is None:
        _discard = memoryview(bytearray(SCRATCH_BYTES))
    return _discard


@dataclass(eq=False)
class PayloadSegment:
    """Arena bytes of one or more adjacent slots of one store job, filled in order; how far
    its bytes are hashed (``fed``) and the xxh3 state of a block that arrives in pieces."""

    view: memoryview
    job: StoreJob
    indexes: range  # key indexes whose blocks the segment holds
    fed: int = 0  # bytes of the segment hashed so far
    state: Any = None  # xxh3 state of the block in progress, when it came in more than one piece

    def hash_arrived(self, received: int) -> None:
        """Hash what arrived since the last call (the segment holds ``received`` bytes now)
        while it is still in the CPU's cache: a block that came whole in this piece at once,
        a block that spans pieces through xxh3's streaming state (the same digest). Each
        block's digest goes to the job once its last byte is in, fixed at the commit
        (docs/security.md "Bytes verified end to end")."""
        block = len(self.view) // len(self.indexes)
        pos = self.fed
        while pos < received:
            b, within = divmod(pos, block)
            end = min(received, (b + 1) * block)
            piece = self.view[pos:end]
            if within == 0 and end - pos == block:
                self.job.digests[self.indexes[b]] = block_digest(piece)
            else:
                if self.state is None:
                    self.state = xxhash.xxh3_64()
                self.state.update(piece)
                if end - b * block == block:
                    self.job.digests[self.indexes[b]] = self.state.intdigest()
                    self.state = None
            pos = end
        self.fed = received


def plan_segments(
    cache: TieredCache, session_id: int, job_id: int, first: int, count: int, length: int
) -> list[PayloadSegment]:
    """Where the run's bytes go: adjacent slots merged into one segment each (one call to
    the job table validates the whole run; KvtierError: refused)."""
    job, entries = cache.jobs.store_run(session_id, job_id, first, count, length)
    block = length // count
    host = cache.host
    segments: list[PayloadSegment] = []
    end = -1  # arena offset just past the last segment
    for index, e in enumerate(entries, first):
        if e.offset == end:  # adjacent to the previous slot: grow that segment
            last = segments[-1]
            start = e.offset - len(last.view)
            last.view = host.view(start, len(last.view) + block)
            last.indexes = range(last.indexes.start, index + 1)
        else:
            segments.append(PayloadSegment(host.view(e.offset, block), job, range(index, index + 1)))
        end = e.offset + block
    return segments

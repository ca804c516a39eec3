"""Where a data connection's payload bytes go: arena segments of a store job, and the scratch
buffer for bytes that are discarded.

Role: the destination half of :class:`kvtierd.transports.tcp_protocol.DataChannelProtocol`
(which parses frames and feeds bytes in): ``plan_segments`` asks the cache's job table once per
WRITE / WRITE_RUN frame where the run's blocks go and merges adjacent slots into one
:class:`PayloadSegment` each; a segment hashes its blocks as they arrive. Ownership: a segment
is a view of arena bytes the job owns; the scratch buffer is module-wide. Concurrency:
event-loop thread only (the scratch buffer is written by any connection and never read, so
sharing it is harmless).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Arena bytes of one or more adjacent slots of one store job, filled in order."""

    view: memoryview
    job: StoreJob
    indexes: range  # key indexes whose blocks the segment holds

    def hash_arrived(self, hashed: int, received: int) -> int:
        """Hash the blocks that arrived in full (``received`` bytes of the segment so far) after
        the first ``hashed``, while their bytes are still in the CPU's cache: their digests,
        fixed at the commit (docs/security.md "Bytes verified end to end"). Returns the blocks
        hashed now in all."""
        block = len(self.view) // len(self.indexes)
        done = received // block
        for b in range(hashed, done):
            self.job.digests[self.indexes[b]] = block_digest(self.view[b * block : (b + 1) * block])
        return done


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

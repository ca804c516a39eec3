"""Where a data connection's payload bytes go: arena segments of a store job, and the scratch
buffer for bytes that are discarded.

Role: the destination half of :class:`kvtierd.transports.tcp_protocol.DataChannelProtocol`
(which parses frames and feeds bytes in): ``plan_segments`` asks the cache's job table once per
WRITE / WRITE_RUN frame where the run's blocks go and merges adjacent slots into one
:class:`PayloadSegment` each; a segment hashes its bytes piece by piece as they arrive
(:class:`kvtier_contract.digests.StreamingDigests`). Ownership: a segment is a view of arena
bytes the job owns, and owns its digests' state; the scratch buffer is module-wide.
Concurrency: event-loop thread only (the scratch buffer is written by any connection and never read, so
sharing it is harmless).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_contract.digests import StreamingDigests
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
    """Arena bytes of one or more adjacent slots of one store job (``view``: exactly their
    blocks, back to back), filled in order; ``digests`` hashes them as they arrive. Made whole
    by ``plan_segments`` (never grown after: its digests are laid out for its blocks)."""

    view: memoryview
    job: StoreJob
    indexes: range  # key indexes whose blocks the segment holds
    digests: StreamingDigests = field(init=False)

    def __post_init__(self) -> None:
        self.digests = StreamingDigests.uniform(len(self.view) // len(self.indexes), len(self.indexes))

    def hash_arrived(self, received: int) -> None:
        """Hash what arrived since the last call (the segment holds ``received`` bytes now)
        while it is still in the CPU's cache (``StreamingDigests``: a block that came whole in
        one piece at once, one that spans pieces through xxh3's streaming state, the same
        digest). Each block's digest goes to the job once its last byte is in, fixed at the
        commit (docs/security.md "Bytes verified end to end")."""
        for b, digest in self.digests.arrived(self.view, received):
            self.job.digests[self.indexes[b]] = digest


def plan_segments(
    cache: TieredCache, session_id: int, job_id: int, first: int, count: int, length: int
) -> list[PayloadSegment]:
    """Where the run's bytes go: adjacent slots merged into one segment each (one call to
    the job table validates the whole run; KvtierError: refused)."""
    job, entries = cache.jobs.store_run(session_id, job_id, first, count, length)
    block = length // count
    runs: list[list[int]] = []  # [arena offset, first key index, blocks] of each segment
    for index, e in enumerate(entries, first):
        if runs and e.offset == runs[-1][0] + runs[-1][2] * block:  # adjacent: grow that run
            runs[-1][2] += 1
        else:
            runs.append([e.offset, index, 1])
    host = cache.host
    return [PayloadSegment(host.view(at, n * block), job, range(i, i + n)) for at, i, n in runs]

"""Counters kept by their owner (the TieredCache, per namespace) and visited by collectors.

Totals are the sum over namespaces, so nothing is counted twice. Field names match the
``Counters`` message in proto/kvtier/v1/kvtier.proto one for one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    """Monotonic counters plus two gauges (resident_*). Event-loop thread only."""

    lookups: int = 0
    blocks_requested: int = 0
    blocks_hit_host: int = 0
    blocks_hit_nvme: int = 0
    blocks_missed: int = 0
    tokens_requested: int = 0
    tokens_hit: int = 0
    tokens_missed: int = 0
    stores_accepted: int = 0
    stores_already_present: int = 0
    stores_rejected: int = 0
    stores_dropped: int = 0
    loads: int = 0
    evictions: int = 0
    bytes_in_shm: int = 0
    bytes_out_shm: int = 0
    bytes_in_tcp: int = 0
    bytes_out_tcp: int = 0
    resident_blocks: int = 0
    resident_bytes: int = 0
    promotions: int = 0
    demotions: int = 0
    nvme_evictions: int = 0
    checksum_failures: int = 0
    nvme_bytes_read: int = 0
    nvme_bytes_written: int = 0
    nvme_resident_blocks: int = 0
    nvme_resident_bytes: int = 0
    bytes_in_cuda_ipc: int = 0
    bytes_out_cuda_ipc: int = 0
    local_lookups: int = 0
    blocks_hit_local: int = 0
    blocks_hit_cluster: int = 0
    cluster_imports: int = 0
    cluster_corrupt: int = 0
    corrupt_blocks: int = 0

    def add(self, other: Counters) -> None:
        for f in COUNTER_FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in COUNTER_FIELDS}


COUNTER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Counters))
GAUGE_FIELDS = frozenset({"resident_blocks", "resident_bytes", "nvme_resident_blocks", "nvme_resident_bytes"})


# Latency bucket upper bounds in seconds (the Prometheus histogram's `le` labels).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)


class LatencyHistogram:
    """Cumulative-bucket histogram of one RPC's service time. Event-loop thread only."""

    __slots__ = ("counts", "count", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # last: +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        for i, bound in enumerate(LATENCY_BUCKETS_S):  # noqa: B007
            if seconds <= bound:
                break
        else:
            i = len(LATENCY_BUCKETS_S)
        self.counts[i] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), self.counts, strict=True):
            acc += n
            out.append((bound, acc))
        return out

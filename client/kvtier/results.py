"""What the client's operations answer, and the counters it keeps: plain data, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier_contract.v1 import kvtier_pb2 as pb

_TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme", pb.TIER_CLUSTER: "cluster"}


@dataclass
class PutResult:
    """What happened to each key of a put: stored, already there, refused for room, or dropped."""

    stored: int = 0
    already_present: int = 0
    rejected: int = 0
    dropped: int = 0

    def __iadd__(self, other: PutResult) -> PutResult:
        self.stored += other.stored
        self.already_present += other.already_present
        self.rejected += other.rejected
        self.dropped += other.dropped
        return self


@dataclass
class LookupResult:
    """A detailed lookup: the ready prefix, each hit's tier, and whether NVMe holds it durably."""

    hits: int
    tiers: list[str]  # "host", "nvme" or "cluster", one per hit
    durable: list[bool]  # one per hit


@dataclass
class PinnedLookup:
    """A lookup whose hits stay pinned (not evictable) until ``Client.release(pin)``.

    ``pin`` is 0 when nothing was pinned (no hit, or the daemon was away); ``epoch`` is the boot
    epoch the pin belongs to (a restarted daemon has forgotten it)."""

    hits: int
    tiers: list[str]
    pin: int
    epoch: int


@dataclass
class PinnedEach:
    """A per-key pinned lookup: ``found[i]`` says whether key ``i`` is ready and now pinned in
    the host tier, all under one pin released by ``Client.release(pin, epoch)`` (0: nothing
    pinned). A key held only below that did not fit in the host tier this round is not found."""

    found: list[bool]
    pin: int
    epoch: int


@dataclass
class SlicesLookup:
    """A pinned lookup in the namespaces of an engine's parallel slices (one per TP rank):
    ``hits`` is the prefix every slice holds; ``slices`` one PinnedLookup per slice looked up,
    in order (fewer than asked once a slice had no hit); release each one's pin."""

    hits: int
    slices: list[PinnedLookup]


@dataclass
class ClientCounters:
    """Owned by one Client; incremented, without a lock, by whichever thread runs the operation."""

    lookups: int = 0
    lookups_failed: int = 0  # answered as a miss because the daemon was away
    lookups_local: int = 0  # of `lookups`: answered from the published index, no round trip
    puts_dropped: int = 0  # blocks not stored because the daemon was away
    gets_failed: int = 0  # get/get_into calls answered as misses because the daemon was away
    out_of_time: int = 0  # RPCs not started because the caller's deadline (step budget) was spent
    overloaded: int = 0  # requests the daemon shed (RESOURCE_EXHAUSTED, errors.OVERLOADED)
    reconnects: int = 0
    epoch_changes: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    corrupt_blocks: int = 0  # loaded blocks whose bytes did not match their digest (misses)
    last_error: str = field(default="", repr=False)


@dataclass(frozen=True)
class TierFigure:
    """A tier's recent load figures as the daemon measured them (``Client.tier_figures``): a
    read of ``n`` bytes of that tier into the host tier (from the daemon's request for it to the
    bytes in place, queueing in the daemon included) costs about ``latency_s + n /
    bytes_per_s``; the latest read that fed them was ``age_s`` ago, ``reads`` the read batches
    measured since the daemon started (docs/metrics.md section 6)."""

    latency_s: float
    bytes_per_s: float
    age_s: float
    reads: int = 0


class TierFigures:
    """The daemon's latest per-tier load figures as a session received them (tier name ->
    ``TierFigure`` and our clock when it arrived). Owned by one session; ``take`` on the threads
    that get replies, ``now`` on any: one new dict swapped in whole, readers see old or new."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._got: dict[str, tuple[TierFigure, float]] = {}

    def take(self, reply: Any) -> None:
        """Keep the figures a reply carries (HeartbeatReply, OpenSessionReply), stamped with our
        clock; a tier the reply leaves out keeps its older figure."""
        now = self._clock()
        got = {
            _TIER_NAMES[f.tier]: (
                TierFigure(f.latency_us / 1e6, float(f.bytes_per_s), f.age_ms / 1e3, int(f.reads)),
                now,
            )
            for f in reply.tier_figures
            if f.tier in _TIER_NAMES
        }
        if got:
            self._got = {**self._got, **got}

    def now(self) -> dict[str, TierFigure]:
        """Each figure, its age grown by the time since it arrived."""
        now = self._clock()
        return {
            tier: replace(fig, age_s=fig.age_s + max(0.0, now - at))
            for tier, (fig, at) in dict(self._got).items()
        }

    def forget(self) -> None:
        """Drop every figure (a test waiting for fresh ones)."""
        self._got = {}

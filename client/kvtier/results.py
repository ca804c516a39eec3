"""What the client's operations answer, and the counters it keeps: plain data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field


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

"""The load-or-recompute decision for one request's hit prefix.

Lifecycle (one owning thread; the figures it holds are fed on the same thread)::

    decider = Decider("adaptive", figures=LoadFigures(), prefill=PrefillRate())
    decider.step(tokens, seconds)            # each engine step that computed tokens
    decider.report(tier, latency_s, bps, age_s=...)  # the daemon's per-tier figures, as they come
    d = decider.decide(tiers, block_tokens=16, block_bytes=...)   # per request, after the lookup
    ...load d.load_blocks blocks, recompute the rest...
    decider.loaded(bytes_by_tier, seconds, predicted_s=d.predicted_s)  # when the load is over

Policies (``LoadPolicy``): ``always`` loads every hit block (kvtier before issue 30), ``never``
loads none (the engine alone, with stores still running), ``adaptive`` (the default) loads the
prefix ``k`` that maximizes ``recompute(k blocks) - load(k blocks)``, never a prefix whose
predicted load takes longer than recomputing it. Ties go to the longer prefix. Costs:

* ``load(k)``: ``LoadFigures.predict`` of the first ``k`` blocks' bytes by tier (a fixed cost per
  tier plus bytes over bandwidth, measured end to end);
* ``recompute(k)``: ``PrefillRate.seconds_per_token × k × block_tokens``.

Without a prefill rate yet (no engine step measured) the decision loads the whole hit; a tier
never seen costs nothing in the sum (loading it is what measures it), so a prefix of unmeasured
host blocks is still loaded while a tier measured slow behind it is cut. A tier that was cut
back is probed: when nothing new about it arrived for ``probe_after_s`` (no own load, no fresh
daemon report), one decision loads up to and including its first block, so a tier that
recovered is seen within one probe interval and one load. A tier still slow costs one block
per probe, and each probe that finds it still slow doubles its interval (up to
``probe_max_s``), so a tier that stays slow costs ever less; the interval starts again from
``probe_after_s`` once the tier pays off again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.adaptive.figures import Clock, LoadFigures, PrefillRate

LoadPolicy = Literal["adaptive", "always", "never"]
# The least a decided load is waited for: twice kvtier.calls.MIN_RPC_S (20 ms: a client never
# starts an RPC with less of its deadline left), so the load's RPCs start and have time to run.
WORTH_FLOOR_S = 0.04
LOAD_POLICIES: tuple[LoadPolicy, ...] = ("adaptive", "always", "never")
Reason = Literal["miss", "always", "never", "faster", "slower", "budget", "no-figures", "probe"]


def worth_waiting_s(recompute_s: float | None) -> float | None:
    """How long a decided load is worth waiting for: as long as recomputing its tokens would
    take (``Decision.recompute_s``), never under ``WORTH_FLOOR_S``. A load still out by then has
    already cost what recomputing would have, and waiting on can only cost more: the owner gives
    up on what has not arrived (keeps the prefix that did) and recomputes the rest, so a load
    predicted wrong costs at most twice the recompute (or the floor and the recompute), never a
    whole step budget or timeout.
    None: unknown (no prefill rate yet, or a pinned policy): the owner's own limit applies."""
    if recompute_s is None:
        return None
    return max(WORTH_FLOOR_S, recompute_s)


def cut_load_s(spent_s: float, had_s: float) -> float:
    """The figure of a load given up on at its deadline with nothing arrived: its true time is
    only known to exceed ``had_s`` (the time it had), so it counts as twice that, or what was
    spent if more (a lower bound: the next decision of this size predicts it does not fit, and
    a real figure replaces it). Counting only the time spent would plan the same cut load again
    and again (a daemon answers a load ahead of its deadline, with its reads still going)."""
    return max(spent_s, 2 * had_s)


@dataclass(frozen=True)
class Decision:
    """How much of a hit prefix to load. ``reason``: ``faster`` (the whole hit pays off),
    ``slower`` (cut back: ``load_blocks < hit_blocks`` because loading the rest would take longer
    than recomputing it), ``probe`` (a cut tier's first block loaded to measure it), ``no-figures``
    (loaded whole: nothing measured yet), or the pinned policy / a ``miss``."""

    load_blocks: int
    hit_blocks: int
    reason: Reason
    predicted_s: float | None = None  # predicted load time of the chosen prefix
    recompute_s: float | None = None  # predicted recompute time of the same tokens

    @property
    def cut_blocks(self) -> int:
        return self.hit_blocks - self.load_blocks


@dataclass
class DecisionStats:
    """Counters of every decision (the integrations export them as metrics)."""

    decisions: int = 0
    tokens_loaded: int = 0
    tokens_recomputed_slower: int = 0  # hits recomputed because loading them was slower
    tokens_recomputed_policy: int = 0  # hits recomputed because the policy is ``never``
    tokens_recomputed_budget: int = 0  # hits recomputed to keep the interference budget
    probes: int = 0
    predicted_load_s: float = 0.0  # over loads with a prediction that reported back
    actual_load_s: float = 0.0  # the same loads, measured
    loads_timed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class Decider:
    """See the module docstring. One owning thread; ``stats`` read by the owner's exporter."""

    def __init__(
        self,
        policy: LoadPolicy = "adaptive",
        *,
        figures: LoadFigures | None = None,
        prefill: PrefillRate | None = None,
        probe_after_s: float = 5.0,
        probe_max_s: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy: {policy!r} is not one of {', '.join(LOAD_POLICIES)}")
        if probe_after_s <= 0:
            raise ValueError(f"probe_after_s: must be > 0, got {probe_after_s}")
        self.policy: LoadPolicy = policy
        self.figures = figures if figures is not None else LoadFigures(clock=clock)
        self.prefill = prefill if prefill is not None else PrefillRate(clock=clock)
        self.probe_after_s = probe_after_s
        self.probe_max_s = max(probe_max_s, probe_after_s)
        self.stats = DecisionStats()
        self._clock = clock
        self._probed: dict[str, float] = {}  # tier -> when it was last probed
        self.cut_tiers: set[str] = set()
        """Tiers the latest adaptive decision that met them cut back for cost (a later one that
        loads them whole clears them): a hint for work done ahead of a decision (the vLLM
        connector's pinned lookups start no promotions from a cut tier)."""
        self._probe_wait: dict[str, float] = {}  # tier -> its probe interval now
        self.probe_reads: set[str] = set()
        """Tiers due a probe by a read (``decide(read_probes=True)``): the owner has the daemon
        read that tier's hits (the vLLM connector lets its next pinned lookups promote), so the
        daemon's figure (``report``) shows whether it recovered; the owner clears it."""

    # -- figures in -----------------------------------------------------------------------------

    def step(self, tokens: int, seconds: float) -> None:
        """An engine step that computed ``tokens`` tokens in ``seconds``."""
        self.prefill.observe_step(tokens, seconds)

    def report(self, tier: str, latency_s: float, bytes_per_s: float, *, age_s: float = 0.0) -> None:
        """The daemon's figures for ``tier``, measured ``age_s`` ago (a figure the daemon has not
        refreshed is not news: it counts as arriving when it was measured)."""
        self.figures.report(tier, latency_s, bytes_per_s, age_s=age_s)

    def loaded(
        self, bytes_by_tier: Mapping[str, int], seconds: float, *, predicted_s: float | None = None
    ) -> None:
        """A load is over: ``seconds`` end to end for these bytes."""
        self.figures.observe(bytes_by_tier, seconds)
        if predicted_s is not None:
            self.stats.predicted_load_s += predicted_s
            self.stats.actual_load_s += seconds
            self.stats.loads_timed += 1

    # -- the decision ---------------------------------------------------------------------------

    def decide(
        self,
        tiers: Sequence[str],
        *,
        block_tokens: int,
        block_bytes: int,
        max_load_s: float | None = None,
        read_probes: bool = False,
    ) -> Decision:
        """How many of the hit blocks (``tiers``: where each is, in prefix order) to load.
        ``max_load_s``: the budget left for loads (adaptive only): a longer prefix is cut back
        to one predicted to fit (reason ``budget``), the rest recomputed. ``read_probes``: a
        probe due loads nothing; the tier is added to ``probe_reads`` instead, for the owner to
        have the daemon read it (where a load that fails costs more than the block: a vLLM sync
        load's whole step is recomputed)."""
        n = len(tiers)
        if n == 0:
            d = Decision(0, 0, "miss")
        elif self.policy == "never":
            d = Decision(0, n, "never")
        elif self.policy == "always":
            d = Decision(n, n, "always", self._load_cost(tiers, n, block_bytes))
        else:
            d = self._adaptive(tiers, block_tokens, block_bytes, read_probes)
            if (
                max_load_s is not None
                and d.load_blocks
                and d.predicted_s is not None
                and d.predicted_s > max_load_s
            ):
                d = self._fit_budget(d, tiers, block_tokens, block_bytes, max_load_s)
        self._count(d, block_tokens)
        return d

    def _fit_budget(
        self, d: Decision, tiers: Sequence[str], block_tokens: int, block_bytes: int, max_load_s: float
    ) -> Decision:
        lo, hi = 0, d.load_blocks  # the load's cost grows with k: the longest prefix that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            c = self._load_cost(tiers, mid, block_bytes)
            if c is not None and c <= max_load_s:
                lo = mid
            else:
                hi = mid - 1
        k = lo
        cost = self._load_cost(tiers, k, block_bytes) if k else None
        spt = self.prefill.seconds_per_token() or 0.0
        return Decision(k, d.hit_blocks, "budget", cost, spt * k * block_tokens if k else None)

    def _adaptive(
        self, tiers: Sequence[str], block_tokens: int, block_bytes: int, read_probes: bool = False
    ) -> Decision:
        n = len(tiers)
        spt = self.prefill.seconds_per_token()
        if spt is None:
            return Decision(n, n, "no-figures", self._load_cost(tiers, n, block_bytes))
        best_k, best_cost = self._best_prefix(tiers, spt, block_tokens, block_bytes)
        unknown = any(not self.figures.known(t) for t in set(tiers[:best_k]))
        if best_k == n and unknown:
            return Decision(n, n, "no-figures", None, spt * n * block_tokens)
        if best_k == n:
            for tier in set(tiers):  # every tier pays off: probe it soon again if it slows
                self._probe_wait.pop(tier, None)
                self.cut_tiers.discard(tier)
            return Decision(n, n, "faster", best_cost, spt * n * block_tokens)
        self.cut_tiers.update(tiers[best_k:])
        self.cut_tiers.difference_update(tiers[:best_k])
        probe = self._probe(tiers, best_k)
        if probe is not None and read_probes:
            self.probe_reads.add(tiers[probe - 1])
            self.stats.probes += 1
        elif probe is not None:
            return Decision(
                probe, n, "probe", self._load_cost(tiers, probe, block_bytes), spt * probe * block_tokens
            )
        return Decision(
            best_k,
            n,
            "slower",
            best_cost if best_k and not unknown else None,
            spt * best_k * block_tokens if best_k else None,
        )

    def _best_prefix(
        self, tiers: Sequence[str], spt: float, block_tokens: int, block_bytes: int
    ) -> tuple[int, float]:
        """(k, predicted load time) of the prefix of ``k`` blocks that maximizes
        ``recompute(k) - load(k)`` (``spt``: the recompute time of one token), the longest on a
        tie; (0, 0.0) when loading any prefix would take longer than recomputing it."""
        n = len(tiers)
        best_k, best_gain, best_cost = 0, 0.0, 0.0
        by_tier: dict[str, int] = {}
        for k in range(1, n + 1):  # one pass: the prefix's bytes by tier grow a block at a time
            by_tier[tiers[k - 1]] = by_tier.get(tiers[k - 1], 0) + block_bytes
            if k < n and tiers[k] == tiers[k - 1]:
                continue  # within a run of one tier cost and gain are linear: check its ends
            # a tier with no figure yet costs nothing here: loading it is what measures it
            cost = self.figures.predict(by_tier, unknown=0.0)
            assert cost is not None
            gain = spt * k * block_tokens - cost
            if gain >= best_gain:
                best_k, best_gain, best_cost = k, gain, cost
        return best_k, best_cost

    def _load_cost(self, tiers: Sequence[str], k: int, block_bytes: int) -> float | None:
        by_tier: dict[str, int] = {}
        for tier in tiers[:k]:
            by_tier[tier] = by_tier.get(tier, 0) + block_bytes
        return self.figures.predict(by_tier)

    def _probe(self, tiers: Sequence[str], k: int) -> int | None:
        """A prefix reaching one block into a cut tier that is due a probe, or None."""
        now = self._clock()
        seen: set[str] = set()
        for i in range(k, len(tiers)):
            tier = tiers[i]
            if tier in seen:
                continue
            seen.add(tier)
            last = max(self.figures.updated_at(tier) or float("-inf"), self._probed.get(tier, float("-inf")))
            wait = self._probe_wait.get(tier, self.probe_after_s)
            if now - last >= wait:
                self._probed[tier] = now
                self._probe_wait[tier] = min(2 * wait, self.probe_max_s)
                return i + 1
        return None

    def _count(self, d: Decision, block_tokens: int) -> None:
        s = self.stats
        s.decisions += 1
        s.by_reason[d.reason] = s.by_reason.get(d.reason, 0) + 1
        s.tokens_loaded += d.load_blocks * block_tokens
        if d.reason == "never":
            s.tokens_recomputed_policy += d.hit_blocks * block_tokens
        elif d.reason == "budget":
            s.tokens_recomputed_budget += d.cut_blocks * block_tokens
        elif d.cut_blocks:
            s.tokens_recomputed_slower += d.cut_blocks * block_tokens
        if d.reason == "probe":
            s.probes += 1

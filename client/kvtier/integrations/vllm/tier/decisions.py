"""The vLLM secondary tier's load-or-recompute decision and interference budget (no vLLM import).

``TierDecisions`` is shared by the tier's three kinds of thread, under its own lock:

* vLLM's lookup thread: ``decide(offload_keys, tiers)`` -> how many of a request's held chunks
  the tier answers HIT for (vLLM promotes those and recomputes from the first MISS on);
* the job threads: ``loaded(...)`` (a load's time with its bytes by tier: the load figures) and
  ``settle(...)`` (a transfer's real time against the budget);
* the scheduler thread: ``step_end()`` once per scheduler step (``on_schedule_end``), request
  arrivals and ends, ``stored_chunks(n)`` per store job vLLM cascades, ``admit_store`` /
  ``charge_load`` per job.

The engine's prefill rate. vLLM's tier API shows a secondary tier no step timing and no token
counts (``ScheduleEndContext`` holds request ids; ``ReqContext`` no lengths). What it does show:
``on_schedule_end`` once per scheduler step, so the time between two calls is one engine step
(the forward and the scheduling around it), and the chunks vLLM cascades to the tier, which are
the full chunks the engine computed (a chunk loaded or already held is not stored again; with
``store`` false vLLM still cascades them, the tier moves nothing). So the rate is measured as
busy step time over computed tokens, over windows of at least ``WINDOW_S`` of busy time that
saw at least one cascaded chunk: an average that counts decode steps too, so it is an upper
bound on the prefill cost per token (it errs toward loading). Time while no request is live
(the engine idle between requests) is not counted. ``prefill_seconds_per_token`` set: that
fixed figure, measured by the operator, instead.

The step time found this way also feeds the interference budget (``interference_budget``, a
fraction of each step): loads are charged and always run, a store job is refused (counted in
``store_budget_dropped_blocks``) when the budget is spent.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.adaptive import Decider, FixedPrefillRate, InterferenceBudget, LoadPolicy, PrefillRate

WINDOW_S = 0.2  # busy seconds per prefill-rate observation
MAX_STEP_S = 5.0  # a longer gap between scheduler steps is not one step
_REMEMBERED = 1 << 16  # chunks answered HIT whose load has not come yet


@dataclass
class DecisionCounts:
    """Counters since the last ``take`` (exported as ``vllm:kv_offload_kvtier_*``)."""

    loaded_tokens: int = 0  # held tokens answered HIT (vLLM loads them)
    recomputed_slower_tokens: int = 0  # held tokens answered MISS: loading them was slower
    recomputed_policy_tokens: int = 0  # held tokens answered MISS: ``load_policy="never"``
    predicted_load_seconds: float = 0.0  # loads with a prediction: predicted time
    actual_load_seconds: float = 0.0  # the same loads: measured time
    store_budget_dropped_blocks: int = 0  # stores refused: the interference budget was spent


class TierDecisions:
    """See the module docstring."""

    def __init__(
        self,
        *,
        policy: LoadPolicy,
        probe_after_s: float,
        budget: float | None,
        chunk_tokens: int,
        row_bytes: int,
        prefill_seconds_per_token: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        rate = (
            FixedPrefillRate(prefill_seconds_per_token)
            if prefill_seconds_per_token
            else PrefillRate(clock=clock)
        )
        self.measured_rate = prefill_seconds_per_token is None
        self.decider = Decider(policy, probe_after_s=probe_after_s, prefill=rate, clock=clock)
        self.budget = InterferenceBudget(budget)
        self.chunk_tokens = chunk_tokens
        self.row_bytes = row_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._tier_of: OrderedDict[bytes, str] = OrderedDict()
        self._predicted: OrderedDict[tuple[bytes, int], float] = OrderedDict()
        self.counts = DecisionCounts()
        # step clock (scheduler thread only)
        self._live: set[str] = set()
        self._last_end: float | None = None
        self._idle_since: float | None = None  # no request live since then
        self._idle_s = 0.0  # idle seconds since the last step end
        self._window_s = 0.0
        self._window_tokens = 0

    # -- lookup thread ----------------------------------------------------------------------

    def decide(
        self,
        offload_keys: Sequence[bytes],
        tiers: Sequence[str],
        figures: dict[str, tuple[float, float, float]],
    ) -> int:
        """How many of the held chunks (``tiers``: each one's tier, prefix order) to answer
        HIT for. ``figures``: the daemon's per-tier (latency_s, bytes_per_s, age_s)."""
        if not tiers:
            return 0
        with self._lock:
            for tier, (lat, bps, age) in figures.items():
                self.decider.report(tier, lat, bps, age_s=age)
            s = self.decider.stats
            slower, policy = s.tokens_recomputed_slower, s.tokens_recomputed_policy
            d = self.decider.decide(list(tiers), block_tokens=self.chunk_tokens, block_bytes=self.row_bytes)
            c = self.counts
            c.loaded_tokens += d.load_blocks * self.chunk_tokens
            c.recomputed_slower_tokens += s.tokens_recomputed_slower - slower
            c.recomputed_policy_tokens += s.tokens_recomputed_policy - policy
            for key, tier in zip(offload_keys[: d.load_blocks], tiers, strict=False):
                self._tier_of[bytes(key)] = tier
                self._tier_of.move_to_end(bytes(key))
            if d.load_blocks and d.predicted_s is not None:
                self._predicted[(bytes(offload_keys[0]), d.load_blocks)] = d.predicted_s
            while len(self._tier_of) > _REMEMBERED:
                self._tier_of.popitem(last=False)
            while len(self._predicted) > 1024:
                self._predicted.popitem(last=False)
            return d.load_blocks

    # -- job threads ------------------------------------------------------------------------

    def loaded(
        self, offload_keys: Sequence[bytes], found: Sequence[bool], seconds: float, charged_s: float
    ) -> None:
        """A load job is over: its figures (when every chunk's tier is known and all arrived)
        and the budget's correction."""
        with self._lock:
            self.budget.settle(charged_s, seconds)
            tiers = [self._tier_of.pop(bytes(k), None) for k in offload_keys]
            predicted = (
                self._predicted.pop((bytes(offload_keys[0]), len(offload_keys)), None)
                if offload_keys
                else None
            )
            if not offload_keys or not all(found) or any(t is None for t in tiers):
                return
            by_tier: dict[str, int] = {}
            for tier in tiers:
                assert tier is not None
                by_tier[tier] = by_tier.get(tier, 0) + self.row_bytes
            self.decider.loaded(by_tier, seconds, predicted_s=predicted)
            if predicted is not None:
                self.counts.predicted_load_seconds += predicted
                self.counts.actual_load_seconds += seconds

    def stored(self, charged_s: float, seconds: float) -> None:
        with self._lock:
            self.budget.settle(charged_s, seconds)

    # -- scheduler thread -------------------------------------------------------------------

    def request_started(self, req_id: str) -> None:
        self._live.add(req_id)
        if self._idle_since is not None:
            self._idle_s += self._clock() - self._idle_since
            self._idle_since = None

    def request_finished(self, req_id: str) -> None:
        self._live.discard(req_id)
        if not self._live and self._idle_since is None:
            self._idle_since = self._clock()

    def step_end(self) -> None:
        """``on_schedule_end``: the step since the last call ended (its time, unless the engine
        was idle meanwhile, goes to the budget and the prefill-rate window)."""
        now = self._clock()
        last, self._last_end = self._last_end, now
        if self._idle_since is not None:  # still idle: that time is not the engine's
            self._idle_s += now - self._idle_since
            self._idle_since = now
        idle, self._idle_s = self._idle_s, 0.0
        if last is None:
            return
        busy = now - last - idle
        if busy <= 0 or busy > MAX_STEP_S:
            return
        with self._lock:
            self.budget.step(busy)
            if self.measured_rate:
                self._window_s += busy
                if self._window_s >= WINDOW_S and self._window_tokens > 0:
                    self.decider.step(self._window_tokens, self._window_s)
                    self._window_s, self._window_tokens = 0.0, 0
                elif self._window_s >= 10 * WINDOW_S:  # steps with nothing stored: not prefill
                    self._window_s = 0.0

    def stored_chunks(self, n: int) -> None:
        """vLLM cascaded ``n`` chunks the engine computed."""
        self._window_tokens += n * self.chunk_tokens

    def charge_load(self, offload_keys: Sequence[bytes]) -> float:
        """A load job starts: its predicted time (by the tier each chunk was answered from;
        the host tier's figure for a chunk not known), charged to the budget."""
        with self._lock:
            by_tier: dict[str, int] = {}
            for key in offload_keys:
                tier = self._tier_of.get(bytes(key), "host")
                by_tier[tier] = by_tier.get(tier, 0) + self.row_bytes
            cost = self.decider.figures.predict(by_tier) or 0.0
            self.budget.charge_load(cost)
            return cost

    def admit_store(self, n_chunks: int) -> float | None:
        """A store job of ``n_chunks``: its predicted time (charged), or None when the budget is
        spent (the job is dropped, counted)."""
        nbytes = n_chunks * self.row_bytes
        with self._lock:
            # A store copies the rows into the daemon's host tier: the host tier's load figure
            # (a copy of the same bytes the other way) predicts it; unknown: free.
            cost = self.decider.figures.cost("host", nbytes) or 0.0
            if self.budget.admit_store(cost, nbytes):
                return cost
            self.counts.store_budget_dropped_blocks += n_chunks
            return None

    def take(self) -> DecisionCounts:
        with self._lock:
            counts, self.counts = self.counts, DecisionCounts()
        return counts

"""The vLLM planner's load-or-recompute decision, and the figures it is made from.

Load or recompute (``decider``, a ``kvtier.adaptive.Decider``; docs/vllm.md §4): of the hit
blocks beyond the engine's own, vLLM is answered the prefix the decider chooses from the
blocks' tiers and the figures: the workers' step and load reports (``observe``) and the
daemon's per-tier figures (read from the lookup thread's session on ``build``, no RPC). While
another request decodes, a load is cut to ``interference_budget`` x the recent step time.
While the decisions cut the tiers below the host tier, the lookups hold hits only
(``LookupThread.promote`` False: no disk reads for blocks vLLM will recompute), except after a
read probe: a sync engine probes a cut tier by letting the next lookups promote (a failed
sync load would cost the step's forward), and the daemon's figure of those reads tells.

Ownership and concurrency: a part of ``planner.Planner``, handed the planner's counters and
lookup thread (whose ``promote`` it sets); owns the ``kvtier.adaptive.Decider``, the
decision's settings and the figures it keeps (recent step time, the requests decoding, the
daemon's last per-tier figures). Scheduler thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from kvtier.adaptive import Decider, Decision
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome, LookupThread
from kvtier.integrations.vllm.connector.plans import LoadReport, PlannerStats, StepReport
from kvtier.integrations.vllm.connector.requests import RequestState

log = logging.getLogger("vllm.kvtier")
BELOW_HOST = frozenset({"nvme", "cluster"})  # tiers a pinned lookup promotes or imports from


def hit_tiers(outcome: LookupOutcome, first: int, usable: int) -> list[str]:
    """The tier of each hit block vLLM may load (``"unknown"`` where the lookup gave none)."""
    n = max(0, usable - first)
    tiers = list(outcome.tiers[first:usable])
    return tiers + ["unknown"] * (n - len(tiers))


class LoadDecisions:
    """The planner's load decisions; see the module docstring."""

    def __init__(
        self,
        stats: PlannerStats,
        thread: LookupThread,
        decider: Decider,
        *,
        block_size: int,
        block_bytes: int,
        load_async: bool,
        interference_budget: float | None,
        sync_load_budget_s: float | None,
    ) -> None:
        """``stats``, ``thread``: the planner's; the rest its parameters of the same names
        (``sync_load_budget_s`` None for an async engine). ``decider``: adaptive by default
        (without figures it loads every hit, which is what measures the tiers). ``block_bytes``:
        the bytes one worker loads per block (one tp slice, every layer), what a tier's load
        time is predicted from."""
        self.stats = stats
        self._thread = thread
        self.decider = decider
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.load_async = load_async
        self.interference_budget = interference_budget
        # a synchronous load runs within the step's budget (``step_budget_ms``) or fails there,
        # its time wasted: the decision cuts a sync load to what is predicted to fit
        self.sync_load_budget_s = sync_load_budget_s
        self.step_s: float | None = None  # recent forward seconds per step (moving average)
        self.decoding: set[str] = set()  # requests that decoded in the last planned step (build)
        self._daemon_figures: dict[str, tuple[float, float, int]] = {}
        # ``never`` loads nothing: its lookups (which skip the stores of what is found) never
        # have the daemon read a disk for it
        self._thread.promote = decider.policy != "never"

    def decide(self, st: RequestState, first: int, tiers: list[str]) -> int:
        """Blocks of the hit ``tiers`` (from block ``first``) to load: the Decider's answer,
        decided once per hit (asked again for the same blocks, the same decision)."""
        d = st.decision
        if d is not None and st.decided_at == (first, len(tiers)):
            return d.load_blocks
        self.daemon_report()  # (an idle engine's first decision: the figures of meanwhile)
        max_load_s = self._max_load_s(st)
        # A sync load that fails costs vLLM the step's whole forward (the request is rescheduled
        # and recomputed from the failed block): a sync engine probes a cut tier by a read
        # instead (its next pinned lookups promote; the daemon's figure tells).
        d = self.decider.decide(
            tiers,
            block_tokens=self.block_size,
            block_bytes=self.block_bytes,
            max_load_s=max_load_s,
            read_probes=not self.load_async,
        )
        st.decision, st.decided_at = d, (first, len(tiers))
        if log.isEnabledFor(logging.DEBUG):
            _log_decision(st.info.req_id, d, tiers, max_load_s)
        # no promotions ahead of decisions that cut the tiers below the host tier, but for a
        # read probe's: the lookups until the next decision promote
        self._thread.promote = self.decider.policy != "never" and (
            not (self.decider.cut_tiers & BELOW_HOST) or bool(self.decider.probe_reads & BELOW_HOST)
        )
        self.decider.probe_reads.clear()
        self._sync_decision_stats()
        return d.load_blocks

    def _max_load_s(self, st: RequestState) -> float | None:
        """The seconds a load for ``st`` may take: the sync load budget, cut to the loads'
        share of a step (``interference_budget`` x the recent step time) while another request
        decodes; None: no limit."""
        max_load_s = self.sync_load_budget_s
        if (
            self.interference_budget is not None
            and self.step_s is not None
            and self.decoding - {st.info.req_id}
        ):
            share = self.interference_budget * self.step_s  # the loads' share of a step
            max_load_s = share if max_load_s is None else min(max_load_s, share)
        return max_load_s

    def observe(
        self, steps: Sequence[StepReport], loads: Sequence[LoadReport], reqs: Mapping[str, RequestState]
    ) -> None:
        """What the workers measured (``update_connector_output``, scheduler thread): each
        step's tokens and forward seconds feed the engine's prefill rate and the recent step
        time (the loads' budget share); each load's bytes by tier and seconds feed the tiers'
        figures, with the decisions' predicted time of the same loads (the requests' records:
        ``reqs``)."""
        for r in steps:
            if r.tokens > 0 and r.seconds > 0:
                self.decider.step(r.tokens, r.seconds)
                self.step_s = r.seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * r.seconds
        for load in loads:
            predicted: float | None = 0.0
            for req_id in load.req_ids:
                st = reqs.get(req_id)
                d = st.decision if st is not None else None
                if d is None or d.predicted_s is None or predicted is None:
                    predicted = None
                else:
                    predicted += d.predicted_s
            self.decider.loaded(load.bytes_by_tier, load.seconds, predicted_s=predicted)
        if loads:
            self._sync_decision_stats()

    def daemon_report(self) -> None:
        """The daemon's per-tier figures, as the lookup thread's session last heard them (a
        read of what its heartbeat brought: no RPC), into the decision when they changed."""
        for tier, f in self._thread.tier_figures().items():
            key = (f.latency_s, f.bytes_per_s, f.reads)
            if self._daemon_figures.get(tier) != key:
                self._daemon_figures[tier] = key
                self.decider.report(tier, f.latency_s, f.bytes_per_s, age_s=f.age_s)

    def _sync_decision_stats(self) -> None:
        ds, s = self.decider.stats, self.stats
        s.decision_tokens_loaded = ds.tokens_loaded
        s.decision_tokens_recomputed_slower = ds.tokens_recomputed_slower
        s.decision_tokens_recomputed_budget = ds.tokens_recomputed_budget
        s.decision_tokens_recomputed_policy = ds.tokens_recomputed_policy
        s.decision_probes = ds.probes
        s.load_seconds_predicted = ds.predicted_load_s
        s.load_seconds_actual = ds.actual_load_s


def _log_decision(req_id: str, d: Decision, tiers: list[str], max_load_s: float | None) -> None:
    """The debug line of request ``req_id``'s decision ``d`` for the hit ``tiers``."""
    log.debug(
        "kvtier decision %s: %d of %d hit blocks (%s), %s, predicted %s s, recompute %s s, budget %s s",
        req_id,
        d.load_blocks,
        d.hit_blocks,
        ",".join(f"{t}x{tiers.count(t)}" for t in dict.fromkeys(tiers)),
        d.reason,
        d.predicted_s,
        d.recompute_s,
        max_load_s,
    )

"""Scheduler-side planning of the vLLM connector: which blocks to look up, load and store.

Plain Python with no vLLM import: the adapter (``adapter``) turns vLLM's ``Request`` and
``SchedulerOutput`` into ``RequestInfo`` / ``StepInput`` and the returned ``StepPlan`` into the
connector metadata the workers receive.

Lifecycle (all calls on the scheduler thread, in vLLM's order)::

    planner = Planner(block_size=..., backend=DaemonBackend(...), ...)
    planner.on_new_request(info)              # keys + pinned lookup start on the lookup thread
    planner.num_new_matched(req_id, n_local, n_tokens)  # None until known; timeout -> miss
    planner.after_alloc(req_id, block_ids, n_external)  # a load is planned, or pins released
    plan = planner.build(step)                 # loads, stores, fences; once per engine step
    planner.observe(step_reports, load_reports)  # what the workers measured (worker meta)
    planner.request_finished(req_id)
    planner.close()

Rules it keeps (DESIGN §7, ../shared/notes/vllm-connector.md §7):

* No RPC on the scheduler thread. Keys are hashed and lookups run on one background thread
  (``kvtier-lookup``). The scheduler thread waits for an answer at most ``lookup_wait_s`` per
  engine step in all (a lookup answered by the published index or one control-channel round
  trip takes well under that, so a new request is admitted in the step it arrives instead of
  the next); past that budget ``num_new_matched`` answers ``None`` ("not yet known", vLLM asks
  again next step), and after ``lookup_timeout_s`` it answers a miss for good.
* Hits are pinned in the daemon from the lookup until the load has run (``pin_release_steps``
  engine steps after it was handed to the workers), or released at once when vLLM does not load.
* The last token is always computed: a hit never covers ``(num_tokens - 1) // block_size`` full
  blocks or more, so a synchronous load never claims the whole prompt.
* The load-or-recompute decision: ``load_decisions`` (``LoadDecisions``).
* Stores: ``store_planning`` (``StorePlanning``); each store job reads engine blocks on a worker
  thread after the step, and the next plan fences it (``flush``) when vLLM hands one of its
  blocks to a request again.
* Idempotent: a repeated ``num_new_matched`` for the same request returns the same answer (the
  decision is made once per hit).
* Asynchronous loads (``load_async``, ``load_mode="async"``): a hit is answered as an async load.
  vLLM then allocates the request's blocks, calls ``after_alloc`` and parks the request in
  ``WAITING_FOR_REMOTE_KVS`` without scheduling it, so ``build`` plans the load for a request that
  is not in the step, fencing any store job still reading one of its blocks first. Its pins are
  held until the workers report the load finished (``load_finished``, from vLLM's
  ``finished_recving``), not ``pin_release_steps``. If the whole load failed vLLM asks again,
  and the answer is 0: the request is recomputed, never loaded twice.

Ownership: the planner owns the request records (``RequestState``, in ``requests``; scheduler
thread only), the counters (``PlannerStats``), the lookup thread (``LookupThread``, in
``lookup_thread``, with the ``Backend`` it drives and the ``LookupOutcome`` it answers; the two
share only the task queue and the result map, under one lock) and two parts, each handed what it
reads of those: ``decisions`` (``LoadDecisions``: the request table, the counters and the lookup
thread) and ``stores`` (``StorePlanning``: the counters).

The data it takes and hands out is in ``plans`` (re-exported here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvtier.adaptive import Decider
from kvtier.integrations.vllm.connector.load_decisions import BELOW_HOST, LoadDecisions, hit_tiers
from kvtier.integrations.vllm.connector.lookup_thread import Backend
from kvtier.integrations.vllm.connector.lookups import Lookups
from kvtier.integrations.vllm.connector.plans import (
    LoadJob,
    LoadReport,
    PlannerStats,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    StepPlan,
    StepReport,
    StoreJob,
)
from kvtier.integrations.vllm.connector.requests import RequestState
from kvtier.integrations.vllm.connector.store_planning import StorePlanning

__all__ = [
    "BELOW_HOST",
    "LoadJob",
    "LoadReport",
    "Planner",
    "PlannerStats",
    "RequestInfo",
    "ScheduledRequest",
    "StepInput",
    "StepPlan",
    "StepReport",
    "StoreJob",
]

log = logging.getLogger("vllm.kvtier")


class Planner:
    """See the module docstring."""

    def __init__(
        self,
        *,
        block_size: int,
        backend: Backend,
        lookup_timeout_s: float = 0.3,
        lookup_wait_s: float = 0.002,
        pin_release_steps: int = 4,
        load: bool = True,
        store: bool = True,
        store_generated: bool = True,
        load_async: bool = False,
        event_token_ids: bool | None = False,
        decider: Decider | None = None,
        block_bytes: int = 0,
        interference_budget: float | None = None,
        sync_load_budget_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.pin_release_steps = pin_release_steps
        self.load_enabled = load
        self.load_async = load_async
        self.stats = PlannerStats()
        self._reqs: dict[str, RequestState] = {}
        self._pending: dict[str, RequestState] = {}  # a load planned, not yet handed out
        self._step = 0
        self.lookups = Lookups(backend, self.stats, lookup_timeout_s, lookup_wait_s, load, clock)
        self.decisions = LoadDecisions(
            self.stats,
            self.lookups.thread,
            decider if decider is not None else Decider(clock=clock),
            block_size=block_size,
            block_bytes=block_bytes,
            load_async=load_async,
            interference_budget=interference_budget,
            sync_load_budget_s=None if load_async else sync_load_budget_s,
        )
        token_ids = self.lookups.thread.events if event_token_ids is None else lambda: event_token_ids
        self.stores = StorePlanning(self.stats, block_size, store, store_generated, token_ids)

    @property
    def decider(self) -> Decider:
        """The load-or-recompute decision's ``Decider`` (``decisions``')."""
        return self.decisions.decider

    # -- admission ------------------------------------------------------------------------------

    def on_new_request(self, info: RequestInfo) -> None:
        st = RequestState(info)
        self._reqs[info.req_id] = st
        self.lookups.submit(st, self.stores.tokens(st))

    def knows(self, req_id: str) -> bool:
        return req_id in self._reqs

    def num_new_matched(self, req_id: str, num_local_tokens: int, num_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond the engine's ``num_local_tokens`` (block-aligned): None while
        the lookup is out, 0 on a miss or after the timeout. The bool: an asynchronous load
        (``load_async`` and a hit). After an async load vLLM asks again only when the whole
        load failed; the answer is then 0 (recompute), never the same load again."""
        st = self._reqs.get(req_id)
        if st is None or st.info.variant is None or not self.load_enabled or st.load_done:
            return 0, False
        if st.matched is not None and st.matched[0] == num_local_tokens:
            return st.matched[1], self.load_async and st.matched[1] > 0
        if st.relookup:
            st.relookup = False
            self.lookups.submit(st, self.stores.tokens(st))
        outcome = self.lookups.outcome(st)
        if outcome is None:
            outcome = self.lookups.wait(st)
        if outcome is None:
            if not self.lookups.expired(st):
                return None, False
            st.timed_out = True
            self.stats.lookup_timeouts += 1
            st.matched = (num_local_tokens, 0)
            return 0, False
        usable = min(outcome.hits, max(0, num_tokens - 1) // self.block_size)
        first = num_local_tokens // self.block_size
        tiers = hit_tiers(outcome, first, usable)
        first_answer = st.matched is None
        if tiers and first_answer:
            self.stats.hit_blocks += len(tiers)
            self.stats.host_hit_blocks += tiers.count("host")
            self.stats.nvme_hit_blocks += tiers.count("nvme")
            if outcome.shared is not None:
                self.stats.shared_hit_blocks += max(0, min(first + len(tiers), outcome.shared.blocks) - first)
        answer = self.decisions.decide(st, first, tiers) * self.block_size
        st.matched = (num_local_tokens, answer)
        return answer, self.load_async and answer > 0

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.block_ids = list(block_ids)
        if num_external_tokens > 0 and st.outcome is not None and st.matched is not None:
            first = st.matched[0] // self.block_size
            count = num_external_tokens // self.block_size
            if first + count <= min(len(st.block_ids), st.outcome.hits):
                st.pending_load = (first, count)
                self._pending[req_id] = st
                return
            log.warning(
                "kvtier: request %s: %d external tokens do not fit its blocks or hits",
                req_id,
                num_external_tokens,
            )
        self.lookups.release_now(st)

    # -- once per step --------------------------------------------------------------------------

    def build(self, step: StepInput) -> StepPlan:
        plan = StepPlan(step=self._step)
        flush: set[int] = set()
        self.decisions.daemon_report()
        for req_id in step.preempted:
            self._preempted(req_id, flush)
        decoding = self._plan_scheduled(step.scheduled, plan, flush)
        for st in list(self._pending.values()):
            # An async load: vLLM does not schedule the request (WAITING_FOR_REMOTE_KVS) until
            # the workers report the load finished, so it is not in ``step.scheduled``. Its
            # blocks are new to it: fence any store job still reading them before the load
            # thread writes them (the workers start the load after this step's fence).
            self.stores.fence_blocks(st.block_ids, flush)
            if st.pending_load is not None:
                plan.loads.append(self._load_job(st))
        plan.flush = sorted(flush)
        plan.decoding = bool(decoding)
        self.decisions.decoding = decoding
        self.stats.flushes += len(plan.flush)
        self._step += 1
        self.lookups.step_done(self._step)  # pins released N builds after the load
        return plan

    def _preempted(self, req_id: str, flush: set[int]) -> None:
        """A preempted request: its store jobs fenced, its plan and pins dropped."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        flush.update(st.jobs)
        st.block_ids, st.pending_load, st.matched, st.decision = [], None, None, None
        st.load_done = False
        self._pending.pop(req_id, None)
        self.lookups.release_now(st)
        st.relookup = True  # look up afresh when vLLM admits it again

    def _plan_scheduled(
        self, scheduled: Sequence[ScheduledRequest], plan: StepPlan, flush: set[int]
    ) -> set[str]:
        """Loads and stores of the step's scheduled requests; the ids of those decoding."""
        decoding: set[str] = set()
        for s in scheduled:
            self.stores.fence_blocks(s.block_ids or (), flush)
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            if s.replace:
                st.block_ids = list(s.block_ids or ())
            elif s.block_ids:
                st.block_ids.extend(s.block_ids)
            plan.tokens += s.num_scheduled_tokens
            if s.num_computed_tokens >= len(st.info.prompt_token_ids):
                decoding.add(s.req_id)  # (its prompt is computed: this step decodes)
            if st.pending_load is not None:
                plan.loads.append(self._load_job(st))
            if self.stores.enabled and st.info.variant is not None:
                computed = s.num_computed_tokens + s.num_scheduled_tokens
                self.stores.plan(st, self.lookups.outcome(st), computed, plan)
        return decoding

    def request_finished(self, req_id: str) -> None:
        """The request is done; its blocks go back to vLLM (in-flight stores are fenced)."""
        st = self._reqs.pop(req_id, None)
        self._pending.pop(req_id, None)
        # A finished request decodes no more: the next decisions owe it no interference budget
        # (with async scheduling vLLM plans one more decode step of a request it then finishes).
        self.decisions.decoding.discard(req_id)
        if st is not None:
            self.lookups.release_now(st)
            self.lookups.forget(req_id)

    def load_finished(self, req_id: str) -> None:
        """The workers reported the request's async load finished (loaded or failed): its
        lookup pins go now (the load's own pins were released by its CompleteLoad)."""
        st = self._reqs.get(req_id)
        if st is not None and st.loading:
            st.loading, st.load_done = False, True
            self.lookups.release_now(st)

    def loads_in_flight(self) -> int:
        return sum(1 for st in self._reqs.values() if st.loading)

    def close(self) -> None:
        for st in self._reqs.values():
            self.lookups.release_now(st)
        self.lookups.close()

    def pending_lookups(self) -> int:
        return self.lookups.pending()

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the external hit by tier ("host", "nvme")."""
        st = self._reqs.get(req_id)
        if st is None or st.outcome is None or st.matched is None or not num_external_tokens:
            return {}
        first = st.matched[0] // self.block_size
        tiers = st.outcome.tiers[first : first + num_external_tokens // self.block_size]
        out: dict[str, int] = {}
        for tier in tiers:
            out[tier] = out.get(tier, 0) + self.block_size
        return out

    def observe(self, steps: Sequence[StepReport], loads: Sequence[LoadReport]) -> None:
        """What the workers measured (``LoadDecisions.observe``)."""
        self.decisions.observe(steps, loads, self._reqs)

    # -- internals ------------------------------------------------------------------------------

    def _load_job(self, st: RequestState) -> LoadJob:
        assert st.pending_load is not None and st.outcome is not None and st.info.variant
        first, count = st.pending_load
        st.pending_load = None
        self._pending.pop(st.info.req_id, None)
        self.stats.load_blocks += count
        if self.load_async:
            st.loading = True  # pins held until the workers report it (load_finished)
        else:
            self.lookups.release_at(st, self._step + self.pin_release_steps)
        d = st.decision
        scope = st.outcome.shared
        shared = 0 if scope is None else max(0, min(count, scope.blocks - first))
        return LoadJob(
            st.info.req_id,
            st.info.variant,
            [k[first : first + count] for k in st.outcome.keys],
            st.block_ids[first : first + count],
            hit_tiers(st.outcome, first, first + count),
            d.predicted_s if d is not None and d.load_blocks == count else None,
            d.recompute_s if d is not None and d.load_blocks == count else None,
            shared,
            scope.variant if shared and scope is not None else None,
        )

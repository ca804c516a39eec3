"""Scheduler-side planning of the vLLM connector: which blocks to look up, load and store.

Plain Python with no vLLM import: the adapter (``connector.py``) turns vLLM's ``Request`` and
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
* The load-or-recompute decision: ``planner_decide`` (``LoadDecisions``).
* Stores: ``planner_store`` (``StorePlanning``); each store job reads engine blocks on a worker
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

Ownership: the planner owns the per-request state (scheduler thread only) and the lookup thread
(``LookupThread``, in ``lookup_thread.py``, with the ``Backend`` it drives and the
``LookupOutcome`` it answers); the two share only the task queue and the result map, under one
lock.

The data it takes and hands out is in ``plans`` (re-exported here); the state its parts share is
``planner_state``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvtier.adaptive import Decider
from kvtier.integrations.vllm.lookup_thread import Backend, LookupOutcome, LookupThread
from kvtier.integrations.vllm.planner_decide import BELOW_HOST, LoadDecisions
from kvtier.integrations.vllm.planner_state import _Req
from kvtier.integrations.vllm.planner_store import StorePlanning
from kvtier.integrations.vllm.plans import (
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


class Planner(LoadDecisions, StorePlanning):
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
        event_token_ids: bool = False,
        decider: Decider | None = None,
        block_bytes: int = 0,
        interference_budget: float | None = None,
        sync_load_budget_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self._init_decisions(
            decider, block_bytes, interference_budget, None if load_async else sync_load_budget_s, clock
        )
        self.lookup_timeout_s = lookup_timeout_s
        self.lookup_wait_s = lookup_wait_s
        self.pin_release_steps = pin_release_steps
        self.load_enabled = load
        self.store_enabled = store
        self.store_generated = store_generated
        self.load_async = load_async
        self.event_token_ids = event_token_ids
        self.stats = PlannerStats()
        self._clock = clock
        self._init_tables()
        self._thread = LookupThread(backend)
        # ``never`` loads nothing: its lookups (which skip the stores of what is found) never
        # have the daemon read a disk for it
        self._thread.promote = self.decider.policy != "never"

    # -- admission ------------------------------------------------------------------------------

    def on_new_request(self, info: RequestInfo) -> None:
        st = _Req(info)
        self._reqs[info.req_id] = st
        self._submit(st)

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
            self._submit(st)
        outcome = self._outcome(st)
        if outcome is None and self._wait_left > 0 and st.info.variant is not None:
            t0 = time.perf_counter()
            got = self._thread.wait(st.info.req_id, st.gen, self._wait_left)
            self._wait_left -= time.perf_counter() - t0
            if got is not None:
                self.stats.lookup_waits += 1
                outcome = self._accept(st, got)
        if outcome is None:
            if self._clock() - st.submitted_at < self.lookup_timeout_s:
                return None, False
            st.timed_out = True
            self.stats.lookup_timeouts += 1
            st.matched = (num_local_tokens, 0)
            return 0, False
        usable = min(outcome.hits, max(0, num_tokens - 1) // self.block_size)
        first = num_local_tokens // self.block_size
        tiers = self._tiers(outcome, first, usable)
        first_answer = st.matched is None
        if tiers and first_answer:
            self.stats.hit_blocks += len(tiers)
            self.stats.host_hit_blocks += tiers.count("host")
            self.stats.nvme_hit_blocks += tiers.count("nvme")
        answer = self._decide(st, first, tiers) * self.block_size
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
        self._release_now(st)

    # -- once per step --------------------------------------------------------------------------

    def build(self, step: StepInput) -> StepPlan:
        plan = StepPlan(step=self._step)
        flush: set[int] = set()
        self._daemon_report()
        for req_id in step.preempted:
            self._preempted(req_id, flush)
        decoding = self._plan_scheduled(step.scheduled, plan, flush)
        for st in list(self._pending.values()):
            # An async load: vLLM does not schedule the request (WAITING_FOR_REMOTE_KVS) until
            # the workers report the load finished, so it is not in ``step.scheduled``. Its
            # blocks are new to it: fence any store job still reading them before the load
            # thread writes them (the workers start the load after this step's fence).
            self._fence_blocks(st.block_ids, flush)
            if st.pending_load is not None:
                plan.loads.append(self._load_job(st))
        plan.flush = sorted(flush)
        plan.decoding = bool(decoding)
        self._decoding = decoding
        self.stats.flushes += len(plan.flush)
        self._step += 1
        self._wait_left = self.lookup_wait_s
        while self._releases and self._releases[0][0] < self._step:  # N builds after the load
            self._thread.release(self._releases.popleft()[1])
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
        self._release_now(st)
        st.relookup = True  # look up afresh when vLLM admits it again

    def _plan_scheduled(
        self, scheduled: Sequence[ScheduledRequest], plan: StepPlan, flush: set[int]
    ) -> set[str]:
        """Loads and stores of the step's scheduled requests; the ids of those decoding."""
        decoding: set[str] = set()
        for s in scheduled:
            self._fence_blocks(s.block_ids or (), flush)
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
            self._plan_store(st, s.num_computed_tokens + s.num_scheduled_tokens, plan)
        return decoding

    def _fence_blocks(self, block_ids: Sequence[int], flush: set[int]) -> None:
        """Store jobs still reading ``block_ids`` (handed to a request again) into ``flush``."""
        for bid in block_ids:
            job = self._fence.pop(bid, None)
            if job is not None:
                flush.add(job)

    def request_finished(self, req_id: str) -> None:
        """The request is done; its blocks go back to vLLM (in-flight stores are fenced)."""
        st = self._reqs.pop(req_id, None)
        self._pending.pop(req_id, None)
        if st is not None:
            self._release_now(st)
            self._thread.forget(req_id)

    def load_finished(self, req_id: str) -> None:
        """The workers reported the request's async load finished (loaded or failed): its
        lookup pins go now (the load's own pins were released by its CompleteLoad)."""
        st = self._reqs.get(req_id)
        if st is not None and st.loading:
            st.loading, st.load_done = False, True
            self._release_now(st)

    def loads_in_flight(self) -> int:
        return sum(1 for st in self._reqs.values() if st.loading)

    def close(self) -> None:
        for st in self._reqs.values():
            self._release_now(st)
        while self._releases:
            self._thread.release(self._releases.popleft()[1])
        self._thread.close()

    def pending_lookups(self) -> int:
        return self._thread.pending()

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, st: _Req) -> None:
        st.gen += 1
        st.outcome, st.timed_out, st.pins_released = None, False, False
        st.submitted_at = self._clock()
        if st.info.variant is not None:
            self.stats.lookups += 1  # a re-lookup (after preemption) covers the output so far too
            self._thread.submit(st.info.req_id, st.gen, st.info.variant, self._tokens(st))

    def _outcome(self, st: _Req) -> LookupOutcome | None:
        if st.outcome is None:
            got = self._thread.take(st.info.req_id, st.gen)
            if got is not None:
                self._accept(st, got)
        return st.outcome

    def _accept(self, st: _Req, got: LookupOutcome) -> LookupOutcome:
        st.outcome = got
        if got.keys and (not st.keys or len(got.keys[0]) > len(st.keys[0])):
            st.keys = [list(k) for k in got.keys]  # a re-lookup may cover more
        if st.timed_out or not self.load_enabled:
            self._release_now(st)  # answered too late to load; keys still serve stores
        return got

    def _release_now(self, st: _Req) -> None:
        if st.outcome is not None and not st.pins_released:
            st.pins_released = True
            if st.outcome.pins:
                self._thread.release(st.outcome.pins)

    def _load_job(self, st: _Req) -> LoadJob:
        assert st.pending_load is not None and st.outcome is not None and st.info.variant
        first, count = st.pending_load
        st.pending_load = None
        self._pending.pop(st.info.req_id, None)
        self.stats.load_blocks += count
        if self.load_async:
            st.loading = True  # pins held until the workers report it (load_finished)
        elif not st.pins_released and st.outcome.pins:
            st.pins_released = True
            self._releases.append((self._step + self.pin_release_steps, list(st.outcome.pins)))
        d = st.decision
        return LoadJob(
            st.info.req_id,
            st.info.variant,
            [k[first : first + count] for k in st.outcome.keys],
            st.block_ids[first : first + count],
            self._tiers(st.outcome, first, first + count),
            d.predicted_s if d is not None and d.load_blocks == count else None,
            d.recompute_s if d is not None and d.load_blocks == count else None,
        )

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
* Stores: every full block once it is computed and its token ids are known, except blocks the
  lookup found in the daemon: the prompt's, and (``store_generated``) the generated tokens' as
  decode completes them, so the next turn of a conversation, which resends them as prompt, loads
  them. A generated block's keys chain on from the prompt's over the request's token ids
  (``LookupOutcome.chain``, hashed on the scheduler thread: one SHA-256 per block and slice),
  exactly as the next turn's prompt hashes them. The last sampled token's KV is never computed, so
  a block it completes is not stored. Each store job reads engine blocks on a worker thread
  after the step; when vLLM hands one of those block ids to a request again (re-allocation,
  also after preemption or finish), the next plan lists the job in ``flush`` and the worker
  waits for it before the forward pass that could overwrite the block (the fence).
* Load or recompute (``decider``, a ``kvtier.adaptive.Decider``; docs/vllm.md §4): of the hit
  blocks beyond the engine's own, vLLM is answered the prefix the decider chooses from the
  blocks' tiers and the figures: the workers' step and load reports (``observe``) and the
  daemon's per-tier figures (read from the lookup thread's session on ``build``, no RPC). While
  another request decodes, a load is cut to ``interference_budget`` x the recent step time.
  While the decisions cut the tiers below the host tier, the lookups hold hits only
  (``LookupThread.promote`` False: no disk reads for blocks vLLM will recompute), except after a
  read probe: a sync engine probes a cut tier by letting the next lookups promote (a failed
  sync load would cost the step's forward), and the daemon's figure of those reads tells.
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

Size: over the 400-line budget (issue 27 lists it): one per-request state machine on the
scheduler thread; the decision itself is ``kvtier.adaptive``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.adaptive import Decider, Decision
from kvtier.integrations.vllm.config import Variant
from kvtier.integrations.vllm.lookup_thread import Backend, LookupOutcome, LookupThread, Pin

log = logging.getLogger("vllm.kvtier")
BELOW_HOST = frozenset({"nvme", "cluster"})  # tiers a pinned lookup promotes or imports from


@dataclass(frozen=True)
class RequestInfo:
    """What the planner needs of a request. ``variant`` None = not cacheable (never looked up
    nor stored, e.g. an adapter without a known revision or a prompt given as embeddings).
    ``token_ids``: the request's live token ids (prompt, then every output token as vLLM appends
    it; read at each step, never written), or None to store prompt blocks only."""

    req_id: str
    prompt_token_ids: Sequence[int]
    variant: Variant | None
    token_ids: Sequence[int] | None = None


@dataclass(frozen=True)
class LoadJob:
    """Load ``keys[slice][i]`` into engine block ``block_ids[i]`` before this step's forward.
    ``tiers[i]``: where the lookup found block ``i`` ("host", "nvme", ...; empty when unknown),
    ``predicted_s``: the decision's predicted load time (None: no figures yet)."""

    req_id: str
    variant: Variant
    keys: list[list[bytes]]
    block_ids: list[int]
    tiers: list[str] = field(default_factory=list)
    predicted_s: float | None = None


@dataclass(frozen=True)
class StoreJob:
    """Store engine block ``block_ids[i]`` under ``keys[slice][i]`` after this step's forward.
    With ``event_token_ids``: the blocks' token ids, and per slice the key before ``keys[s][0]``
    (None at a chain's start), which the daemon publishes in its KV events (docs/events.md)."""

    job_id: int
    req_id: str
    variant: Variant
    keys: list[list[bytes]]
    block_ids: list[int]
    token_ids: list[int] | None = None
    parents: list[bytes | None] | None = None


@dataclass
class StepPlan:
    """What the workers do in one step: fences first, then loads, forward, stores. ``step``:
    the plan's number; ``tokens``: tokens the step computes (the workers report the step's
    forward seconds with both: the engine's prefill rate); ``decoding``: a request in the step
    is decoding (its stores are held to the interference budget)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    step: int = 0
    tokens: int = 0
    decoding: bool = False

    def empty(self) -> bool:
        return not (self.loads or self.stores or self.flush)


@dataclass(frozen=True)
class ScheduledRequest:
    """One scheduled request of a step. ``block_ids`` is the whole table when ``replace`` (new or
    resumed requests), else the blocks added this step (or None)."""

    req_id: str
    block_ids: Sequence[int] | None
    replace: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class StepInput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class PlannerStats:
    lookups: int = 0
    lookup_timeouts: int = 0
    lookup_waits: int = 0  # lookups answered while the scheduler thread waited (same step)
    hit_blocks: int = 0
    host_hit_blocks: int = 0
    nvme_hit_blocks: int = 0
    load_blocks: int = 0
    store_blocks: int = 0
    store_generated_blocks: int = 0
    flushes: int = 0
    # the load-or-recompute decision (the Decider's counters, exported unprefixed)
    decision_tokens_loaded: int = 0
    decision_tokens_recomputed_slower: int = 0
    decision_tokens_recomputed_budget: int = 0
    decision_tokens_recomputed_policy: int = 0
    decision_probes: int = 0
    load_seconds_predicted: float = 0.0
    load_seconds_actual: float = 0.0


@dataclass(frozen=True)
class StepReport:
    """One engine step as the workers measured it: the plan's ``step``, its ``tokens`` and the
    forward's seconds (kvtier's own engine-thread time taken out)."""

    step: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class LoadReport:
    """One load the workers ran: the requests it served, its bytes by tier (one tp slice) and
    its seconds end to end."""

    req_ids: tuple[str, ...]
    bytes_by_tier: dict[str, int]
    seconds: float


@dataclass
class _Req:
    info: RequestInfo
    gen: int = 0
    submitted_at: float = 0.0
    outcome: LookupOutcome | None = None
    timed_out: bool = False
    matched: tuple[int, int] | None = None  # (num_local_tokens, answer) once answered
    block_ids: list[int] = field(default_factory=list)
    pending_load: tuple[int, int] | None = None  # (first block, count)
    stored_upto: int = 0
    keys: list[list[bytes]] | None = None  # the key chain so far, per slice (prompt, then output)
    jobs: list[int] = field(default_factory=list)
    pins_released: bool = False
    relookup: bool = False
    loading: bool = False  # an async load is in flight (handed to the workers, not finished)
    load_done: bool = False  # its async load finished: vLLM asks again only after a failure
    decision: Decision | None = None  # the load-or-recompute decision behind ``matched``
    decided_at: tuple[int, int] = (0, 0)  # (first hit block, hit blocks) it was made for


class Planner:
    """See the module docstring."""

    def __init__(self, *, block_size: int, backend: Backend, lookup_timeout_s: float = 0.3,
                 lookup_wait_s: float = 0.002, pin_release_steps: int = 4, load: bool = True,
                 store: bool = True, store_generated: bool = True, load_async: bool = False,
                 event_token_ids: bool = False, decider: Decider | None = None,
                 block_bytes: int = 0, interference_budget: float | None = None,
                 sync_load_budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        # The load-or-recompute decision (adaptive by default: without figures it loads every
        # hit, which is what measures the tiers). ``block_bytes``: the bytes one worker loads
        # per block (one tp slice, every layer), what a tier's load time is predicted from.
        self.decider = decider if decider is not None else Decider(clock=clock)
        self.block_bytes = block_bytes
        self.interference_budget = interference_budget
        # a synchronous load runs within the step's budget (``step_budget_ms``) or fails there,
        # its time wasted: the decision cuts a sync load to what is predicted to fit
        self.sync_load_budget_s = None if load_async else sync_load_budget_s
        self._step_s: float | None = None  # recent forward seconds per step (moving average)
        self._decoding: set[str] = set()  # requests that decoded in the last planned step
        self._daemon_figures: dict[str, tuple[float, float, int]] = {}
        self.lookup_timeout_s = lookup_timeout_s
        self.lookup_wait_s = lookup_wait_s
        self._wait_left = lookup_wait_s  # of this step's budget for waiting on lookups
        self.pin_release_steps = pin_release_steps
        self.load_enabled = load
        self.store_enabled = store
        self.store_generated = store_generated
        self.load_async = load_async
        self.event_token_ids = event_token_ids
        self.stats = PlannerStats()
        self._clock = clock
        self._reqs: dict[str, _Req] = {}
        self._fence: dict[int, int] = {}  # engine block id -> last store job reading it
        self._releases: deque[tuple[int, list[Pin]]] = deque()  # (due step, pins)
        self._pending: dict[str, _Req] = {}  # requests with a load planned, not yet handed out
        self._step = 0
        self._next_job = 1
        self._thread = LookupThread(backend)

    # -- admission ------------------------------------------------------------------------------

    def on_new_request(self, info: RequestInfo) -> None:
        st = _Req(info)
        self._reqs[info.req_id] = st
        self._submit(st)

    def knows(self, req_id: str) -> bool:
        return req_id in self._reqs

    def num_new_matched(self, req_id: str, num_local_tokens: int, num_tokens: int
                        ) -> tuple[int | None, bool]:
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

    def _tiers(self, outcome: LookupOutcome, first: int, usable: int) -> list[str]:
        """The tier of each hit block vLLM may load (``"unknown"`` where the lookup gave none)."""
        n = max(0, usable - first)
        tiers = list(outcome.tiers[first:usable])
        return tiers + ["unknown"] * (n - len(tiers))

    def _decide(self, st: _Req, first: int, tiers: list[str]) -> int:
        """Blocks of the hit ``tiers`` (from block ``first``) to load: the Decider's answer,
        decided once per hit (asked again for the same blocks, the same decision)."""
        d = st.decision
        if d is not None and st.decided_at == (first, len(tiers)):
            return d.load_blocks
        self._daemon_report()  # (an idle engine's first decision: the figures of meanwhile)
        max_load_s = self.sync_load_budget_s
        if self.interference_budget is not None and self._step_s is not None \
                and self._decoding - {st.info.req_id}:
            share = self.interference_budget * self._step_s  # the loads' share of a step
            max_load_s = share if max_load_s is None else min(max_load_s, share)
        # A sync load that fails costs vLLM the step's whole forward (the request is rescheduled
        # and recomputed from the failed block): a sync engine probes a cut tier by a read
        # instead (its next pinned lookups promote; the daemon's figure tells).
        d = self.decider.decide(tiers, block_tokens=self.block_size,
                                block_bytes=self.block_bytes, max_load_s=max_load_s,
                                read_probes=not self.load_async)
        st.decision, st.decided_at = d, (first, len(tiers))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvtier decision %s: %d of %d hit blocks (%s), %s, predicted %s s, "
                      "recompute %s s, budget %s s", st.info.req_id, d.load_blocks, d.hit_blocks,
                      ",".join(f"{t}x{tiers.count(t)}" for t in dict.fromkeys(tiers)), d.reason,
                      d.predicted_s, d.recompute_s, max_load_s)
        # no promotions ahead of decisions that cut the tiers below the host tier, but for a
        # read probe's: the lookups until the next decision promote
        self._thread.promote = not (self.decider.cut_tiers & BELOW_HOST) or \
            bool(self.decider.probe_reads & BELOW_HOST)
        self.decider.probe_reads.clear()
        self._sync_decision_stats()
        return d.load_blocks

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
            log.warning("kvtier: request %s: %d external tokens do not fit its blocks or hits",
                        req_id, num_external_tokens)
        self._release_now(st)

    # -- once per step --------------------------------------------------------------------------

    def build(self, step: StepInput) -> StepPlan:
        plan = StepPlan(step=self._step)
        flush: set[int] = set()
        self._daemon_report()
        decoding: set[str] = set()
        for req_id in step.preempted:
            st = self._reqs.get(req_id)
            if st is None:
                continue
            flush.update(st.jobs)
            st.block_ids, st.pending_load, st.matched, st.decision = [], None, None, None
            st.load_done = False
            self._pending.pop(req_id, None)
            self._release_now(st)
            st.relookup = True  # look up afresh when vLLM admits it again
        for s in step.scheduled:
            for bid in s.block_ids or ():
                job = self._fence.pop(bid, None)
                if job is not None:
                    flush.add(job)
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
        for st in list(self._pending.values()):
            # An async load: vLLM does not schedule the request (WAITING_FOR_REMOTE_KVS) until
            # the workers report the load finished, so it is not in ``step.scheduled``. Its
            # blocks are new to it: fence any store job still reading them before the load
            # thread writes them (the workers start the load after this step's fence).
            for bid in st.block_ids:
                job = self._fence.pop(bid, None)
                if job is not None:
                    flush.add(job)
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

    def observe(self, steps: Sequence[StepReport], loads: Sequence[LoadReport]) -> None:
        """What the workers measured (``update_connector_output``, scheduler thread): each
        step's tokens and forward seconds feed the engine's prefill rate and the recent step
        time (the loads' budget share); each load's bytes by tier and seconds feed the tiers'
        figures, with the decisions' predicted time of the same loads."""
        for r in steps:
            if r.tokens > 0 and r.seconds > 0:
                self.decider.step(r.tokens, r.seconds)
                self._step_s = r.seconds if self._step_s is None else \
                    0.8 * self._step_s + 0.2 * r.seconds
        for load in loads:
            predicted: float | None = 0.0
            for req_id in load.req_ids:
                st = self._reqs.get(req_id)
                d = st.decision if st is not None else None
                if d is None or d.predicted_s is None or predicted is None:
                    predicted = None
                else:
                    predicted += d.predicted_s
            self.decider.loaded(load.bytes_by_tier, load.seconds, predicted_s=predicted)
        if loads:
            self._sync_decision_stats()

    def _daemon_report(self) -> None:
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
        return LoadJob(st.info.req_id, st.info.variant,
                       [k[first : first + count] for k in st.outcome.keys],
                       st.block_ids[first : first + count],
                       self._tiers(st.outcome, first, first + count),
                       d.predicted_s if d is not None and d.load_blocks == count else None)

    def _tokens(self, st: _Req) -> Sequence[int]:
        """The token ids whose full blocks are stored: prompt and output, or the prompt alone."""
        if self.store_generated and st.info.token_ids is not None:
            return st.info.token_ids
        return st.info.prompt_token_ids

    def _chain(self, st: _Req, outcome: LookupOutcome, tokens: Sequence[int], upto: int
               ) -> int:
        """Extend ``st.keys`` to ``upto`` blocks of ``tokens`` (each slice's chain goes on from
        its last key); the number of blocks that have keys."""
        keys = st.keys
        if not keys:
            return 0
        have = len(keys[0])
        if upto > have and outcome.chain is not None:
            block = tokens[have * self.block_size : upto * self.block_size]
            for r, chain in enumerate(keys):
                chain.extend(outcome.chain(r, chain[-1] if chain else None, block))
            have = len(keys[0])
        return have

    def _plan_store(self, st: _Req, computed_tokens: int, plan: StepPlan) -> None:
        if not self.store_enabled or st.info.variant is None:
            return
        outcome = self._outcome(st)
        if outcome is None or not st.keys:
            return  # keys not hashed yet: planned on a later step
        tokens = self._tokens(st)
        # Full blocks whose KV this step computes and whose token ids are known (with async
        # scheduling or spec decode the ids of a computed slot may come a step later).
        full = min(len(tokens), computed_tokens) // self.block_size
        full = min(full, len(st.block_ids))
        start = max(st.stored_upto, outcome.hits)
        if full <= start:
            return
        full = min(full, self._chain(st, outcome, tokens, full))
        if full <= start:
            return
        events = self.event_token_ids
        job = StoreJob(self._next_job, st.info.req_id, st.info.variant,
                       [k[start:full] for k in st.keys], st.block_ids[start:full],
                       list(tokens[start * self.block_size : full * self.block_size])
                       if events else None,
                       [k[start - 1] if start else None for k in st.keys] if events else None)
        self._next_job += 1
        for bid in job.block_ids:
            self._fence[bid] = job.job_id
        st.jobs.append(job.job_id)
        st.stored_upto = full
        self.stats.store_blocks += full - start
        if full > len(st.info.prompt_token_ids) // self.block_size:
            self.stats.store_generated_blocks += full - max(
                start, len(st.info.prompt_token_ids) // self.block_size)
        plan.stores.append(job)

"""Worker-side half of the vLLM connector: moves blocks between the engine's paged KV and kvtierd.

No vLLM import (the adapter hands in the per-layer tensors and the plans). Lifecycle::

    w = KvtierWorker(identity, cfg, tp_rank=r)
    w.register(layer_tensors)        # in layer order; builds the PagedKvLayout, opens 2 clients
    each step:  w.forward_start()                # the plan is bound: the step starts
                deadline = w.step_deadline()      # the step's budget (step_budget_ms)
                w.wait(plan.flush, deadline)      # fence: store jobs still reading re-allocated blocks
                failed = w.load(plan.loads, deadline, decoding=...)  # before the forward
                w.forward_start()                 # (sync loads: the forward starts after them)
                (or, async: w.load_async(plan.loads) after the forward, and every step
                 done_reqs, failed = w.finished_loads())
                w.forward_end(plan.step, plan.tokens, plan.decoding)  # in wait_for_save
                w.submit_stores(plan.stores, decoding=...)  # after the forward; returns at once
                w.take_stats(); w.take_reports()  # counters; step and load figures

The interference budget (``cfg.interference_budget``, ``kvtier.adaptive.InterferenceBudget``,
under ``_cond``), over the steps in which a request decodes: ``forward_end`` refills it with the
step's forward seconds; the step's loads were charged before (sync: measured; async: predicted
at hand-off, settled when done); each store job is admitted while the balance lasts, charged its
predicted copy time and settled with the real one, otherwise dropped and counted
(``store_dropped_budget_blocks``), never queued.
    w.close()

Never stall the engine. The engine thread's kvtier work in one step is bounded by
``step_budget_ms``: no load RPC or load round starts after it (those blocks fail and vLLM
recomputes them), and the fence waits no longer. The worker's clients share one circuit breaker
with every kvtier client of this process for the same daemon (``shared_breaker``: the load and
store sessions, and the scheduler's lookup session when it lives here): after the first call that
finds the daemon down or silent, loads fail and stores are dropped at once until the breaker's
probe thread has seen the daemon again.

With ``load_mode="sync"`` (the default) loads run on the engine thread, one batched
``get_blocks`` per namespace variant (over shm, scatter kernels read straight from the pinned
slots); a miss, a timeout or a daemon that is away fails those block ids, which vLLM
recomputes (``kv_load_failure_policy="recompute"``).
Stores run on one ``kvtier-store`` thread: one ``put_blocks`` per job (over shm the gather kernel
writes straight into the reserved arena slots, ``kvtier.direct``); on CUDA the gather first waits
for an event recorded on the engine's stream in ``submit_stores``. When ``max_queued_stores`` jobs
wait already, or the breaker is open, a new job is dropped and counted (never blocks the engine).

The fence. A store job reads engine blocks only during its copy out of them (``batches.CopyGuard``
marks it); its RPCs (PrepareStore before, CompleteStore after) never touch them. A store job's
states, under ``_cond``::

    QUEUED --store thread--> PREPARING <--guard.begin/end--> COPYING --last copy / put done--> DONE
      |                          |                             |
      +--------fence-------------+                             +--fence, copy outlasts the step's
      v                                                        v  budget: REVOKED (batch aborted)
    SNAPSHOT (engine thread copies the job's blocks out) --> SNAPPED (the put writes the copy)
      or REVOKED at once when the breaker is open (the store would be dropped anyway)

So the fence waits only for a copy in progress, never for an RPC, and a job that left the fence
(SNAPPED, REVOKED, DONE) never reads an engine block again; a revoked copy is never committed.

Ownership: the engine owns the KV tensors; this object owns two ``kvtier.Client`` sessions (loads,
stores: a long store transfer never delays a load), the store thread, its queue and the job
records. Thread-safety: ``register``/``wait``/``load``/``submit_stores``/``take_stats``/``close``
on the engine thread; the store thread shares the queue, the job records and the counters under
one condition, never held across an RPC or a copy.

Asynchronous loads (``load_mode="async"``). ``load_async(jobs)`` (engine thread, after the
forward) queues one load per request and returns at once; the ``kvtier-load`` thread runs its
``get_blocks`` (the daemon pins the blocks from PrepareLoad until the copy into the engine blocks
is done and CompleteLoad is sent, as for a synchronous load) within ``async_load_timeout_ms``,
and ``finished_loads()`` (engine thread, every step) hands back the requests whose load is over
and the block ids that failed. vLLM does not schedule a request while its load is in flight
(``WAITING_FOR_REMOTE_KVS``), so no forward pass reads those blocks, and it holds them even if the
request is aborted until the load is reported finished. kvtier itself never stores from a block
a load is writing: ``submit_stores`` drops such a job (it cannot happen through the planner, which
stores only scheduled requests' computed blocks; the check makes it a rule). Loads use the load
session and their own ``PagedKvLayout`` (staging buffers) on the load thread only.

Size: over the 400-line budget (issue 27 lists it): the worker's load, store and fence paths
share one job table and lock; ``_load_now`` (49 lines) and ``_store_loop`` keep each path's
accounting under that lock in one place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier.adaptive import InterferenceBudget
from kvtier.batches import CopyRevoked
from kvtier.breaker import Breaker
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.config import (
    BASE,
    ConfigError,
    ConnectorConfig,
    EngineIdentity,
    Variant,
)
from kvtier.integrations.vllm.planner import LoadJob, LoadReport, StepReport, StoreJob
from kvtier.settings import ClientSettings
from kvtier_contract.errors import KvtierError

log = logging.getLogger("vllm.kvtier")

_BREAKERS: dict[str, Breaker] = {}
_BREAKERS_LOCK = threading.Lock()


def shared_breaker(address: str) -> Breaker:
    """The one breaker of this process for the daemon at ``address`` (workers' and scheduler's
    clients alike): one daemon, one verdict on whether it answers."""
    with _BREAKERS_LOCK:
        breaker = _BREAKERS.get(address)
        if breaker is None:
            breaker = _BREAKERS[address] = Breaker()
        return breaker


@dataclass
class WorkerStats:
    """Counters since the last ``take_stats`` (vLLM's KVConnectorStats interval)."""

    loaded_blocks: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_failed_blocks: int = 0
    load_seconds: float = 0.0
    stored_blocks: int = 0
    stored_tokens: int = 0
    stored_bytes: int = 0
    store_present_blocks: int = 0
    store_dropped_blocks: int = 0
    store_seconds: float = 0.0
    fence_waits: int = 0
    fence_seconds: float = 0.0  # engine-thread time in the fence
    fence_snapshots: int = 0  # fenced jobs whose blocks the engine thread copied out itself
    fence_revoked: int = 0  # fenced jobs given up (breaker open, or a copy past the budget)
    engine_seconds: float = 0.0  # engine-thread time in kvtier (fence, loads, store submission)
    budget_exhausted: int = 0  # steps whose loads stopped at the step budget
    # the interference budget, over the steps in which a request decodes
    budget_steps: int = 0
    budget_step_seconds: float = 0.0  # their forward seconds
    budget_store_jobs: int = 0  # store jobs admitted in them
    budget_load_seconds: float = 0.0  # loads issued in them, measured
    budget_store_seconds: float = 0.0  # stores admitted in them, measured
    store_dropped_budget_blocks: int = 0  # stores refused: the budget was spent
    store_dropped_budget_bytes: int = 0


State = Literal["queued", "preparing", "copying", "snapshot", "done"]


class _Job:
    """One queued store job and where it stands with the fence (guarded by the worker's
    ``_cond``). ``snapshot``: the engine thread's copy of its blocks; ``revoked``: the engine
    took its blocks back without one."""

    def __init__(self, job: StoreJob, forward_done: Any) -> None:
        self.job = job
        self.forward_done = forward_done
        self.charged: float | None = None  # the budget's charge (predicted seconds), if held to it
        self.state: State = "queued"
        self.snapshot: Any = None
        self.revoked = False


class _Guard:
    """The ``batches.CopyGuard`` of one job (store thread), over the worker's condition."""

    def __init__(self, worker: KvtierWorker, rec: _Job) -> None:
        self.worker = worker
        self.rec = rec

    def begin(self) -> Any | None:
        rec, cond = self.rec, self.worker._cond
        with cond:
            cond.wait_for(lambda: rec.state != "snapshot")
            if rec.snapshot is not None:
                return rec.snapshot
            if rec.revoked:
                raise CopyRevoked("the fence took the blocks back")
            rec.state = "copying"
            return None

    def end(self, more: bool) -> bool:
        rec, worker = self.rec, self.worker
        with worker._cond:
            if rec.state == "copying":
                rec.state = "preparing"
                if not more:  # no engine block is read again: the fence may let go now
                    rec.state = "done"
                    worker._unread.pop(rec.job.job_id, None)
            worker._cond.notify_all()
            return rec.snapshot is not None or not rec.revoked


class KvtierWorker:
    """See the module docstring."""

    def __init__(self, identity: EngineIdentity, cfg: ConnectorConfig, *, tp_rank: int = 0,
                 max_queued_stores: int = 64, breaker: Breaker | None = None) -> None:
        self.identity = identity
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.max_queued_stores = max_queued_stores
        self.breaker = breaker if breaker is not None else shared_breaker(cfg.address)
        self.block_bytes = identity.namespace(tp_rank=tp_rank).block_bytes
        self._layouts: tuple[Any, Any, Any] | None = None  # (engine's, store's, load thread's)
        self._clients: dict[str, Client] = {}
        self._handles: dict[tuple[str, Variant], NamespaceHandle] = {}
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._unread: dict[int, _Job] = {}  # jobs the fence must wait for or take over
        self._stats = WorkerStats()
        self._closed = False
        self._busy_job = False
        self._thread: threading.Thread | None = None
        # async loads (under _cond): queued (req_id, jobs), finished (req_id, failed block ids),
        # engine blocks being written (block id -> loads writing it)
        self._load_queue: deque[tuple[str, list[LoadJob], float | None]] = deque()
        self._loads_done: list[tuple[str, set[int]]] = []
        self._loading_blocks: dict[int, int] = {}
        self._load_busy = False
        self._load_thread: threading.Thread | None = None
        # The interference budget and the figures the scheduler's decision needs (under _cond):
        # each step's forward seconds, each load's bytes by tier and seconds.
        self.budget = InterferenceBudget(cfg.interference_budget)
        self._store_s_per_byte: float | None = None  # measured stores (moving average)
        self._engine_s_total = 0.0  # engine-thread seconds in kvtier, never reset
        self._forward: tuple[float, float, Any] | None = None  # (wall start, engine_s, event)
        self._pending_steps: list[tuple[int, int, bool, Any, Any]] = []  # CUDA: events to read
        self._step_reports: list[StepReport] = []
        self._load_reports: list[LoadReport] = []
        self._warm_loads: set[bool] = set()  # load paths (engine thread or not) used once

    # -- engine thread ----------------------------------------------------------------------------

    def register(self, layers: Sequence[Any]) -> None:
        """Per-layer KV tensors in layer order (vLLM's ``[B, H, N, C]`` views)."""
        from kvtier.layouts import PagedKvLayout  # torch; only when a worker exists

        engine_layout = PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout)
        if engine_layout.block_bytes != self.block_bytes:
            raise ConfigError("kv_cache", f"{engine_layout.num_layers} layers x "
                              f"{engine_layout.page_bytes} B pages = {engine_layout.block_bytes} B "
                              f"per block, but the namespace says {self.block_bytes} B")
        self._layouts = (engine_layout,
                         PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout),
                         PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout))
        for role in ("load", "store"):
            self._clients[role] = Client.connect(  # lazy: away is a miss, logged once per cause
                self.cfg.address, lazy=True, breaker=self.breaker, settings=ClientSettings(
                    transport=self.cfg.transport, timeout_s=self.cfg.request_timeout_ms / 1000,
                    lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                    probe_timeout_s=self.cfg.probe_timeout_ms / 1000,
                    client_name=f"vllm-tp{self.tp_rank}-{role}", token_file=self.cfg.token_file,
                    unix_login=self.cfg.unix_login))
            self._handle(role, BASE)  # registered now, not on the engine's first step
        self._thread = threading.Thread(target=self._store_loop, name="kvtier-store", daemon=True)
        self._thread.start()
        if self.cfg.load_mode == "async":
            self._load_thread = threading.Thread(target=self._load_loop, name="kvtier-load",
                                                 daemon=True)
            self._load_thread.start()

    @property
    def registered(self) -> bool:
        return self._layouts is not None

    def step_deadline(self) -> float:
        """The end of a step's budget for kvtier's work, starting now."""
        return time.monotonic() + self.cfg.step_budget_ms / 1000

    def forward_start(self) -> None:
        """The step's forward starts now (engine thread; again after sync loads: the later
        mark wins). On CUDA an event on the engine's stream marks it too."""
        event = None
        if self._layouts is not None and self._layouts[0].device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._layouts[0].device))
        with self._cond:
            self._forward = (time.perf_counter(), self._engine_s_total, event)

    def forward_end(self, step: int, tokens: int, decoding: bool) -> None:
        """The step's forward is over (engine thread, in ``wait_for_save`` before the stores
        are submitted): its seconds, less kvtier's own engine-thread time in between, are the
        step's figure and, when a request decodes in it, refill the interference budget. On
        CUDA the time between the two events is read once the GPU has passed them."""
        with self._cond:
            mark, self._forward = self._forward, None
            if mark is None:
                return
            t0, engine0, start_event = mark
            if start_event is None:
                seconds = time.perf_counter() - t0 - (self._engine_s_total - engine0)
                self._stepped(step, tokens, decoding, seconds)
                return
        import torch

        end_event = torch.cuda.Event(enable_timing=True)
        assert self._layouts is not None
        end_event.record(torch.cuda.current_stream(self._layouts[0].device))
        with self._cond:
            self._pending_steps.append((step, tokens, decoding, start_event, end_event))
            self._read_events()

    def _read_events(self) -> None:
        """CUDA step timings whose events the GPU has passed (caller holds _cond)."""
        while self._pending_steps and self._pending_steps[0][4].query():
            step, tokens, decoding, start, end = self._pending_steps.pop(0)
            self._stepped(step, tokens, decoding, start.elapsed_time(end) / 1000)

    def _stepped(self, step: int, tokens: int, decoding: bool, seconds: float) -> None:
        if seconds <= 0:
            return
        self._step_reports.append(StepReport(step, tokens, seconds))
        if decoding:
            self.budget.step(seconds)
            self._stats.budget_steps += 1
            self._stats.budget_step_seconds += seconds

    def take_reports(self) -> tuple[list[StepReport], list[LoadReport]]:
        """The steps and loads measured since the last call, for the scheduler's decision."""
        with self._cond:
            if self._pending_steps:
                self._read_events()
            steps, self._step_reports = self._step_reports, []
            loads, self._load_reports = self._load_reports, []
        return steps, loads

    def _engine_time(self, seconds: float) -> None:
        """Engine-thread seconds kvtier spent (caller holds _cond)."""
        self._stats.engine_seconds += seconds
        self._engine_s_total += seconds

    def _load_bytes(self, jobs: Sequence[LoadJob], only: set[int] | None = None
                    ) -> dict[str, int]:
        """Bytes by tier of the jobs' blocks (``only``: of those engine block ids)."""
        out: dict[str, int] = {}
        for job in jobs:
            tiers = job.tiers or ["unknown"] * len(job.block_ids)
            for bid, tier in zip(job.block_ids, tiers, strict=False):
                if only is None or bid in only:
                    out[tier] = out.get(tier, 0) + self.block_bytes
        return out

    def wait(self, job_ids: Sequence[int], deadline: float | None = None) -> None:
        """The fence: return once none of ``job_ids`` can read an engine block any more. A job
        not copying yet is taken over (its blocks copied out here, or dropped while the breaker
        is open); a copy in progress is waited for until ``deadline``, then revoked."""
        if not job_ids:
            return
        t0 = time.perf_counter()
        deadline = self.step_deadline() if deadline is None else deadline
        take: list[_Job] = []
        with self._cond:
            fenced = [self._unread[j] for j in job_ids if j in self._unread]
            if fenced:
                self._stats.fence_waits += 1
            for rec in fenced:
                if rec.state in ("queued", "preparing"):
                    if self.breaker.allows():
                        rec.state = "snapshot"
                        take.append(rec)
                    else:
                        self._revoke(rec)
        for rec in take:  # outside the lock: a local copy, no RPC
            self._snapshot(rec)
        with self._cond:
            while True:
                copying = [r for r in fenced if r.job.job_id in self._unread]
                left = deadline - time.monotonic()
                if not copying or left <= 0:
                    break
                self._cond.wait(left)
            for rec in copying:  # a copy that outlasts the step's budget: aborted, never stored
                self._revoke(rec)
            spent = time.perf_counter() - t0
            self._stats.fence_seconds += spent
            self._engine_time(spent)

    def _snapshot(self, rec: _Job) -> None:
        assert self._layouts is not None
        layout = self._layouts[0]
        try:
            rows = layout.staging(len(rec.job.block_ids))
            layout.gather(rec.job.block_ids, rows)
        except Exception as e:  # a failed copy is a dropped store, never an engine error
            log.warning("kvtier: fence copy of store job %d failed: %s", rec.job.job_id, e)
            rows = None
        with self._cond:
            rec.state = "preparing"
            rec.snapshot = rows
            if rows is None:
                self._revoke(rec)
            else:
                self._stats.fence_snapshots += 1
                self._unread.pop(rec.job.job_id, None)
            self._cond.notify_all()

    def _revoke(self, rec: _Job) -> None:
        """The engine takes the job's blocks back with no copy of them (caller holds _cond)."""
        rec.revoked = True
        self._stats.fence_revoked += 1
        self._unread.pop(rec.job.job_id, None)
        self._cond.notify_all()

    def load(self, jobs: Sequence[LoadJob], deadline: float | None = None, *,
             decoding: bool = False) -> set[int]:
        """Load every job into its engine blocks now, within ``deadline`` (the step's budget);
        returns the block ids that failed. ``decoding``: a request decodes in this step (the
        load is charged to the interference budget: loads always run, before the stores)."""
        if not jobs:
            return set()
        if self._layouts is None or not self.breaker.allows():
            missed = {b for j in jobs for b in j.block_ids}
            with self._cond:
                self._stats.load_failed_blocks += len(missed)
            return missed
        deadline = self.step_deadline() if deadline is None else deadline
        return self._load_now(jobs, self._layouts[0], deadline, engine_thread=True,
                              charge=decoding)

    def _load_now(self, jobs: Sequence[LoadJob], layout: Any, deadline: float, *,
                  engine_thread: bool, charge: bool = False, charged: float | None = None
                  ) -> set[int]:
        """One batched ``get_blocks`` per variant into ``layout``'s engine blocks, by
        ``deadline``; the block ids that failed."""
        t0 = time.perf_counter()
        had = deadline - time.monotonic()  # the time this load may take
        failed: set[int] = set()
        loaded = 0
        client = self._clients["load"]
        out_of_time = client.counters.out_of_time
        # a sync load planned from host hits only never waits on a promotion: a block that
        # left the host tier since the lookup is a miss at once, not the step's budget spent on
        # a disk read (which would also open the breaker)
        host_only = engine_thread and all(j.tiers and set(j.tiers) == {"host"} for j in jobs)
        for variant, keys, block_ids in _by_variant(jobs, self.tp_rank):
            try:
                found = self._handle("load", variant, deadline).get_blocks(
                    keys, layout, block_ids, deadline=deadline, host_only=host_only)
            except KvtierError as e:
                log.warning("kvtier: load of %d blocks failed: %s", len(keys), e)
                found = [False] * len(keys)
            except Exception as e:  # off the engine thread: never lose the report
                if engine_thread:
                    raise
                log.warning("kvtier: async load of %d blocks failed: %s", len(keys), e)
                found = [False] * len(keys)
            loaded += sum(found)
            failed.update(b for b, ok in zip(block_ids, found, strict=True) if not ok)
        spent = time.perf_counter() - t0
        with self._cond:
            self._stats.loaded_blocks += loaded
            self._stats.loaded_tokens += loaded * self.identity.tokens_per_block
            self._stats.loaded_bytes += loaded * self.block_bytes
            self._stats.load_failed_blocks += len(failed)
            self._stats.load_seconds += spent
            if engine_thread:
                self._engine_time(spent)
                self._stats.budget_exhausted += int(client.counters.out_of_time > out_of_time)
            if charged is not None:  # an async load charged its prediction when handed off
                self.budget.settle(charged, spent)
                self._stats.budget_load_seconds += spent
            elif charge:
                self.budget.charge_load(spent)
                self._stats.budget_load_seconds += spent
            # out of time: an RPC not started for lack of it, or one that outlasted it
            timed_out = client.counters.out_of_time > out_of_time or (
                bool(failed) and time.monotonic() >= deadline - 0.001)
            if timed_out and not loaded:
                # it needed more than the time it had (the daemon may answer ahead of the
                # deadline with its reads still going): count twice that, which a load with
                # this much time is then predicted not to fit (a real figure replaces it)
                spent = max(spent, 2 * had)
            self._report_load(jobs, engine_thread, loaded, failed, timed_out, spent)
        return failed

    def _report_load(self, jobs: Sequence[LoadJob], engine_thread: bool, loaded: int,
                     failed: set[int], timed_out: bool, spent: float) -> None:
        """The load's figure for the scheduler's decision (caller holds _cond)."""
        if loaded and engine_thread not in self._warm_loads:
            # the first load of each path pays one-time setup (staging buffers, the data
            # channel): not a figure of the tier
            self._warm_loads.add(engine_thread)
        elif loaded or timed_out:
            # a load cut at its deadline is a figure too, a lower bound: what did arrive
            # took ``spent`` (nothing did: one block took longer than ``spent``)
            arrived = None if not failed else (
                {b for j in jobs for b in j.block_ids} - failed if loaded else
                _first_block(jobs))
            self._load_reports.append(LoadReport(
                tuple(dict.fromkeys(j.req_id for j in jobs)),
                self._load_bytes(jobs, arrived), spent))

    def load_async(self, jobs: Sequence[LoadJob], *, decoding: bool = False) -> None:
        """Queue each request's load for the load thread and return at once (engine thread,
        after the forward). Every request is reported by ``finished_loads`` exactly once, also
        when it cannot be loaded at all (breaker open, not registered, closing)."""
        if not jobs:
            return
        t0 = time.perf_counter()
        by_req: dict[str, list[LoadJob]] = {}
        for job in jobs:
            by_req.setdefault(job.req_id, []).append(job)
        with self._cond:
            for req_id, req_jobs in by_req.items():
                ids = [b for j in req_jobs for b in j.block_ids]
                if self._layouts is None or self._closed or self._load_thread is None or \
                        not self.breaker.allows():
                    self._stats.load_failed_blocks += len(ids)
                    self._loads_done.append((req_id, set(ids)))
                    continue
                for b in ids:
                    self._loading_blocks[b] = self._loading_blocks.get(b, 0) + 1
                charged = None
                if decoding:  # charged its prediction now (loads before this step's stores)
                    charged = sum(j.predicted_s or 0.0 for j in req_jobs)
                    self.budget.charge_load(charged)
                self._load_queue.append((req_id, req_jobs, charged))
            self._cond.notify_all()
            self._engine_time(time.perf_counter() - t0)

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """The requests whose async load is over since the last call, and the block ids of
        theirs that failed (vLLM recomputes them): report both in the same step."""
        with self._cond:
            done, self._loads_done = self._loads_done, []
        return {r for r, _ in done}, {b for _, failed in done for b in failed}

    def loads_in_flight(self) -> int:
        with self._cond:
            return len(self._load_queue) + int(self._load_busy)

    def _load_loop(self) -> None:
        assert self._layouts is not None
        layout = self._layouts[2]
        while True:
            with self._cond:
                while not self._load_queue and not self._closed:
                    self._cond.wait()
                if not self._load_queue:
                    return
                req_id, jobs, charged = self._load_queue.popleft()
                self._load_busy = True
            ids = [b for j in jobs for b in j.block_ids]
            failed = set(ids)
            try:
                if self.breaker.allows():
                    deadline = time.monotonic() + self.cfg.async_load_timeout_ms / 1000
                    failed = self._load_now(jobs, layout, deadline, engine_thread=False,
                                            charged=charged)
                    if layout.device.type == "cuda":  # copies done before vLLM reads the blocks
                        import torch

                        torch.cuda.current_stream(layout.device).synchronize()
                else:
                    with self._cond:
                        self._stats.load_failed_blocks += len(ids)
            except Exception as e:  # every load is reported, loaded or failed
                log.warning("kvtier: async load for %s failed: %s", req_id, e)
                failed = set(ids)
            with self._cond:
                for b in ids:
                    left = self._loading_blocks.get(b, 0) - 1
                    if left > 0:
                        self._loading_blocks[b] = left
                    else:
                        self._loading_blocks.pop(b, None)
                self._loads_done.append((req_id, failed))
                self._load_busy = False
                self._cond.notify_all()

    def submit_stores(self, jobs: Sequence[StoreJob], *, decoding: bool = False) -> None:
        """Queue this step's store jobs (engine thread, after the forward; returns at once).
        ``decoding``: a request decodes in this step, so each job is held to the interference
        budget: admitted while it lasts (charged its predicted copy time, settled when done),
        otherwise dropped and counted rather than queued."""
        if not jobs:
            return
        t0 = time.perf_counter()
        with self._cond:
            for job in jobs:
                if self._layouts is None or self._closed or not self.breaker.allows() or \
                        len(self._queue) >= self.max_queued_stores or \
                        any(b in self._loading_blocks for b in job.block_ids):
                    # (a block an async load is still writing is never read by a store)
                    self._stats.store_dropped_blocks += len(job.block_ids)
                    continue
                charged = None
                if decoding:
                    nbytes = len(job.block_ids) * self.block_bytes
                    charged = (self._store_s_per_byte or 0.0) * nbytes
                    if not self.budget.admit_store(charged, nbytes):
                        self._stats.store_dropped_budget_blocks += len(job.block_ids)
                        self._stats.store_dropped_budget_bytes += nbytes
                        self._stats.store_dropped_blocks += len(job.block_ids)
                        continue
                    self._stats.budget_store_jobs += 1
                rec = _Job(job, self._forward_done())
                rec.charged = charged
                self._queue.append(rec)
                self._unread[job.job_id] = rec
            self._cond.notify_all()
            self._engine_time(time.perf_counter() - t0)

    def _forward_done(self) -> Any:
        """On CUDA, an event recorded on the engine's current stream after this step's forward:
        the store thread's gather waits for it (its own stream is not ordered with the engine's).
        None on CPU, where the forward has finished when wait_for_save runs."""
        assert self._layouts is not None
        device = self._layouts[0].device
        if device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def take_stats(self) -> dict[str, Any]:
        with self._cond:
            out = asdict(self._stats)
            self._stats = WorkerStats()
        return out

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._unread

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until the queued stores are done (for shutdown and tests)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._queue or self._busy_job) and time.monotonic() < deadline:
                self._cond.wait(timeout=0.05)
            return not self._queue and not self._busy_job

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._load_thread is not None:
            self._load_thread.join(timeout=self.cfg.async_load_timeout_ms / 1000 + 5)
        for c in self._clients.values():
            c.close()

    # -- store thread -----------------------------------------------------------------------------

    def _store_loop(self) -> None:
        assert self._layouts is not None
        layout = self._layouts[1]
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                rec = self._queue.popleft()
                if rec.revoked:  # the fence dropped it before it started
                    self._stats.store_dropped_blocks += len(rec.job.block_ids)
                    if rec.charged is not None:
                        self.budget.settle(rec.charged, 0.0)
                    continue
                if rec.state == "queued":
                    rec.state = "preparing"
                self._busy_job = True
            job = rec.job
            t0 = time.perf_counter()
            stored = present = dropped = 0
            try:
                keys = job.keys[self.tp_rank]
                if rec.forward_done is not None:  # CUDA: read only what the forward wrote
                    import torch

                    torch.cuda.current_stream(layout.device).wait_event(rec.forward_done)
                # over shm: one gather straight into the reserved arena slots, under the guard
                result = self._handle("store", job.variant).put_blocks(
                    keys, layout, job.block_ids, guard=_Guard(self, rec), token_ids=job.token_ids,
                    parent=job.parents[self.tp_rank] if job.parents else None)
                stored, present = result.stored, result.already_present
                dropped = result.dropped + result.rejected
            except Exception as e:  # a failed store is a future miss, never an engine error
                log.warning("kvtier: store job %d failed: %s", job.job_id, e)
                dropped = len(job.block_ids)
            with self._cond:
                rec.state = "done"
                rec.snapshot = None
                self._unread.pop(job.job_id, None)  # engine blocks may be reused from here on
                self._stats.stored_blocks += stored
                self._stats.stored_tokens += stored * self.identity.tokens_per_block
                self._stats.stored_bytes += stored * self.block_bytes
                self._stats.store_present_blocks += present
                self._stats.store_dropped_blocks += dropped
                spent = time.perf_counter() - t0
                self._stats.store_seconds += spent
                if stored:
                    per_byte = spent / (stored * self.block_bytes)
                    old = self._store_s_per_byte
                    self._store_s_per_byte = per_byte if old is None else \
                        0.8 * old + 0.2 * per_byte
                if rec.charged is not None:
                    self.budget.settle(rec.charged, spent)
                    self._stats.budget_store_seconds += spent
                self._busy_job = False
                self._cond.notify_all()

    def _handle(self, role: str, variant: Variant, deadline: float | None = None
                ) -> NamespaceHandle:
        h = self._handles.get((role, variant))
        if h is None:
            h = self._clients[role].register(self.identity.namespace(variant, self.tp_rank),
                                             deadline=deadline)
            self._handles[(role, variant)] = h
        return h


def _first_block(jobs: Sequence[LoadJob]) -> set[int]:
    """The first engine block of the first job (a load that delivered nothing)."""
    return {jobs[0].block_ids[0]} if jobs and jobs[0].block_ids else set()


def _by_variant(jobs: Sequence[LoadJob], rank: int
                ) -> list[tuple[Variant, list[bytes], list[int]]]:
    """Jobs merged per variant (one batched transfer each), in first-seen order."""
    merged: dict[Variant, tuple[list[bytes], list[int]]] = {}
    for job in jobs:
        keys, ids = merged.setdefault(job.variant, ([], []))
        keys.extend(job.keys[rank])
        ids.extend(job.block_ids)
    return [(v, k, i) for v, (k, i) in merged.items()]

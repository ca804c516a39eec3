"""The load path of the vLLM worker: engine blocks filled from kvtierd, sync or async.

With ``load_mode="sync"`` (the default) loads run on the engine thread, one batched
``get_blocks`` per namespace variant (over shm, scatter kernels read straight from the pinned
slots); a miss, a timeout or a daemon that is away fails those block ids, which vLLM
recomputes (``kv_load_failure_policy="recompute"``). No load RPC or load round starts after the
step's budget (``step_budget_ms``), nor after the time recomputing the loaded blocks would take
(the decision's ``recompute_s``, ``kvtier.adaptive.worth_waiting_s``): a load predicted wrong
costs at most that, and the daemon answers by the deadline with what its host tier holds.

Asynchronous loads (``load_mode="async"``). ``load_async(jobs)`` (engine thread, after the
forward) queues one load per request and returns at once; the ``kvtier-load`` thread runs its
``get_blocks`` (the daemon pins the blocks from PrepareLoad until the copy into the engine blocks
is done and CompleteLoad is sent, as for a synchronous load) within ``async_load_timeout_ms``,
and ``finished_loads()`` (engine thread, every step) hands back the requests whose load is over
and the block ids that failed. An async load the adaptive decision chose is also given up after
the time recomputing it would take, from when the load thread starts it (the request waits for
it: a load that late has already cost it the recompute). vLLM does not schedule a request while
its load is in flight (``WAITING_FOR_REMOTE_KVS``), so no forward pass reads those blocks, and it
holds them even if the request is aborted until the load is reported finished. kvtier itself
never stores from a block a load is writing: ``submit_stores`` drops such a job (it cannot happen
through the planner, which stores only scheduled requests' computed blocks; the check makes it a
rule). Loads use the load session and their own ``PagedKvLayout`` (staging buffers) on the load
thread only.

Each load is counted, charged to the interference budget when a request decodes (sync: measured;
async: predicted at hand-off, settled when done) and reported (``LoadReport``) for the
scheduler's decision.

Ownership and concurrency: a part of ``KvtierWorker`` (``worker``), handed the worker's
``WorkerState``; owns the load thread, the async queue, the blocks being written, the finished
loads and the load reports, and uses the state's load session (``clients["load"]``). Engine
thread and ``kvtier-load`` thread, under the state's ``cond``, never held across an RPC or a
copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtier.adaptive import cut_load_s, worth_waiting_s
from kvtier.client import Client
from kvtier.integrations.vllm.connector.config import Variant
from kvtier.integrations.vllm.connector.plans import LoadJob, LoadReport
from kvtier.integrations.vllm.connector.worker_state import WorkerState
from kvtier_contract.errors import KvtierError

log = logging.getLogger("vllm.kvtier")


class LoadPath:
    """The worker's loads; see the module docstring."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        # async loads (under state.cond): queued (req_id, jobs, charge), finished (req_id,
        # failed block ids), engine blocks being written (block id -> loads writing it)
        self._load_queue: deque[tuple[str, list[LoadJob], float | None]] = deque()
        self._loads_done: list[tuple[str, set[int]]] = []
        self._loading_blocks: dict[int, int] = {}
        self._load_busy = False
        self._thread: threading.Thread | None = None
        # the loads' figures for the scheduler's decision, and the paths (engine thread or not)
        # that paid their one-time setup already
        self._load_reports: list[LoadReport] = []
        self._warm_loads: set[bool] = set()

    def start(self) -> None:
        """Start the ``kvtier-load`` thread (``load_mode="async"``, after ``register``)."""
        self._thread = threading.Thread(target=self._load_loop, name="kvtier-load", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the load thread once the state is closed (its last load gets its timeout)."""
        if self._thread is not None:
            self._thread.join(timeout=self.state.cfg.async_load_timeout_ms / 1000 + 5)

    def writing(self, block_ids: Sequence[int]) -> bool:
        """Whether an async load is still writing one of ``block_ids`` (caller holds the
        state's cond)."""
        return any(b in self._loading_blocks for b in block_ids)

    def take_reports(self) -> list[LoadReport]:
        """The loads measured since the last call (caller holds the state's cond)."""
        loads, self._load_reports = self._load_reports, []
        return loads

    def load(
        self, jobs: Sequence[LoadJob], deadline: float | None = None, *, decoding: bool = False
    ) -> set[int]:
        """Load every job into its engine blocks now, within ``deadline`` (the step's budget) and
        no longer than recomputing them would take (the jobs' ``recompute_s``, when every job
        has one: ``kvtier.adaptive.worth_waiting_s``); returns the block ids that failed.
        ``decoding``: a request decodes in this step (the load is charged to the interference
        budget: loads always run, before the stores)."""
        if not jobs:
            return set()
        if self.state.layouts is None or not self.state.breaker.allows():
            missed = {b for j in jobs for b in j.block_ids}
            with self.state.cond:
                self.state.stats.load_failed_blocks += len(missed)
            return missed
        deadline = _worth_deadline(self.state.step_deadline() if deadline is None else deadline, jobs)
        return self._load_now(jobs, self.state.layouts[0], deadline, engine_thread=True, charge=decoding)

    def _load_now(
        self,
        jobs: Sequence[LoadJob],
        layout: Any,
        deadline: float,
        *,
        engine_thread: bool,
        charge: bool = False,
        charged: float | None = None,
    ) -> set[int]:
        """One batched ``get_blocks`` per variant into ``layout``'s engine blocks, by
        ``deadline``; the block ids that failed."""
        t0 = time.perf_counter()
        had = deadline - time.monotonic()  # the time this load may take
        client = self.state.clients["load"]
        out_of_time = client.counters.out_of_time
        loaded, failed = self._get_blocks(jobs, layout, deadline, engine_thread)
        spent = time.perf_counter() - t0
        with self.state.cond:
            self._count_load(
                client,
                out_of_time,
                loaded,
                failed,
                spent,
                engine_thread=engine_thread,
                charge=charge,
                charged=charged,
            )
            # out of time: an RPC not started for lack of it, or one that outlasted it
            timed_out = client.counters.out_of_time > out_of_time or (
                bool(failed) and time.monotonic() >= deadline - 0.001
            )
            if timed_out and not loaded:  # it needed more than the time it had
                spent = cut_load_s(spent, had)
            self._report_load(jobs, engine_thread, loaded, failed, timed_out, spent)
        return failed

    def _get_blocks(
        self, jobs: Sequence[LoadJob], layout: Any, deadline: float, engine_thread: bool
    ) -> tuple[int, set[int]]:
        """The transfers of ``_load_now``: (blocks loaded, block ids that failed)."""
        failed: set[int] = set()
        loaded = 0
        # a sync load planned from host hits only never waits on a promotion: a block that
        # left the host tier since the lookup is a miss at once, not the step's budget spent on
        # a disk read (which would also open the breaker)
        host_only = engine_thread and all(j.tiers and set(j.tiers) == {"host"} for j in jobs)
        for variant, keys, block_ids in _by_variant(jobs, self.state.tp_rank):
            try:
                found = self.state.handle("load", variant, deadline).get_blocks(
                    keys, layout, block_ids, deadline=deadline, host_only=host_only
                )
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
        return loaded, failed

    def _count_load(
        self,
        client: Client,
        out_of_time: int,
        loaded: int,
        failed: set[int],
        spent: float,
        *,
        engine_thread: bool,
        charge: bool,
        charged: float | None,
    ) -> None:
        """A load's counters and its charge to the interference budget (caller holds the
        state's cond)."""
        self.state.stats.loaded_blocks += loaded
        self.state.stats.loaded_tokens += loaded * self.state.identity.tokens_per_block
        self.state.stats.loaded_bytes += loaded * self.state.block_bytes
        self.state.stats.load_failed_blocks += len(failed)
        self.state.stats.load_seconds += spent
        if engine_thread:
            self.state.engine_time(spent)
            self.state.stats.budget_exhausted += int(client.counters.out_of_time > out_of_time)
        if charged is not None:  # an async load charged its prediction when handed off
            self.state.budget.settle(charged, spent)
            self.state.stats.budget_load_seconds += spent
        elif charge:
            self.state.budget.charge_load(spent)
            self.state.stats.budget_load_seconds += spent

    def _report_load(
        self,
        jobs: Sequence[LoadJob],
        engine_thread: bool,
        loaded: int,
        failed: set[int],
        timed_out: bool,
        spent: float,
    ) -> None:
        """The load's figure for the scheduler's decision (caller holds the state's cond)."""
        if loaded and engine_thread not in self._warm_loads:
            # the first load of each path pays one-time setup (staging buffers, the data
            # channel): not a figure of the tier
            self._warm_loads.add(engine_thread)
        elif loaded or timed_out:
            # a load cut at its deadline is a figure too, a lower bound: what did arrive
            # took ``spent`` (nothing did: one block took longer than ``spent``)
            arrived = (
                None
                if not failed
                else ({b for j in jobs for b in j.block_ids} - failed if loaded else _first_block(jobs))
            )
            self._load_reports.append(
                LoadReport(
                    tuple(dict.fromkeys(j.req_id for j in jobs)), self._load_bytes(jobs, arrived), spent
                )
            )

    def _load_bytes(self, jobs: Sequence[LoadJob], only: set[int] | None = None) -> dict[str, int]:
        """Bytes by tier of the jobs' blocks (``only``: of those engine block ids)."""
        out: dict[str, int] = {}
        for job in jobs:
            tiers = job.tiers or ["unknown"] * len(job.block_ids)
            for bid, tier in zip(job.block_ids, tiers, strict=False):
                if only is None or bid in only:
                    out[tier] = out.get(tier, 0) + self.state.block_bytes
        return out

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
        with self.state.cond:
            for req_id, req_jobs in by_req.items():
                ids = [b for j in req_jobs for b in j.block_ids]
                if (
                    self.state.layouts is None
                    or self.state.closed
                    or self._thread is None
                    or not self.state.breaker.allows()
                ):
                    self.state.stats.load_failed_blocks += len(ids)
                    self._loads_done.append((req_id, set(ids)))
                    continue
                for b in ids:
                    self._loading_blocks[b] = self._loading_blocks.get(b, 0) + 1
                charged = None
                if decoding:  # charged its prediction now (loads before this step's stores)
                    charged = sum(j.predicted_s or 0.0 for j in req_jobs)
                    self.state.budget.charge_load(charged)
                self._load_queue.append((req_id, req_jobs, charged))
            self.state.cond.notify_all()
            self.state.engine_time(time.perf_counter() - t0)

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """The requests whose async load is over since the last call, and the block ids of
        theirs that failed (vLLM recomputes them): report both in the same step."""
        with self.state.cond:
            done, self._loads_done = self._loads_done, []
        return {r for r, _ in done}, {b for _, failed in done for b in failed}

    def loads_in_flight(self) -> int:
        with self.state.cond:
            return len(self._load_queue) + int(self._load_busy)

    def _load_loop(self) -> None:
        assert self.state.layouts is not None
        layout = self.state.layouts[2]
        while True:
            with self.state.cond:
                while not self._load_queue and not self.state.closed:
                    self.state.cond.wait()
                if not self._load_queue:
                    return
                req_id, jobs, charged = self._load_queue.popleft()
                self._load_busy = True
            ids = [b for j in jobs for b in j.block_ids]
            failed = set(ids)
            try:
                if self.state.breaker.allows():
                    # the request waits for it: no longer than recomputing it would take
                    deadline = _worth_deadline(
                        time.monotonic() + self.state.cfg.async_load_timeout_ms / 1000, jobs
                    )
                    failed = self._load_now(jobs, layout, deadline, engine_thread=False, charged=charged)
                    if layout.device.type == "cuda":  # copies done before vLLM reads the blocks
                        import torch

                        torch.cuda.current_stream(layout.device).synchronize()
                else:
                    with self.state.cond:
                        self.state.stats.load_failed_blocks += len(ids)
            except Exception as e:  # every load is reported, loaded or failed
                log.warning("kvtier: async load for %s failed: %s", req_id, e)
                failed = set(ids)
            with self.state.cond:
                for b in ids:
                    left = self._loading_blocks.get(b, 0) - 1
                    if left > 0:
                        self._loading_blocks[b] = left
                    else:
                        self._loading_blocks.pop(b, None)
                self._loads_done.append((req_id, failed))
                self._load_busy = False
                self.state.cond.notify_all()


def _first_block(jobs: Sequence[LoadJob]) -> set[int]:
    """The first engine block of the first job (a load that delivered nothing)."""
    return {jobs[0].block_ids[0]} if jobs and jobs[0].block_ids else set()


def _by_variant(jobs: Sequence[LoadJob], rank: int) -> list[tuple[Variant, list[bytes], list[int]]]:
    """Jobs merged per variant (one batched transfer each), in first-seen order."""
    merged: dict[Variant, tuple[list[bytes], list[int]]] = {}
    for job in jobs:
        for variant, part_keys, part_ids in job.parts(rank):
            if part_ids:
                keys, ids = merged.setdefault(variant, ([], []))
                keys.extend(part_keys)
                ids.extend(part_ids)
    return [(v, k, i) for v, (k, i) in merged.items()]


def _worth_deadline(deadline: float, jobs: Sequence[LoadJob]) -> float:
    """``deadline``, cut to as long from now as recomputing all the jobs' blocks would take
    (they load together, and would be recomputed together); uncut when a job's recompute time
    is unknown (no figures yet, or the ``always`` policy)."""
    if any(j.recompute_s is None for j in jobs):
        return deadline
    worth = worth_waiting_s(sum(j.recompute_s or 0.0 for j in jobs))
    return deadline if worth is None else min(deadline, time.monotonic() + worth)

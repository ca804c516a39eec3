"""The store path of the vLLM worker: store jobs, their thread and the fence.

Stores run on one ``kvtier-store`` thread: one ``put_blocks`` per job (over shm the gather kernel
writes straight into the reserved arena slots, ``kvtier.direct``); on CUDA the gather first waits
for an event recorded on the engine's stream in ``submit_stores``. When ``max_queued_stores`` jobs
wait already, or the breaker is open, a new job is dropped and counted (never blocks the engine).
While a request decodes, each job is admitted against the interference budget (charged its
predicted copy time, settled with the real one), otherwise dropped and counted
(``store_dropped_budget_blocks``), never queued.

The fence. A store job reads engine blocks only during its copy out of them (``batches.CopyGuard``
marks it); its RPCs (PrepareStore before, CompleteStore after) never touch them. A store job's
states, under the state's ``cond``::

    QUEUED --store thread--> PREPARING <--guard.begin/end--> COPYING --last copy / put done--> DONE
      |                          |                             |
      +--------fence-------------+                             +--fence, copy outlasts the step's
      v                                                        v  budget: REVOKED (batch aborted)
    SNAPSHOT (engine thread copies the job's blocks out) --> SNAPPED (the put writes the copy)
      or REVOKED at once when the breaker is open (the store would be dropped anyway)

So the fence waits only for a copy in progress, never for an RPC, and a job that left the fence
(SNAPPED, REVOKED, DONE) never reads an engine block again; a revoked copy is never committed.


Ownership and concurrency: a part of ``KvtierWorker`` (``worker``), handed the worker's
``WorkerState`` and its ``LoadPath`` (asked which blocks an async load is writing); owns the store
thread, its queue, the job records (``StoreJobRecord``) and the measured store rate, and uses the
state's store session (``clients["store"]``). ``submit_stores``/``wait`` on the engine thread,
``_store_loop`` on the ``kvtier-store`` thread, sharing the queue, the records and the counters
under the state's ``cond``, never held across an RPC or a copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtier.batches import CopyRevoked
from kvtier.integrations.vllm.connector.loads import LoadPath
from kvtier.integrations.vllm.connector.plans import StoreJob
from kvtier.integrations.vllm.connector.worker_state import StoreJobRecord, WorkerState

log = logging.getLogger("vllm.kvtier")


class _Guard:
    """The ``batches.CopyGuard`` of one job (store thread), over the worker's condition."""

    def __init__(self, stores: StorePath, rec: StoreJobRecord) -> None:
        self.stores = stores
        self.rec = rec

    def begin(self) -> Any | None:
        rec, cond = self.rec, self.stores.state.cond
        with cond:
            cond.wait_for(lambda: rec.state != "snapshot")
            if rec.snapshot is not None:
                return rec.snapshot
            if rec.revoked:
                raise CopyRevoked("the fence took the blocks back")
            rec.state = "copying"
            return None

    def end(self, more: bool) -> bool:
        rec, stores = self.rec, self.stores
        with stores.state.cond:
            if rec.state == "copying":
                rec.state = "preparing"
                if not more:  # no engine block is read again: the fence may let go now
                    rec.state = "done"
                    stores.let_go(rec)
            stores.state.cond.notify_all()
            return rec.snapshot is not None or not rec.revoked


class StorePath:
    """The worker's stores and fence; see the module docstring."""

    def __init__(self, state: WorkerState, loads: LoadPath, max_queued_stores: int) -> None:
        self.state = state
        self.loads = loads  # (a block an async load is still writing is never read by a store)
        self.max_queued_stores = max_queued_stores
        # under state.cond: the queued jobs, the jobs the fence must wait for or take over, a
        # job on the store thread, the measured store rate (moving average)
        self._queue: deque[StoreJobRecord] = deque()
        self._unread: dict[int, StoreJobRecord] = {}
        self._busy_job = False
        self._store_s_per_byte: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the ``kvtier-store`` thread (after ``register``)."""
        self._thread = threading.Thread(target=self._store_loop, name="kvtier-store", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Wait for the store thread once the state is closed."""
        if self._thread is not None:
            self._thread.join(timeout=5)

    def let_go(self, rec: StoreJobRecord) -> None:
        """The job reads no engine block again: the fence need not wait for it (caller holds
        the state's cond)."""
        self._unread.pop(rec.job.job_id, None)

    def submit_stores(self, jobs: Sequence[StoreJob], *, decoding: bool = False) -> None:
        """Queue this step's store jobs (engine thread, after the forward; returns at once).
        ``decoding``: a request decodes in this step, so each job is held to the interference
        budget: admitted while it lasts (charged its predicted copy time, settled when done),
        otherwise dropped and counted rather than queued."""
        if not jobs:
            return
        t0 = time.perf_counter()
        with self.state.cond:
            for job in jobs:
                if (
                    self.state.layouts is None
                    or self.state.closed
                    or not self.state.breaker.allows()
                    or len(self._queue) >= self.max_queued_stores
                    or self.loads.writing(job.block_ids)
                ):
                    # (a block an async load is still writing is never read by a store)
                    self.state.stats.store_dropped_blocks += len(job.block_ids)
                    continue
                charged = None
                if decoding:
                    nbytes = len(job.block_ids) * self.state.block_bytes
                    charged = (self._store_s_per_byte or 0.0) * nbytes
                    if not self.state.budget.admit_store(charged, nbytes):
                        self.state.stats.store_dropped_budget_blocks += len(job.block_ids)
                        self.state.stats.store_dropped_budget_bytes += nbytes
                        self.state.stats.store_dropped_blocks += len(job.block_ids)
                        continue
                    self.state.stats.budget_store_jobs += 1
                rec = StoreJobRecord(job, self._forward_done())
                rec.charged = charged
                self._queue.append(rec)
                self._unread[job.job_id] = rec
            self.state.cond.notify_all()
            self.state.engine_time(time.perf_counter() - t0)

    def _forward_done(self) -> Any:
        """On CUDA, an event recorded on the engine's current stream after this step's forward:
        the store thread's gather waits for it (its own stream is not ordered with the engine's).
        None on CPU, where the forward has finished when wait_for_save runs."""
        assert self.state.layouts is not None
        device = self.state.layouts[0].device
        if device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def wait(self, job_ids: Sequence[int], deadline: float | None = None) -> None:
        """The fence: return once none of ``job_ids`` can read an engine block any more. A job
        not copying yet is taken over (its blocks copied out here, or dropped while the breaker
        is open); a copy in progress is waited for until ``deadline``, then revoked."""
        if not job_ids:
            return
        t0 = time.perf_counter()
        deadline = self.state.step_deadline() if deadline is None else deadline
        take: list[StoreJobRecord] = []
        with self.state.cond:
            fenced = [self._unread[j] for j in job_ids if j in self._unread]
            if fenced:
                self.state.stats.fence_waits += 1
            for rec in fenced:
                if rec.state in ("queued", "preparing"):
                    if self.state.breaker.allows():
                        rec.state = "snapshot"
                        take.append(rec)
                    else:
                        self._revoke(rec)
        for rec in take:  # outside the lock: a local copy, no RPC
            self._snapshot(rec)
        with self.state.cond:
            while True:
                copying = [r for r in fenced if r.job.job_id in self._unread]
                left = deadline - time.monotonic()
                if not copying or left <= 0:
                    break
                self.state.cond.wait(left)
            for rec in copying:  # a copy that outlasts the step's budget: aborted, never stored
                self._revoke(rec)
            spent = time.perf_counter() - t0
            self.state.stats.fence_seconds += spent
            self.state.engine_time(spent)

    def _snapshot(self, rec: StoreJobRecord) -> None:
        assert self.state.layouts is not None
        layout = self.state.layouts[0]
        try:
            rows = layout.staging(len(rec.job.block_ids))
            layout.gather(rec.job.block_ids, rows)
        except Exception as e:  # a failed copy is a dropped store, never an engine error
            log.warning("kvtier: fence copy of store job %d failed: %s", rec.job.job_id, e)
            rows = None
        with self.state.cond:
            rec.state = "preparing"
            rec.snapshot = rows
            if rows is None:
                self._revoke(rec)
            else:
                self.state.stats.fence_snapshots += 1
                self._unread.pop(rec.job.job_id, None)
            self.state.cond.notify_all()

    def _revoke(self, rec: StoreJobRecord) -> None:
        """The engine takes the job's blocks back with no copy of them (caller holds the
        state's cond)."""
        rec.revoked = True
        self.state.stats.fence_revoked += 1
        self._unread.pop(rec.job.job_id, None)
        self.state.cond.notify_all()

    def idle(self) -> bool:
        with self.state.cond:
            return not self._queue and not self._unread

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until the queued stores are done (for shutdown and tests)."""
        deadline = time.monotonic() + timeout_s
        with self.state.cond:
            while (self._queue or self._busy_job) and time.monotonic() < deadline:
                self.state.cond.wait(timeout=0.05)
            return not self._queue and not self._busy_job

    # -- store thread -----------------------------------------------------------------------------

    def _store_loop(self) -> None:
        assert self.state.layouts is not None
        layout = self.state.layouts[1]
        while True:
            rec = self._next_store()
            if rec is None:
                return
            t0 = time.perf_counter()
            stored, present, dropped = self._put(rec, layout)
            self._stored(rec, t0, stored, present, dropped)

    def _next_store(self) -> StoreJobRecord | None:
        """The next job to run (store thread), None once closed with none left; a job the
        fence dropped before it started is counted here and skipped."""
        with self.state.cond:
            while True:
                while not self._queue and not self.state.closed:
                    self.state.cond.wait()
                if not self._queue:
                    return None
                rec = self._queue.popleft()
                if rec.revoked:  # the fence dropped it before it started
                    self.state.stats.store_dropped_blocks += len(rec.job.block_ids)
                    if rec.charged is not None:
                        self.state.budget.settle(rec.charged, 0.0)
                    continue
                if rec.state == "queued":
                    rec.state = "preparing"
                self._busy_job = True
                return rec

    def _put(self, rec: StoreJobRecord, layout: Any) -> tuple[int, int, int]:
        """The job's ``put_blocks`` (store thread, no lock): (stored, present, dropped)."""
        job = rec.job
        stored = present = dropped = 0
        try:
            keys = job.keys[self.state.tp_rank]
            if rec.forward_done is not None:  # CUDA: read only what the forward wrote
                import torch

                torch.cuda.current_stream(layout.device).wait_event(rec.forward_done)
            # over shm: one gather straight into the reserved arena slots, under the guard
            result = self.state.handle("store", job.variant).put_blocks(
                keys,
                layout,
                job.block_ids,
                guard=_Guard(self, rec),
                token_ids=job.token_ids,
                parent=job.parents[self.state.tp_rank] if job.parents else None,
            )
            stored, present = result.stored, result.already_present
            dropped = result.dropped + result.rejected
        except Exception as e:  # a failed store is a future miss, never an engine error
            log.warning("kvtier: store job %d failed: %s", job.job_id, e)
            dropped = len(job.block_ids)
        return stored, present, dropped

    def _stored(self, rec: StoreJobRecord, t0: float, stored: int, present: int, dropped: int) -> None:
        """The job is over: counters, the store rate, the budget's settlement (store thread)."""
        with self.state.cond:
            rec.state = "done"
            rec.snapshot = None
            self._unread.pop(rec.job.job_id, None)  # engine blocks may be reused from here on
            self.state.stats.stored_blocks += stored
            self.state.stats.stored_tokens += stored * self.state.identity.tokens_per_block
            self.state.stats.stored_bytes += stored * self.state.block_bytes
            self.state.stats.store_present_blocks += present
            self.state.stats.store_dropped_blocks += dropped
            spent = time.perf_counter() - t0
            self.state.stats.store_seconds += spent
            if stored:
                per_byte = spent / (stored * self.state.block_bytes)
                old = self._store_s_per_byte
                self._store_s_per_byte = per_byte if old is None else 0.8 * old + 0.2 * per_byte
            if rec.charged is not None:
                self.state.budget.settle(rec.charged, spent)
                self.state.stats.budget_store_seconds += spent
            self._busy_job = False
            self.state.cond.notify_all()

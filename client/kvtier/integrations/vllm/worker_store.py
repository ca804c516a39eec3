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
states, under ``_cond``::

    QUEUED --store thread--> PREPARING <--guard.begin/end--> COPYING --last copy / put done--> DONE
      |                          |                             |
      +--------fence-------------+                             +--fence, copy outlasts the step's
      v                                                        v  budget: REVOKED (batch aborted)
    SNAPSHOT (engine thread copies the job's blocks out) --> SNAPPED (the put writes the copy)
      or REVOKED at once when the breaker is open (the store would be dropped anyway)

So the fence waits only for a copy in progress, never for an RPC, and a job that left the fence
(SNAPPED, REVOKED, DONE) never reads an engine block again; a revoked copy is never committed.


Ownership and concurrency: a mixin of ``KvtierWorker`` (``worker.py``) over its shared state
(``worker_state``): the store session (``_clients["store"]``), the store thread's queue and the
job records (``_Job``); ``submit_stores``/``wait`` on the engine thread, ``_store_loop`` on the
``kvtier-store`` thread, sharing the queue, the records and the counters under ``_cond``, never
held across an RPC or a copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from kvtier.batches import CopyRevoked
from kvtier.integrations.vllm.plans import StoreJob
from kvtier.integrations.vllm.worker_state import WorkerState, _Job

log = logging.getLogger("vllm.kvtier")


class _Guard:
    """The ``batches.CopyGuard`` of one job (store thread), over the worker's condition."""

    def __init__(self, worker: StorePath, rec: _Job) -> None:
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


class StorePath(WorkerState):
    """The worker's stores and fence; see the module docstring."""

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
                if (
                    self._layouts is None
                    or self._closed
                    or not self.breaker.allows()
                    or len(self._queue) >= self.max_queued_stores
                    or any(b in self._loading_blocks for b in job.block_ids)
                ):
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

    # -- store thread -----------------------------------------------------------------------------

    def _store_loop(self) -> None:
        assert self._layouts is not None
        layout = self._layouts[1]
        while True:
            rec = self._next_store()
            if rec is None:
                return
            t0 = time.perf_counter()
            stored, present, dropped = self._put(rec, layout)
            self._stored(rec, t0, stored, present, dropped)

    def _next_store(self) -> _Job | None:
        """The next job to run (store thread), None once closed with none left; a job the
        fence dropped before it started is counted here and skipped."""
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return None
                rec = self._queue.popleft()
                if rec.revoked:  # the fence dropped it before it started
                    self._stats.store_dropped_blocks += len(rec.job.block_ids)
                    if rec.charged is not None:
                        self.budget.settle(rec.charged, 0.0)
                    continue
                if rec.state == "queued":
                    rec.state = "preparing"
                self._busy_job = True
                return rec

    def _put(self, rec: _Job, layout: Any) -> tuple[int, int, int]:
        """The job's ``put_blocks`` (store thread, no lock): (stored, present, dropped)."""
        job = rec.job
        stored = present = dropped = 0
        try:
            keys = job.keys[self.tp_rank]
            if rec.forward_done is not None:  # CUDA: read only what the forward wrote
                import torch

                torch.cuda.current_stream(layout.device).wait_event(rec.forward_done)
            # over shm: one gather straight into the reserved arena slots, under the guard
            result = self._handle("store", job.variant).put_blocks(
                keys,
                layout,
                job.block_ids,
                guard=_Guard(self, rec),
                token_ids=job.token_ids,
                parent=job.parents[self.tp_rank] if job.parents else None,
            )
            stored, present = result.stored, result.already_present
            dropped = result.dropped + result.rejected
        except Exception as e:  # a failed store is a future miss, never an engine error
            log.warning("kvtier: store job %d failed: %s", job.job_id, e)
            dropped = len(job.block_ids)
        return stored, present, dropped

    def _stored(self, rec: _Job, t0: float, stored: int, present: int, dropped: int) -> None:
        """The job is over: counters, the store rate, the budget's settlement (store thread)."""
        with self._cond:
            rec.state = "done"
            rec.snapshot = None
            self._unread.pop(rec.job.job_id, None)  # engine blocks may be reused from here on
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
                self._store_s_per_byte = per_byte if old is None else 0.8 * old + 0.2 * per_byte
            if rec.charged is not None:
                self.budget.settle(rec.charged, spent)
                self._stats.budget_store_seconds += spent
            self._busy_job = False
            self._cond.notify_all()

"""The state every path of the vLLM worker shares (``worker.KvtierWorker`` is built from it).

``WorkerState`` declares the attributes the store path (``worker_store``), the load path
(``worker_load``) and the step timing (``worker_steps``) share, and the few helpers all of them
use; ``KvtierWorker.__init__`` sets them. ``WorkerStats`` is the counters' record, ``_Job``
a store job's record (its states: ``worker_store``).

Ownership and concurrency: as ``KvtierWorker`` (see ``worker.py``): the job table, the queues,
the counters, the interference budget and the reports are guarded by one condition, ``_cond``,
never held across an RPC or a copy.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.adaptive import InterferenceBudget
from kvtier.breaker import Breaker
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.config import ConnectorConfig, EngineIdentity, Variant
from kvtier.integrations.vllm.plans import LoadJob, LoadReport, StepReport, StoreJob


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


class WorkerState:
    """The worker's shared state (declared here, set by ``KvtierWorker.__init__``); see the
    module docstring. Engine thread, store thread and load thread, under ``_cond``."""

    identity: EngineIdentity
    cfg: ConnectorConfig
    tp_rank: int
    max_queued_stores: int
    breaker: Breaker
    block_bytes: int
    _layouts: tuple[Any, Any, Any] | None  # (engine's, store's, load thread's)
    _clients: dict[str, Client]
    _handles: dict[tuple[str, Variant], NamespaceHandle]
    _cond: threading.Condition
    _queue: deque[_Job]
    _unread: dict[int, _Job]  # jobs the fence must wait for or take over
    _stats: WorkerStats
    _closed: bool
    _busy_job: bool
    _thread: threading.Thread | None
    _load_queue: deque[tuple[str, list[LoadJob], float | None]]
    _loads_done: list[tuple[str, set[int]]]
    _loading_blocks: dict[int, int]
    _load_busy: bool
    _load_thread: threading.Thread | None
    budget: InterferenceBudget
    _store_s_per_byte: float | None
    _engine_s_total: float
    _forward: tuple[float, float, Any] | None
    _pending_steps: list[tuple[int, int, bool, Any, Any]]
    _step_reports: list[StepReport]
    _load_reports: list[LoadReport]
    _warm_loads: set[bool]

    def step_deadline(self) -> float:
        """The end of a step's budget for kvtier's work, starting now."""
        return time.monotonic() + self.cfg.step_budget_ms / 1000

    def _engine_time(self, seconds: float) -> None:
        """Engine-thread seconds kvtier spent (caller holds _cond)."""
        self._stats.engine_seconds += seconds
        self._engine_s_total += seconds

    def _handle(self, role: str, variant: Variant, deadline: float | None = None) -> NamespaceHandle:
        h = self._handles.get((role, variant))
        if h is None:
            h = self._clients[role].register(
                self.identity.namespace(variant, self.tp_rank), deadline=deadline
            )
            self._handles[(role, variant)] = h
        return h

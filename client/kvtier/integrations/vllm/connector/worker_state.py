"""What the vLLM worker's parts share: ``WorkerState``, the counters and a store job's record.

``KvtierWorker`` (``worker``) builds one ``WorkerState`` and hands it to each of its parts: the
load path (``loads.LoadPath``), the store path (``stores.StorePath``) and the step timing
(``step_timing.StepTiming``). ``WorkerStats`` is the counters' record; ``StoreJobRecord`` a store
job's record (its states: ``stores``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier.adaptive import InterferenceBudget
from kvtier.breaker import Breaker
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.connector.config import ConnectorConfig, EngineIdentity, Variant
from kvtier.integrations.vllm.connector.plans import StoreJob


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


class StoreJobRecord:
    """One queued store job and where it stands with the fence (guarded by the worker's
    condition, ``WorkerState.cond``). ``snapshot``: the engine thread's copy of its blocks;
    ``revoked``: the engine took its blocks back without one."""

    def __init__(self, job: StoreJob, forward_done: Any) -> None:
        self.job = job
        self.forward_done = forward_done
        self.charged: float | None = None  # the budget's charge (predicted seconds), if held to it
        self.state: State = "queued"
        self.snapshot: Any = None
        self.revoked = False


class WorkerState:
    """What every part of one worker shares, and the helpers they all use.

    Owns: the engine's identity and settings, the breaker it was handed, the three
    ``PagedKvLayout``s once ``register`` set them (the engine thread's, the store thread's, the
    load thread's), the two sessions (``clients["load"]``, ``clients["store"]``) and their
    namespace handles, the counters (``stats``), the interference budget (``budget``: the step
    timing refills it, the loads charge it, the stores are admitted against it), kvtier's
    engine-thread seconds and the closing flag.

    Concurrency: ``cond`` is the worker's one condition; the counters, the budget, the closing
    flag and the engine-thread seconds, and every part's own tables, are guarded by it, never
    held across an RPC or a copy. ``layouts``, ``clients`` and the identity are set on the engine
    thread before the worker's threads start, read-only after; the handle table is filled
    lazily per role, each role by its one thread.
    """

    def __init__(
        self, identity: EngineIdentity, cfg: ConnectorConfig, tp_rank: int, breaker: Breaker
    ) -> None:
        self.identity = identity
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.breaker = breaker
        self.block_bytes = identity.namespace(tp_rank=tp_rank).block_bytes
        self.layouts: tuple[Any, Any, Any] | None = None  # (engine's, store's, load thread's)
        self.clients: dict[str, Client] = {}
        self.handles: dict[tuple[str, Variant], NamespaceHandle] = {}
        self.cond = threading.Condition()
        self.stats = WorkerStats()
        self.closed = False
        self.budget = InterferenceBudget(cfg.interference_budget)
        self.engine_s_total = 0.0  # engine-thread seconds in kvtier, never reset

    def step_deadline(self) -> float:
        """The end of a step's budget for kvtier's work, starting now."""
        return time.monotonic() + self.cfg.step_budget_ms / 1000

    def engine_time(self, seconds: float) -> None:
        """Engine-thread seconds kvtier spent (caller holds ``cond``)."""
        self.stats.engine_seconds += seconds
        self.engine_s_total += seconds

    def handle(self, role: str, variant: Variant, deadline: float | None = None) -> NamespaceHandle:
        """Session ``role``'s handle of the namespace of ``variant`` (registered on first use)."""
        h = self.handles.get((role, variant))
        if h is None:
            h = self.clients[role].register(self.identity.namespace(variant, self.tp_rank), deadline=deadline)
            self.handles[(role, variant)] = h
        return h

    def take_stats(self) -> dict[str, Any]:
        """The counters since the last call, reset."""
        with self.cond:
            out = asdict(self.stats)
            self.stats = WorkerStats()
        return out

"""The state the vLLM planner's parts share (``planner.Planner`` is built from it).

``_Req`` is one request's record on the scheduler side; ``PlannerState`` declares the attributes
the load decision (``planner_decide``), the store planning (``planner_store``) and the planner
itself share (``Planner.__init__`` sets them).

Ownership and concurrency: the planner owns every record; scheduler thread only, no locks (the
lookup thread is reached through ``LookupThread``'s own lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.adaptive import Decider, Decision
from kvtier.integrations.vllm.lookup_thread import LookupOutcome, LookupThread, Pin
from kvtier.integrations.vllm.plans import PlannerStats, RequestInfo


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


class PlannerState:
    """The planner's shared state (declared here, set by ``Planner.__init__``); scheduler
    thread only."""

    block_size: int
    decider: Decider
    block_bytes: int
    interference_budget: float | None
    sync_load_budget_s: float | None
    _step_s: float | None  # recent forward seconds per step (moving average)
    _decoding: set[str]  # requests that decoded in the last planned step
    _daemon_figures: dict[str, tuple[float, float, int]]
    lookup_timeout_s: float
    lookup_wait_s: float
    _wait_left: float  # of this step's budget for waiting on lookups
    pin_release_steps: int
    load_enabled: bool
    store_enabled: bool
    store_generated: bool
    load_async: bool
    event_token_ids: bool
    stats: PlannerStats
    _clock: Callable[[], float]
    _reqs: dict[str, _Req]
    _fence: dict[int, int]  # engine block id -> last store job reading it
    _releases: deque[tuple[int, list[Pin]]]  # (due step, pins)
    _pending: dict[str, _Req]  # requests with a load planned, not yet handed out
    _step: int
    _next_job: int
    _thread: LookupThread

    def _init_tables(self) -> None:
        """The per-request and per-step records, empty (``Planner.__init__``)."""
        self._wait_left = self.lookup_wait_s  # of this step's budget for waiting on lookups
        self._reqs = {}
        self._fence = {}  # engine block id -> last store job reading it
        self._releases = deque()  # (due step, pins)
        self._pending = {}  # requests with a load planned, not yet handed out
        self._step = 0
        self._next_job = 1

    def _outcome(self, st: _Req) -> LookupOutcome | None:
        raise NotImplementedError  # Planner's

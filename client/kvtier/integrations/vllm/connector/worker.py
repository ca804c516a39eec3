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
under the state's ``cond``), over the steps in which a request decodes: ``forward_end`` refills
it with the step's forward seconds; the step's loads were charged before (sync: measured;
async: predicted at hand-off, settled when done); each store job is admitted while the balance
lasts, charged its predicted copy time and settled with the real one, otherwise dropped and
counted (``store_dropped_budget_blocks``), never queued.
    w.close()

Never stall the engine. The engine thread's kvtier work in one step is bounded by
``step_budget_ms``: no load RPC or load round starts after it (those blocks fail and vLLM
recomputes them), and the fence waits no longer. The worker's clients share one circuit breaker
with every kvtier client of this process for the same daemon (``breaker.shared_breaker``: the
load and store sessions, the scheduler's lookup session when it lives here, the secondary
tier's): after the first call that finds the daemon down or silent, loads fail and stores are
dropped at once until the breaker's probe thread has seen the daemon again.

The worker holds three parts over one ``WorkerState`` (``worker_state``: the identity, the
settings, the sessions, the layouts, the counters, the interference budget, the one condition),
each handed the state in its constructor: ``loads.LoadPath`` (sync loads on the engine thread,
async loads on the ``kvtier-load`` thread), ``stores.StorePath`` (store jobs on the
``kvtier-store`` thread, and the fence that keeps them off re-allocated blocks; handed the load
path too, which says which blocks an async load is writing) and ``step_timing.StepTiming`` (each
step's forward seconds, the reports for the scheduler, the interference budget's refill).

Ownership: the engine owns the KV tensors; the worker owns its parts and the state, which holds
two ``kvtier.Client`` sessions (loads, stores: a long store transfer never delays a load).
Thread-safety: ``register``/``wait``/``load``/``submit_stores``/``take_stats``/``close`` on the
engine thread; the store and load threads share the queues, the job records and the counters
under the state's one condition, never held across an RPC or a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.adaptive import InterferenceBudget
from kvtier.breaker import Breaker
from kvtier.client import Client
from kvtier.integrations.vllm.breaker import shared_breaker
from kvtier.integrations.vllm.config import ConfigError
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, EngineIdentity
from kvtier.integrations.vllm.connector.loads import LoadPath
from kvtier.integrations.vllm.connector.plans import LoadJob, LoadReport, StepReport, StoreJob
from kvtier.integrations.vllm.connector.step_timing import StepTiming
from kvtier.integrations.vllm.connector.stores import StorePath
from kvtier.integrations.vllm.connector.worker_state import WorkerState, WorkerStats
from kvtier.settings import ClientSettings

__all__ = ["KvtierWorker", "WorkerStats"]


class KvtierWorker:
    """See the module docstring."""

    def __init__(
        self,
        identity: EngineIdentity,
        cfg: ConnectorConfig,
        *,
        tp_rank: int = 0,
        max_queued_stores: int = 64,
        breaker: Breaker | None = None,
    ) -> None:
        self.state = WorkerState(
            identity, cfg, tp_rank, breaker if breaker is not None else shared_breaker(cfg.address)
        )
        self.loads = LoadPath(self.state)
        self.stores = StorePath(self.state, self.loads, max_queued_stores)
        self.steps = StepTiming(self.state)

    @property
    def identity(self) -> EngineIdentity:
        return self.state.identity

    @property
    def cfg(self) -> ConnectorConfig:
        return self.state.cfg

    @property
    def tp_rank(self) -> int:
        return self.state.tp_rank

    @property
    def breaker(self) -> Breaker:
        return self.state.breaker

    @property
    def block_bytes(self) -> int:
        return self.state.block_bytes

    @property
    def budget(self) -> InterferenceBudget:
        """The interference budget (``cfg.interference_budget``), under the state's cond."""
        return self.state.budget

    # -- engine thread ----------------------------------------------------------------------------

    def register(self, layers: Sequence[Any]) -> None:
        """Per-layer KV tensors in layer order (vLLM's ``[B, H, N, C]`` views)."""
        from kvtier.layouts import PagedKvLayout  # torch; only when a worker exists

        state = self.state
        engine_layout = PagedKvLayout.from_layer_tensors(layers, name=state.identity.layout)
        if engine_layout.block_bytes != state.block_bytes:
            raise ConfigError(
                "kv_cache",
                f"{engine_layout.num_layers} layers x "
                f"{engine_layout.page_bytes} B pages = {engine_layout.block_bytes} B "
                f"per block, but the namespace says {state.block_bytes} B",
            )
        state.layouts = (
            engine_layout,
            PagedKvLayout.from_layer_tensors(layers, name=state.identity.layout),
            PagedKvLayout.from_layer_tensors(layers, name=state.identity.layout),
        )
        for role in ("load", "store"):
            state.clients[role] = Client.connect(  # lazy: away is a miss, logged once per cause
                state.cfg.address, lazy=True, breaker=state.breaker, settings=self._settings(role)
            )
            state.handle(role, BASE)  # registered now, not on the engine's first step
        self.stores.start()
        if state.cfg.load_mode == "async":
            self.loads.start()

    def _settings(self, role: str) -> ClientSettings:
        """The client settings of session ``role`` (``load`` or ``store``)."""
        cfg = self.state.cfg
        return ClientSettings(
            transport=cfg.transport,
            timeout_s=cfg.request_timeout_ms / 1000,
            lease_ttl_s=cfg.lease_ttl_ms / 1000,
            probe_timeout_s=cfg.probe_timeout_ms / 1000,
            client_name=f"vllm-tp{self.state.tp_rank}-{role}",
            token_file=cfg.token_file,
            unix_login=cfg.unix_login,
        )

    @property
    def registered(self) -> bool:
        return self.state.layouts is not None

    def step_deadline(self) -> float:
        """The end of a step's budget for kvtier's work, starting now."""
        return self.state.step_deadline()

    def forward_start(self) -> None:
        """The step's forward starts now (``StepTiming.forward_start``)."""
        self.steps.forward_start()

    def forward_end(self, step: int, tokens: int, decoding: bool) -> None:
        """The step's forward is over (``StepTiming.forward_end``)."""
        self.steps.forward_end(step, tokens, decoding)

    def wait(self, job_ids: Sequence[int], deadline: float | None = None) -> None:
        """The fence (``StorePath.wait``)."""
        self.stores.wait(job_ids, deadline)

    def load(
        self, jobs: Sequence[LoadJob], deadline: float | None = None, *, decoding: bool = False
    ) -> set[int]:
        """Load now (``LoadPath.load``); the block ids that failed."""
        return self.loads.load(jobs, deadline, decoding=decoding)

    def load_async(self, jobs: Sequence[LoadJob], *, decoding: bool = False) -> None:
        """Queue the loads for the load thread (``LoadPath.load_async``)."""
        self.loads.load_async(jobs, decoding=decoding)

    def finished_loads(self) -> tuple[set[str], set[int]]:
        """The async loads over since the last call (``LoadPath.finished_loads``)."""
        return self.loads.finished_loads()

    def loads_in_flight(self) -> int:
        return self.loads.loads_in_flight()

    def submit_stores(self, jobs: Sequence[StoreJob], *, decoding: bool = False) -> None:
        """Queue this step's store jobs (``StorePath.submit_stores``)."""
        self.stores.submit_stores(jobs, decoding=decoding)

    def idle(self) -> bool:
        return self.stores.idle()

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until the queued stores are done (for shutdown and tests)."""
        return self.stores.drain(timeout_s)

    def take_reports(self) -> tuple[list[StepReport], list[LoadReport]]:
        """The steps and loads measured since the last call, for the scheduler's decision."""
        with self.state.cond:
            return self.steps.take_reports(), self.loads.take_reports()

    def take_stats(self) -> dict[str, Any]:
        return self.state.take_stats()

    def close(self) -> None:
        self.drain()
        with self.state.cond:
            self.state.closed = True
            self.state.cond.notify_all()
        self.stores.join()
        self.loads.join()
        for c in self.state.clients.values():
            c.close()

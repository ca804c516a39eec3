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

The paths live beside this module, as mixins over one shared state (``worker_state``):
``worker_load`` (sync loads on the engine thread, async loads on the ``kvtier-load`` thread),
``worker_store`` (store jobs on the ``kvtier-store`` thread, and the fence that keeps them off
re-allocated blocks) and ``worker_steps`` (each step's forward seconds, the reports for the
scheduler, the interference budget's refill).

Ownership: the engine owns the KV tensors; this object owns two ``kvtier.Client`` sessions (loads,
stores: a long store transfer never delays a load), the store thread, its queue and the job
records. Thread-safety: ``register``/``wait``/``load``/``submit_stores``/``take_stats``/``close``
on the engine thread; the store thread shares the queue, the job records and the counters under
one condition, never held across an RPC or a copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvtier.breaker import Breaker
from kvtier.client import Client
from kvtier.integrations.vllm.config import BASE, ConfigError, ConnectorConfig, EngineIdentity
from kvtier.integrations.vllm.worker_load import LoadPath
from kvtier.integrations.vllm.worker_state import WorkerStats
from kvtier.integrations.vllm.worker_steps import StepTiming
from kvtier.integrations.vllm.worker_store import StorePath
from kvtier.settings import ClientSettings

__all__ = ["KvtierWorker", "WorkerStats", "shared_breaker"]

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


class KvtierWorker(StepTiming, LoadPath, StorePath):
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
        self.identity = identity
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.max_queued_stores = max_queued_stores
        self.breaker = breaker if breaker is not None else shared_breaker(cfg.address)
        self.block_bytes = identity.namespace(tp_rank=tp_rank).block_bytes
        self._layouts = None  # (engine's, store's, load thread's)
        self._clients = {}
        self._handles = {}
        self._cond = threading.Condition()
        self._queue = deque()
        self._unread = {}  # jobs the fence must wait for or take over
        self._stats = WorkerStats()
        self._closed = False
        self._busy_job = False
        self._thread = None
        self._init_async_loads()
        self._init_step_timing(cfg.interference_budget)

    # -- engine thread ----------------------------------------------------------------------------

    def register(self, layers: Sequence[Any]) -> None:
        """Per-layer KV tensors in layer order (vLLM's ``[B, H, N, C]`` views)."""
        from kvtier.layouts import PagedKvLayout  # torch; only when a worker exists

        engine_layout = PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout)
        if engine_layout.block_bytes != self.block_bytes:
            raise ConfigError(
                "kv_cache",
                f"{engine_layout.num_layers} layers x "
                f"{engine_layout.page_bytes} B pages = {engine_layout.block_bytes} B "
                f"per block, but the namespace says {self.block_bytes} B",
            )
        self._layouts = (
            engine_layout,
            PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout),
            PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout),
        )
        for role in ("load", "store"):
            self._clients[role] = Client.connect(  # lazy: away is a miss, logged once per cause
                self.cfg.address,
                lazy=True,
                breaker=self.breaker,
                settings=ClientSettings(
                    transport=self.cfg.transport,
                    timeout_s=self.cfg.request_timeout_ms / 1000,
                    lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                    probe_timeout_s=self.cfg.probe_timeout_ms / 1000,
                    client_name=f"vllm-tp{self.tp_rank}-{role}",
                    token_file=self.cfg.token_file,
                    unix_login=self.cfg.unix_login,
                ),
            )
            self._handle(role, BASE)  # registered now, not on the engine's first step
        self._thread = threading.Thread(target=self._store_loop, name="kvtier-store", daemon=True)
        self._thread.start()
        if self.cfg.load_mode == "async":
            self._load_thread = threading.Thread(target=self._load_loop, name="kvtier-load", daemon=True)
            self._load_thread.start()

    @property
    def registered(self) -> bool:
        return self._layouts is not None

    def take_stats(self) -> dict[str, Any]:
        with self._cond:
            out = asdict(self._stats)
            self._stats = WorkerStats()
        return out

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

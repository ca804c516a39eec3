"""Worker-side half of the vLLM connector: moves blocks between the engine's paged KV and kvtierd.

No vLLM import (the adapter hands in the per-layer tensors and the plans). Lifecycle::

    w = KvtierWorker(identity, cfg, tp_rank=r)
    w.register(layer_tensors)        # in layer order; builds the PagedKvLayout, opens 2 clients
    each step:  w.wait(plan.flush)   # fence: store jobs still reading re-allocated blocks
                failed = w.load(plan.loads)      # before the forward; failed block ids
                w.submit_stores(plan.stores)     # after the forward; returns at once
                w.take_stats()
    w.close()

Loads are synchronous on the engine thread, one batched ``get_blocks`` per namespace variant
(over shm, scatter kernels read straight from the pinned slots); a miss, a timeout or a daemon
that is away fails those block ids, which vLLM recomputes (``kv_load_failure_policy="recompute"``).
Stores run on one ``kvtier-store`` thread: one ``put_blocks`` per job (over shm the gather kernel
writes straight into the reserved arena slots, ``kvtier.direct``), then the job is marked *read*,
which is what the fence waits for; on CUDA the gather first waits for an event recorded on the
engine's stream in ``submit_stores``. When ``max_queued_stores`` jobs wait already, a new job is
dropped and counted (never blocks the engine).

Ownership: the engine owns the KV tensors; this object owns two ``kvtier.Client`` sessions (loads,
stores: a long store transfer never delays a load), the store thread and its queue. Thread-safety:
``register``/``wait``/``load``/``submit_stores``/``take_stats``/``close`` on the engine thread;
the store thread shares the queue, the set of unread jobs and the counters under one condition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.config import ConfigError, ConnectorConfig, EngineIdentity, Variant
from kvtier.integrations.vllm.planner import LoadJob, StoreJob
from kvtier_contract.errors import KvtierError

log = logging.getLogger("vllm.kvtier")


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


class KvtierWorker:
    """See the module docstring."""

    def __init__(self, identity: EngineIdentity, cfg: ConnectorConfig, *, tp_rank: int = 0,
                 max_queued_stores: int = 64) -> None:
        self.identity = identity
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.max_queued_stores = max_queued_stores
        self.block_bytes = identity.namespace(tp_rank=tp_rank).block_bytes
        self._layouts: tuple[Any, Any] | None = None  # (engine thread's, store thread's)
        self._clients: dict[str, Client] = {}
        self._handles: dict[tuple[str, Variant], NamespaceHandle] = {}
        self._cond = threading.Condition()
        self._queue: deque[tuple[StoreJob, Any]] = deque()  # (job, CUDA event or None)
        self._unread: set[int] = set()
        self._stats = WorkerStats()
        self._closed = False
        self._busy_job = False
        self._thread: threading.Thread | None = None

    # -- engine thread ----------------------------------------------------------------------------

    def register(self, layers: Sequence[Any]) -> None:
        """Per-layer KV tensors in layer order (vLLM's ``[B, H, N, C]`` views)."""
        from kvtier.layouts import PagedKvLayout  # torch; only when a worker exists

        engine_layout = PagedKvLayout.from_layer_tensors(layers, name=self.identity.layout)
        if engine_layout.block_bytes != self.block_bytes:
            raise ConfigError("kv_cache", f"{engine_layout.num_layers} layers x "
                              f"{engine_layout.page_bytes} B pages = {engine_layout.block_bytes} B "
                              f"per block, but the namespace says {self.block_bytes} B")
        self._layouts = (engine_layout, PagedKvLayout.from_layer_tensors(
            layers, name=self.identity.layout))
        for role in ("load", "store"):
            self._clients[role] = Client.connect(
                self.cfg.address, self.cfg.transport, timeout_s=self.cfg.request_timeout_ms / 1000,
                lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                client_name=f"vllm-tp{self.tp_rank}-{role}")
        self._thread = threading.Thread(target=self._store_loop, name="kvtier-store", daemon=True)
        self._thread.start()

    @property
    def registered(self) -> bool:
        return self._layouts is not None

    def wait(self, job_ids: Sequence[int]) -> None:
        """Block until none of ``job_ids`` still has to read engine blocks (the fence)."""
        with self._cond:
            if any(j in self._unread for j in job_ids):
                self._stats.fence_waits += 1
            while any(j in self._unread for j in job_ids):
                self._cond.wait()

    def load(self, jobs: Sequence[LoadJob]) -> set[int]:
        """Load every job into its engine blocks now; returns the block ids that failed."""
        if not jobs:
            return set()
        failed: set[int] = set()
        if self._layouts is None:
            return {b for j in jobs for b in j.block_ids}
        t0 = time.perf_counter()
        loaded = 0
        for variant, keys, block_ids in _by_variant(jobs, self.tp_rank):
            try:
                found = self._handle("load", variant).get_blocks(keys, self._layouts[0], block_ids)
            except KvtierError as e:
                log.warning("kvtier: load of %d blocks failed: %s", len(keys), e)
                found = [False] * len(keys)
            loaded += sum(found)
            failed.update(b for b, ok in zip(block_ids, found, strict=True) if not ok)
        with self._cond:
            self._stats.loaded_blocks += loaded
            self._stats.loaded_tokens += loaded * self.identity.tokens_per_block
            self._stats.loaded_bytes += loaded * self.block_bytes
            self._stats.load_failed_blocks += len(failed)
            self._stats.load_seconds += time.perf_counter() - t0
        return failed

    def submit_stores(self, jobs: Sequence[StoreJob]) -> None:
        if not jobs:
            return
        with self._cond:
            for job in jobs:
                if self._layouts is None or self._closed or \
                        len(self._queue) >= self.max_queued_stores:
                    self._stats.store_dropped_blocks += len(job.block_ids)
                    continue
                self._queue.append((job, self._forward_done()))
                self._unread.add(job.job_id)
            self._cond.notify_all()

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
                job, forward_done = self._queue.popleft()
                self._busy_job = True
            t0 = time.perf_counter()
            stored = present = dropped = 0
            try:
                keys = job.keys[self.tp_rank]
                try:
                    if forward_done is not None:  # CUDA: read only what the forward wrote
                        import torch

                        torch.cuda.current_stream(layout.device).wait_event(forward_done)
                    # over shm: one gather straight into the reserved arena slots
                    result = self._handle("store", job.variant).put_blocks(keys, layout,
                                                                          job.block_ids)
                finally:
                    self._read_done(job.job_id)  # engine blocks may be reused from here on
                stored, present = result.stored, result.already_present
                dropped = result.dropped + result.rejected
            except Exception as e:  # a failed store is a future miss, never an engine error
                log.warning("kvtier: store job %d failed: %s", job.job_id, e)
                dropped = len(job.block_ids)
                self._read_done(job.job_id)
            with self._cond:
                self._stats.stored_blocks += stored
                self._stats.stored_tokens += stored * self.identity.tokens_per_block
                self._stats.stored_bytes += stored * self.block_bytes
                self._stats.store_present_blocks += present
                self._stats.store_dropped_blocks += dropped
                self._stats.store_seconds += time.perf_counter() - t0
                self._busy_job = False
                self._cond.notify_all()

    def _read_done(self, job_id: int) -> None:
        with self._cond:
            self._unread.discard(job_id)
            self._cond.notify_all()

    def _handle(self, role: str, variant: Variant) -> NamespaceHandle:
        h = self._handles.get((role, variant))
        if h is None:
            h = self._clients[role].register(self.identity.namespace(variant, self.tp_rank))
            self._handles[(role, variant)] = h
        return h


def _by_variant(jobs: Sequence[LoadJob], rank: int
                ) -> list[tuple[Variant, list[bytes], list[int]]]:
    """Jobs merged per variant (one batched transfer each), in first-seen order."""
    merged: dict[Variant, tuple[list[bytes], list[int]]] = {}
    for job in jobs:
        keys, ids = merged.setdefault(job.variant, ([], []))
        keys.extend(job.keys[rank])
        ids.extend(job.block_ids)
    return [(v, k, i) for v, (k, i) in merged.items()]

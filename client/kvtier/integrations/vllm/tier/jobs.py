"""The vLLM secondary tier's work off the scheduler thread: lookups, loads, stores (no vLLM import).

``TierJobs`` owns two lazily connected ``kvtier.Client`` sessions on the daemon (one for
lookups, with the short ``lookup_timeout_ms`` deadline, one for transfers) sharing this process's
breaker for that address, one namespace handle on each, and two single-thread executors (loads,
stores: a load never waits behind a burst of stores). The pool's rows are a flat writable
``memoryview`` (vLLM's primary CPU tier); a job names rows by chunk id and moves them with one
batched ``put`` / ``get_into`` (the client copies into or out of the daemon's arena with ``shm``,
or streams them with ``tcp``).

Scheduler-thread API, none of which waits for the daemon: ``submit_store``, ``submit_load``
(queue a job and return), ``finished`` (the jobs done since the last call), ``take_stats``.
``lookup`` blocks up to ``lookup_timeout_ms`` and is called only from vLLM's lookup thread.
``drain`` waits for the queued jobs (vLLM's ``drain_jobs``, on cache reset): bounded by
``job_timeout_ms`` per job, and by the breaker once the daemon is away.

A daemon that is away, hung or restarting costs at most one RPC deadline: the first call trips
the breaker, later calls miss (lookups), fail (loads) or drop (stores) at once, and the client
reconnects by itself when the daemon answers again. A job never raises: an unexpected error
fails that job and is logged once per kind.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.breaker import shared_breaker
from kvtier.integrations.vllm.tier.config import TierConfig, offload_block_key
from kvtier.integrations.vllm.tier.decisions import TierDecisions
from kvtier.settings import ClientSettings
from kvtier_contract.identity import Namespace

log = logging.getLogger("vllm.kvtier")

MAX_QUEUED_JOBS = 256  # per direction; a job beyond that fails at once (stores: dropped)


@dataclass(frozen=True)
class JobDone:
    """A finished job: ``found`` holds, per key, whether its row now holds the block (loads) or
    the daemon holds it (stores)."""

    job_id: int
    is_load: bool
    found: tuple[bool, ...]
    nbytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return all(self.found)


@dataclass
class TierStats:
    """Counters since the last ``take_stats`` (owned by TierJobs; updated under its lock)."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    stored_blocks: int = 0
    store_dropped_blocks: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


class TierJobs:
    """See the module docstring. Thread-safety: the scheduler thread calls the submit/finished/
    stats methods, vLLM's lookup thread calls ``lookup``; shared state is under ``_lock``."""

    def __init__(
        self,
        cfg: TierConfig,
        namespace: Namespace,
        rows: memoryview,
        row_bytes: int,
        *,
        client_name: str = "vllm-tier",
    ) -> None:
        if namespace.block_bytes != row_bytes:
            raise ValueError(f"namespace blocks of {namespace.block_bytes} B for rows of {row_bytes} B")
        self.cfg = cfg
        self.namespace = namespace
        self._rows = rows
        self._row_bytes = row_bytes
        self._client_name = client_name
        self._lock = threading.Lock()
        self._done: queue.SimpleQueue[JobDone] = queue.SimpleQueue()
        self._pending: dict[Future[None], bool] = {}  # future -> is_load
        self._stats = TierStats()
        self.decisions = TierDecisions(
            policy=cfg.load_policy,
            probe_after_s=cfg.probe_after_s,
            budget=cfg.interference_budget,
            chunk_tokens=namespace.tokens_per_block,
            row_bytes=row_bytes,
            prefill_seconds_per_token=cfg.prefill_seconds_per_token,
        )
        self._clients: dict[str, tuple[Client, NamespaceHandle]] = {}
        self._loads = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tier-load")
        self._stores = ThreadPoolExecutor(1, thread_name_prefix="kvtier-tier-store")
        self._closed = False
        # Open the transfer session off the scheduler thread, before the first job needs it.
        self._stores.submit(self._handle, "transfer")

    # -- scheduler thread -------------------------------------------------------------------

    def submit_store(self, job_id: int, offload_keys: Sequence[bytes], chunk_ids: Sequence[int]) -> None:
        self._submit(job_id, False, list(offload_keys), [int(c) for c in chunk_ids])

    def submit_load(self, job_id: int, offload_keys: Sequence[bytes], chunk_ids: Sequence[int]) -> None:
        self._submit(job_id, True, list(offload_keys), [int(c) for c in chunk_ids])

    def finished(self) -> list[JobDone]:
        out: list[JobDone] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            stats, self._stats = self._stats, TierStats()
        return {**stats.as_dict(), **vars(self.decisions.take())}

    def drain(self) -> None:
        with self._lock:
            futures = list(self._pending)
        wait_futures(futures)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._stores.shutdown(wait=False, cancel_futures=True)
        for client, _ in list(self._clients.values()):
            client.close()
        try:  # let vLLM unmap its pool (a job still running keeps its rows until it ends)
            self._rows.release()
        except BufferError:
            pass

    def _submit(self, job_id: int, is_load: bool, offload_keys: list[bytes], chunk_ids: list[int]) -> None:
        if len(offload_keys) != len(chunk_ids):
            raise ValueError(f"job {job_id}: {len(offload_keys)} keys, {len(chunk_ids)} chunks")
        if not offload_keys:  # nothing to move (e.g. stores turned off): done at once
            self._finish(job_id, is_load, [], 0, 0.0)
            return
        # The interference budget: a load is charged and runs; a store beyond it is dropped.
        charged = (
            self.decisions.charge_load(offload_keys)
            if is_load
            else self.decisions.admit_store(len(offload_keys))
        )
        if charged is None:
            self._finish(job_id, is_load, [False] * len(offload_keys), 0, 0.0)
            return
        fut: Future[None] | None = None
        with self._lock:
            queued = sum(1 for v in self._pending.values() if v == is_load)
            if not self._closed and queued < MAX_QUEUED_JOBS:
                pool = self._loads if is_load else self._stores
                fut = pool.submit(self._run, job_id, is_load, offload_keys, chunk_ids, charged)
                self._pending[fut] = is_load
        if fut is None:  # closed, or too many queued: failed (a store: dropped) at once
            self._finish(job_id, is_load, [False] * len(offload_keys), 0, 0.0)
            return
        fut.add_done_callback(self._forget)

    def _forget(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.pop(fut, None)

    # -- job threads --------------------------------------------------------------------------

    def _run(
        self,
        job_id: int,
        is_load: bool,
        offload_keys: list[bytes],
        chunk_ids: list[int],
        charged_s: float = 0.0,
    ) -> None:
        t0 = time.monotonic()
        found = [False] * len(offload_keys)
        try:
            _, handle = self._handle("transfer")
            keys = self._keys(handle, offload_keys)
            views = [self._rows[c * self._row_bytes : (c + 1) * self._row_bytes] for c in chunk_ids]
            deadline = time.monotonic() + self.cfg.job_timeout_ms / 1000
            if is_load:
                found = handle.get_into(keys, views, deadline=deadline)
            else:
                got = handle.put(keys, views, deadline=deadline)
                ok = got.dropped == 0 and got.rejected == 0
                found = [ok] * len(keys)
        except Exception as e:  # never into vLLM's scheduler: the job failed
            log.warning("kvtier tier: %s job %d failed: %s", "load" if is_load else "store", job_id, e)
        nbytes = sum(found) * self._row_bytes
        seconds = time.monotonic() - t0
        if is_load:  # the load figures (and the budget's correction)
            self.decisions.loaded(offload_keys, found, seconds, charged_s)
        else:
            self.decisions.stored(charged_s, seconds)
        self._finish(job_id, is_load, found, nbytes, seconds)

    def _finish(self, job_id: int, is_load: bool, found: list[bool], nbytes: int, seconds: float) -> None:
        n_ok = sum(found)
        with self._lock:
            if is_load:
                self._stats.loaded_blocks += n_ok
                self._stats.load_failed_blocks += len(found) - n_ok
            else:
                self._stats.stored_blocks += n_ok
                self._stats.store_dropped_blocks += len(found) - n_ok
        self._done.put(JobDone(job_id, is_load, tuple(found), nbytes, seconds))

    # -- lookup thread ------------------------------------------------------------------------

    def lookup(self, offload_keys: Sequence[bytes]) -> list[bool]:
        """Which of ``offload_keys`` (one request's chunks, in order) to answer HIT for: the
        ready prefix the daemon holds, cut by ``load_policy`` to the prefix worth loading
        (``TierDecisions.decide``); the rest a miss. Never raises: away is a miss."""
        held = hits = 0
        try:
            client, handle = self._handle("lookup")
            keys = self._keys(handle, offload_keys)[: client.max_batch]
            if keys:
                looked = handle.lookup_tiers(keys)
                tiers = looked.tiers[: looked.hits]
                held = len(tiers)
                figures = {t: (f.latency_s, f.bytes_per_s, f.age_s) for t, f in client.tier_figures().items()}
                hits = self.decisions.decide(offload_keys, tiers, figures)
        except Exception as e:
            log.warning("kvtier tier: lookup of %d keys failed: %s", len(offload_keys), e)
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_keys += len(offload_keys)
            self._stats.lookup_hits += held
        return [i < hits for i in range(len(offload_keys))]

    # -- sessions -----------------------------------------------------------------------------

    def _handle(self, role: str) -> tuple[Client, NamespaceHandle]:
        """The ``role`` session ("lookup" or "transfer") and its handle, opened on first use
        on the calling (job or lookup) thread; lazy: an absent daemon never raises here."""
        got = self._clients.get(role)
        if got is not None:
            return got
        cfg = self.cfg
        timeout_ms = (
            min(cfg.lookup_timeout_ms, cfg.request_timeout_ms) if role == "lookup" else cfg.request_timeout_ms
        )
        client = Client.connect(
            cfg.address,
            lazy=True,
            breaker=shared_breaker(cfg.address),
            settings=ClientSettings(
                transport=cfg.transport,
                timeout_s=timeout_ms / 1000,
                lease_ttl_s=cfg.lease_ttl_ms / 1000,
                client_name=f"{self._client_name}-{role}",
                probe_timeout_s=cfg.probe_timeout_ms / 1000,
                op_timeout_s=cfg.job_timeout_ms / 1000,
                token_file=cfg.token_file,
                unix_login=cfg.unix_login,
            ),
        )
        got = (client, client.register(self.namespace))
        with self._lock:
            if role in self._clients:  # (another thread of the same role won: keep one)
                client.close()
                return self._clients[role]
            self._clients[role] = got
        return got

    def _keys(self, handle: NamespaceHandle, offload_keys: Sequence[bytes]) -> list[bytes]:
        digest = self.namespace.digest
        tenant_key = handle.client.tenant_key
        return [offload_block_key(digest, bytes(k), tenant_key) for k in offload_keys]

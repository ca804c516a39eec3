"""``KvtierL2Adapter``: LMCache's ``L2AdapterInterface`` (lmcache==0.5.6) backed by kvtierd.

LMCache's multi-process server loads it with ``--l2-adapter '{"type": "plugin",
"module_path": "kvtier.integrations.lmcache", "class_name": "KvtierL2Adapter",
"adapter_params": {...}}'`` (docs/lmcache.md). LMCache's L1 (host memory) stays in front; the
store controller copies chunks from L1 to this adapter, the prefetch controller looks them up,
locks them, loads them back into L1 buffers and unlocks them.

Lifecycle of a task: LMCache's controller thread calls ``submit_*`` (returns a task id at once),
one of the adapter's ``workers`` threads runs it against the daemon within ``op_timeout_ms``,
records the result and signals the task kind's eventfd; the controller then collects it with
``pop_completed_store_tasks`` / ``query_*_result`` (each result handed out once).

* store: chunks are grouped by namespace (``keys.KeyMapper``) and put; the task succeeds when
  every chunk is stored or was already there. A chunk whose key or byte size fits no configured
  identity (refused: the reason is logged once at WARNING), or that the daemon did not take
  (away, out of time, no room), fails the task: LMCache then keeps it only in L1.
* lookup-and-lock: one answer per key, as LMCache's contract asks (its prefetch policies combine
  the answers of L1 and every L2, so a chunk found here after one missing here still counts).
  Per namespace, a pinned lookup (``NamespaceHandle.lookup_pinned``) of its keys in order pins
  the ready prefix; when a key is missing, one per-key pinned lookup
  (``lookup_each_pinned``: PrepareLoad's answer per key) answers the keys after it. Exactly
  the keys reported found are pinned against eviction, until LMCache unlocks every key of a pin
  (``locks.PinTable``); then the pin is released.
* load: ``get_into`` straight into LMCache's L1 buffers; the bitmap says which arrived (a block
  counts only once the daemon confirmed that its pin held during the copy).
* unlock: bookkeeping on the caller's thread, the release RPC on a worker thread; never fails
  (a pin the daemon forgot, after a restart or a lapsed lease, is already released).

Never hang, never raise into LMCache: every RPC has a deadline; a daemon that is away turns
lookups and loads into misses and stores into failed tasks (the kvtier Client's breaker answers
at once while it is away); an unexpected exception in a task is logged, counted and reported as
a miss or a failed store. Only a bad ``adapter_params`` raises, at construction.

Thread-safety (the interface's contract: LMCache's store and prefetch controller threads call
concurrently): task ids, results and the closed flag are guarded by ``_lock``; the pin table
and the key mapper lock themselves; the kvtier Client is thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.lmcache.config import AdapterConfig, AdapterCounters
from kvtier.integrations.lmcache.keys import KeyMapper
from kvtier.integrations.lmcache.locks import PinTable
from kvtier.settings import ClientSettings
from kvtier_contract.errors import KvtierError
from kvtier_contract.identity import Namespace

log = logging.getLogger("kvtier.integrations.lmcache")
R = TypeVar("R")
Groups = dict[Namespace, tuple[list[int], list[bytes]]]  # namespace -> (indices, kvtier keys)


class KvtierL2Adapter(L2AdapterInterface):
    """See the module docstring. Owns one kvtier Client, its worker pool and three eventfds."""

    def __init__(self, config: Mapping[str, Any] | AdapterConfig, **_kwargs: Any) -> None:
        """``config``: LMCache's ``adapter_params`` (or an ``AdapterConfig``). Other keyword
        arguments LMCache passes (``l1_memory_desc``) are accepted and unused."""
        cfg = config if isinstance(config, AdapterConfig) else AdapterConfig.from_params(config)
        super().__init__(max_capacity_bytes=0)  # kvtier owns capacity and eviction
        self.cfg = cfg
        self.counters = AdapterCounters()
        self._client = Client.connect(  # lazy: a daemon away is a miss, logged once per cause
            cfg.address,
            lazy=True,
            settings=ClientSettings(
                transport=cfg.transport,
                timeout_s=cfg.request_timeout_ms / 1000,
                op_timeout_s=cfg.op_timeout_ms / 1000,
                lease_ttl_s=cfg.lease_ttl_ms / 1000,
                client_name="lmcache-l2",
                token_file=cfg.token_file,
            ),
        )
        self._keys = KeyMapper(cfg, self._client.tenant_key)
        self._handles: dict[Namespace, NamespaceHandle] = {}
        self._handles_lock = threading.Lock()
        self._pins = PinTable()
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="kvtier-lmcache")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._said: set[str] = set()  # reasons already logged (refusals, daemon refusals)
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}

    # -- eventfds ---------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- the interface ----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(
            lambda: self._store(keys, objects), L2StoreResult(False, 0), self._stores, self._store_efd
        )

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:  # emptied in place: tasks in flight hold this very dict
            done = dict(self._stores)
            self._stores.clear()
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        return self._submit(lambda: self._lookup(keys), Bitmap(len(keys)), self._lookups, self._lookup_efd)

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        self.counters.unlocks += len(keys)
        done = self._pins.unlock(keys)
        if done:
            self._background(lambda: self._release(done))

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit(lambda: self._load(keys, objects), Bitmap(len(keys)), self._loads, self._load_efd)

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        """Finish the tasks in flight (each bounded by ``op_timeout_ms``), release every pin
        still held, close the session and the eventfds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._release(self._pins.drain())
        self._client.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    def report_status(self) -> dict[str, Any]:
        """``is_healthy`` stays true while the daemon is away (LMCache folds it into the
        server's own health, and a daemon away only makes misses); ``daemon_connected`` says
        whether it answers."""
        c = self.counters
        return {
            "is_healthy": not self._closed,
            "type": "KvtierL2Adapter",
            "daemon_connected": self._client.connected and self._client.breaker.allows(),
            "address": self.cfg.address,
            "stored": c.stored,
            "store_dropped": c.store_dropped,
            "refused": c.refused,
            "lookups": c.lookups,
            "locked": c.locked,
            "locked_past_gap": c.locked_past_gap,
            "loaded": c.loaded,
            "load_missed": c.load_missed,
            "unlocks": c.unlocks,
            "locked_keys": len(self._pins),
            "last_refusal": c.last_refusal,
            "errors": c.errors,
            "last_error": c.last_error,
        }

    # -- task plumbing ----------------------------------------------------------------------------

    def _submit(self, work: Callable[[], R], failed: R, results: dict[int, R], efd: Any) -> int:
        """Run ``work`` on a worker thread; its result (``failed`` if it raised, or if the
        adapter is closed) goes to ``results`` under the task id, then ``efd`` is signalled."""
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        def run() -> None:
            try:
                result = work()
            except Exception as e:  # noqa: BLE001  (never raise into LMCache: a miss)
                self._note_error(e)
                result = failed
            with self._lock:
                results[task_id] = result
            efd.notify()  # close() closes the eventfds only after the last task ran

        if not self._background(run):
            with self._lock:
                results[task_id] = failed
            efd.notify()
        return task_id

    def _background(self, fn: Callable[[], None]) -> bool:
        try:
            self._pool.submit(fn)
        except RuntimeError:  # closed
            return False
        return True

    def _refused(self, why: str) -> None:
        self.counters.refused += 1
        self.counters.last_refusal = why
        if not self._first_time(why):
            return
        log.warning(
            "kvtier L2 adapter: chunk refused (a miss or a failed store; said once per "
            "reason, counted in 'refused'): %s",
            why,
        )

    def _first_time(self, why: str) -> bool:
        with self._lock:
            if why in self._said or len(self._said) >= 64:  # bounded: reasons may carry numbers
                return False
            self._said.add(why)
            return True

    def _note_error(self, e: BaseException) -> None:
        self.counters.errors += 1
        self.counters.last_error = f"{type(e).__name__}: {e}"
        log.exception("kvtier L2 adapter task failed (reported as a miss)")

    def _handle(self, ns: Namespace) -> NamespaceHandle:
        with self._handles_lock:
            handle = self._handles.get(ns)
            if handle is None:
                handle = self._handles[ns] = self._client.register(ns)
            return handle

    def _group(self, keys: list[Any], objects: list[Any] | None) -> Groups:
        """Keys by namespace, in order; keys (and objects of the wrong size) that fit no
        identity are left out, counted as refused, and each reason is logged once."""
        groups: Groups = {}
        for i, key in enumerate(keys):
            resolved = self._keys.resolve_or_why(key)
            if (
                not isinstance(resolved, str)
                and objects is not None
                and objects[i].get_size() != resolved[0].block_bytes
            ):
                resolved = (
                    f"object of {objects[i].get_size()} bytes; a chunk of model "
                    f"{key.model_name!r} is {resolved[0].block_bytes} bytes "
                    f"(2 x num_layers x num_kv_heads x head_dim x itemsize x "
                    f"chunk_tokens)"
                )
            if isinstance(resolved, str):
                self._refused(resolved)
                continue
            ns, kvkey = resolved
            idx, kvkeys = groups.setdefault(ns, ([], []))
            idx.append(i)
            kvkeys.append(kvkey)
        return groups

    # -- the work (worker threads) ----------------------------------------------------------------

    def _store(self, keys: list[Any], objects: list[Any]) -> L2StoreResult:
        groups = self._group(keys, objects)
        deadline = self._client.deadline()
        kept = stored_bytes = 0
        for ns, (idx, kvkeys) in groups.items():
            handle = self._handle(ns)
            result = handle.put(kvkeys, [objects[i].byte_array for i in idx], deadline=deadline)
            kept += result.stored + result.already_present
            stored_bytes += result.stored * handle.block_bytes
        self.counters.stored += kept
        self.counters.store_dropped += len(keys) - kept
        return L2StoreResult(kept == len(keys), stored_bytes)

    def _lookup(self, keys: list[Any]) -> Bitmap:
        """One answer per key: per namespace and batch, the ready prefix in one pinned lookup;
        the keys after its first miss in one per-key pinned lookup (only when there are any)."""
        self.counters.lookups += 1
        bitmap = Bitmap(len(keys))
        for ns, (idx, kvkeys) in self._group(keys, None).items():
            handle = self._handle(ns)
            step = max(1, self._client.max_batch)
            for start in range(0, len(kvkeys), step):
                part = kvkeys[start : start + step]
                try:  # a refusal (a tenant's pin quota) is a miss for these keys, not the task:
                    # the locks already taken stay reported, so LMCache unlocks them
                    prefix = handle.lookup_pinned(part)
                    self._lock_found(
                        bitmap, keys, [idx[start + j] for j in range(prefix.hits)], prefix.pin, prefix.epoch
                    )
                    rest = prefix.hits + 1  # key `hits` is missing (or the daemon is away)
                    if rest >= len(part):
                        continue
                    each = handle.lookup_each_pinned(part[rest:])
                    found = [idx[start + rest + j] for j, ok in enumerate(each.found) if ok]
                    self._lock_found(bitmap, keys, found, each.pin, each.epoch)
                    self.counters.locked_past_gap += len(found)
                except KvtierError as e:
                    self.counters.errors += 1
                    self.counters.last_error = why = f"{type(e).__name__}: {e}"
                    if self._first_time(why):
                        log.warning(
                            "kvtier L2 adapter: lookup refused by the daemon (misses; "
                            "said once per reason, counted in 'errors'): %s",
                            why,
                        )
        return bitmap

    def _lock_found(self, bitmap: Bitmap, keys: list[Any], found: list[int], pin: int, epoch: int) -> None:
        """Report ``found`` (indexes into ``keys``) and record their pin as their locks."""
        if pin and found:
            self._pins.add(pin, epoch, [keys[i] for i in found])
        elif pin:
            self._client.release(pin, epoch)
        for i in found:
            bitmap.set(i)
        self.counters.locked += len(found)

    def _load(self, keys: list[Any], objects: list[Any]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        deadline = self._client.deadline()
        loaded = 0
        for ns, (idx, kvkeys) in self._group(keys, objects).items():
            found = self._handle(ns).get_into(kvkeys, [objects[i].byte_array for i in idx], deadline=deadline)
            for i, ok in zip(idx, found, strict=True):
                if ok:
                    bitmap.set(i)
                    loaded += 1
        self.counters.loaded += loaded
        self.counters.load_missed += len(keys) - loaded
        return bitmap

    def _release(self, pins: list[tuple[int, int]]) -> None:
        for pin, epoch in pins:
            self._client.release(pin, epoch)
            self.counters.pins_released += 1

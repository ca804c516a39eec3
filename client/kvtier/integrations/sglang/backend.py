"""``KvtierHiCacheStorage``: SGLang's HiCache L3 storage backed by a kvtierd daemon.

Loaded by SGLang's dynamic backend loader (``--hicache-storage-backend dynamic``, docs/sglang.md)
as ``KvtierHiCacheStorage(storage_config, kwargs)``. Lifecycle:

    __init__  (SGLang startup)  validate the extra config, resolve the model identity (a missing
                                field raises ConfigError here: SGLang refuses to start), connect
    register_mem_pool_host      probe the host pool's pages (``pages.HostPoolPages``), build the
              (SGLang startup)  namespace from the pool's dtype and geometry, register it
    register_mem_host_pool_v2   each pool of the model's group: the KV pool again ("kv"), and a
              (SGLang startup)  hybrid model's side pools (Mamba, SWA, indexer, ...), each in a
                                namespace of its own (``side_pools``)
    batch_exists / batch_get_v1 / batch_set_v1 / get / set / ...   (SGLang's storage threads)
    batch_exists_v2 / batch_get_v2 / batch_set_v2   (hybrid models: per-pool transfers)
    clear                       False: a shared daemon is not emptied by one engine (logged once)
    close

``KvtierHiCacheStorage`` is SGLang's ``HiCacheStorage`` and holds the parts that do the work,
each handed what it uses: ``core`` (``core.StorageCore``: the client, settings, identity,
counters, the never-raise guard, the KV pool's registration), ``decisions``
(``decisions.PageDecisions``: load or recompute, ``load_policy``, docs/sglang.md), ``kv``
(``kv_pages.KvPages``: the KV pool, the zero-copy and the plain calls) and ``side``
(``side_pools.SidePools``: hybrid models' side pools, the v2 calls). Its methods are SGLang's
calls, each handed to the part that owns it.

Never raises into SGLang's storage threads: an exception there kills the thread and leaks host
memory, so every storage call catches everything, counts it (``self.counters``) and answers a
miss: ``False`` per key, 0 leading hits, ``None``. A daemon that is away is a miss too (the SDK's
breaker answers at once). Calls before ``register_mem_pool_host`` are misses.

Thread-safety: SGLang's prefetch and backup threads call concurrently; the kvtier ``Client`` is
thread-safe, each thread gets its own ``PagedKvLayout``, and the counters are plain integers
incremented without a lock (approximate under races, as the SDK's).
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.sglang.core import BackendCounters, StorageCore, log
from kvtier.integrations.sglang.decisions import PageDecisions
from kvtier.integrations.sglang.kv_pages import KvPages
from kvtier.integrations.sglang.pages import HostPoolPages
from kvtier.integrations.sglang.side_pools import SidePools

__all__ = ["BackendCounters", "KvtierHiCacheStorage"]


class KvtierHiCacheStorage(HiCacheStorage):
    """See the module docstring. Owns its four parts (``core``, ``decisions``, ``kv``,
    ``side``); SGLang's storage threads call it concurrently, as the parts allow."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.core = StorageCore(storage_config)
        self.decisions = PageDecisions(self.core)
        self.kv = KvPages(self.core, self.decisions)
        self.side = SidePools(self.core, self.decisions, self.kv)
        self._cleared_logged = False

    @property
    def client(self) -> Client:
        return self.core.client

    @property
    def counters(self) -> BackendCounters:
        return self.core.counters

    @property
    def pages(self) -> HostPoolPages | None:
        """The KV pool's page geometry (None before ``register_mem_pool_host``)."""
        return self.core.pages

    @property
    def handle(self) -> NamespaceHandle | None:
        """This rank's KV namespace (None before ``register_mem_pool_host``)."""
        return self.core.handle

    # -- startup ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Probe the host pool and register this rank's namespace (raises at SGLang startup when
        the pool cannot be stored exactly: unknown dtype, unsupported layout, irregular pages)."""
        super().register_mem_pool_host(mem_pool_host)
        self.kv.register(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Every host pool of the model's group (``SidePools.register``; raises ``ConfigError``
        at SGLang startup for a pool whose pages cannot be stored exactly)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.side.register(host_pool, host_pool_name)

    # -- the zero-copy interface (interface_v1) --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self.kv.batch_exists(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self.kv.batch_get_v1(keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self.kv.batch_set_v1(keys, host_indices)

    # -- the plain interface (flat data pages) ---------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        return self.kv.batch_get(keys, target_locations)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.kv.batch_set(keys, values)

    # -- storage interface v2 (hybrid models: the KV pool with side pools) ------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        return self.side.batch_exists_v2(keys, pool_transfers)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        return self.side.batch_get_v2(transfers)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        return self.side.batch_set_v2(transfers)

    # -- the rest ----------------------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each zero-copy batch since the last
        call) when SGLang runs with ``--enable-metrics``; else None."""
        if not self.core.metrics:
            return None

        def run() -> Any:
            from sglang.srt.observability.metrics_collector import StorageMetrics

            loads, stores = self.core.take_samples()
            return StorageMetrics(
                prefetch_pgs=[n for n, _ in loads],
                backup_pgs=[n for n, _ in stores],
                prefetch_bandwidth=[g for _, g in loads],
                backup_bandwidth=[g for _, g in stores],
            )

        return self.core.guard("get_stats", run, None)

    def clear(self) -> bool:
        """``False``: nothing is cleared, and a warning says why, once. The daemon has no call
        that drops a namespace's pages (it evicts by itself), and its pages are shared with every
        other engine of the same identity, which one SGLang rank may not empty. Use a new
        ``cache_salt`` (or restart the daemon) to start from an empty cache."""
        if not self._cleared_logged:
            self._cleared_logged = True
            log.warning(
                "kvtier HiCache clear: nothing cleared: the kvtier daemon has no call "
                "that drops a namespace's pages (it evicts by itself, and they are "
                "shared with other engines); set a new cache_salt to start empty"
            )
        return False

    def close(self) -> None:
        self.core.guard("close", self.core.client.close, None)

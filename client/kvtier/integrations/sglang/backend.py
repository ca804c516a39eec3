"""``KvtierHiCacheStorage``: SGLang's HiCache L3 storage backed by a kvtierd daemon.

Loaded by SGLang's dynamic backend loader (``--hicache-storage-backend dynamic``, docs/sglang.md)
as ``KvtierHiCacheStorage(storage_config, kwargs)``. Lifecycle:

    __init__  (SGLang startup)  validate the extra config, resolve the model identity (a missing
                                field raises ConfigError here: SGLang refuses to start), connect
    register_mem_pool_host      probe the host pool's pages (``pages.HostPoolPages``), build the
              (SGLang startup)  namespace from the pool's dtype and geometry, register it
    register_mem_host_pool_v2   each pool of the model's group: the KV pool again ("kv"), and a
              (SGLang startup)  hybrid model's side pools (Mamba, SWA, indexer, ...), each in a
                                namespace of its own (``SidePool``, ``_side_namespace``)
    batch_exists / batch_get_v1 / batch_set_v1 / get / set / ...   (SGLang's storage threads)
    batch_exists_v2 / batch_get_v2 / batch_set_v2   (hybrid models: per-pool transfers)
    clear                       False: a shared daemon is not emptied by one engine (logged once)
    close

The shared state, the never-raise guard, the counters and the load-or-recompute bookkeeping
(``load_policy``, docs/sglang.md) are in ``backend_base`` (``StorageBase``); the storage
interface v2 and the side pools in ``backend_v2`` (``PoolsV2``); this module is the startup
and the v1 and plain calls on top of them.

Never raises into SGLang's storage threads: an exception there kills the thread and leaks host
memory, so every storage call catches everything, counts it (``self.counters``) and answers a
miss: ``False`` per key, 0 leading hits, ``None``. A daemon that is away is a miss too (the SDK's
breaker answers at once). Calls before ``register_mem_pool_host`` are misses.

Thread-safety: SGLang's prefetch and backup threads call concurrently; the kvtier ``Client`` is
thread-safe, each thread gets its own ``PagedKvLayout``, and the counters are plain integers
incremented without a lock (approximate under races, as the SDK's).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvtier.integrations.sglang.backend_base import BackendCounters, _length, log
from kvtier.integrations.sglang.backend_v2 import PoolsV2
from kvtier.integrations.sglang.config import ConfigError
from kvtier.integrations.sglang.pages import HostPoolPages, PoolShapeError
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import KV_DTYPES, Namespace

__all__ = ["BackendCounters", "KvtierHiCacheStorage"]


class KvtierHiCacheStorage(PoolsV2):
    """See the module docstring. Owns one kvtier ``Client`` and the namespace of this rank."""

    # -- startup ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Probe the host pool and register this rank's namespace (raises at SGLang startup when
        the pool cannot be stored exactly: unknown dtype, unsupported layout, irregular pages)."""
        super().register_mem_pool_host(mem_pool_host)
        kind = "mla" if self.is_mla else "mha"
        layout = getattr(mem_pool_host, "layout", None)
        name = f"sglang.{layout}.{kind}"
        try:
            pages = HostPoolPages.probe(mem_pool_host, name)
            namespace = self._namespace(mem_pool_host, name)
        except ConfigError:
            raise
        except (
            PoolShapeError,
            ValueError,
            NotImplementedError,
            AttributeError,
            TypeError,
            InvalidArgument,
        ) as e:
            raise ConfigError(
                "mem_pool_host",
                f"{type(mem_pool_host).__name__} ({layout}): cannot store its pages: {type(e).__name__}: {e}",
            ) from e
        if namespace.block_bytes != pages.block_bytes:
            raise ConfigError(
                "mem_pool_host",
                f"a page holds {pages.block_bytes} bytes in "
                f"{pages.segments} segments; its geometry says "
                f"{namespace.block_bytes}",
            )
        self.pages = pages
        self.handle = self.client.register(namespace)
        log.info(
            "kvtier HiCache storage: namespace %s (%d-byte pages) at %s",
            namespace.to_dict(),
            pages.block_bytes,
            self.cfg.address,
        )

    def _namespace(self, pool: Any, layout: str) -> Namespace:
        dtype = str(pool.dtype).removeprefix("torch.")
        if dtype not in KV_DTYPES:
            raise ConfigError("mem_pool_host", f"KV dtype {dtype} is not one kvtier stores")
        cfg = self.storage_config
        if self.is_mla:
            # The latent (kv_lora_rank + rope dims) is one row per token and layer, the same on
            # every TP rank: one namespace for all ranks (tp 1/0), written by rank 0 only (SGLang's
            # is_storage_writer) and read by all. Namespace counts K and V (x2): the row is its
            # head_dim x 2, so block_bytes is the page's bytes exactly.
            dim = int(pool.kv_cache_dim)
            if dim % 2:
                raise ConfigError("mem_pool_host", f"MLA row of odd width {dim}")
            heads, head_dim, tp_size, tp_rank = 1, dim // 2, 1, 0
        else:
            heads, head_dim = int(pool.head_num), int(pool.head_dim)
            tp_size, tp_rank = cfg.tp_size, cfg.tp_rank
        return Namespace(
            model_id=self.identity.model_id,
            model_revision=self.identity.model_revision,
            tokenizer_digest=self.identity.tokenizer_digest,
            kv_dtype=dtype,
            layout=layout,
            tokens_per_block=int(pool.page_size),
            num_layers=int(pool.layer_num),
            num_kv_heads=heads,
            head_dim=head_dim,
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=cfg.pp_size,
            pp_rank=cfg.pp_rank,
            cache_salt=self.cfg.cache_salt,
            tenant=self.cfg.tenant,
        )

    # -- the zero-copy interface (interface_v1) --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the daemon holds, cut by ``load_policy`` to
        the prefix worth loading (SGLang prefetches what this answers, recomputes the rest)."""

        def run() -> int:
            handle = self._ready()
            if handle is None or not keys:
                return 0
            return self._held_and_decided(handle, keys)

        self.counters.pages_queried += _length(keys)
        return self._guard("batch_exists", run, 0)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load ``keys`` into the host pool pages named by ``host_indices``; a page not loaded
        is left untouched and answers False."""

        def run() -> list[bool]:
            handle, ids = self._ready(), self._page_ids(host_indices, len(keys))
            if handle is None or ids is None or self.pages is None:
                return [False] * len(keys)
            found = handle.get_blocks(self._keys(handle, keys), self.pages.layout(), ids)
            self._loaded(keys, found, time.perf_counter() - start)
            return found

        n, start = _length(keys), time.perf_counter()
        found = self._guard("batch_get_v1", run, [False] * n)
        self._count_loaded(n, sum(map(bool, found)))
        self._sample(self._loads, sum(map(bool, found)), start)
        return found

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool pages named by ``host_indices`` under ``keys``. All True when
        every page is stored or already there; otherwise all False (the SDK counts a put's
        outcomes, not which keys had which)."""

        def run() -> bool:
            handle, ids = self._ready(), self._page_ids(host_indices, len(keys))
            if handle is None or ids is None or self.pages is None:
                return False
            result = handle.put_blocks(self._keys(handle, keys), self.pages.layout(), ids)
            return result.stored + result.already_present == len(keys)

        n, start = _length(keys), time.perf_counter()
        ok = n > 0 and self._guard("batch_set_v1", run, False)
        self._count_stored(n, ok)
        self._sample(self._stores, n if ok else 0, start)
        return [ok] * n

    # -- the plain interface (flat data pages) ---------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fill each target (a flat data page tensor) or, when none is given, a new one of the
        pool's dtype; None for a page not found."""

        def run() -> list[torch.Tensor | None]:
            handle = self._ready()
            if handle is None or not keys:
                return [None] * len(keys)
            targets = list(target_locations or [None] * len(keys))
            bufs = [t if t is not None else self._new_page() for t in targets]
            start = time.perf_counter()
            found = handle.get_into(self._keys(handle, keys), bufs)
            self._loaded(keys, found, time.perf_counter() - start)
            return [b if f else None for b, f in zip(bufs, found, strict=True)]

        n = _length(keys)
        missed: list[torch.Tensor | None] = [None] * n
        out = self._guard("batch_get", run, missed)
        self._count_loaded(n, sum(t is not None for t in out))
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store flat data pages ``values`` under ``keys``; True when all are stored."""

        def run() -> bool:
            handle = self._ready()
            if handle is None or values is None:
                return False
            result = handle.put(self._keys(handle, keys), list(values))
            return result.stored + result.already_present == len(keys)

        n = _length(keys)
        if n == 0 and keys is not None:
            return True  # nothing to store is done (SGLang's HiCacheFile answers True too)
        ok = n > 0 and self._guard("batch_set", run, False)
        self._count_stored(n, ok)
        return ok

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each zero-copy batch since the last
        call) when SGLang runs with ``--enable-metrics``; else None."""
        if not self.metrics:
            return None

        def run() -> Any:
            from sglang.srt.observability.metrics_collector import StorageMetrics

            loads, stores = self._loads, self._stores
            self._loads, self._stores = [], []
            return StorageMetrics(
                prefetch_pgs=[n for n, _ in loads],
                backup_pgs=[n for n, _ in stores],
                prefetch_bandwidth=[g for _, g in loads],
                backup_bandwidth=[g for _, g in stores],
            )

        return self._guard("get_stats", run, None)

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
        self._guard("close", self.client.close, None)

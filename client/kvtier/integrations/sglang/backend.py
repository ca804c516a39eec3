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

Load or recompute (``load_policy``, docs/sglang.md): ``batch_exists`` / ``batch_exists_v2``
answer the held prefix cut to what a ``kvtier.adaptive.Decider`` finds worth loading (each
page's tier, the loads' measured times, the daemon's per-tier figures, and the operator's
``prefill_seconds_per_token``: the storage interface shows no engine step to measure it from).

Never raises into SGLang's storage threads: an exception there kills the thread and leaks host
memory, so every storage call catches everything, counts it (``self.counters``) and answers a
miss: ``False`` per key, 0 leading hits, ``None``. A daemon that is away is a miss too (the SDK's
breaker answers at once). Calls before ``register_mem_pool_host`` are misses.

Thread-safety: SGLang's prefetch and backup threads call concurrently; the kvtier ``Client`` is
thread-safe, each thread gets its own ``PagedKvLayout``, and the counters are plain integers
incremented without a lock (approximate under races, as the SDK's).

Size: over the house limit, because SGLang's storage interface is one class (v1 and v2 calls
and the legacy get/set family), each call a few lines around the never-raise guard; the page
geometry lives in ``pages`` (``HostPoolPages``, ``SidePool``) and the identity in ``config``; the
load-or-recompute bookkeeping (a page's tier from its hit query to its load) is two helpers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransferResult,
)

from kvtier.adaptive import Decider, FixedPrefillRate, PrefillRate
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.sglang.config import (
    BackendConfig,
    ConfigError,
    ModelIdentity,
    page_key,
    resolve_identity,
)
from kvtier.integrations.sglang.pages import (
    SIDE_GEOMETRY_ATTRS,
    HostPoolPages,
    PoolShapeError,
    SidePool,
)
from kvtier.settings import ClientSettings
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import KV_DTYPES, Namespace

__all__ = ["BackendCounters", "KvtierHiCacheStorage"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_LOG_EVERY_S = 30.0  # at most one warning per failing operation name per this many seconds
_REMEMBERED_PAGES = 1 << 16  # pages reported by batch_exists whose tier waits for their load
_REMEMBERED_PREFIXES = 1024  # decided prefixes whose predicted load time waits for it


@dataclass
class BackendCounters:
    """What the backend did, in pages (plus the exceptions it kept from SGLang)."""

    pages_queried: int = 0
    pages_hit: int = 0  # leading pages the daemon held at batch_exists (before load_policy)
    pages_loaded: int = 0
    pages_load_failed: int = 0  # asked for and not loaded (miss, daemon away, bad indices)
    pages_stored: int = 0  # stored or already present
    pages_store_failed: int = 0
    v2_pages_loaded: int = 0  # pages of batch_get_v2 transfers loaded (any pool)
    v2_pages_stored: int = 0  # pages of batch_set_v2 transfers stored or already present
    v2_pages_failed: int = 0  # pages of v2 transfers not loaded / not stored
    errors: int = 0  # exceptions caught at the SGLang boundary
    # The load-or-recompute decision (``load_policy``; every count in ``decider.stats``):
    tokens_reported: int = 0  # held tokens batch_exists reported (what SGLang will prefetch)
    tokens_recomputed_slower: int = 0  # held tokens not reported: loading them was slower
    tokens_recomputed_policy: int = 0  # held tokens not reported: ``load_policy="never"``
    predicted_load_s: float = 0.0  # predicted time of the loads of a decided prefix
    actual_load_s: float = 0.0  # the same loads, measured
    last_error: str = field(default="", repr=False)


class KvtierHiCacheStorage(HiCacheStorage):
    """See the module docstring. Owns one kvtier ``Client`` and the namespace of this rank."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.cfg = BackendConfig.from_extra(storage_config.extra_config)
        self.identity: ModelIdentity = resolve_identity(self.cfg, storage_config.model_name)
        _check_parallelism(storage_config)
        self.is_mla = bool(storage_config.is_mla_model)
        self.counters = BackendCounters()
        self.pages: HostPoolPages | None = None
        self.handle: NamespaceHandle | None = None
        self.side_pools: dict[str, SidePool] = {}  # hybrid models' other host pools, by name
        self._logged: dict[str, float] = {}
        self._cleared_logged = False
        self.metrics = bool(storage_config.enable_storage_metrics)
        # (pages, GB/s) of each load / store batch since the last get_stats (SGLang's metrics).
        self._loads: list[tuple[int, float]] = []
        self._stores: list[tuple[int, float]] = []
        spt = self.cfg.prefill_seconds_per_token
        self.decider = Decider(self.cfg.load_policy, probe_after_s=self.cfg.probe_after_s,
                               prefill=FixedPrefillRate(spt) if spt else PrefillRate())
        self._decider_lock = threading.Lock()  # the prefetch and the I/O threads share it
        self._tier_of: OrderedDict[str, str] = OrderedDict()  # reported page -> its tier
        self._predicted: OrderedDict[tuple[str, int], float] = OrderedDict()
        rank = f"tp{storage_config.tp_rank}pp{storage_config.pp_rank}dp{storage_config.dp_rank}"
        self.client = Client.connect(  # lazy: a daemon away is a miss, logged once per cause
            self.cfg.address, lazy=True, settings=ClientSettings(
                transport=self.cfg.transport, timeout_s=self.cfg.request_timeout_ms / 1000,
                op_timeout_s=self.cfg.op_timeout_ms / 1000,
                lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                probe_timeout_s=self.cfg.probe_timeout_ms / 1000, client_name=f"sglang-{rank}",
                token_file=self.cfg.token_file))

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
        except (PoolShapeError, ValueError, NotImplementedError, AttributeError, TypeError,
                InvalidArgument) as e:
            raise ConfigError("mem_pool_host", f"{type(mem_pool_host).__name__} ({layout}): "
                              f"cannot store its pages: {type(e).__name__}: {e}") from e
        if namespace.block_bytes != pages.block_bytes:
            raise ConfigError("mem_pool_host", f"a page holds {pages.block_bytes} bytes in "
                              f"{pages.segments} segments; its geometry says "
                              f"{namespace.block_bytes}")
        self.pages = pages
        self.handle = self.client.register(namespace)
        log.info("kvtier HiCache storage: namespace %s (%d-byte pages) at %s",
                 namespace.to_dict(), pages.block_bytes, self.cfg.address)

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
            model_id=self.identity.model_id, model_revision=self.identity.model_revision,
            tokenizer_digest=self.identity.tokenizer_digest, kv_dtype=dtype, layout=layout,
            tokens_per_block=int(pool.page_size), num_layers=int(pool.layer_num),
            num_kv_heads=heads, head_dim=head_dim, tp_size=tp_size, tp_rank=tp_rank,
            pp_size=cfg.pp_size, pp_rank=cfg.pp_rank, cache_salt=self.cfg.cache_salt,
            tenant=self.cfg.tenant)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool of the model's group here (storage interface v2):
        the KV pool (``"kv"``, the pool ``register_mem_pool_host`` already registered) and, for
        hybrid models, each side pool (Mamba state, SWA window, DSA indexer, draft, DeepSeek V4
        compressed pools). Each side pool gets its own namespace (``_side_namespace``: the pool's
        name, class, layout, dtypes and page bytes), so its pages never share a key with the KV
        pool's or another pool's. Raises ``ConfigError`` (SGLang does not start) for a pool whose
        pages cannot be stored exactly."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == "kv":
            if host_pool is not getattr(self, "mem_pool_host", None):
                raise ConfigError("mem_pool_host", f"HiCache KV pool {type(host_pool).__name__} "
                                  "is not the pool registered by register_mem_pool_host (a "
                                  "logical anchor): not supported by the kvtier backend")
            return
        try:
            side = SidePool.probe(host_pool, name)
            namespace = self._side_namespace(host_pool, name, side)
        except ConfigError:
            raise
        except (PoolShapeError, ValueError, NotImplementedError, AttributeError, TypeError,
                InvalidArgument) as e:
            raise ConfigError(f"host_pool.{name}", f"{type(host_pool).__name__}: cannot store "
                              f"its pages: {type(e).__name__}: {e}") from e
        side.handle = self.client.register(namespace)
        self.side_pools[name] = side
        log.info("kvtier HiCache storage: pool %s: namespace %s (%d-byte pages, %s)", name,
                 namespace.to_dict(), side.block_bytes,
                 "zero-copy" if side.pages is not None else "flat pages")

    def _side_namespace(self, pool: Any, name: str, side: SidePool) -> Namespace:
        """A side pool's namespace: the model's identity, and the pool's own geometry. Its pages
        are opaque bytes (``kv_dtype`` uint8, 1 layer, 1 head of ``block_bytes / 2 /
        page_size``); ``layout`` names the pool, its class and host layout, and a digest of its
        dtypes and shapes. Rank-replicated (one copy, written by rank 0 and read by all) only
        for an MLA model's pools that are not Mamba state and not per-head (SGLang's writers:
        ``HybridCacheController.should_backup``); every other pool is per TP rank."""
        page_size = side.page_size
        if side.block_bytes % (2 * page_size):
            raise ConfigError(f"host_pool.{name}", f"a page of {side.block_bytes} bytes is not "
                              f"a whole number of 2 x {page_size} bytes")
        geometry = {attr: str(getattr(pool, attr)) for attr in SIDE_GEOMETRY_ATTRS
                    if hasattr(pool, attr)}
        geometry.update(page_bytes=str(side.block_bytes), page_size=str(page_size))
        digest = hashlib.sha256(repr(sorted(geometry.items())).encode()).hexdigest()[:16]
        layout = f"sglang.v2.{name}.{type(pool).__name__}.{getattr(pool, 'layout', None)}.{digest}"
        cfg = self.storage_config
        shared = self.is_mla and name != "mamba" and not hasattr(pool, "head_num")
        tp_size, tp_rank = (1, 0) if shared else (cfg.tp_size, cfg.tp_rank)
        return Namespace(
            model_id=self.identity.model_id, model_revision=self.identity.model_revision,
            tokenizer_digest=self.identity.tokenizer_digest, kv_dtype="uint8", layout=layout,
            tokens_per_block=page_size, num_layers=1, num_kv_heads=1,
            head_dim=side.block_bytes // (2 * page_size), tp_size=tp_size, tp_rank=tp_rank,
            pp_size=cfg.pp_size, pp_rank=cfg.pp_rank, cache_salt=self.cfg.cache_salt,
            tenant=self.cfg.tenant)

    # -- storage interface v2 (hybrid models: the KV pool with side pools) ------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """SGLang's hybrid hit query (``HiCacheFile.batch_exists_v2`` semantics): the leading KV
        pages the daemon holds, then each transfer's pool cuts the usable prefix: ``ALL_PAGES``
        needs the pool's page for every KV page of the prefix, ``TRAILING_PAGES`` only for the
        last ``len(transfer.keys)`` pages before the cut. A side pool's page ``i`` is stored
        under KV key ``keys[i]`` in the pool's namespace. ``restorable_prefix_pages`` lists every
        usable prefix length (SGLang intersects them across ranks)."""
        def run() -> Any:
            handle = self._ready()
            kv_pages = self._held_and_decided(handle, keys) if handle and keys else 0
            hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            deadline = time.monotonic() + self.cfg.op_timeout_ms / 1000
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                policy = _policy(transfer.hit_policy)
                if policy == "all_pages":  # one prefix lookup
                    boundary = self._held_prefix(transfer.name, keys[:kv_pages])
                    usable = set(range(1, boundary + 1))
                elif policy == "trailing_pages":  # one lookup per page
                    have = self._presence(transfer.name, keys[:kv_pages], deadline)
                    n = max(1, len(transfer.keys or []))
                    usable = {end for end in range(1, kv_pages + 1)
                              if all(have[max(0, end - n):end])}
                    boundary = max(usable, default=0)
                else:
                    self._note("batch_exists_v2", f"pool {transfer.name}: hit policy {policy} "
                               "is not supported (no hit)")
                    usable, boundary = set(), 0
                if boundary:
                    hits[transfer.name] = boundary
                restorable = [p for p in restorable if p in usable]
            return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

        self.counters.pages_queried += _length(keys)
        return self._guard("batch_exists_v2", run, PoolTransferResult.empty())

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Load each transfer's pages (``keys``, ``host_indices`` of its pool) into its host
        pool; ``True`` per page loaded, a page not found is left untouched."""
        return self._batch_v2("batch_get_v2", transfers, load=True)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages (for a ``TRAILING_PAGES`` pool SGLang passes only the
        last pages of the prefix). Per pool all ``True`` when every page is stored or already
        there, else all ``False`` (as ``batch_set_v1``)."""
        return self._batch_v2("batch_set_v2", transfers, load=False)

    def _batch_v2(self, op: str, transfers: Any, *, load: bool) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in _iterate(transfers):
            n = _length(getattr(transfer, "keys", None) or [])
            name = getattr(transfer, "name", None)
            ok = self._guard(op, functools.partial(self._transfer, transfer, load=load),
                             [False] * n)
            if name is not None:
                out[name] = ok
            loaded = sum(map(bool, ok))
            if load:
                self.counters.v2_pages_loaded += loaded
            else:
                self.counters.v2_pages_stored += loaded
            self.counters.v2_pages_failed += n - loaded
        return out

    def _transfer(self, transfer: Any, *, load: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        name = _pool_name(transfer.name)
        if name == "kv":
            if load:
                return self.batch_get_v1(keys, transfer.host_indices)
            return self.batch_set_v1(keys, transfer.host_indices)
        side = self.side_pools.get(name)
        if side is None or side.handle is None:
            self._note(f"pool.{name}", "a transfer for a pool SGLang never registered")
            return [False] * len(keys)
        ids = side.page_ids(transfer.host_indices, len(keys))
        if ids is None:
            self._note(f"pool.{name}", f"{len(keys)} keys with host indices that are not whole "
                       "pages")
            return [False] * len(keys)
        handle = side.handle
        kk = self._keys(handle, keys)
        if side.pages is not None:  # zero-copy, as batch_*_v1
            if load:
                return handle.get_blocks(kk, side.pages.layout(), ids)
            result = handle.put_blocks(kk, side.pages.layout(), ids)
            return [result.stored + result.already_present == len(keys)] * len(keys)
        pool, ps = side.pool, side.page_size
        if load:  # SGLang's flat data pages (HiCacheFile's path)
            bufs = [pool.get_dummy_flat_data_page() for _ in keys]
            found = handle.get_into(kk, bufs)
            for page, buf, hit in zip(ids, bufs, found, strict=True):
                if hit:
                    pool.set_from_flat_data_page(page * ps, buf)
            return found
        pages = [pool.get_data_page(page * ps, flat=True) for page in ids]
        result = handle.put(kk, pages)
        return [result.stored + result.already_present == len(keys)] * len(keys)

    def _pool_handle(self, pool_name: Any) -> NamespaceHandle | None:
        name = _pool_name(pool_name)
        handle = self.handle if name == "kv" else getattr(
            self.side_pools.get(name), "handle", None)
        if handle is None:
            self._note(f"pool.{name}", "a hit query for a pool SGLang never registered")
        return handle

    def _held_prefix(self, pool_name: Any, keys: list[str]) -> int:
        """How many of the pool's pages of ``keys``, from the first, the daemon holds."""
        handle = self._pool_handle(pool_name)
        return handle.lookup(self._keys(handle, keys)) if handle is not None and keys else 0

    def _presence(self, pool_name: Any, keys: list[str], deadline: float) -> list[bool]:
        """Whether pool ``pool_name`` holds its page of each KV key (one lookup per key; the
        local index answers without a round trip over ``shm``). Unregistered pool, or past the
        deadline: not held."""
        handle = self._pool_handle(pool_name)
        if handle is None:
            return [False] * len(keys)
        have = []
        for key in self._keys(handle, keys):
            if time.monotonic() >= deadline:
                have.append(False)
                continue
            # The published index first, left out of the client's lookup counts (one query
            # here is one lookup per page); a round trip only when it cannot answer.
            hit = handle.lookup_local([key], count=False)
            have.append((handle.lookup([key]) if hit is None else hit) == 1)
        return have

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

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
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

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
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

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None
            ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
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

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
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
            return StorageMetrics(prefetch_pgs=[n for n, _ in loads],
                                  backup_pgs=[n for n, _ in stores],
                                  prefetch_bandwidth=[g for _, g in loads],
                                  backup_bandwidth=[g for _, g in stores])

        return self._guard("get_stats", run, None)

    def clear(self) -> bool:
        """``False``: nothing is cleared, and a warning says why, once. The daemon has no call
        that drops a namespace's pages (it evicts by itself), and its pages are shared with every
        other engine of the same identity, which one SGLang rank may not empty. Use a new
        ``cache_salt`` (or restart the daemon) to start from an empty cache."""
        if not self._cleared_logged:
            self._cleared_logged = True
            log.warning("kvtier HiCache clear: nothing cleared: the kvtier daemon has no call "
                        "that drops a namespace's pages (it evicts by itself, and they are "
                        "shared with other engines); set a new cache_salt to start empty")
        return False

    def close(self) -> None:
        self._guard("close", self.client.close, None)

    # -- load or recompute (docs/sglang.md, "Load or recompute") ---------------------------------

    def _held_and_decided(self, handle: NamespaceHandle, keys: list[str]) -> int:
        """The leading pages of ``keys`` the daemon holds, cut to the prefix ``load_policy``
        loads: what ``batch_exists`` tells SGLang, so SGLang prefetches only that prefix and
        recomputes the rest."""
        keys = keys[: self.client.max_batch]  # SGLang asks in batches of 128 or fewer
        looked = handle.lookup_detail(self._keys(handle, keys))
        tiers = looked.tiers[: looked.hits]
        self.counters.pages_hit += len(tiers)
        if not tiers or self.pages is None:
            return len(tiers)
        ps = self.pages.page_size
        with self._decider_lock:
            for tier, fig in self.client.tier_figures().items():
                self.decider.report(tier, fig.latency_s, fig.bytes_per_s, age_s=fig.age_s)
            stats = self.decider.stats
            slower, policy = stats.tokens_recomputed_slower, stats.tokens_recomputed_policy
            d = self.decider.decide(tiers, block_tokens=ps, block_bytes=self.pages.block_bytes)
            c = self.counters
            c.tokens_reported += d.load_blocks * ps
            c.tokens_recomputed_slower += stats.tokens_recomputed_slower - slower
            c.tokens_recomputed_policy += stats.tokens_recomputed_policy - policy
            for key, tier in zip(keys[: d.load_blocks], tiers, strict=False):
                self._tier_of[key] = tier
                self._tier_of.move_to_end(key)
            if d.load_blocks and d.predicted_s is not None:
                self._predicted[(keys[0], d.load_blocks)] = d.predicted_s
            while len(self._tier_of) > _REMEMBERED_PAGES:  # reported pages SGLang never got
                self._tier_of.popitem(last=False)
            while len(self._predicted) > _REMEMBERED_PREFIXES:
                self._predicted.popitem(last=False)
        return d.load_blocks

    def _loaded(self, keys: Sequence[str], found: Sequence[bool], seconds: float) -> None:
        """A load of pages ``batch_exists`` reported is over: its time, with its bytes by tier,
        into the decider's figures (a load of pages whose tier is not known, or with a miss,
        measures nothing)."""
        if self.pages is None or not keys:
            return
        with self._decider_lock:
            tiers = [self._tier_of.pop(k, None) for k in keys]
            predicted = self._predicted.pop((keys[0], len(keys)), None)
            if not all(found) or any(t is None for t in tiers):
                return
            by_tier: dict[str, int] = {}
            for tier in tiers:
                assert tier is not None
                by_tier[tier] = by_tier.get(tier, 0) + self.pages.block_bytes
            self.decider.loaded(by_tier, seconds, predicted_s=predicted)
            if predicted is not None:
                self.counters.predicted_load_s += predicted
                self.counters.actual_load_s += seconds

    # -- helpers ----------------------------------------------------------------------------------

    def _ready(self) -> NamespaceHandle | None:
        return self.handle

    def _keys(self, handle: NamespaceHandle, keys: Sequence[str]) -> list[bytes]:
        digest, tenant_key = handle.namespace.digest, self.client.tenant_key
        return [page_key(digest, k, tenant_key) for k in keys]

    def _page_ids(self, host_indices: Any, n: int) -> list[int] | None:
        if self.pages is None:
            return None
        ids = self.pages.page_ids(host_indices, n)
        if ids is None:
            self._note("host_indices", f"{n} keys with host indices that are not whole pages")
        return ids

    def _new_page(self) -> torch.Tensor:
        assert self.mem_pool_host is not None and self.pages is not None
        dtype = self.mem_pool_host.dtype
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(self.pages.block_bytes // itemsize, dtype=dtype)

    def _count_loaded(self, n: int, loaded: int) -> None:
        self.counters.pages_loaded += loaded
        self.counters.pages_load_failed += n - loaded

    def _sample(self, into: list[tuple[int, float]], pages: int, start: float) -> None:
        if self.metrics and pages and self.pages is not None:
            seconds = max(time.perf_counter() - start, 1e-9)
            into.append((pages, pages * self.pages.block_bytes / seconds / 1e9))
            del into[:-1024]  # bounded if SGLang never asks

    def _count_stored(self, n: int, ok: bool) -> None:
        if ok:
            self.counters.pages_stored += n
        else:
            self.counters.pages_store_failed += n

    def _guard(self, op: str, fn: Callable[[], _T], failed: _T) -> _T:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - nothing may reach SGLang's storage threads
            self.counters.errors += 1
            self._note(op, f"{type(e).__name__}: {e}")
            return failed

    def _note(self, op: str, message: str) -> None:
        self.counters.last_error = f"{op}: {message}"
        now = time.monotonic()
        if now - self._logged.get(op, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[op] = now
            log.warning("kvtier HiCache %s failed (answered as a miss): %s", op, message)


def _pool_name(name: Any) -> str:
    """A PoolName (a ``str`` enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


def _policy(policy: Any) -> str:
    return str(getattr(policy, "value", policy))


def _iterate(items: Any) -> list[Any]:
    """``list(items)``, or [] for something that is not a sequence (never raises)."""
    try:
        return list(items or [])
    except Exception:  # noqa: BLE001
        return []


def _length(keys: Any) -> int:
    """``len(keys)``, or 0 for something without one (never raises)."""
    try:
        return len(keys)
    except Exception:  # noqa: BLE001
        return 0


def _check_parallelism(cfg: HiCacheStorageConfig) -> None:
    """Refuse the parallel shapes whose page bytes this backend cannot name (docs/sglang.md)."""
    if getattr(cfg, "dcp_size", 1) != 1:
        raise ConfigError("dcp_size", "decode context parallelism is not supported")
    if getattr(cfg, "attn_cp_size", 1) != 1:
        raise ConfigError("attn_cp_size", "attention context parallelism is not supported")
    if getattr(cfg, "should_split_heads", False):
        raise ConfigError("tp_lcm_size", "heterogeneous-TP head splitting is not supported")

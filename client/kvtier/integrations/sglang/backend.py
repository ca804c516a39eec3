"""``KvtierHiCacheStorage``: SGLang's HiCache L3 storage backed by a kvtierd daemon.

Loaded by SGLang's dynamic backend loader (``--hicache-storage-backend dynamic``, docs/sglang.md)
as ``KvtierHiCacheStorage(storage_config, kwargs)``. Lifecycle:

    __init__  (SGLang startup)  validate the extra config, resolve the model identity (a missing
                                field raises ConfigError here: SGLang refuses to start), connect
    register_mem_pool_host      probe the host pool's pages (``pages.HostPoolPages``), build the
              (SGLang startup)  namespace from the pool's dtype and geometry, register it
    batch_exists / batch_get_v1 / batch_set_v1 / get / set / ...   (SGLang's storage threads)
    close

Never raises into SGLang's storage threads: an exception there kills the thread and leaks host
memory, so every storage call catches everything, counts it (``self.counters``) and answers a
miss: ``False`` per key, 0 leading hits, ``None``. A daemon that is away is a miss too (the SDK's
breaker answers at once). Calls before ``register_mem_pool_host`` are misses.

Thread-safety: SGLang's prefetch and backup threads call concurrently; the kvtier ``Client`` is
thread-safe, each thread gets its own ``PagedKvLayout``, and the counters are plain integers
incremented without a lock (approximate under races, as the SDK's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolTransferResult,
)

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.sglang.config import (
    BackendConfig,
    ConfigError,
    ModelIdentity,
    page_key,
    resolve_identity,
)
from kvtier.integrations.sglang.pages import HostPoolPages, PoolShapeError
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import KV_DTYPES, Namespace

__all__ = ["BackendCounters", "KvtierHiCacheStorage"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_LOG_EVERY_S = 30.0  # at most one warning per failing operation name per this many seconds


@dataclass
class BackendCounters:
    """What the backend did, in pages (plus the exceptions it kept from SGLang)."""

    pages_queried: int = 0
    pages_hit: int = 0  # leading hits answered by batch_exists / exists
    pages_loaded: int = 0
    pages_load_failed: int = 0  # asked for and not loaded (miss, daemon away, bad indices)
    pages_stored: int = 0  # stored or already present
    pages_store_failed: int = 0
    errors: int = 0  # exceptions caught at the SGLang boundary
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
        self._logged: dict[str, float] = {}
        self.metrics = bool(storage_config.enable_storage_metrics)
        # (pages, GB/s) of each load / store batch since the last get_stats (SGLang's metrics).
        self._loads: list[tuple[int, float]] = []
        self._stores: list[tuple[int, float]] = []
        rank = f"tp{storage_config.tp_rank}pp{storage_config.pp_rank}dp{storage_config.dp_rank}"
        self.client = Client.connect(  # lazy: a daemon away is a miss, logged once per cause
            self.cfg.address, self.cfg.transport, lazy=True, timeout_s=self.cfg.request_timeout_ms / 1000,
            op_timeout_s=self.cfg.op_timeout_ms / 1000, lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
            probe_timeout_s=self.cfg.probe_timeout_ms / 1000, client_name=f"sglang-{rank}",
            token_file=self.cfg.token_file)

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
        """SGLang 0.5.23 registers every model's pools as a group: a plain MHA/MLA model's group
        holds only the KV pool, already registered by ``register_mem_pool_host``. Any other pool
        (Mamba, SWA, DSA indexer: hybrid models) is refused at startup, rather than storing a KV
        prefix without the state that must go with it."""
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ConfigError("mem_pool_host", f"HiCache pool {host_pool_name!s} "
                          f"({type(host_pool).__name__}): hybrid / multi-pool models are not "
                          "supported by the kvtier backend")

    # The *_v2 verbs of hybrid models: never reached after the refusal above, and still never
    # raising into SGLang's storage threads if they are.
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._guard("batch_get_v2", lambda: {
            str(t.name): [False] * len(t.keys or []) for t in transfers or []}, {})

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        return self.batch_get_v2(transfers, extra_info)

    # -- the zero-copy interface (interface_v1) --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the daemon holds."""
        def run() -> int:
            handle = self._ready()
            if handle is None or not keys:
                return 0
            hits = handle.lookup(self._keys(handle, keys))
            self.counters.pages_hit += hits
            return hits

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
            return handle.get_blocks(self._keys(handle, keys), self.pages.layout(), ids)

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
            found = handle.get_into(self._keys(handle, keys), bufs)
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

    def clear(self) -> None:
        """Nothing to do: kvtier evicts by itself, and one rank may not drop a shared cache."""

    def close(self) -> None:
        self._guard("close", self.client.close, None)

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

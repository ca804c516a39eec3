"""What every call of the kvtier HiCache backend stands on: its client, guard and counters.

``StorageCore`` connects the kvtier ``Client`` and holds what the backend's parts share: the
settings and the model identity, the KV pool's page geometry and namespace handle once
``register_mem_pool_host`` set them (``KvPages.register``), the never-raise guard (``guard``,
``note``), the page keys and ids, the counters (``BackendCounters``) and the metrics samples.
The parts that use it: ``decisions.PageDecisions`` (load or recompute), ``kv_pages.KvPages`` (the
KV pool: the zero-copy and the plain calls) and ``side_pools.SidePools`` (hybrid models' side
pools, the v2 calls); ``backend.KvtierHiCacheStorage`` (SGLang's ``HiCacheStorage``) holds them.

Never raises into SGLang's storage threads: an exception there kills the thread and leaks host
memory, so every storage call catches everything (``guard``), counts it (``counters``) and
answers a miss: ``False`` per key, 0 leading hits, ``None``. A daemon that is away is a miss too
(the SDK's breaker answers at once). Calls before ``register_mem_pool_host`` are misses.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.sglang.config import (
    BackendConfig,
    ConfigError,
    ModelIdentity,
    page_key,
    resolve_identity,
)
from kvtier.integrations.sglang.pages import HostPoolPages, PoolShapeError
from kvtier.settings import ClientSettings
from kvtier_contract.errors import InvalidArgument

log = logging.getLogger("kvtier.integrations.sglang.backend")
_T = TypeVar("_T")
_LOG_EVERY_S = 30.0  # at most one warning per failing operation name per this many seconds


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


class StorageCore:
    """The backend's shared state and helpers; see the module docstring.

    Owns one kvtier ``Client``, the settings and identity, the counters, the last-logged times of
    the guard's warnings, the metrics samples and the KV pool's registration (``pool``,
    ``pages``, ``handle``: set once at SGLang startup, read-only after). Thread-safety: SGLang's
    prefetch and backup threads call concurrently; the ``Client`` is thread-safe, each thread
    gets its own ``PagedKvLayout``, and the counters are plain integers incremented without a
    lock (approximate under races, as the SDK's)."""

    def __init__(self, storage_config: Any) -> None:
        self.storage_config = storage_config
        self.cfg = BackendConfig.from_extra(storage_config.extra_config)
        self.identity: ModelIdentity = resolve_identity(self.cfg, storage_config.model_name)
        _check_parallelism(storage_config)
        self.is_mla = bool(storage_config.is_mla_model)
        self.counters = BackendCounters()
        self.pool: Any = None  # SGLang's KV host pool (``register_mem_pool_host``)
        self.pages: HostPoolPages | None = None
        self.handle: NamespaceHandle | None = None
        self._logged: dict[str, float] = {}
        self.metrics = bool(storage_config.enable_storage_metrics)
        # (pages, GB/s) of each load / store batch since the last get_stats (SGLang's metrics).
        self.loads: list[tuple[int, float]] = []
        self.stores: list[tuple[int, float]] = []
        rank = f"tp{storage_config.tp_rank}pp{storage_config.pp_rank}dp{storage_config.dp_rank}"
        self.client = Client.connect(  # lazy: a daemon away is a miss, logged once per cause
            self.cfg.address,
            lazy=True,
            settings=ClientSettings(
                transport=self.cfg.transport,
                timeout_s=self.cfg.request_timeout_ms / 1000,
                op_timeout_s=self.cfg.op_timeout_ms / 1000,
                lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                probe_timeout_s=self.cfg.probe_timeout_ms / 1000,
                client_name=f"sglang-{rank}",
                token_file=self.cfg.token_file,
            ),
        )

    def keys(self, handle: NamespaceHandle, keys: Sequence[str]) -> list[bytes]:
        """SGLang's page keys as kvtier block keys in ``handle``'s namespace."""
        digest, tenant_key = handle.namespace.digest, self.client.tenant_key
        return [page_key(digest, k, tenant_key) for k in keys]

    def page_ids(self, host_indices: Any, n: int) -> list[int] | None:
        """The KV pool's page ids of ``n`` keys' ``host_indices`` (None, noted: not whole pages)."""
        if self.pages is None:
            return None
        ids = self.pages.page_ids(host_indices, n)
        if ids is None:
            self.note("host_indices", f"{n} keys with host indices that are not whole pages")
        return ids

    def new_page(self) -> torch.Tensor:
        """A flat data page of the KV pool's dtype."""
        assert self.pool is not None and self.pages is not None
        dtype = self.pool.dtype
        return torch.empty(self.pages.block_bytes // dtype.itemsize, dtype=dtype)

    def count_loaded(self, n: int, loaded: int) -> None:
        self.counters.pages_loaded += loaded
        self.counters.pages_load_failed += n - loaded

    def count_stored(self, n: int, ok: bool) -> None:
        if ok:
            self.counters.pages_stored += n
        else:
            self.counters.pages_store_failed += n

    def sample(self, into: list[tuple[int, float]], pages: int, start: float) -> None:
        """One batch's pages and GB/s into ``loads`` or ``stores`` (with ``--enable-metrics``)."""
        if self.metrics and pages and self.pages is not None:
            seconds = max(time.perf_counter() - start, 1e-9)
            into.append((pages, pages * self.pages.block_bytes / seconds / 1e9))
            del into[:-1024]  # bounded if SGLang never asks

    def take_samples(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """The (loads, stores) samples since the last call."""
        loads, stores = self.loads, self.stores
        self.loads, self.stores = [], []
        return loads, stores

    def guard(self, op: str, fn: Callable[[], _T], failed: _T) -> _T:
        """``fn()``, or ``failed`` when it raises (counted and noted: nothing reaches SGLang)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - nothing may reach SGLang's storage threads
            self.counters.errors += 1
            self.note(op, f"{type(e).__name__}: {e}")
            return failed

    def note(self, op: str, message: str) -> None:
        """``op`` failed: the last error, and a warning at most once per ``_LOG_EVERY_S``."""
        self.counters.last_error = f"{op}: {message}"
        now = time.monotonic()
        if now - self._logged.get(op, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[op] = now
            log.warning("kvtier HiCache %s failed (answered as a miss): %s", op, message)


def as_list(items: Any) -> list[Any]:
    """``list(items)``, or [] for something that is not a sequence (never raises)."""
    try:
        return list(items or [])
    except Exception:  # noqa: BLE001
        return []


def length(keys: Any) -> int:
    """``len(keys)``, or 0 for something without one (never raises)."""
    try:
        return len(keys)
    except Exception:  # noqa: BLE001
        return 0


def _check_parallelism(cfg: Any) -> None:
    """Refuse the parallel shapes whose page bytes this backend cannot name (docs/sglang.md)."""
    if getattr(cfg, "dcp_size", 1) != 1:
        raise ConfigError("dcp_size", "decode context parallelism is not supported")
    if getattr(cfg, "attn_cp_size", 1) != 1:
        raise ConfigError("attn_cp_size", "attention context parallelism is not supported")
    if getattr(cfg, "should_split_heads", False):
        raise ConfigError("tp_lcm_size", "heterogeneous-TP head splitting is not supported")


@contextlib.contextmanager
def storable(field: str, pool: str) -> Iterator[None]:
    """``ConfigError`` naming ``field`` when probing a host pool (``pool``: its words) or
    building its namespace finds pages that cannot be stored exactly."""
    try:
        yield
    except ConfigError:  # (a ValueError itself: kept as raised)
        raise
    except (PoolShapeError, ValueError, NotImplementedError, AttributeError, TypeError, InvalidArgument) as e:
        raise ConfigError(field, f"{pool}: cannot store its pages: {type(e).__name__}: {e}") from e

"""What every call of the kvtier HiCache backend stands on: its client, guard, counters and decision.

``StorageBase`` (a ``HiCacheStorage``) connects the kvtier ``Client`` and holds the page
geometry and the namespace handle once ``register_mem_pool_host`` set them; the never-raise guard
(``_guard``, ``_note``), the page keys and ids, the counters (``BackendCounters``) and the
load-or-recompute bookkeeping every storage call shares live here. The calls themselves are in
``backend`` (``KvtierHiCacheStorage``: startup, the zero-copy and the plain interface) and
``backend_v2`` (hybrid models' side pools).

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
The decider and its two maps (a reported page's tier, a decided prefix's predicted time) are
under ``_decider_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.adaptive import Decider, FixedPrefillRate, PrefillRate
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.sglang.config import (
    BackendConfig,
    ConfigError,
    ModelIdentity,
    page_key,
    resolve_identity,
)
from kvtier.integrations.sglang.pages import HostPoolPages, SidePool
from kvtier.settings import ClientSettings

log = logging.getLogger("kvtier.integrations.sglang.backend")
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


class StorageBase(HiCacheStorage):
    """The backend's shared state and helpers; see the module docstring. Owns one kvtier
    ``Client`` and the namespace of this rank."""

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
        self.decider = Decider(
            self.cfg.load_policy,
            probe_after_s=self.cfg.probe_after_s,
            prefill=FixedPrefillRate(spt) if spt else PrefillRate(),
        )
        self._decider_lock = threading.Lock()  # the prefetch and the I/O threads share it
        self._tier_of: OrderedDict[str, str] = OrderedDict()  # reported page -> its tier
        self._predicted: OrderedDict[tuple[str, int], float] = OrderedDict()
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

    # -- load or recompute (docs/sglang.md, "Load or recompute") ---------------------------------

    def _held_and_decided(self, handle: NamespaceHandle, keys: list[str]) -> int:
        """The leading pages of ``keys`` the daemon holds, cut to the prefix ``load_policy``
        loads: what ``batch_exists`` tells SGLang, so SGLang prefetches only that prefix and
        recomputes the rest."""
        tiers = self._held_tiers(handle, keys)
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

    def _held_tiers(self, handle: NamespaceHandle, keys: list[str]) -> list[str]:
        """The tier of each leading page of ``keys`` the daemon holds. A query of any length:
        SGLang's hybrid controller sends every page of a prompt in one ``batch_exists_v2``, so
        the keys go in lookups of at most the client's batch limit, the next one only while
        every page so far is held (as ``HiCacheFile`` answers the whole prefix)."""
        tiers: list[str] = []
        step = max(1, self.client.max_batch)
        for start in range(0, len(keys), step):
            chunk = self._keys(handle, keys[start : start + step])
            looked = handle.lookup_detail(chunk)
            tiers += looked.tiers[: looked.hits]
            if looked.hits < len(chunk):
                break
        return tiers

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

"""Hybrid models' side pools in kvtierd: SGLang's storage interface v2.

SGLang registers every host pool of the model's group (``register_mem_host_pool_v2``): the KV
pool again (``"kv"``) and a hybrid model's side pools (Mamba state, SWA window, DSA indexer,
draft, DeepSeek V4 compressed pools), each in a namespace of its own (``_side_namespace``), so a
side pool's page ``i`` is stored under KV key ``keys[i]`` in the pool's namespace. The v2 calls
(``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2``) move the KV pool's pages through the
KV pool's calls (``kv_pages.KvPages``) and a side pool's zero-copy (``SidePool.pages``) or as
SGLang's flat data pages.

Ownership and concurrency: a part of ``KvtierHiCacheStorage``, handed the backend's
``StorageCore``, its ``PageDecisions`` and its ``KvPages``; owns the side pools (``pools``,
registered at SGLang startup, read-only after). SGLang's storage threads call concurrently, each
call behind the never-raise guard.
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

from kvtier.client import NamespaceHandle
from kvtier.integrations.sglang.config import ConfigError
from kvtier.integrations.sglang.core import StorageCore, as_list, length, log, storable
from kvtier.integrations.sglang.decisions import PageDecisions
from kvtier.integrations.sglang.kv_pages import KvPages
from kvtier.integrations.sglang.pages import SIDE_GEOMETRY_ATTRS, SidePool
from kvtier_contract.identity import Namespace


class SidePools:
    """The side pools and the v2 calls; see the module docstring."""

    def __init__(self, core: StorageCore, decisions: PageDecisions, kv: KvPages) -> None:
        self.core = core
        self.decisions = decisions
        self.kv = kv
        self.pools: dict[str, SidePool] = {}  # hybrid models' other host pools, by name

    def register(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool of the model's group here (storage interface v2):
        the KV pool (``"kv"``, the pool ``register_mem_pool_host`` already registered) and, for
        hybrid models, each side pool (Mamba state, SWA window, DSA indexer, draft, DeepSeek V4
        compressed pools). Each side pool gets its own namespace (``_side_namespace``: the pool's
        name, class, layout, dtypes and page bytes), so its pages never share a key with the KV
        pool's or another pool's. Raises ``ConfigError`` (SGLang does not start) for a pool whose
        pages cannot be stored exactly."""
        name = _pool_name(host_pool_name)
        if name == "kv":
            self._check_kv_pool(host_pool)
            return
        side, namespace = self._probe_side(host_pool, name)
        side.handle = self.core.client.register(namespace)
        self.pools[name] = side
        log.info(
            "kvtier HiCache storage: pool %s: namespace %s (%d-byte pages, %s)",
            name,
            namespace.to_dict(),
            side.block_bytes,
            "zero-copy" if side.pages is not None else "flat pages",
        )

    def _check_kv_pool(self, host_pool: Any) -> None:
        """The v2 KV pool must be the pool ``register_mem_pool_host`` registered (else
        ``ConfigError``: a logical anchor is not supported)."""
        if host_pool is not self.core.pool:
            raise ConfigError(
                "mem_pool_host",
                f"HiCache KV pool {type(host_pool).__name__} "
                "is not the pool registered by register_mem_pool_host (a "
                "logical anchor): not supported by the kvtier backend",
            )

    def _probe_side(self, host_pool: Any, name: str) -> tuple[SidePool, Namespace]:
        """Side pool ``name``'s pages and namespace; ``ConfigError`` naming
        ``host_pool.<name>`` when its pages cannot be stored exactly."""
        with storable(f"host_pool.{name}", type(host_pool).__name__):
            side = SidePool.probe(host_pool, name)
            return side, self._side_namespace(host_pool, name, side)

    def _side_namespace(self, pool: Any, name: str, side: SidePool) -> Namespace:
        """A side pool's namespace: the model's identity, and the pool's own geometry. Its pages
        are opaque bytes (``kv_dtype`` uint8, 1 layer, 1 head of ``block_bytes / 2 /
        page_size``); ``layout`` names the pool, its class and host layout, and a digest of its
        dtypes and shapes. Rank-replicated (one copy, written by rank 0 and read by all) only
        for an MLA model's pools that are not Mamba state and not per-head (SGLang's writers:
        ``HybridCacheController.should_backup``); every other pool is per TP rank."""
        page_size = side.page_size
        if side.block_bytes % (2 * page_size):
            raise ConfigError(
                f"host_pool.{name}",
                f"a page of {side.block_bytes} bytes is not a whole number of 2 x {page_size} bytes",
            )
        geometry = {attr: str(getattr(pool, attr)) for attr in SIDE_GEOMETRY_ATTRS if hasattr(pool, attr)}
        geometry.update(page_bytes=str(side.block_bytes), page_size=str(page_size))
        digest = hashlib.sha256(repr(sorted(geometry.items())).encode()).hexdigest()[:16]
        layout = f"sglang.v2.{name}.{type(pool).__name__}.{getattr(pool, 'layout', None)}.{digest}"
        core = self.core
        cfg = core.storage_config
        shared = core.is_mla and name != "mamba" and not hasattr(pool, "head_num")
        tp_size, tp_rank = (1, 0) if shared else (cfg.tp_size, cfg.tp_rank)
        return Namespace(
            model_id=core.identity.model_id,
            model_revision=core.identity.model_revision,
            tokenizer_digest=core.identity.tokenizer_digest,
            kv_dtype="uint8",
            layout=layout,
            tokens_per_block=page_size,
            num_layers=1,
            num_kv_heads=1,
            head_dim=side.block_bytes // (2 * page_size),
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=cfg.pp_size,
            pp_rank=cfg.pp_rank,
            cache_salt=core.cfg.cache_salt,
            tenant=core.cfg.tenant,
        )

    # -- storage interface v2 (hybrid models: the KV pool with side pools) ------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None) -> Any:
        """SGLang's hybrid hit query (``HiCacheFile.batch_exists_v2`` semantics) over ``keys`` of
        any length (SGLang's hybrid controller sends every page of a prompt in one call): the
        leading KV pages the daemon holds, then each transfer's pool cuts the usable prefix:
        ``ALL_PAGES`` needs the pool's page for every KV page of the prefix, ``TRAILING_PAGES``
        only for the last ``len(transfer.keys)`` pages before the cut. A side pool's page ``i`` is stored
        under KV key ``keys[i]`` in the pool's namespace. ``restorable_prefix_pages`` lists every
        usable prefix length (SGLang intersects them across ranks)."""

        def run() -> Any:
            handle = self.core.handle
            kv_pages = self.decisions.held_and_decided(handle, keys) if handle and keys else 0
            hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            deadline = time.monotonic() + self.core.cfg.op_timeout_ms / 1000
            for transfer in pool_transfers or []:
                if not restorable:
                    break
                policy = _hit_policy(transfer.hit_policy)
                if policy == "all_pages":  # one prefix lookup
                    boundary = self._held_prefix(transfer.name, keys[:kv_pages])
                    usable = set(range(1, boundary + 1))
                elif policy == "trailing_pages":  # one lookup per page
                    have = self._presence(transfer.name, keys[:kv_pages], deadline)
                    n = max(1, len(transfer.keys or []))
                    usable = {end for end in range(1, kv_pages + 1) if all(have[max(0, end - n) : end])}
                    boundary = max(usable, default=0)
                else:
                    self.core.note(
                        "batch_exists_v2",
                        f"pool {transfer.name}: hit policy {policy} is not supported (no hit)",
                    )
                    usable, boundary = set(), 0
                if boundary:
                    hits[transfer.name] = boundary
                restorable = [p for p in restorable if p in usable]
            return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

        self.core.counters.pages_queried += length(keys)
        return self.core.guard("batch_exists_v2", run, PoolTransferResult.empty())

    def batch_get_v2(self, transfers: Any) -> dict[Any, list[bool]]:
        """Load each transfer's pages (``keys``, ``host_indices`` of its pool) into its host
        pool; ``True`` per page loaded, a page not found is left untouched."""
        return self._batch_v2("batch_get_v2", transfers, load=True)

    def batch_set_v2(self, transfers: Any) -> dict[Any, list[bool]]:
        """Store each transfer's pages (for a ``TRAILING_PAGES`` pool SGLang passes only the
        last pages of the prefix). Per pool all ``True`` when every page is stored or already
        there, else all ``False`` (as ``batch_set_v1``)."""
        return self._batch_v2("batch_set_v2", transfers, load=False)

    def _batch_v2(self, op: str, transfers: Any, *, load: bool) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in as_list(transfers):
            n = length(getattr(transfer, "keys", None) or [])
            name = getattr(transfer, "name", None)
            ok = self.core.guard(op, functools.partial(self._transfer, transfer, load=load), [False] * n)
            if name is not None:
                out[name] = ok
            loaded = sum(map(bool, ok))
            if load:
                self.core.counters.v2_pages_loaded += loaded
            else:
                self.core.counters.v2_pages_stored += loaded
            self.core.counters.v2_pages_failed += n - loaded
        return out

    def _transfer(self, transfer: Any, *, load: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        name = _pool_name(transfer.name)
        if name == "kv":  # the KV pool: the KV pool's calls (``kv_pages``)
            done: list[bool] = (self.kv.batch_get_v1 if load else self.kv.batch_set_v1)(
                keys, transfer.host_indices
            )
            return done
        side = self.pools.get(name)
        if side is None or side.handle is None:
            self.core.note(f"pool.{name}", "a transfer for a pool SGLang never registered")
            return [False] * len(keys)
        ids = side.page_ids(transfer.host_indices, len(keys))
        if ids is None:
            self.core.note(f"pool.{name}", f"{len(keys)} keys with host indices that are not whole pages")
            return [False] * len(keys)
        handle = side.handle
        kk = self.core.keys(handle, keys)
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
        handle = self.core.handle if name == "kv" else getattr(self.pools.get(name), "handle", None)
        if handle is None:
            self.core.note(f"pool.{name}", "a hit query for a pool SGLang never registered")
        return handle

    def _held_prefix(self, pool_name: Any, keys: list[str]) -> int:
        """How many of the pool's pages of ``keys``, from the first, the daemon holds."""
        handle = self._pool_handle(pool_name)
        return handle.lookup(self.core.keys(handle, keys)) if handle is not None and keys else 0

    def _presence(self, pool_name: Any, keys: list[str], deadline: float) -> list[bool]:
        """Whether pool ``pool_name`` holds its page of each KV key (one lookup per key; the
        local index answers without a round trip over ``shm``). Unregistered pool, or past the
        deadline: not held."""
        handle = self._pool_handle(pool_name)
        if handle is None:
            return [False] * len(keys)
        have = []
        for key in self.core.keys(handle, keys):
            if time.monotonic() >= deadline:
                have.append(False)
                continue
            # The published index first, left out of the client's lookup counts (one query
            # here is one lookup per page); a round trip only when it cannot answer.
            hit = handle.lookup_local([key], count=False)
            have.append((handle.lookup([key]) if hit is None else hit) == 1)
        return have


def _pool_name(name: Any) -> str:
    """A PoolName (a ``str`` enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


def _hit_policy(policy: Any) -> str:
    """A transfer's hit policy (an enum or a string), as its value."""
    return str(getattr(policy, "value", policy))

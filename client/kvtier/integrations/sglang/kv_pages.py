"""The KV host pool's pages in kvtierd: SGLang's zero-copy (``interface_v1``) and plain calls.

``KvPages.register`` probes the KV host pool (``pages.HostPoolPages``) at SGLang startup and
registers this rank's namespace, built from the pool's dtype and geometry (MLA: one namespace
for every rank, written by rank 0). The calls: ``batch_exists`` (the held prefix, cut by the
load-or-recompute decision), ``batch_get_v1`` / ``batch_set_v1`` (zero-copy, the pool's pages
named by ``host_indices``) and ``batch_get`` / ``batch_set`` (flat data pages). Each is one
guarded call (``StorageCore.guard``): a miss, never an exception, for SGLang.

Ownership and concurrency: a part of ``KvtierHiCacheStorage``, handed the backend's
``StorageCore`` (where it sets the KV pool's registration: ``pool``, ``pages``, ``handle``) and
its ``PageDecisions``; no state of its own beyond them. SGLang's storage threads call
concurrently (the ``Client`` is thread-safe, each thread gets its own ``PagedKvLayout``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvtier.integrations.sglang.config import ConfigError
from kvtier.integrations.sglang.core import StorageCore, length, log, storable
from kvtier.integrations.sglang.decisions import PageDecisions
from kvtier.integrations.sglang.pages import HostPoolPages
from kvtier_contract.identity import KV_DTYPES, Namespace


class KvPages:
    """The KV pool's registration and calls; see the module docstring."""

    def __init__(self, core: StorageCore, decisions: PageDecisions) -> None:
        self.core = core
        self.decisions = decisions

    def register(self, mem_pool_host: Any) -> None:
        """Probe the host pool and register this rank's namespace (raises at SGLang startup when
        the pool cannot be stored exactly: unknown dtype, unsupported layout, irregular pages)."""
        core = self.core
        core.pool = mem_pool_host
        kind = "mla" if core.is_mla else "mha"
        layout = getattr(mem_pool_host, "layout", None)
        name = f"sglang.{layout}.{kind}"
        with storable("mem_pool_host", f"{type(mem_pool_host).__name__} ({layout})"):
            pages = HostPoolPages.probe(mem_pool_host, name)
            namespace = self._namespace(mem_pool_host, name)
        if namespace.block_bytes != pages.block_bytes:
            raise ConfigError(
                "mem_pool_host",
                f"a page holds {pages.block_bytes} bytes in "
                f"{pages.segments} segments; its geometry says "
                f"{namespace.block_bytes}",
            )
        core.pages = pages
        core.handle = core.client.register(namespace)
        log.info(
            "kvtier HiCache storage: namespace %s (%d-byte pages) at %s",
            namespace.to_dict(),
            pages.block_bytes,
            core.cfg.address,
        )

    def _namespace(self, pool: Any, layout: str) -> Namespace:
        """This rank's namespace of the KV pool ``pool`` (its dtype and geometry)."""
        dtype = str(pool.dtype).removeprefix("torch.")
        if dtype not in KV_DTYPES:
            raise ConfigError("mem_pool_host", f"KV dtype {dtype} is not one kvtier stores")
        cfg, core = self.core.storage_config, self.core
        if core.is_mla:
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
            model_id=core.identity.model_id,
            model_revision=core.identity.model_revision,
            tokenizer_digest=core.identity.tokenizer_digest,
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
            cache_salt=core.cfg.cache_salt,
            tenant=core.cfg.tenant,
        )

    def batch_exists(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, the daemon holds, cut by ``load_policy`` to
        the prefix worth loading (SGLang prefetches what this answers, recomputes the rest)."""

        def run() -> int:
            handle = self.core.handle
            if handle is None or not keys:
                return 0
            return self.decisions.held_and_decided(handle, keys)

        self.core.counters.pages_queried += length(keys)
        return self.core.guard("batch_exists", run, 0)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Load ``keys`` into the host pool pages named by ``host_indices``; a page not loaded
        is left untouched and answers False."""

        def run() -> list[bool]:
            handle, ids = self.core.handle, self.core.page_ids(host_indices, len(keys))
            if handle is None or ids is None or self.core.pages is None:
                return [False] * len(keys)
            found = handle.get_blocks(self.core.keys(handle, keys), self.core.pages.layout(), ids)
            self.decisions.loaded(keys, found, time.perf_counter() - start)
            return found

        n, start = length(keys), time.perf_counter()
        found = self.core.guard("batch_get_v1", run, [False] * n)
        self.core.count_loaded(n, sum(map(bool, found)))
        self.core.sample(self.core.loads, sum(map(bool, found)), start)
        return found

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Store the host pool pages named by ``host_indices`` under ``keys``. All True when
        every page is stored or already there; otherwise all False (the SDK counts a put's
        outcomes, not which keys had which)."""

        def run() -> bool:
            handle, ids = self.core.handle, self.core.page_ids(host_indices, len(keys))
            if handle is None or ids is None or self.core.pages is None:
                return False
            result = handle.put_blocks(self.core.keys(handle, keys), self.core.pages.layout(), ids)
            return result.stored + result.already_present == len(keys)

        n, start = length(keys), time.perf_counter()
        ok = n > 0 and self.core.guard("batch_set_v1", run, False)
        self.core.count_stored(n, ok)
        self.core.sample(self.core.stores, n if ok else 0, start)
        return [ok] * n

    def batch_get(self, keys: list[str], target_locations: Any = None) -> list[torch.Tensor | None]:
        """Fill each target (a flat data page tensor) or, when none is given, a new one of the
        pool's dtype; None for a page not found."""

        def run() -> list[torch.Tensor | None]:
            handle = self.core.handle
            if handle is None or not keys:
                return [None] * len(keys)
            targets = list(target_locations or [None] * len(keys))
            bufs = [t if t is not None else self.core.new_page() for t in targets]
            start = time.perf_counter()
            found = handle.get_into(self.core.keys(handle, keys), bufs)
            self.decisions.loaded(keys, found, time.perf_counter() - start)
            return [b if f else None for b, f in zip(bufs, found, strict=True)]

        n = length(keys)
        missed: list[torch.Tensor | None] = [None] * n
        out = self.core.guard("batch_get", run, missed)
        self.core.count_loaded(n, sum(t is not None for t in out))
        return out

    def batch_set(self, keys: list[str], values: Any = None) -> bool:
        """Store flat data pages ``values`` under ``keys``; True when all are stored."""

        def run() -> bool:
            handle = self.core.handle
            if handle is None or values is None:
                return False
            result = handle.put(self.core.keys(handle, keys), list(values))
            return result.stored + result.already_present == len(keys)

        n = length(keys)
        if n == 0 and keys is not None:
            return True  # nothing to store is done (SGLang's HiCacheFile answers True too)
        ok = n > 0 and self.core.guard("batch_set", run, False)
        self.core.count_stored(n, ok)
        return ok

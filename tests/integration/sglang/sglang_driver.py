"""SGLang's HiCache storage seam with the kvtier backend, in its own process (the SGLang env).

Run with the SGLang environment's interpreter: ``.venv-sglang/bin/python sglang_driver.py``.
It answers ``DRIVER {"ready": true}``, then one ``DRIVER {json}`` line per JSON command on stdin.

What is SGLang's own code here: ``HiCacheStorageConfig``, the dynamic backend loader
(``StorageBackendFactory.create_backend("dynamic", ...)``, which imports the backend class, checks
it subclasses ``HiCacheStorage`` and calls ``cls(storage_config, kwargs)``), and the host pool
methods the backend depends on: ``get_page_buffer_meta``, ``get_data_page``,
``set_from_flat_data_page`` and ``get_dummy_flat_data_page`` are lifted, unchanged, from the
installed ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` source (their modules cannot be
imported without CUDA kernels, docs/sglang.md). Only the pool's allocation is written here:
``kv_buffer`` with the dims of SGLang's ``init_kv_buffer`` for each layout, in plain CPU memory.

Commands (``name``s are the driver's handles):

* ``{"op": "pool", "name", "kind": "mha"|"mla", "layout", "pages", "page_size", "layers",
  "heads", "head_dim", "kv_cache_dim", "dtype", "seed": int|null}`` (seed null: zeros)
* ``{"op": "pool", "name", "kind": "mamba", "layout", "pages", "layers", "temporal": [dims],
  "convs": [[dims], ...], "temporal_dtype", "dtype", "seed"}``: a ``MambaPoolHost`` (one state
  slot per page; its page methods lifted likewise, its buffers with ``init_kv_buffer``'s dims);
  ``{"kind": "dsa_indexer", "layout", "pages", "page_size", "layers", "page_stride", "seed"}``:
  a ``DSAIndexerPoolHost`` likewise
* ``{"op": "backend", "name", "pool", "tp_rank", "tp_size", "model_name", "extra": {...},
  "sides": {pool name: pool}, "metrics": bool, "file": dir|null}``: SGLang's attach (the loader,
  then the pool registrations: the KV pool, then each side pool of a hybrid model); ``file``:
  SGLang's own ``HiCacheFile`` (``create_backend("file", ...)``) instead of kvtier
  -> ``{"ok": true}`` or ``{"error": "<type>: <message>"}`` (construction or registration raised)
* ``{"op": "call", "backend", "method", "keys", "pages", "transfers"}``: ``batch_exists``,
  ``batch_get_v1``, ``batch_set_v1`` (pages -> host indices), ``exists``, ``get_page`` /
  ``set_page`` (the plain ``get`` / ``set`` with SGLang's flat data pages), ``batch_set`` (plain,
  flat pages), ``clear``, ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` (transfers:
  ``[{"name", "keys", "pages", "policy"}]`` -> SGLang ``PoolTransfer``s), ``garbage`` (every verb
  with malformed arguments) -> ``{"result", "raised", "seconds"}``
* ``{"op": "digests", "pool", "pages"}`` -> SHA-256 of each page's flat data page bytes
* ``{"op": "counters", "backend"}``; ``{"op": "close", "backend"}``
* ``{"op": "bench", "backend", "reader", "pages": 128}`` -> seconds and bytes of a put and a get
* ``{"op": "quit"}``
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LIFTED = (
    "get_page_buffer_meta",
    "get_data_page",
    "set_from_flat_data_page",
    "get_dummy_flat_data_page",
    "_storage_page_index",
    "_iter_page_tensors",
    "_flatten_tensor_bytes",
    "get_size_per_token",
)


def sglang_methods(module: str, cls: str) -> dict[str, Any]:
    """The methods ``LIFTED`` of SGLang class ``cls`` in ``module``, compiled from its installed
    source (without importing the module)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(spec.submodule_search_locations[0], *module.split(".")[1:]) + ".py"
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fns = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in LIFTED]
    scope: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=fns, type_ignores=[]), path, "exec"), scope)  # noqa: S102
    return {n.name: scope[n.name] for n in fns}


MHA = sglang_methods("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost")
MLA = sglang_methods("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost")
MAMBA = sglang_methods("sglang.srt.mem_cache.pool_host.mamba", "MambaPoolHost")
CpuMHAPool = type("CpuMHAPool", (), dict(MHA))
CpuMLAPool = type("CpuMLAPool", (), dict(MLA))
CpuMambaPool = type("CpuMambaPool", (), dict(MAMBA))
DSA = sglang_methods("sglang.srt.mem_cache.pool_host.dsa", "DSAIndexerPoolHost")
CpuDSAIndexerPool = type("CpuDSAIndexerPool", (), dict(DSA))


def make_dsa_indexer_pool(
    layout: str, pages: int, page_size: int, layers: int, page_stride: int, seed: int | None
) -> Any:
    """SGLang's DSAIndexerPoolHost (its page methods) over a CPU ``index_k_with_scale_buffer``
    with the dims of its ``init_kv_buffer`` (uint8: a page's index keys and scales, per layer)."""
    pool = CpuDSAIndexerPool()
    size = pages * page_size
    pool.layout, pool.page_size, pool.size, pool.page_num = layout, page_size, size, pages
    pool.layer_num, pool.indexer_page_stride_size = layers, page_stride
    pool.indexer_dtype = pool.dtype = torch.uint8
    pool.device, pool.pin_memory = "cpu", False
    pool.indexer_page_num = (size + page_size + 1) // page_size
    dims = (
        (layers, pool.indexer_page_num, page_stride)
        if layout == "layer_first"
        else (pool.indexer_page_num, layers, 1, page_stride)
    )
    g = torch.Generator().manual_seed(seed or 0)
    pool.index_k_with_scale_buffer = (
        torch.zeros(dims, dtype=torch.uint8)
        if seed is None
        else torch.randint(0, 256, dims, generator=g, dtype=torch.uint8)
    )
    return pool


def make_mamba_pool(
    layout: str,
    slots: int,
    layers: int,
    temporal: list[int],
    convs: list[list[int]],
    temporal_dtype: str,
    conv_dtype: str,
    seed: int | None,
) -> Any:
    """SGLang's MambaPoolHost (its page methods) over CPU buffers with the dims of its
    ``init_kv_buffer``: one slot per page (page_size 1), the temporal (SSM) state and each conv
    state in its own buffer."""
    pool = CpuMambaPool()
    pool.layout, pool.page_size, pool.size, pool.page_num = layout, 1, slots, slots
    pool.num_mamba_layers, pool.device, pool.pin_memory = layers, "cpu", False
    pool.temporal_state_shape = torch.Size(temporal)
    pool.conv_state_shapes = [torch.Size(c) for c in convs]
    pool.temporal_state_elem_size = int(torch.Size(temporal).numel())
    pool.conv_state_elem_sizes = [int(torch.Size(c).numel()) for c in convs]
    pool.temporal_dtype, pool.conv_dtype = getattr(torch, temporal_dtype), getattr(torch, conv_dtype)
    pool.dtype = pool.conv_dtype
    pool.slot_state_device_tensors, pool.slot_state_buffers = (), []
    g = torch.Generator().manual_seed(seed or 0)

    def alloc(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if seed is None:
            return torch.zeros(dims, dtype=dtype)
        return torch.randn(dims, generator=g).to(dtype)

    if layout in ("page_first", "page_first_direct"):
        pool.temporal_buffer = alloc((slots, layers, 1, *temporal), pool.temporal_dtype)
        pool.conv_buffer = [alloc((slots, layers, 1, *c), pool.conv_dtype) for c in convs]
    else:
        pool.temporal_buffer = alloc((layers, slots, *temporal), pool.temporal_dtype)
        pool.conv_buffer = [alloc((layers, slots, *c), pool.conv_dtype) for c in convs]
    pool.kv_buffer = [pool.temporal_buffer, *pool.conv_buffer]
    pool.size_per_token = pool.get_size_per_token()
    return pool


def make_pool(
    kind: str,
    layout: str,
    pages: int,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    kv_cache_dim: int,
    dtype: str,
    seed: int | None,
) -> Any:
    pool = (CpuMHAPool if kind == "mha" else CpuMLAPool)()
    size = pages * page_size
    pool.layout, pool.page_size, pool.layer_num, pool.size, pool.page_num = (
        layout,
        page_size,
        layers,
        size,
        pages,
    )
    pool.dtype, pool.device, pool.pin_memory = getattr(torch, dtype), "cpu", False
    if kind == "mha":
        pool.head_num, pool.head_dim = heads, head_dim
        dims = {
            "layer_first": (2, layers, size, heads, head_dim),
            "page_first": (2, size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
            "page_head": (2, pages, heads, page_size, layers, head_dim),
        }[layout]
    else:
        pool.kv_cache_dim, pool.dcp_size, pool.logical_page_size = kv_cache_dim, 1, page_size
        dims = {
            "layer_first": (layers, size, 1, kv_cache_dim),
            "page_first": (size, layers, 1, kv_cache_dim),
            "page_first_direct": (pages, layers, page_size, 1, kv_cache_dim),
        }[layout]
    if seed is None:
        pool.kv_buffer = torch.zeros(dims, dtype=pool.dtype)
    else:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer = torch.randn(dims, generator=g).to(pool.dtype)
    return pool


def storage_config(
    pool: Any,
    tp_rank: int,
    tp_size: int,
    model_name: str | None,
    extra: dict[str, Any],
    metrics: bool = False,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=isinstance(pool, CpuMLAPool),
        enable_storage_metrics=metrics,
        is_page_first_layout=pool.layout == "page_first",
        model_name=model_name,
        extra_config={
            "backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1,
            **extra,
        },
    )


def host_indices(pool: Any, pages: list[int]) -> torch.Tensor:
    ps = pool.page_size
    return (
        torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])
        if pages
        else torch.empty(0, dtype=torch.int64)
    )


def page_bytes(pool: Any, page: int) -> bytes:
    return bytes(
        pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    )


class Driver:
    def __init__(self) -> None:
        self.pools: dict[str, Any] = {}
        self.backends: dict[str, Any] = {}

    def pool(self, c: dict[str, Any]) -> dict[str, Any]:
        if c["kind"] == "dsa_indexer":
            self.pools[c["name"]] = make_dsa_indexer_pool(
                c["layout"], c["pages"], c["page_size"], c["layers"], c["page_stride"], c.get("seed")
            )
            return {"ok": True}
        if c["kind"] == "mamba":
            self.pools[c["name"]] = make_mamba_pool(
                c["layout"],
                c["pages"],
                c["layers"],
                c["temporal"],
                c["convs"],
                c.get("temporal_dtype", "float32"),
                c.get("dtype", "bfloat16"),
                c.get("seed"),
            )
            return {"ok": True}
        self.pools[c["name"]] = make_pool(
            c["kind"],
            c["layout"],
            c["pages"],
            c["page_size"],
            c["layers"],
            c.get("heads", 1),
            c.get("head_dim", 1),
            c.get("kv_cache_dim", 0),
            c.get("dtype", "bfloat16"),
            c.get("seed"),
        )
        return {"ok": True}

    def backend(self, c: dict[str, Any]) -> dict[str, Any]:
        pool = self.pools[c["pool"]]
        cfg = storage_config(
            pool,
            c.get("tp_rank", 0),
            c.get("tp_size", 1),
            c.get("model_name", "test/model"),
            c.get("extra", {}),
            c.get("metrics", False),
        )
        kind = "dynamic"
        if c.get("file"):  # SGLang's own reference backend (HiCacheFile) over a directory
            kind, cfg.extra_config = "file", {"file_storage_path": c["file"]}
        try:  # as SGLang's HybridCacheController.attach_storage_backend does (0.5.23: every
            # model's host pools are a group; a plain MHA/MLA model's holds the KV pool only)
            backend = StorageBackendFactory.create_backend(kind, cfg, pool)
            backend.register_mem_pool_host(pool)
            backend.register_mem_host_pool_v2(pool, PoolName.KV)
            for name, side in (c.get("sides") or {}).items():  # a hybrid model's other pools
                backend.register_mem_host_pool_v2(self.pools[side], PoolName(name))
            backend.on_host_pools_registered()
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(e).__name__}: {e}"}
        self.backends[c["name"]] = backend
        return {"ok": True, "class": type(backend).__name__}

    def call(self, c: dict[str, Any]) -> dict[str, Any]:
        b = self.backends[c["backend"]]
        pool = b.mem_pool_host
        keys, pages = c.get("keys", []), c.get("pages", [])
        start = time.perf_counter()
        raised = None
        result: Any = None
        try:
            m = c["method"]
            if m == "batch_exists":
                result = b.batch_exists(keys, None)
            elif m in ("batch_get_v1", "batch_set_v1"):
                result = getattr(b, m)(keys, host_indices(pool, pages), None)
            elif m == "exists":
                result = b.exists(keys[0])
            elif m == "prefetch":  # as SGLang's prefetch: the hit query, then the hit's pages
                n = b.batch_exists(keys, None)
                found = b.batch_get_v1(keys[:n], host_indices(pool, pages[:n]), None) if n else []
                result = {"reported": n, "found": found}
            elif m == "tiers":  # where the daemon holds each leading hit
                result = b.handle.lookup_detail(b.core.keys(b.handle, keys)).tiers
            elif m in ("batch_get_v2", "batch_set_v2"):
                got = getattr(b, m)(self.transfers(b, c["transfers"]), None)
                result = {str(name): list(ok) for name, ok in got.items()}
            elif m == "batch_exists_v2":
                r = b.batch_exists_v2(keys, self.transfers(b, c.get("transfers", [])), None)
                result = {
                    "kv": r.kv_hit_pages,
                    "pools": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
                    "restorable": r.restorable_prefix_pages,
                }
            elif m == "batch_set":  # the plain call with flat data pages
                result = b.batch_set(keys, [pool.get_data_page(p * pool.page_size, flat=True) for p in pages])
            elif m == "clear":
                result = b.clear()
            elif m == "get_page":  # the plain path, as SGLang's _generic_page_get
                got = b.get(keys[0], pool.get_dummy_flat_data_page())
                if got is not None:
                    pool.set_from_flat_data_page(pages[0] * pool.page_size, got)
                result = got is not None
            elif m == "set_page":  # the plain path, as SGLang's _generic_page_set
                result = b.set(keys[0], pool.get_data_page(pages[0] * pool.page_size, flat=True))
            elif m == "garbage":  # malformed arguments: every verb must still answer
                result = [
                    repr(x)
                    for x in (
                        b.batch_exists(None, None),
                        b.batch_get_v1(None, None, None),
                        b.batch_set_v1(keys, None, None),
                        b.batch_get_v1(keys, "x", None),
                        b.batch_set_v1([1, 2], host_indices(pool, [0, 1]), None),
                        b.get(keys[0], torch.empty(3)),
                        b.set(keys[0], torch.empty(3)),
                        b.batch_set(keys, None),
                        b.batch_exists_v2(keys, None),
                        b.batch_get_v2(None),
                        b.batch_set_v2([object()]),
                        b.get_stats(),
                    )
                ]
            else:
                raise ValueError(f"unknown method {m}")
        except BaseException as e:  # noqa: BLE001 - the backend must never raise: report it
            raised = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        return {"result": result, "raised": raised, "seconds": time.perf_counter() - start}

    def transfers(self, b: Any, specs: list[dict[str, Any]]) -> list[PoolTransfer]:
        """SGLang PoolTransfers: ``{"name", "keys", "pages" (of that pool), "policy"}``."""
        out = []
        for t in specs:
            name = PoolName(t["name"])
            pool = b.registered_pools.get(name, b.mem_pool_host)  # unregistered: KV indices
            out.append(
                PoolTransfer(
                    name=name,
                    keys=t.get("keys"),
                    host_indices=host_indices(pool, t["pages"]) if "pages" in t else None,
                    hit_policy=PoolHitPolicy(t.get("policy", "all_pages")),
                )
            )
        return out

    def digests(self, c: dict[str, Any]) -> dict[str, Any]:
        pool = self.pools[c["pool"]]
        return {"digests": [hashlib.sha256(page_bytes(pool, p)).hexdigest()[:16] for p in c["pages"]]}

    def flat(self, c: dict[str, Any]) -> dict[str, Any]:
        """Bytes of each of a pool's flat data pages (any pool kind)."""
        return {"bytes": [len(page_bytes(self.pools[c["pool"]], p)) for p in c["pages"]]}

    def counters(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"counters": dataclasses.asdict(self.backends[c["backend"]].counters)}

    def close(self, c: dict[str, Any]) -> dict[str, Any]:
        self.backends.pop(c["backend"]).close()
        return {"ok": True}

    def bench(self, c: dict[str, Any]) -> dict[str, Any]:
        """``pages`` pages stored by ``backend`` and loaded by ``reader``, ``rounds`` times
        (fresh keys each round); the best round of each."""
        w, r = self.backends[c["backend"]], self.backends[c["reader"]]
        n, rounds = c.get("pages", 128), c.get("rounds", 3)
        idx_w, idx_r = (
            host_indices(w.mem_pool_host, list(range(n))),
            host_indices(r.mem_pool_host, list(range(n))),
        )
        put_s, get_s = [], []
        for k in range(rounds):
            keys = [f"bench-{c.get('tag', '')}-{k}-{i}" for i in range(n)]
            t = time.perf_counter()
            ok_w = all(w.batch_set_v1(keys, idx_w, None))
            put_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            ok_r = all(r.batch_get_v1(keys, idx_r, None))
            get_s.append(time.perf_counter() - t)
            if not (ok_w and ok_r):
                return {"error": f"round {k}: put {ok_w} get {ok_r}"}
        same = all(page_bytes(w.mem_pool_host, p) == page_bytes(r.mem_pool_host, p) for p in range(n))
        return {"bytes": n * w.pages.block_bytes, "put_s": min(put_s), "get_s": min(get_s), "same": same}


def main() -> None:
    driver = Driver()
    print("DRIVER " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        c = json.loads(line)
        if c["op"] == "quit":
            break
        try:
            answer = getattr(driver, c["op"])(c)
        except Exception as e:  # noqa: BLE001 - a driver bug, reported to the test
            answer = {"error": f"driver: {type(e).__name__}: {e}", "trace": traceback.format_exc()}
        print("DRIVER " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

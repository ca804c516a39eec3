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
* ``{"op": "backend", "name", "pool", "tp_rank", "tp_size", "model_name", "extra": {...},
  "sidecar": pool|null, "metrics": bool}``: SGLang's attach (the loader, then the pool registrations)
  -> ``{"ok": true}`` or ``{"error": "<type>: <message>"}`` (construction or registration raised)
* ``{"op": "call", "backend", "method", "keys", "pages"}``: ``batch_exists``, ``batch_get_v1``,
  ``batch_set_v1`` (pages -> host indices), ``exists``, ``get_page`` / ``set_page`` (the plain
  ``get`` / ``set`` with SGLang's flat data pages), ``garbage`` (every verb with malformed
  arguments) -> ``{"result", "raised", "seconds"}``
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
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

LIFTED = ("get_page_buffer_meta", "get_data_page", "set_from_flat_data_page",
          "get_dummy_flat_data_page", "_storage_page_index")


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
CpuMHAPool = type("CpuMHAPool", (), dict(MHA))
CpuMLAPool = type("CpuMLAPool", (), dict(MLA))


def make_pool(kind: str, layout: str, pages: int, page_size: int, layers: int, heads: int,
              head_dim: int, kv_cache_dim: int, dtype: str, seed: int | None) -> Any:
    pool = (CpuMHAPool if kind == "mha" else CpuMLAPool)()
    size = pages * page_size
    pool.layout, pool.page_size, pool.layer_num, pool.size, pool.page_num = (
        layout, page_size, layers, size, pages)
    pool.dtype, pool.device, pool.pin_memory = getattr(torch, dtype), "cpu", False
    if kind == "mha":
        pool.head_num, pool.head_dim = heads, head_dim
        dims = {"layer_first": (2, layers, size, heads, head_dim),
                "page_first": (2, size, layers, heads, head_dim),
                "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
                "page_head": (2, pages, heads, page_size, layers, head_dim)}[layout]
    else:
        pool.kv_cache_dim, pool.dcp_size, pool.logical_page_size = kv_cache_dim, 1, page_size
        dims = {"layer_first": (layers, size, 1, kv_cache_dim),
                "page_first": (size, layers, 1, kv_cache_dim),
                "page_first_direct": (pages, layers, page_size, 1, kv_cache_dim)}[layout]
    if seed is None:
        pool.kv_buffer = torch.zeros(dims, dtype=pool.dtype)
    else:
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer = torch.randn(dims, generator=g).to(pool.dtype)
    return pool


def storage_config(pool: Any, tp_rank: int, tp_size: int, model_name: str | None,
                   extra: dict[str, Any], metrics: bool = False) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=isinstance(pool, CpuMLAPool), enable_storage_metrics=metrics,
        is_page_first_layout=pool.layout == "page_first", model_name=model_name,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierHiCacheStorage", "interface_v1": 1, **extra})


def host_indices(pool: Any, pages: list[int]) -> torch.Tensor:
    ps = pool.page_size
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages]) if pages else \
        torch.empty(0, dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    return bytes(pool.get_data_page(page * pool.page_size, flat=True)
                 .contiguous().view(torch.uint8).numpy().tobytes())


class Driver:
    def __init__(self) -> None:
        self.pools: dict[str, Any] = {}
        self.backends: dict[str, Any] = {}

    def pool(self, c: dict[str, Any]) -> dict[str, Any]:
        self.pools[c["name"]] = make_pool(
            c["kind"], c["layout"], c["pages"], c["page_size"], c["layers"], c.get("heads", 1),
            c.get("head_dim", 1), c.get("kv_cache_dim", 0), c.get("dtype", "bfloat16"),
            c.get("seed"))
        return {"ok": True}

    def backend(self, c: dict[str, Any]) -> dict[str, Any]:
        pool = self.pools[c["pool"]]
        cfg = storage_config(pool, c.get("tp_rank", 0), c.get("tp_size", 1),
                             c.get("model_name", "test/model"), c.get("extra", {}),
                             c.get("metrics", False))
        try:  # as SGLang's HybridCacheController.attach_storage_backend does (0.5.23: every
            # model's host pools are a group; a plain MHA/MLA model's holds the KV pool only)
            backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
            backend.register_mem_pool_host(pool)
            backend.register_mem_host_pool_v2(pool, PoolName.KV)
            if c.get("sidecar"):  # a hybrid model's second pool (e.g. Mamba states)
                backend.register_mem_host_pool_v2(self.pools[c["sidecar"]], PoolName.MAMBA)
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
            elif m == "get_page":  # the plain path, as SGLang's _generic_page_get
                got = b.get(keys[0], pool.get_dummy_flat_data_page())
                if got is not None:
                    pool.set_from_flat_data_page(pages[0] * pool.page_size, got)
                result = got is not None
            elif m == "set_page":  # the plain path, as SGLang's _generic_page_set
                result = b.set(keys[0], pool.get_data_page(pages[0] * pool.page_size, flat=True))
            elif m == "garbage":  # malformed arguments: every verb must still answer
                result = [repr(x) for x in (
                    b.batch_exists(None, None), b.batch_get_v1(None, None, None),
                    b.batch_set_v1(keys, None, None), b.batch_get_v1(keys, "x", None),
                    b.batch_set_v1([1, 2], host_indices(pool, [0, 1]), None),
                    b.get(keys[0], torch.empty(3)), b.set(keys[0], torch.empty(3)),
                    b.batch_set(keys, None), b.batch_exists_v2(keys, None),
                    b.batch_get_v2(None), b.batch_set_v2([object()]), b.get_stats())]
            else:
                raise ValueError(f"unknown method {m}")
        except BaseException as e:  # noqa: BLE001 - the backend must never raise: report it
            raised = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        return {"result": result, "raised": raised, "seconds": time.perf_counter() - start}

    def digests(self, c: dict[str, Any]) -> dict[str, Any]:
        pool = self.pools[c["pool"]]
        return {"digests": [hashlib.sha256(page_bytes(pool, p)).hexdigest()[:16]
                            for p in c["pages"]]}

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
        idx_w, idx_r = host_indices(w.mem_pool_host, list(range(n))), \
            host_indices(r.mem_pool_host, list(range(n)))
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
        same = all(page_bytes(w.mem_pool_host, p) == page_bytes(r.mem_pool_host, p)
                   for p in range(n))
        return {"bytes": n * w.pages.block_bytes, "put_s": min(put_s), "get_s": min(get_s),
                "same": same}


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

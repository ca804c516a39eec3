"""Drives a running LMCache multi-process server with LMCache's own client API (run with the
LMCache environment's python; see test_lmcache_adapter.py).

``python lmcache_driver.py '<spec json>'`` opens LMCache's SDK context (``lmcache.sdk``) for
``spec["model"]``, registering a CPU worker's KV layout as an engine-driven worker does, and
answers one JSON line per command read
from stdin, each prefixed ``DRIVER ``:

* ``{"op": "store", "seed": s, "chunks": n}``: store n chunks of tokens(s) with KV bytes drawn
  from seed s -> ``{"ok": bool}``;
* ``{"op": "retrieve", "seed": s, "chunks": n}`` -> ``{"tokens": how many came back,
  "exact": whether they equal what ``store`` stored for seed s}``;
* ``{"op": "keys", "seed": s, "chunks": n}`` -> ``{"hashes": LMCache's chunk hashes (hex),
  "sha256": the SHA-256 of each chunk's bytes as LMCache stores them}``;
* ``{"op": "clear"}``: LMCache's CLEAR request (drops L1) -> ``{"ok": true}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import torch
from lmcache.sdk.cache_kind import LMCacheSDKCacheKind
from lmcache.sdk.context import LMCacheSDKContext
from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
from lmcache.v1.gpu_connector.utils import LayoutHints
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
    EngineDrivenTransferContext,
    create_transfer_context,
)


def say(obj: dict[str, Any]) -> None:
    print("DRIVER " + json.dumps(obj), flush=True)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 10 for i in range(n)]


def kv_of(spec: dict[str, Any], seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hidden = spec["heads"] * spec["head_dim"]
    kv = torch.randn((2, spec["layers"], n, hidden), generator=g, dtype=torch.float32)
    return kv.to(getattr(torch, spec["dtype"]))


class Context(LMCacheSDKContext):
    """LMCache's SDK context with the geometry given here instead of read from a registered
    GPU engine (the SDK's ``register_caches`` needs one; this is the same registration an
    engine-driven CPU worker makes)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        super().__init__(
            url=spec["url"],
            http_url=spec["http_url"],
            model_name=spec["model"],
            kind=LMCacheSDKCacheKind.KV,
            timeout=60.0,
        )
        self.register_caches()

    def register_caches(self) -> None:
        spec = self.spec
        self._world_size = 1
        self._num_kv_readers = 1
        shape = (1, 2, spec["heads"], spec["block"], spec["head_dim"])  # one HND block a layer
        self._kv_caches = {
            f"layer.{i}": torch.zeros(shape, dtype=getattr(torch, spec["dtype"]))
            for i in range(spec["layers"])
        }
        ctx = create_transfer_context(
            self._kv_caches, instance_id=self.instance_id, req_client=self._req_client
        )
        self.blocks_in_chunk = self._chunk_size // spec["block"]
        ctx.register(
            self._kv_caches,
            self._model_name,
            1,
            self.blocks_in_chunk,
            60.0,
            layout_hints=LayoutHints(
                kv_layout="HND",
                num_kv_heads=spec["heads"],
                tokens_per_block=spec["block"],
                head_dim=spec["head_dim"],
            ),
        )
        assert isinstance(ctx, EngineDrivenTransferContext), type(ctx)
        self._transfer_ctx = ContiguousTransferWrapper(ctx.engine_driven_context, self._chunk_size)


def main() -> None:
    spec = json.loads(sys.argv[1])
    sdk = Context(spec)
    chunk = sdk.chunk_size
    say({"ready": True, "chunk": chunk})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "store":
            n = cmd["chunks"] * chunk
            ok = sdk.store(kv_of(spec, cmd["seed"], n), tokens(cmd["seed"], n))
            say({"ok": bool(ok)})
        elif cmd["op"] == "retrieve":
            n = cmd["chunks"] * chunk
            got = sdk.retrieve(tokens(cmd["seed"], n))
            if got is None:
                say({"tokens": 0, "exact": False})
                continue
            k = int(got.shape[2])
            want = kv_of(spec, cmd["seed"], n)[:, :, :k]
            exact = (
                got.dtype == want.dtype
                and got.shape == want.shape
                and bytes(got.contiguous().view(torch.uint8).numpy())
                == bytes(want.contiguous().view(torch.uint8).numpy())
            )
            say({"tokens": k, "exact": bool(exact)})
        elif cmd["op"] == "keys":
            n = cmd["chunks"] * chunk
            hashes = TokenHasher(chunk, spec["hash_algorithm"]).compute_chunk_hashes(tokens(cmd["seed"], n))
            kv = kv_of(spec, cmd["seed"], n)
            digests = [
                hashlib.sha256(
                    bytes(kv[:, :, i * chunk : (i + 1) * chunk].contiguous().view(torch.uint8).numpy())
                ).hexdigest()
                for i in range(cmd["chunks"])
            ]
            say({"hashes": [h.hex() for h in hashes], "sha256": digests})
        elif cmd["op"] == "clear":
            sdk._req_client.clear(True).result(timeout=60.0)
            say({"ok": True})
        else:
            say({"error": f"unknown op {cmd['op']!r}"})


if __name__ == "__main__":
    main()

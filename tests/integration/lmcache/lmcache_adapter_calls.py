"""Calls ``KvtierL2Adapter`` the way LMCache's controllers do, with LMCache's own classes
(``ObjectKey``, ``TensorMemoryObj``, ``Bitmap``) and many tasks in flight at once (run with the
LMCache environment's python; see test_lmcache_adapter.py).

``python lmcache_adapter_calls.py '<adapter_params json>'`` prints one JSON line: a store
thread submits ``N`` one-chunk store tasks back to back while a collector thread waits on the
store eventfd and pops finished tasks (as LMCache's store controller does); then one
lookup-and-lock of all N keys plus one unknown key, a load into fresh buffers, and the unlocks
in two parts. Reports what came back.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvtier.integrations.lmcache import KvtierL2Adapter

N = 32
SHAPE = torch.Size([2, 2, 16, 128])  # [K/V, layers, chunk tokens, heads x head dim]


def obj(fill: int | None) -> TensorMemoryObj:
    t = torch.zeros(SHAPE, dtype=torch.bfloat16)
    if fill is not None:
        t.view(torch.int16).copy_(torch.arange(SHAPE.numel()).view(SHAPE) * 7 + fill)
    raw = t.reshape(-1).view(torch.uint8)
    meta = MemoryObjMetadata(
        shape=SHAPE,
        dtype=torch.bfloat16,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def key(i: int) -> ObjectKey:
    return ObjectKey(
        chunk_hash=i.to_bytes(4, "big") * 8,
        model_name="test/model",
        kv_rank=ObjectKey.ComputeKVRank(1, 0, 1, 0),
    )


def wait(fd: int, timeout_s: float = 10.0) -> None:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if ready:
        os.eventfd_read(fd)


def main() -> None:
    adapter = KvtierL2Adapter(json.loads(sys.argv[1]))
    stores = [obj(i) for i in range(N)]
    keys = [key(i) for i in range(N)]
    results: dict[int, bool] = {}
    submitted: list[int] = []

    def collect() -> None:  # LMCache's store controller: eventfd, then pop what finished
        deadline = time.monotonic() + 30
        while len(results) < N and time.monotonic() < deadline:
            wait(adapter.get_store_event_fd(), 0.1)
            results.update({t: r.is_successful() for t, r in adapter.pop_completed_store_tasks().items()})

    collector = threading.Thread(target=collect)
    collector.start()
    for i in range(N):
        submitted.append(adapter.submit_store_task([keys[i]], [stores[i]]))
    collector.join()

    probe = [*keys, key(N + 1)]  # the last was never stored
    task = adapter.submit_lookup_and_lock_task(probe, {})
    found = None
    while found is None:
        wait(adapter.get_lookup_and_lock_event_fd())
        found = adapter.query_lookup_and_lock_result(task)
    hits = found.get_indices_list()
    locked_after_lookup = adapter.report_status()["locked_keys"]

    loads = [obj(None) for _ in range(N)]
    task = adapter.submit_load_task(keys, loads)
    loaded = None
    while loaded is None:
        wait(adapter.get_load_event_fd())
        loaded = adapter.query_load_result(task)
    exact = all(torch.equal(a.raw_tensor, b.raw_tensor) for a, b in zip(stores, loads, strict=True))
    adapter.submit_unlock(keys[: N // 2])
    adapter.submit_unlock(keys[N // 2 :])
    print(
        json.dumps(
            {
                "submitted": len(set(submitted)),
                "results": len(results),
                "all_succeeded": all(results.values()),
                "hits": hits,
                "locked_after_lookup": locked_after_lookup,
                "loaded": len(loaded.get_indices_list()),
                "exact": exact,
                "locked_after_unlock": adapter.report_status()["locked_keys"],
            }
        ),
        flush=True,
    )
    adapter.close()


if __name__ == "__main__":
    main()

"""LMCache's lookup-and-lock contract, one answer per key, run against an L2 adapter built by
LMCache's own factory (run with the LMCache environment's python; see test_lmcache_adapter.py).

``python lmcache_per_key_lookup.py '<--l2-adapter json>' ['<kvtier address>']`` stores chunks
1, 2 and 4 of a six-chunk prompt (chunk 0 is held elsewhere, in LMCache's L1 or another L2;
chunks 3 and 5 nowhere), then looks up and locks all six keys, as LMCache's prefetch
controller does with a request's flattened keys. ``L2AdapterInterface.query_lookup_and_lock_result``
answers "a bitmap indicating the success or failure of each key-object pair": 1, 2 and 4.
With a kvtier address it also reads the daemon's pinned blocks while the keys are locked and
after ``submit_unlock``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

SHAPE = torch.Size([2, 2, 16, 128])  # [K/V, layers, chunk tokens, heads x head dim]
STORED = (1, 2, 4)


def obj(buf: torch.Tensor, fill: int) -> TensorMemoryObj:
    buf.view(torch.int16).copy_(torch.arange(SHAPE.numel()).view(SHAPE) * 7 + fill)
    raw = buf.reshape(-1).view(torch.uint8)
    meta = MemoryObjMetadata(
        shape=SHAPE,
        dtype=torch.bfloat16,
        address=raw.data_ptr(),
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None)


def key(i: int) -> ObjectKey:
    return ObjectKey(
        chunk_hash=bytes([i]) * 32, model_name="test/model", kv_rank=ObjectKey.ComputeKVRank(1, 0, 1, 0)
    )


def wait(fd: int, timeout_s: float = 10.0) -> None:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    if ready:
        os.eventfd_read(fd)


def pinned(address: str | None, expected: int) -> int | None:
    """The daemon's pinned blocks, once they are ``expected`` (an unlock's release runs on the
    adapter's worker thread) or after 10 s; None without a daemon to ask."""
    if address is None:
        return None
    import kvtier

    with kvtier.Client.connect(address) as client:
        deadline = time.monotonic() + 10
        while True:
            n = int(client.stats()["pinned_blocks"])
            if n == expected or time.monotonic() > deadline:
                return n
            time.sleep(0.02)


def main() -> None:
    spec, address = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec])).adapters[0]
    l1 = torch.zeros((len(STORED), *SHAPE), dtype=torch.bfloat16)
    adapter = create_l2_adapter(
        cfg,
        l1_memory_desc=L1MemoryDesc(ptr=l1.data_ptr(), size=l1.numel() * l1.element_size(), align_bytes=2),
    )
    try:
        task = adapter.submit_store_task(
            [key(i) for i in STORED], [obj(l1[n], i) for n, i in enumerate(STORED)]
        )
        stored = None
        while stored is None:
            wait(adapter.get_store_event_fd())
            stored = adapter.pop_completed_store_tasks().get(task)
        keys = [key(i) for i in range(6)]
        task = adapter.submit_lookup_and_lock_task(keys, {})
        found = None
        while found is None:
            wait(adapter.get_lookup_and_lock_event_fd())
            found = adapter.query_lookup_and_lock_result(task)
        hits = found.get_indices_list()
        pinned_locked = pinned(address, len(hits))
        adapter.submit_unlock([keys[i] for i in hits])
        print(
            json.dumps(
                {
                    "stored": stored.is_successful(),
                    "found": hits,
                    "pinned_while_locked": pinned_locked,
                    "pinned_after_unlock": pinned(address, 0),
                }
            ),
            flush=True,
        )
    finally:
        adapter.close()


if __name__ == "__main__":
    main()

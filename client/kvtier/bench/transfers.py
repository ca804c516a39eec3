"""kvtier put / get / get_into over one transport, as an engine calls them.

This process is the client; the daemon is another process (``DaemonProc``). Each ``put`` run
stores ``plan.total_bytes`` under fresh keys (so every byte moves); ``get_into`` (into one
preallocated batch buffer) and ``get`` (block views of one buffer per call, kvtier.get_buffers)
then read the keys of the latest put, all resident. The ops' checks compare the bytes read with
the bytes put.

Memory each sample touches (``Op.touches``): put reads one batch buffer (reused for every batch)
and fills ``plan.sample_bytes`` of fresh slots; get_into reads as many slots and writes one batch
buffer; get reads as many slots into one batch buffer too: each batch's blocks are dropped before
the next get, which therefore reuses the buffer (a get whose previous blocks are still held
writes fresh memory, and pays for it: kvtier.get_buffers). The baselines (``baselines``) touch
the same memory, of the same kind: the batch buffers are ``bench.memory.engine_buffer``s
(page-aligned, prefaulted), as the memcpy baselines' are.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvtier.bench.baselines import block_views
from kvtier.bench.memory import engine_batch, engine_buffer
from kvtier.bench.plan import Op, Plan, Touches, size_label
from kvtier.client import Client, NamespaceHandle
from kvtier_contract.identity import Namespace

RPC_TIMEOUT_S = 60.0  # a 64 MiB batch over a slow path must not hit the client's deadline


def bench_namespace(block: int, name: str = "kvtier-bench") -> Namespace:
    """A namespace whose blocks have exactly ``block`` bytes (uint8, 16 tokens, 1 layer)."""
    if block % 32:
        raise ValueError(f"block size {block} is not a multiple of 32 bytes")
    return Namespace(
        model_id=name,
        model_revision="bench",
        tokenizer_digest="none",
        kv_dtype="uint8",
        layout="contiguous",
        tokens_per_block=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=block // 32,
    )


class KeySource:
    """Fresh 32-byte keys, never repeated within a run (the daemon sees opaque keys)."""

    def __init__(self) -> None:
        self._nonce = os.urandom(8)
        self._count = itertools.count()

    def take(self, n: int) -> list[bytes]:
        return [
            hashlib.sha256(self._nonce + next(self._count).to_bytes(8, "little")).digest() for _ in range(n)
        ]


def connect(address: str, transport: str, **kwargs: Any) -> Client:
    client = Client.connect(
        address,
        transport,  # type: ignore[arg-type]
        timeout_s=RPC_TIMEOUT_S,
        client_name=f"bench-{transport}",
        **kwargs,
    )
    if not client.connected:
        client.close()
        raise RuntimeError(f"cannot connect to kvtierd at {address}: {client.counters.last_error}")
    return client


def _chunks(keys: list[bytes], n: int) -> Iterator[list[bytes]]:
    for i in range(0, len(keys), n):
        yield keys[i : i + n]


def _put_all(t: str, ns: NamespaceHandle, batches: list[list[bytes]], views: list[Any]) -> None:
    """Put ``views`` under each batch of keys; RuntimeError unless every block was stored."""
    for batch in batches:
        res = ns.put(batch, views)
        if res.stored != len(batch):
            raise RuntimeError(f"{t} put stored {res.stored} of {len(batch)}: {res}")


def _get_all_into(
    t: str, client: Client, ns: NamespaceHandle, batches: list[list[bytes]], dst_views: list[Any]
) -> None:
    """get_into ``dst_views`` each batch of keys; RuntimeError unless every block was found."""
    for batch in batches:
        if not all(ns.get_into(batch, dst_views)):
            raise RuntimeError(
                f"{t} get_into missed keys that were just put ({client.counters.last_error or 'evicted?'})"
            )


def _get_all(t: str, ns: NamespaceHandle, batches: list[list[bytes]]) -> None:
    """get each batch of keys (its blocks dropped before the next); RuntimeError unless every
    block was found."""
    for batch in batches:
        if any(b is None for b in ns.get(batch)):
            raise RuntimeError(f"{t} get missed keys that were just put")


def _check_get(t: str, ns: NamespaceHandle, batch: list[bytes], views: list[Any]) -> None:
    """get ``batch`` once more and assert that its blocks are the bytes of ``views``."""
    got = ns.get(batch)
    assert all(g is not None and g == v for g, v in zip(got, views, strict=True)), (
        f"{t} get returned other bytes than were put"
    )


def transfer_ops(
    plan: Plan, client: Client, block: int, keys: KeySource, name: str | None = None
) -> list[Op]:
    """put, get_into and get of ``block``-byte blocks over ``client``'s transport, in order
    (figures named ``<name>_put`` ..., by default the transport's name)."""
    t = name or client.settings.transport
    ns = client.register(bench_namespace(block))
    n = plan.blocks_per_batch(block)
    src, nkeys = engine_batch(plan, block, seed=block), plan.batches(block) * n
    views = block_views(src, block, n)
    dst_views = block_views(dst := engine_buffer(src.nbytes), block, n)
    current: list[list[bytes]] = []
    # Keys of the warm-up and of every round, hashed now so that no timed put pays for them.
    pending = [list(_chunks(keys.take(nkeys), n)) for _ in range(plan.repeat + 1)]

    def put() -> None:
        current[:] = pending.pop(0) if pending else list(_chunks(keys.take(nkeys), n))
        _put_all(t, ns, current, views)

    def get_into() -> None:
        _get_all_into(t, client, ns, current, dst_views)

    def get() -> None:
        _get_all(t, ns, current)

    def check_get_into() -> None:
        assert np.array_equal(src, dst), f"{t} get_into returned other bytes than were put"

    def check_get() -> None:
        _check_get(t, ns, current[-1], views)

    label = f"{t} %s {size_label(block)}"
    total, batch = plan.sample_bytes(block), n * block
    return [
        Op(f"{t}_put", label % "put", put, touches=Touches(src=batch, dst=total)),
        Op(f"{t}_get_into", label % "get_into", get_into, check_get_into, Touches(src=total, dst=batch)),
        Op(f"{t}_get", label % "get", get, check_get, Touches(src=total, dst=batch)),
    ]

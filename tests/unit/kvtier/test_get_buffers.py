"""``NamespaceHandle.get``'s memory (issue 41): one buffer per call, cut into block views; a
buffer is reused only once nothing holds any view of it (or anything over its memory)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.get_buffers import KEEP, GetBuffers
from kvtier.handle import NamespaceHandle
from kvtier_contract.identity import Namespace

BLOCK = 4096


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def test_one_buffer_per_call_cut_into_consecutive_block_views() -> None:
    views = GetBuffers().take(4, BLOCK)
    assert [len(v) for v in views] == [BLOCK] * 4 and not any(v.readonly for v in views)
    base = address(views[0])
    assert base % 4096 == 0  # page-aligned: no aliasing with the arena's slots
    assert [address(v) - base for v in views] == [i * BLOCK for i in range(4)]
    assert GetBuffers().take(0, BLOCK) == []


def test_a_buffer_is_reused_only_once_nothing_holds_its_memory() -> None:
    pool = GetBuffers()
    first = pool.take(4, BLOCK)
    base = address(first[0])
    held = pool.take(4, BLOCK)  # the first is held: another buffer
    assert address(held[0]) != base
    array = np.frombuffer(first[2], np.uint8)  # an array over one block keeps the buffer
    del first
    gc.collect()
    assert address(pool.take(4, BLOCK)[0]) not in (base, address(held[0]))  # both in use
    assert pool.kept == KEEP  # (that fresh one was not kept)
    del array
    assert address(pool.take(4, BLOCK)[0]) == base


def test_a_dropped_get_is_reused_and_a_held_one_is_never_written() -> None:
    pool = GetBuffers()
    views = pool.take(2, BLOCK)
    views[0][:] = b"\x01" * BLOCK
    base = address(views[0])
    del views
    reused = pool.take(2, BLOCK)
    assert address(reused[0]) == base  # nothing held it: no fresh memory
    keep = bytes(reused[0])
    for _ in range(2 * KEEP):
        for v in pool.take(2, BLOCK):
            v[:] = b"\x02" * BLOCK
    assert bytes(reused[0]) == keep  # held: never handed out again


def test_concurrent_takes_never_share_a_buffer() -> None:
    pool = GetBuffers()
    seen: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            views = pool.take(2, BLOCK)
            with lock:
                assert address(views[0]) not in seen
                seen.append(address(views[0]))
            with lock:
                seen.remove(address(views[0]))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.kept <= KEEP


class _Owner:
    """Just enough of a Client for a handle whose get_into is replaced."""

    session: Any = None
    settings: Any = None
    tenant_key = None
    counters: Any = None


def test_handle_get_returns_views_and_none_for_a_miss(monkeypatch: Any) -> None:
    ns = Namespace(
        model_id="m",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="uint8",
        layout="contiguous",
        tokens_per_block=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=BLOCK // 32,
    )
    handle = NamespaceHandle(_Owner(), ns)

    def get_into(keys: Sequence[bytes], buffers: Sequence[Any], **_: Any) -> list[bool]:
        for k, b in zip(keys, buffers, strict=True):
            b[:] = k[:1] * BLOCK
        return [k != b"miss" for k in keys]

    monkeypatch.setattr(handle, "get_into", get_into)
    got = handle.get([b"a", b"miss", b"c"])
    assert got[1] is None
    assert [bytes(g) for g in (got[0], got[2]) if g is not None] == [b"a" * BLOCK, b"c" * BLOCK]
    assert got[0] == b"a" * BLOCK  # compares as bytes
    first = address(got[0])  # type: ignore[arg-type]
    del got
    assert address(handle.get([b"x", b"y", b"z"])[0]) == first  # dropped: reused

"""The memcpy baselines copy between memory of the kind kvtier's paths use (issue 41): the
engine's side page-aligned and prefaulted, the daemon's side a shared memfd mapping as the
arena; kvtier's own bench buffers are the engine's kind too."""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from kvtier.bench import baselines, memory
from kvtier.bench.plan import Plan


def _plan() -> Plan:
    return Plan(suite="shm", block_sizes=(64 << 10,), batch_bytes=1 << 20, total_bytes=4 << 20, repeat=1)


def test_engine_buffers_are_page_aligned_and_written() -> None:
    buf = memory.engine_buffer(1 << 20, fill=3)
    assert buf.ctypes.data % 4096 == 0 and not buf.flags.owndata
    assert int(buf.min()) == int(buf.max()) == 3
    batch = memory.engine_batch(_plan(), 64 << 10, seed=5)
    assert batch.ctypes.data % 4096 == 0
    assert np.array_equal(batch, baselines.random_batch(_plan(), 64 << 10, seed=5))


def test_arena_memory_is_a_shared_page_aligned_mapping() -> None:
    buf = memory.arena_memory(1 << 20)
    assert buf.ctypes.data % 4096 == 0 and int(buf[0]) == 0x5A
    base = buf.base.obj if isinstance(buf.base, memoryview) else buf.base
    assert isinstance(base, mmap.mmap)


def test_memcpy_as_get_reads_arena_memory_into_an_engine_buffer() -> None:
    plan, block = _plan(), 64 << 10
    put, get = baselines.memcpy_ops(dataclasses.replace(plan), block)
    for op in (put, get):
        op.run()
        assert op.check is not None
        op.check()
    assert get.touches is not None and get.touches.dst == plan.batch_bytes

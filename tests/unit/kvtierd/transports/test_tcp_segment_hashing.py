"""A tcp store's segment hashes its bytes piece by piece as they arrive: whatever the pieces
(smaller than a block, across blocks, many blocks at once), each block's digest is the
one-shot digest of its bytes, and a block's digest is set only once its last byte is in."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier_contract.digests import block_digest
from kvtierd.transports.tcp_segments import PayloadSegment, plan_segments


def segment(blocks: int, block: int, first: int = 3) -> tuple[PayloadSegment, Any, bytes]:
    data = os.urandom(blocks * block)
    job = SimpleNamespace(digests=[0] * (first + blocks))
    return PayloadSegment(memoryview(data), job, range(first, first + blocks)), job, data  # type: ignore[arg-type]


@pytest.mark.parametrize("block", [4096, 300_001, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_pieces_give_each_blocks_one_shot_digest(block: int, seed: int) -> None:
    rng = random.Random(seed)
    seg, job, data = segment(5, block)
    received = 0
    while received < len(data):
        received = min(len(data), received + rng.choice([1, 4095, block // 3 + 1, block, 2 * block + 7]))
        seg.hash_arrived(received)
        whole = received // block
        assert [d != 0 for d in job.digests[3:]] == [i < whole for i in range(5)]  # only blocks all in
    assert job.digests[3:] == [block_digest(data[i * block : (i + 1) * block]) for i in range(5)]
    assert job.digests[:3] == [0, 0, 0] and seg.digests.done


def test_a_call_without_new_bytes_changes_nothing() -> None:
    seg, job, data = segment(2, 8192)
    seg.hash_arrived(5000)
    seg.hash_arrived(5000)
    seg.hash_arrived(8192)
    assert job.digests[3] == block_digest(data[:8192]) and job.digests[4] == 0


def test_adjacent_slots_become_one_segment_whose_blocks_hash_like_separate_ones() -> None:
    arena = bytearray(os.urandom(10 * 100))
    job = SimpleNamespace(digests=[0] * 9)
    slots = [SimpleNamespace(offset=o) for o in (300, 400, 500, 0, 800, 900)]  # 3 runs
    cache = SimpleNamespace(
        jobs=SimpleNamespace(store_run=lambda *_a: (job, slots)),
        host=SimpleNamespace(view=lambda at, n: memoryview(arena)[at : at + n]),
    )
    segs = plan_segments(cache, 1, 1, 3, 6, 600)  # type: ignore[arg-type]
    assert [(s.view.obj is arena, len(s.view), s.indexes) for s in segs] == [
        (True, 300, range(3, 6)),  # slots at 300, 400, 500
        (True, 100, range(6, 7)),  # slot at 0
        (True, 200, range(7, 9)),  # slots at 800, 900
    ]
    for s in segs:
        s.hash_arrived(len(s.view) // 2)
        s.hash_arrived(len(s.view))
    assert job.digests[3:] == [block_digest(arena[o : o + 100]) for o in (300, 400, 500, 0, 800, 900)]

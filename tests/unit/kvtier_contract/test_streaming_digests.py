"""StreamingDigests: blocks laid out back to back, fed in pieces of any size (a byte at a time,
across three blocks, ending exactly on block boundaries), give each block's one-shot
``block_digest``, each reported once, when its last byte is in."""

from __future__ import annotations

import os
import random

import pytest

from kvtier_contract.digests import StreamingDigests, block_digest


def blocks_of(*lengths: int) -> list[bytes]:
    return [os.urandom(n) for n in lengths]


def fed_in(pieces: list[int], blocks: list[bytes]) -> tuple[StreamingDigests, list[tuple[int, int]]]:
    """The stream of ``blocks`` fed in pieces of the given sizes: (the digests, all reported)."""
    data = b"".join(blocks)
    assert sum(pieces) == len(data)
    stream = StreamingDigests([len(b) for b in blocks])
    reported: list[tuple[int, int]] = []
    pos = 0
    for n in pieces:
        reported += stream.feed(memoryview(data)[pos : pos + n])
        pos += n
    return stream, reported


def one_shot(blocks: list[bytes]) -> list[tuple[int, int]]:
    return [(k, block_digest(b)) for k, b in enumerate(blocks)]


def test_one_byte_pieces() -> None:
    blocks = blocks_of(5, 3, 7)
    stream, reported = fed_in([1] * 15, blocks)
    assert reported == one_shot(blocks) and stream.done
    assert stream.digests == [d for _k, d in one_shot(blocks)]


def test_one_piece_spanning_three_blocks() -> None:
    blocks = blocks_of(100, 100, 100, 100, 100)
    # 50 (block 0 half) | 270 (block 0 rest, 1, 2, 20 of 3) | 180 (block 3 rest, 4)
    stream, reported = fed_in([50, 270, 180], blocks)
    assert reported == one_shot(blocks)


def test_pieces_on_exact_block_boundaries_hash_each_block_whole() -> None:
    blocks = blocks_of(64, 64, 64, 64)
    stream = StreamingDigests.uniform(64, 4)
    data = b"".join(blocks)
    assert stream.feed(data[:64]) == one_shot(blocks)[:1]  # one block, exactly
    assert stream.feed(data[64:192]) == one_shot(blocks)[1:3]  # two blocks, exactly
    assert stream.feed(b"") == [] and not stream.done  # nothing new: nothing changes
    assert stream.feed(data[192:]) == one_shot(blocks)[3:] and stream.done


def test_a_block_is_reported_only_once_its_last_byte_is_in() -> None:
    blocks = blocks_of(10, 10)
    stream = StreamingDigests.uniform(10, 2)
    data = b"".join(blocks)
    assert stream.feed(data[:9]) == [] and stream.digests == [None, None]
    assert (stream.index, stream.offset) == (0, 9)
    assert stream.feed(data[9:19]) == one_shot(blocks)[:1]
    assert (stream.index, stream.offset) == (1, 9) and stream.digests[1] is None
    assert stream.feed(data[19:]) == one_shot(blocks)[1:]


@pytest.mark.parametrize("seed", range(8))
def test_random_piece_boundaries_give_every_blocks_one_shot_digest(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([1, 7, 4096, 300_001])
    blocks = blocks_of(*[block] * rng.randint(1, 6))
    total, pieces = len(blocks) * block, list[int]()
    while sum(pieces) < total:
        n = rng.choice([1, 2, block - 1, block, block + 1, 3 * block - 1, rng.randint(1, 2 * block)])
        pieces.append(min(max(n, 1), total - sum(pieces)))
    stream, reported = fed_in(pieces, blocks)
    assert reported == one_shot(blocks) and stream.fed == total


@pytest.mark.parametrize("seed", range(4))
def test_blocks_of_different_lengths_in_random_pieces(seed: int) -> None:
    rng = random.Random(seed)
    blocks = blocks_of(*[rng.choice([1, 3, 1000, 65_537]) for _ in range(8)])
    total, pieces = sum(map(len, blocks)), list[int]()
    while sum(pieces) < total:
        pieces.append(min(rng.randint(1, 70_000), total - sum(pieces)))
    _stream, reported = fed_in(pieces, blocks)
    assert reported == one_shot(blocks)


def test_arrived_hashes_what_a_contiguous_buffer_gained_since_the_last_call() -> None:
    blocks = blocks_of(8, 8, 8)
    buf = memoryview(bytearray(24))
    stream = StreamingDigests.uniform(8, 3)
    buf[:13] = b"".join(blocks)[:13]
    assert stream.arrived(buf, 13) == one_shot(blocks)[:1]
    assert stream.arrived(buf, 13) == []  # no new bytes
    buf[13:] = b"".join(blocks)[13:]
    assert stream.arrived(buf, 24) == one_shot(blocks)[1:] and stream.fed == 24


def test_unwanted_blocks_are_passed_over_and_never_reported() -> None:
    blocks = blocks_of(6, 6, 6)
    stream = StreamingDigests([6, 6, 6], [True, False, True])
    data = b"".join(blocks)
    reported = stream.feed(data[:4]) + stream.feed(data[4:15]) + stream.feed(data[15:])
    assert reported == [(0, block_digest(blocks[0])), (2, block_digest(blocks[2]))]
    assert stream.digests[1] is None and stream.done


def test_blocks_of_no_bytes_are_complete_when_the_cursor_reaches_them() -> None:
    stream = StreamingDigests([0, 4, 0, 0])
    assert stream.index == 1 and stream.digests[0] == block_digest(b"")  # complete from the start
    assert stream.feed(b"abcd") == [(1, block_digest(b"abcd"))]
    assert stream.done and stream.digests[2:] == [block_digest(b"")] * 2
    assert StreamingDigests([]).done


def test_feeding_past_the_last_block_is_a_bug() -> None:
    stream = StreamingDigests.uniform(4, 1)
    with pytest.raises(AssertionError):
        stream.feed(b"abcde")

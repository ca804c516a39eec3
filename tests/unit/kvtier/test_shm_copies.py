"""The shm transport's copies (issue 41): blocks whose slots and buffers both follow one another
move in one copy per run, the others block by block, aliased or not; the bytes and the digests
are those of copying block by block. No daemon: the arena is an anonymous mapping."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.transports import shm
from kvtier_contract.digests import block_digest

BLOCK = 256 << 10
ARENA = 64 * BLOCK


@pytest.fixture
def transport() -> Iterator[shm.ShmTransport]:
    """A ShmTransport over an anonymous mapping holding random bytes, as if attached."""
    t = shm.ShmTransport()
    mm = mmap.mmap(-1, ARENA)
    mm.write(np.random.default_rng(1).integers(0, 256, ARENA, dtype=np.uint8).tobytes())
    t._mm, t._view = mm, memoryview(mm)
    t._base, t.arena_bytes = shm._address(t._view), ARENA
    t.writable_bytes = ARENA
    yield t
    t.close()


def arena(t: shm.ShmTransport) -> np.ndarray:
    assert t._view is not None
    return np.frombuffer(t._view, np.uint8)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the ``ctypes.memmove`` calls the transport makes."""
    sizes: list[int] = []
    real = ctypes.memmove

    def counted(dst: int, src: int, n: int) -> int:
        sizes.append(n)
        return real(dst, src, n)  # type: ignore[no-any-return]

    monkeypatch.setattr(shm.ctypes, "memmove", counted)
    return sizes


def page_aligned(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


@pytest.mark.parametrize("offset", [0, 16], ids=["page-aligned", "16-bytes-into-a-page"])
def test_a_batch_buffer_over_consecutive_slots_is_one_copy(
    transport: shm.ShmTransport, copies: list[int], offset: int
) -> None:
    n = 16
    dst = page_aligned(n * BLOCK + 4096)[offset : offset + n * BLOCK]
    views = [memoryview(dst[i * BLOCK : (i + 1) * BLOCK]) for i in range(n)]
    transport.read(1, [(i, (8 + i) * BLOCK, v) for i, v in enumerate(views)])
    assert copies == [n * BLOCK]  # aliased or not: a 4 MiB run is past rep movsb's range
    assert np.array_equal(dst, arena(transport)[8 * BLOCK : (8 + n) * BLOCK])


def test_scattered_slots_or_buffers_are_copied_block_by_block(
    transport: shm.ShmTransport, copies: list[int]
) -> None:
    dst = page_aligned(8 * BLOCK)
    views = [memoryview(dst[i * BLOCK : (i + 1) * BLOCK]) for i in range(8)]
    slots = [3, 4, 9, 1, 2, 20, 21, 22]  # runs: [3,4] [9] [1,2] [20,21,22]
    transport.read(1, [(i, s * BLOCK, v) for i, (s, v) in enumerate(zip(slots, views, strict=True))])
    assert copies == [2 * BLOCK, BLOCK, 2 * BLOCK, 3 * BLOCK]
    a = arena(transport)
    for s, v in zip(slots, views, strict=True):
        assert bytes(v) == a[s * BLOCK : (s + 1) * BLOCK].tobytes()


def test_a_short_aliased_run_goes_block_by_block_through_numpy(
    transport: shm.ShmTransport, copies: list[int]
) -> None:
    dst = page_aligned(2 * BLOCK + 4096)[16 : 16 + 2 * BLOCK]  # 512 KiB run, 16 B after its slots
    views = [memoryview(dst[:BLOCK]), memoryview(dst[BLOCK:])]
    transport.read(1, [(0, 0, views[0]), (1, BLOCK, views[1])])
    assert copies == []  # numpy's loop, not memcpy's rep movsb
    assert np.array_equal(dst, arena(transport)[: 2 * BLOCK])


def test_verified_reads_report_the_same_corrupt_blocks(transport: shm.ShmTransport) -> None:
    n = 32  # 8 MiB: hashed on the helper thread, group by group
    a = arena(transport)
    digests = [block_digest(memoryview(a[i * BLOCK : (i + 1) * BLOCK])) for i in range(n)]
    digests[5] ^= 1
    digests[7] = 0  # not checked
    dst = page_aligned(n * BLOCK)
    views = [memoryview(dst[i * BLOCK : (i + 1) * BLOCK]) for i in range(n)]
    assert transport.read(1, [(i, i * BLOCK, v) for i, v in enumerate(views)], digests) == [5]
    assert np.array_equal(dst, a[: n * BLOCK])


def test_a_put_from_one_batch_buffer_is_one_copy_and_hashes_the_same(
    transport: shm.ShmTransport, copies: list[int]
) -> None:
    n = 16
    src = np.random.default_rng(2).integers(0, 256, n * BLOCK, dtype=np.uint8)
    views = [memoryview(src[i * BLOCK : (i + 1) * BLOCK]) for i in range(n)]
    got = transport.write(1, [(i, (40 + i) * BLOCK, v) for i, v in enumerate(views)], digest=True)
    assert copies == [n * BLOCK]
    assert got == [block_digest(v) for v in views]
    assert np.array_equal(arena(transport)[40 * BLOCK : (40 + n) * BLOCK], src)


def test_a_put_of_read_only_blocks_still_copies_each(transport: shm.ShmTransport) -> None:
    blocks = [bytes([i]) * BLOCK for i in range(3)]
    transport.write(1, [(i, (10 + i) * BLOCK, memoryview(b)) for i, b in enumerate(blocks)])
    assert arena(transport)[10 * BLOCK : 13 * BLOCK].tobytes() == b"".join(blocks)

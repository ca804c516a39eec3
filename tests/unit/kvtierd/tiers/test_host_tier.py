"""HostTier: slots carved from slabs of one memfd arena, slabs moving between size classes.

Capacities are tiny: a few slabs of 16 KiB with 4 KiB alignment, so a slab holds four 4 KiB
slots or two 8 KiB slots. The tier knows no keys: tests talk in offsets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvtierd.tiers import Arena, HostTier

KIB = 1024
SLAB = 16 * KIB
ALIGN = 4 * KIB
SMALL, LARGE = 4 * KIB, 8 * KIB  # two size classes: 4 and 2 slots per slab
MakeTier = Callable[..., HostTier]


@pytest.fixture
def make_tier() -> Iterator[MakeTier]:
    arenas: list[Arena] = []

    def make(
        slabs: int = 2, *, arena_bytes: int | None = None, slab_bytes: int = SLAB, align: int = ALIGN
    ) -> HostTier:
        arena = Arena(arena_bytes if arena_bytes is not None else slabs * slab_bytes, prefault=False)
        arenas.append(arena)
        return HostTier(arena, slab_bytes=slab_bytes, slot_align_bytes=align)

    yield make
    for a in arenas:
        a.close()


def slab_of(offset: int) -> int:
    return offset // SLAB


def alloc_n(tier: HostTier, slot_bytes: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        off = tier.alloc(slot_bytes)
        assert off is not None
        out.append(off)
    return out


def test_size_class_is_block_rounded_up_to_the_alignment(make_tier: MakeTier) -> None:
    tier = make_tier()
    assert tier.slot_bytes_for(1) == ALIGN
    assert tier.slot_bytes_for(ALIGN) == ALIGN
    assert tier.slot_bytes_for(ALIGN + 1) == 2 * ALIGN
    assert tier.fits(SLAB)
    assert not tier.fits(SLAB + 1)  # larger than a slab: never placeable
    assert not tier.fits(0)


def test_capacity_is_a_whole_number_of_slabs(make_tier: MakeTier) -> None:
    tier = make_tier(arena_bytes=3 * SLAB + SLAB // 2)
    # the half slab at the end is never handed out
    assert tier.num_slabs == 3
    assert tier.capacity_bytes == 3 * SLAB
    assert tier.free_slabs() == 3
    assert tier.used_bytes == 0


def test_slots_are_aligned_in_the_arena_and_in_memory(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=2)
    offsets = alloc_n(tier, tier.slot_bytes_for(1000), 8)  # 4 KiB class: fills both slabs
    assert sorted(offsets) == [i * ALIGN for i in range(8)]  # every slot, none twice
    for off in offsets:
        view = tier.arena.slot(off, 1000)
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data
        assert address % ALIGN == 0, hex(address)
        del view


def test_slots_of_one_class_fill_one_slab_before_taking_another(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=3)
    first = alloc_n(tier, SMALL, 4)
    # one slab, four 4 KiB slots
    assert {slab_of(o) for o in first} == {0}
    assert tier.free_slabs() == 2
    fifth = tier.alloc(SMALL)
    assert fifth is not None and slab_of(fifth) == 1
    assert tier.free_slabs() == 1
    assert tier.used_bytes == 5 * SMALL


def test_two_classes_never_share_a_slab(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=2)
    small = tier.alloc(SMALL)
    large = tier.alloc(LARGE)
    assert small is not None and large is not None
    # slab 0: 4 KiB class (1 of 4 used); slab 1: 8 KiB class (1 of 2 used)
    assert slab_of(small) != slab_of(large)
    assert tier.free_slabs() == 0
    assert slab_of(tier.alloc(LARGE) or -1) == slab_of(large)
    assert tier.alloc(LARGE) is None  # its slab is full and no slab is free, though slab 0 has room
    assert slab_of(tier.alloc(SMALL) or -1) == slab_of(small)


def test_exhaustion_returns_none_for_every_class(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=2)
    alloc_n(tier, SMALL, 8)
    # both slabs full of 4 KiB slots
    assert tier.alloc(SMALL) is None
    assert tier.alloc(LARGE) is None
    assert tier.used_bytes == tier.capacity_bytes
    assert tier.free_slabs() == 0


def test_a_freed_slot_is_reused_by_its_class(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=1)
    offsets = alloc_n(tier, SMALL, 4)
    tier.free(offsets[2], SMALL)
    # slab 0: 3 of 4 used; the slab stays with the 4 KiB class
    assert tier.free_slabs() == 0
    assert tier.used_bytes == 3 * SMALL
    assert tier.alloc(LARGE) is None
    assert tier.alloc(SMALL) == offsets[2]
    assert tier.alloc(SMALL) is None


def test_an_emptied_slab_returns_to_the_pool_and_moves_to_a_starving_class(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=2)
    offsets = alloc_n(tier, SMALL, 8)
    assert tier.alloc(LARGE) is None  # the 8 KiB class starves
    slab1 = [o for o in offsets if slab_of(o) == 1]
    for off in slab1[:3]:
        tier.free(off, SMALL)
    # slab 1 still holds one 4 KiB slot: not yet in the pool
    assert tier.free_slabs() == 0
    assert tier.alloc(LARGE) is None
    tier.free(slab1[3], SMALL)
    # slab 1 empty: back in the pool
    assert tier.free_slabs() == 1
    assert tier.used_bytes == 4 * SMALL
    large = alloc_n(tier, LARGE, 2)
    # slab 1 now belongs to the 8 KiB class: two slots, aligned to the slot size within it
    assert sorted(large) == [SLAB, SLAB + LARGE]
    assert tier.alloc(LARGE) is None
    assert tier.alloc(SMALL) is None  # the 4 KiB class lost the slab
    assert tier.used_bytes == tier.capacity_bytes


def test_a_slab_moves_back_when_its_new_class_empties_it(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=1)
    small = alloc_n(tier, SMALL, 4)
    for off in small:
        tier.free(off, SMALL)
    large = alloc_n(tier, LARGE, 2)
    for off in large:
        tier.free(off, LARGE)
    # slab 0 went 4 KiB -> pool -> 8 KiB -> pool; the 4 KiB class can have it again
    assert tier.free_slabs() == 1
    assert sorted(alloc_n(tier, SMALL, 4)) == sorted(small)
    assert tier.used_bytes == SLAB


def test_freeing_with_the_wrong_class_is_a_bug(make_tier: MakeTier) -> None:
    tier = make_tier(slabs=1)
    off = tier.alloc(SMALL)
    assert off is not None
    with pytest.raises(AssertionError):
        tier.free(off, LARGE)
    # nothing changed: the slot is still allocated
    assert tier.used_bytes == SMALL


def test_arena_is_shared_memory_behind_its_fd(make_tier: MakeTier) -> None:
    import mmap

    tier = make_tier(slabs=1)
    off = tier.alloc(SMALL)
    assert off is not None
    tier.arena.slot(off, 4)[:] = b"kvt!"
    # a second mapping of the same fd (what an shm client does) sees the bytes
    with mmap.mmap(tier.arena.fd, tier.arena.size, flags=mmap.MAP_SHARED) as other:
        assert other[off : off + 4] == b"kvt!"


def test_claim_takes_exactly_the_named_slot_and_refuses_conflicts() -> None:
    from kvtierd.tiers import SlabAllocator

    space = SlabAllocator(4 * 8192, slab_bytes=8192, slot_align_bytes=4096)
    # recovery re-creates [_ 4096] in slab 0 and [16384 _] in slab 2
    assert space.claim(4096, 4096) and space.claim(16384, 4096)
    assert space.used_bytes == 8192 and space.free_slabs() == 2
    assert not space.claim(4096, 4096)  # already taken
    assert not space.claim(8192 + 4096, 8192)  # not on an 8 KiB slot boundary of slab 1
    assert not space.claim(0, 8192)  # slab 0 belongs to the 4 KiB class now
    assert space.alloc(4096) in (0, 16384 + 4096)  # the free slots of the claimed slabs
    assert space.claim(99 * 8192, 4096) is False  # beyond the space


def test_each_arena_is_a_pool_of_its_own_and_arenas_never_touch(make_tier: MakeTier) -> None:
    tier = make_tier(2)
    other = Arena(3 * SLAB, prefault=False)
    try:
        pool = tier.add_arena(other)
        assert pool == 1 and tier.capacity_bytes == 5 * SLAB
        base = tier.pool_bases[1]
        assert base == 3 * SLAB  # one guard slab after arena 0's two
        assert tier.pool_of(2 * SLAB) == -1 and tier.pool_of(base) == 1
        shared = alloc_n(tier, LARGE, 4)  # arena 0 full...
        assert tier.alloc(LARGE) is None
        mine = [tier.alloc(LARGE, pool) for _ in range(6)]  # ...arena 1 untouched by it
        assert all(o is not None and base <= o < base + 3 * SLAB for o in mine)
        assert tier.alloc(LARGE, pool) is None and tier.free_bytes(pool) == 0
        # a slot's view is the bytes of its own arena, at offset - base
        off = mine[0]
        assert off is not None
        tier.view(off, 4)[:] = b"mine"
        assert bytes(other.slot(off - base, 4)) == b"mine"
        assert bytes(tier.arena.slot(shared[0], 4)) != b"mine"
        # an emptied slab goes back to its own arena's pool, never to another
        for o in mine[:2]:
            assert o is not None
            tier.free(o, LARGE)
        assert tier.free_slabs(0) == 0 and tier.free_slabs(1) == 1
        assert tier.alloc(SMALL) is None and tier.alloc(SMALL, pool) is not None
        assert tier.pool_used == [4 * LARGE, 4 * LARGE + SMALL]
        assert tier.intact()
    finally:
        other.close()

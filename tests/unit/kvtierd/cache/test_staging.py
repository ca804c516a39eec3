"""Staged stores' copies (kvtierd.cache.staging): staging and entry slots that follow one another
on both sides move as one run; a run stops where either side does not follow on, or crosses
into another arena (two pools may be neighbours in the host tier's offsets, never in memory)."""

from __future__ import annotations

from kvtierd.cache.staging import _runs

SLOT = 4096


def test_slots_that_follow_on_both_sides_are_one_run() -> None:
    pairs = [(1000 * SLOT + k * SLOT, 50 * SLOT + k * SLOT) for k in range(8)]
    assert _runs(pairs, SLOT, lambda off: 0) == [(1000 * SLOT, 50 * SLOT, 8)]


def test_a_run_stops_where_either_side_skips_or_the_arena_changes() -> None:
    pairs = [
        (0, 100 * SLOT),
        (SLOT, 101 * SLOT),
        (2 * SLOT, 103 * SLOT),
        (3 * SLOT, 104 * SLOT),
        (4 * SLOT, 105 * SLOT),
    ]

    def pool_of(off: int) -> int:
        return 1 if off >= 105 * SLOT else 0  # the entry side changes arena at 105

    assert _runs(pairs, SLOT, pool_of) == [
        (0, 100 * SLOT, 2),
        (2 * SLOT, 103 * SLOT, 2),
        (4 * SLOT, 105 * SLOT, 1),
    ]

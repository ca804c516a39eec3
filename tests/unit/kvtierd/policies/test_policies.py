"""Eviction-policy scenarios: one suite over every policy, then ARC's and PrefixPolicy's own.

Keys are small integers. ``drain`` consumes ``victims()`` the way the cache does, and
``admit`` plays a tiny cache of fixed entry capacity so scans can be compared.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvtierd.policies import (
    ArcPolicy,
    EvictionPolicy,
    LruPolicy,
    PolicyName,
    PrefixPolicy,
    link_policy,
    make_policy,
)

POLICY_NAMES: list[PolicyName] = ["lru", "arc", "prefix"]


@pytest.fixture(params=POLICY_NAMES)
def policy(request: pytest.FixtureRequest) -> EvictionPolicy[int]:
    return make_policy(request.param, ghost_capacity=4)


def keys(*ks: int) -> list[int]:
    return list(ks)


def fill(policy: EvictionPolicy[int], ks: Iterable[int]) -> None:
    for k in ks:
        policy.insert(k)


def order(policy: EvictionPolicy[int]) -> list[int]:
    return list(policy.victims())


def evict(policy: EvictionPolicy[int], n: int, pinned: frozenset[int] = frozenset()) -> list[int]:
    """Evict ``n`` unpinned keys in victim order, removing each while iterating."""
    out: list[int] = []
    for k in policy.victims():
        if len(out) == n:
            break
        if k in pinned:
            continue
        policy.remove(k, evicted=True)
        out.append(k)
    return out


def admit(policy: EvictionPolicy[int], key: int, capacity: int) -> None:
    """A cache of ``capacity`` entries: hit -> touch; miss -> evict until room, insert."""
    if key in policy:
        policy.touch(key)
        return
    while len(policy) >= capacity:
        evict(policy, 1)
    policy.insert(key)


# ---- every policy --------------------------------------------------------------------


def test_insert_order_is_victim_order(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3))
    # never touched: oldest first
    assert order(policy) == keys(1, 2, 3)
    assert len(policy) == 3
    assert 2 in policy and 4 not in policy


def test_touched_keys_go_last(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3, 4))
    policy.touch(2)
    policy.touch(1)
    # untouched 3, 4 first; then 2 and 1 in touch order
    assert order(policy) == keys(3, 4, 2, 1)
    policy.touch(2)
    assert order(policy) == keys(3, 4, 1, 2)


def test_touch_unknown_is_noop(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2))
    policy.touch(9)
    assert order(policy) == keys(1, 2)
    assert 9 not in policy


def test_remove_unknown_is_noop(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2))
    policy.remove(9, evicted=True)
    policy.remove(9, evicted=False)
    assert order(policy) == keys(1, 2)
    assert len(policy) == 2


def test_remove_then_reinsert(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3))
    policy.remove(2, evicted=False)
    # resident: 1, 3
    assert order(policy) == keys(1, 3)
    assert 2 not in policy
    policy.insert(2)
    # a fresh insert: 2 is the newest once-seen key
    assert order(policy) == keys(1, 3, 2)


def test_insert_twice_asserts(policy: EvictionPolicy[int]) -> None:
    policy.insert(1)
    policy.touch(1)
    with pytest.raises(AssertionError):
        policy.insert(1)


def test_remove_each_yielded_key_while_iterating(policy: EvictionPolicy[int]) -> None:
    fill(policy, range(1, 11))
    # 10 keys spans several snapshot chunks (4, 8, ...)
    assert evict(policy, 10) == list(range(1, 11))
    assert len(policy) == 0
    assert order(policy) == []


def test_pinned_keys_are_skipped(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3, 4, 5))
    # 1 and 3 are pinned: the cache takes the next two candidates
    assert evict(policy, 2, pinned=frozenset({1, 3})) == keys(2, 4)
    # resident: 1, 3, 5
    assert order(policy) == keys(1, 3, 5)


def test_pinned_skip_across_chunks(policy: EvictionPolicy[int]) -> None:
    fill(policy, range(1, 11))
    evens = frozenset(range(2, 11, 2))
    # ask for more than exist: the loop must end after yielding each key once
    assert evict(policy, 99, pinned=evens) == keys(1, 3, 5, 7, 9)
    assert order(policy) == keys(2, 4, 6, 8, 10)


def test_removing_a_later_key_mid_iteration_skips_it(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3, 4, 5, 6))
    seen: list[int] = []
    for k in policy.victims():
        seen.append(k)
        if k == 1:
            policy.remove(2, evicted=False)  # in the current chunk
            policy.remove(6, evicted=False)  # in a later chunk
    assert seen == keys(1, 3, 4, 5)


def test_touch_mid_iteration_yields_each_key_once(policy: EvictionPolicy[int]) -> None:
    fill(policy, range(1, 9))
    seen: list[int] = []
    for k in policy.victims():
        seen.append(k)
        policy.touch(k)  # moves k to the back of the order
    assert sorted(seen) == list(range(1, 9))


def test_insert_mid_iteration_does_not_raise(policy: EvictionPolicy[int]) -> None:
    fill(policy, range(1, 6))
    seen: list[int] = []
    for k in policy.victims():
        seen.append(k)
        if k == 1:
            policy.insert(100)
    # 100 is newest: it can only come last, if at all
    assert seen[:5] == keys(1, 2, 3, 4, 5)
    assert seen[5:] in ([], [100])


def test_victims_is_lazy_and_restartable(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2, 3))
    assert next(policy.victims()) == 1
    assert next(policy.victims()) == 1  # taking a candidate changes nothing


def test_unknown_policy_name_names_the_field() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        make_policy("fifo", ghost_capacity=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ghost_capacity"):
        make_policy("arc", ghost_capacity=-1)


def test_make_policy_builds_the_named_class() -> None:
    assert isinstance(make_policy("lru", 0), LruPolicy)
    assert isinstance(make_policy("arc", 0), ArcPolicy)
    assert isinstance(make_policy("prefix", 0), PrefixPolicy)


def test_insert_many_keeps_every_key(policy: EvictionPolicy[int]) -> None:
    policy.insert_many(keys(1, 2, 3))
    assert sorted(order(policy)) == keys(1, 2, 3) and len(policy) == 3


def test_orphan_of_unknown_keys_is_noop(policy: EvictionPolicy[int]) -> None:
    fill(policy, keys(1, 2))
    policy.orphan(keys(7, 8))
    assert len(policy) == 2 and 7 not in policy and not policy.orphaned(7)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_chain_blind_policies_ignore_chains(name: PolicyName) -> None:
    p: EvictionPolicy[int] = make_policy(name, ghost_capacity=4)
    p.insert_many(keys(1, 2, 3))  # [1 2 3]: batch order
    p.orphan(keys(3))  # a no-op
    assert order(p) == keys(1, 2, 3) and not p.orphaned(3) and not p.wants_parents


def test_link_policy_follows_the_host_policy() -> None:
    assert isinstance(link_policy(PrefixPolicy[int]()), PrefixPolicy)
    assert isinstance(link_policy(LruPolicy[int]()), LruPolicy)
    assert isinstance(link_policy(ArcPolicy[int](4)), LruPolicy)


# ---- ARC -----------------------------------------------------------------------------


def arc(ghost_capacity: int = 4) -> ArcPolicy[int]:
    return ArcPolicy(ghost_capacity)


def test_scan_does_not_flush_keys_seen_twice() -> None:
    lru: EvictionPolicy[int] = LruPolicy()
    adaptive = arc()
    for p in (lru, adaptive):
        # a 4-entry cache: 1 and 2 are hot (seen twice), then a one-time scan of 10..19
        for k in keys(1, 2, 1, 2):
            admit(p, k, capacity=4)
        for k in range(10, 20):
            admit(p, k, capacity=4)
    # LRU kept only the tail of the scan
    assert sorted(lru.victims()) == keys(16, 17, 18, 19)
    # ARC: T2 = [1, 2] survived; the scan churned through T1 (p stayed 0)
    assert 1 in adaptive and 2 in adaptive
    assert (adaptive.t1_size, adaptive.t2_size, adaptive.p) == (2, 2, 0)
    assert order(adaptive) == keys(18, 19, 1, 2)


def test_ghost_hit_in_b1_raises_p_and_goes_to_t2() -> None:
    a = arc(ghost_capacity=4)
    fill(a, keys(1, 2, 3))
    a.remove(1, evicted=True)
    # T1 = [2, 3], B1 = [1], p = 0
    assert (a.t1_size, a.b1_size, a.p) == (2, 1, 0)
    a.insert(1)
    # B1 hit: p += max(1, |B2|/|B1| = 0) -> 1; T1 = [2, 3], T2 = [1]
    assert (a.t1_size, a.t2_size, a.b1_size, a.p) == (2, 1, 0, 1)
    # |T1| = 2 > p = 1: T1 first
    assert order(a) == keys(2, 3, 1)
    a.remove(2, evicted=True)
    # T1 = [3], |T1| = 1 = p: now T2 goes first
    assert order(a) == keys(1, 3)


def test_b1_hit_step_is_ratio_of_ghost_lists() -> None:
    a = arc(ghost_capacity=8)
    fill(a, keys(1, 2, 3))
    a.touch(1)
    a.touch(2)
    for k in keys(1, 2, 3):
        a.remove(k, evicted=True)
    # B2 = [1, 2], B1 = [3]
    assert (a.b1_size, a.b2_size) == (1, 2)
    a.insert(3)
    # p += max(1, 2 / 1) = 2
    assert a.p == 2
    assert (a.t1_size, a.t2_size) == (0, 1)


def test_ghost_hit_in_b2_lowers_p() -> None:
    a = arc(ghost_capacity=4)
    fill(a, keys(1, 2))
    a.touch(1)
    a.remove(2, evicted=True)
    a.insert(2)
    # B1 hit: p = 1; T2 = [1, 2], T1 = []
    assert (a.p, a.t1_size, a.t2_size) == (1, 0, 2)
    assert evict(a, 1) == keys(1)
    # T1 empty so T2 gave 1; B2 = [1]
    assert a.b2_size == 1
    a.insert(1)
    # B2 hit: p -= max(1, 0 / 1) -> 0; T2 = [2, 1]
    assert (a.p, a.t2_size, a.b2_size) == (0, 2, 0)
    assert order(a) == keys(2, 1)


def test_p_is_clamped_to_ghost_capacity() -> None:
    a = arc(ghost_capacity=1)
    for k in keys(1, 2, 3):
        a.insert(k)
        a.remove(k, evicted=True)
        a.insert(k)  # B1 hit each time
    # three B1 hits of +1 each, clamped at ghost_capacity
    assert a.p == 1


def test_p_is_clamped_at_zero() -> None:
    a = arc(ghost_capacity=4)
    a.insert(1)
    a.touch(1)
    a.remove(1, evicted=True)
    a.insert(1)  # B2 hit with p = 0
    assert a.p == 0


def test_ghosts_are_bounded_oldest_first() -> None:
    a = arc(ghost_capacity=2)
    fill(a, keys(1, 2, 3, 4))
    a.touch(4)
    assert evict(a, 4) == keys(1, 2, 3, 4)
    # ghosts, oldest first: 1, 2, 3 (B1), 4 (B2); capacity 2 keeps 3 and 4
    assert (a.b1_size, a.b2_size) == (1, 1)
    a.insert(1)
    # 1 was forgotten: a plain insert into T1, p unchanged
    assert (a.p, a.t1_size, a.t2_size) == (0, 1, 0)
    a.insert(3)
    # 3 is still a B1 ghost: p rises, 3 goes to T2
    assert (a.p, a.t1_size, a.t2_size, a.b1_size) == (1, 1, 1, 0)


def test_remove_without_eviction_leaves_no_ghost() -> None:
    a = arc(ghost_capacity=4)
    fill(a, keys(1, 2))
    a.touch(2)
    a.remove(1, evicted=False)
    a.remove(2, evicted=False)
    assert (a.b1_size, a.b2_size) == (0, 0)
    a.insert(1)
    # plain insert: T1, p unchanged
    assert (a.p, a.t1_size, a.t2_size) == (0, 1, 0)


def test_zero_ghost_capacity_keeps_no_history() -> None:
    a = arc(ghost_capacity=0)
    a.insert(1)
    a.remove(1, evicted=True)
    assert (a.b1_size, a.b2_size) == (0, 0)
    a.insert(1)
    assert (a.p, a.t1_size) == (0, 1)


def test_touch_promotes_t1_to_t2() -> None:
    a = arc()
    fill(a, keys(1, 2))
    a.touch(1)
    # T1 = [2], T2 = [1]
    assert (a.t1_size, a.t2_size) == (1, 1)
    a.touch(1)
    assert (a.t1_size, a.t2_size, len(a)) == (1, 1, 2)


# ---- PrefixPolicy --------------------------------------------------------------------


def test_prefix_batch_insert_puts_the_deepest_key_first() -> None:
    p = PrefixPolicy[int]()
    fill(p, keys(9))
    p.insert_many(keys(1, 2, 3))  # a chain 1 -> 2 -> 3, head-first
    # [9 3 2 1]: older keys first, then the chain tail-first
    assert order(p) == keys(9, 3, 2, 1) and p.wants_parents


def test_prefix_batch_touch_puts_the_deepest_key_first() -> None:
    p = PrefixPolicy[int]()
    fill(p, keys(1, 2, 3, 4))
    p.touch_many(iter(keys(1, 2, 3)))  # a lookup's hits, head-first (any iterable)
    assert order(p) == keys(4, 3, 2, 1)
    p.touch_many(keys(5, 1))  # unknown keys are skipped
    assert order(p) == keys(4, 3, 2, 1)


def test_prefix_orphans_go_before_anything_reachable() -> None:
    p = PrefixPolicy[int]()
    fill(p, keys(1, 2, 3, 4, 5))
    p.orphan(keys(4, 5))  # 4 -> 5 lost their ancestor
    # [5 4 | 1 2 3]: orphans first, the deepest first, then LRU
    assert order(p) == keys(5, 4, 1, 2, 3)
    assert p.orphaned(5) and not p.orphaned(1) and p.orphans == 2 and len(p) == 5
    p.insert(6)
    assert order(p) == keys(5, 4, 1, 2, 3, 6)
    p.orphan(keys(2))  # newer orphans go first
    assert order(p) == keys(2, 5, 4, 1, 3, 6)


def test_prefix_hit_makes_an_orphan_reachable_again() -> None:
    p = PrefixPolicy[int]()
    fill(p, keys(1, 2, 3))
    p.orphan(keys(2, 3))  # [3 2 | 1]
    p.touch(2)  # its ancestor was stored again and it was hit
    assert order(p) == keys(3, 1, 2) and not p.orphaned(2)
    p.touch_many(keys(3))
    assert order(p) == keys(1, 2, 3) and p.orphans == 0


def test_prefix_remove_forgets_orphans_and_reachable_keys() -> None:
    p = PrefixPolicy[int]()
    fill(p, keys(1, 2, 3))
    p.orphan(keys(3))
    p.remove(3, evicted=True)
    p.remove(1, evicted=False)
    assert order(p) == keys(2) and p.orphans == 0 and 3 not in p
    p.insert(3)  # no history: back as a reachable key
    assert order(p) == keys(2, 3) and not p.orphaned(3)


def test_prefix_iteration_survives_orphaning_mid_walk() -> None:
    p = PrefixPolicy[int]()
    fill(p, range(1, 21))
    seen: list[int] = []
    for k in p.victims():
        seen.append(k)
        if k == 2:
            p.orphan(keys(15, 16))  # moved to the front of a later chunk's snapshot
        if k % 2:
            p.remove(k, evicted=True)
    # every key once; 15 and 16 met at the front of the next chunk
    assert sorted(seen) == list(range(1, 21)) and len(seen) == 20
    assert seen[4:6] == keys(16, 15)

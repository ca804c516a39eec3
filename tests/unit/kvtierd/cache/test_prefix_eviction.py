"""Prefix-aware eviction (issue 42) in a host-only cache of four 4 KiB slots, against LRU; then
the NVMe link below a prefix-aware host tier.

A chain ``A0 -> A1 -> A2 -> A3`` is stored head-first in one batch; a lookup hits a longest
prefix, so once ``A0`` is gone ``A1..A3`` are orphans: no lookup can reach them. Expected state
is written as ``[A3 A2 A1 A0]`` (resident, victim order); ``|`` separates orphans from the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import test_tiering
from test_cache import BLOCK, SHM, done, keys, session, spec
from test_tiering import Rig, payload, scenario
from test_tiering import keys as tiering_keys

from kvtierd.cache import TieredCache
from kvtierd.cache import residency as residency_module
from kvtierd.index import Entry, NamespaceState
from kvtierd.policies import PolicyName, PrefixPolicy, make_policy
from kvtierd.sessions import Session
from kvtierd.tiers import Arena, HostTier

A0, A1, A2, A3, B, X, Y = keys(10, 11, 12, 13, 20, 30, 31)
make_rig = test_tiering.make_rig  # the fixture


@pytest.fixture
def arenas() -> Iterator[list[Arena]]:
    made: list[Arena] = []
    yield made
    for a in made:
        a.close()


def cache_of(arenas: list[Arena], policy: PolicyName, blocks: int = 4) -> tuple[TieredCache, NamespaceState]:
    """A cache of exactly ``blocks`` blocks evicting by ``policy``, and its namespace."""
    arena = Arena(blocks * BLOCK, prefault=False)
    arenas.append(arena)
    host = HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
    cache = TieredCache(
        host,
        make_policy(policy, ghost_capacity=16),
        max_namespaces=4,
        policy_name=policy,
        clock=time.monotonic,
    )
    return cache, cache.register_namespace(spec())


def put(cache: TieredCache, ns: NamespaceState, ks: Sequence[bytes], parent: bytes | None = None) -> None:
    s: Session = session()
    job, _status, _ = cache.stores.reserve(s, ns, ks, SHM, parent=parent)
    assert job is not None
    cache.complete_store(s, job.id, ok=True)


def resident(ns: NamespaceState) -> set[bytes]:
    return set(ns.ready)


@pytest.mark.parametrize(
    ("policy", "left"),
    [
        ("lru", {A1, A2, A3, B}),  # A0 went first: A1..A3 are orphans, no lookup hits them
        ("prefix", {A0, A1, A2, B}),  # the tail went first: the chain still hits 3 blocks
    ],
)
def test_a_full_cache_evicts_the_tail_of_a_chain_not_its_head(
    arenas: list[Arena], policy: PolicyName, left: set[bytes]
) -> None:
    cache, ns = cache_of(arenas, policy)
    put(cache, ns, [A0, A1, A2, A3])  # prefix: [A3 A2 A1 A0]; lru: [A0 A1 A2 A3]
    put(cache, ns, [B])  # one slot: one eviction
    assert resident(ns) == left
    hit = done(cache.lookup(ns, [A0, A1, A2, A3])).hit
    assert hit == (3 if policy == "prefix" else 0)


def test_a_lookup_keeps_its_prefix_and_gives_up_its_tail_first(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0, A1])
    put(cache, ns, [X, Y])  # [A1 A0 Y X]
    assert done(cache.lookup(ns, [A0, A1])).hit == 2  # [Y X A1 A0]: hits touched tail-first
    put(cache, ns, [B])
    assert resident(ns) == {A0, A1, X, B}


def test_a_tail_stored_after_its_prefix_was_looked_up_goes_before_the_prefix(arenas: list[Arena]) -> None:
    """An engine looks its prompt up (the hit prefix touched), computes the rest and stores it
    later: the new tail must still rank colder than the prefix it hangs from, or the next
    eviction takes the prefix and leaves the tail an orphan."""
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0, A1, A2])  # [A2 A1 A0 _]
    assert done(cache.lookup(ns, [A0, A1, A2, A3])).hit == 3
    put(cache, ns, [A3], parent=A2)  # [A3 A2 A1 A0]: the commit touched A0..A2 after A3
    put(cache, ns, [B])  # one eviction
    assert resident(ns) == {A0, A1, A2, B}
    assert done(cache.lookup(ns, [A0, A1, A2, A3])).hit == 3


@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_an_orphan_goes_before_a_colder_reachable_block(arenas: list[Arena], policy: PolicyName) -> None:
    cache, ns = cache_of(arenas, policy)
    put(cache, ns, [X])  # the coldest block, reachable
    put(cache, ns, [A0, A1, A2])  # [X A2 A1 A0]
    assert cache.drop_corrupt([ns.entries[A0]]) == 1  # A0 leaves the index: [A2 A1 | X]
    put(cache, ns, [Y, B])  # one free slot, one eviction
    if policy == "prefix":
        assert resident(ns) == {X, A1, Y, B}  # the orphan A2 went, not X
        assert cache.residency.orphans_evicted == 1
        assert cache.figures()["orphaned_blocks"] == 1 and cache.figures()["orphans_evicted"] == 1  # (Stats)
    else:
        assert resident(ns) == {A1, A2, Y, B}  # LRU keeps the orphans, loses X
        assert cache.residency.orphans_evicted == 0
        assert cache.figures()["orphaned_blocks"] == 0  # (not tracked)


def test_parents_are_learned_from_lookups_and_store_parents(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0])
    put(cache, ns, [A1])  # no parent said: not known yet
    put(cache, ns, [A2], parent=A1)  # the request names it
    assert ns.entries[A1].parent is None and ns.entries[A2].parent == A1
    assert done(cache.lookup(ns, [A0, A1, A2])).hit == 3  # hits are a chain: A1 under A0
    assert ns.entries[A1].parent == A0
    policy = cache.policy
    cache.drop_corrupt([ns.entries[A0]])  # A1 and A2 are orphans now
    assert policy.orphaned(ns.entries[A1]) and policy.orphaned(ns.entries[A2])
    assert next(policy.victims()) is ns.entries[A2]  # the deepest first
    put(cache, ns, [X, Y])  # two slots free: nothing evicted
    assert not policy.orphaned(ns.entries[X])


def test_a_block_stored_below_a_missing_parent_is_an_orphan_at_once(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [X])
    put(cache, ns, [A2, A3], parent=A1)  # A1 is not held: [A3 A2 | X]
    assert [e.key for e in cache.policy.victims()] == [A3, A2, X]


def test_a_block_stored_below_an_orphan_is_an_orphan_at_once(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0, A1])
    cache.drop_corrupt([ns.entries[A0]])  # A1 an orphan
    put(cache, ns, [A2], parent=A1)  # held below an orphan: no lookup reaches it either
    assert cache.policy.orphaned(ns.entries[A2])
    assert [e.key for e in cache.policy.victims()] == [A2, A1]


@pytest.mark.parametrize("order", ["head-first", "tail-first"])
def test_an_orphaned_chain_leaving_block_by_block_is_walked_once(
    arenas: list[Arena], order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's long chain loses its head, then its blocks leave one at a time (here as
    corrupt, in the order least kind to the cache): each leaving must not walk what is left
    below it again, or an N-block chain costs N²/2 steps on the event loop."""
    n = 600
    cache, ns = cache_of(arenas, "prefix", blocks=n)
    chain = keys(*range(1000, 1000 + n))
    for i in range(0, n, 100):
        put(cache, ns, chain[i : i + 100], parent=chain[i - 1] if i else None)
    visited = 0
    real = residency_module.descendants

    def counted(ns: NamespaceState, key: bytes) -> list[Entry]:
        nonlocal visited
        found = real(ns, key)
        visited += len(found)
        return found

    monkeypatch.setattr(residency_module, "descendants", counted)
    cache.drop_corrupt([ns.entries[chain[0]]])
    assert cache.policy.orphans == n - 1 and visited == n - 1
    for k in chain[1:] if order == "head-first" else reversed(chain[1:]):
        cache.drop_corrupt([ns.entries[k]])
    assert ns.entries == {} and ns.children == {}
    assert visited == n - 1  # the head's walk only
    # (a chain committed below a missing parent in one batch is walked once too)
    put(cache, ns, chain[1:101], parent=chain[0])
    assert cache.policy.orphans == 100 and visited == n - 1 + 99


def test_the_children_map_empties_as_blocks_leave(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0, A1, A2])
    put(cache, ns, [A3], parent=A0)  # a branch: A0 has two children
    assert set(ns.children) == {A0, A1} and isinstance(ns.children[A0], set)
    for k in (A2, A1, A3, A0):
        cache.drop_corrupt([ns.entries[k]])
    assert ns.children == {} and ns.entries == {}


def test_chain_blind_policies_keep_no_parent_links(arenas: list[Arena]) -> None:
    cache, ns = cache_of(arenas, "lru")
    put(cache, ns, [A0, A1], parent=X)
    done(cache.lookup(ns, [A0, A1]))
    assert ns.children == {} and ns.entries[A1].parent is None


# -- the NVMe link below (test_tiering's Rig: a real NVMe tier in a temp directory) ------------


@scenario
async def test_the_nvme_link_offers_orphans_first_too(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4, nvme=8, write_policy="write-through", policy="prefix")
    await rig.store(1, 2, 3)  # a chain 1 -> 2 -> 3, written through to NVMe
    await rig.settle()
    link, host = rig.link.policy, rig.cache.policy
    assert isinstance(link, PrefixPolicy)
    assert [e.key for e in link.victims()] == tiering_keys(3, 2, 1)  # the tail first there too
    rig.link.drop_copy(rig.entry(1), corrupt=False)
    rig.cache.drop_corrupt([rig.entry(1)])  # block 1 leaves the index: 2 and 3 are orphans
    assert all(p.orphaned(rig.entry(i)) for p in (link, host) for i in (2, 3))
    await rig.store(4, 5, 6)  # one host eviction: the orphan 3 (its copy stays on NVMe)
    await rig.settle()
    assert not rig.entry(3).in_host and rig.cache.residency.orphans_evicted == 1
    assert link.orphaned(rig.entry(3))  # not made the most recent copy by its host eviction
    assert next(link.victims()) is rig.entry(3)


@scenario
async def test_orphans_are_not_written_down_and_go_before_blocks_held_below(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(host=4, nvme=8, write_policy="write-through", policy="prefix")
    await rig.store(1)  # written through: held below too
    await rig.settle()
    ks = tiering_keys(2, 3)
    job, _, _ = await rig.cache.prepare_store(rig.session, rig.ns, ks, SHM, parent=tiering_keys(99)[0])
    assert job is not None  # 2 -> 3 below a block not held: orphans at once, [3 2 | 1]
    for i, e in job.items.items():
        rig.cache.host.arena.slot(e.offset, BLOCK)[:] = payload(2 + i)
    rig.cache.complete_store(rig.session, job.id, ok=True)
    await rig.settle()
    assert rig.entry(2).copies is None and rig.entry(3).copies is None  # not written
    await rig.store(4, 5)  # one eviction: the orphan 3 loses nothing, 1 (held below) stays
    await rig.settle()
    assert rig.entry(1).in_host and 3 not in [int.from_bytes(k, "big") for k in rig.ns.entries]
    assert rig.cache.residency.orphans_evicted == 1


def test_orphans_reach_stats_and_metrics(arenas: list[Arena]) -> None:
    from kvtier_contract.protoutil import to_dict
    from kvtier_contract.v1 import kvtier_pb2 as pb
    from kvtierd.metric_families import KvtierCollector

    cache, ns = cache_of(arenas, "prefix")
    put(cache, ns, [A0, A1, A2])
    cache.drop_corrupt([ns.entries[A0]])  # A1, A2: orphans
    put(cache, ns, [X, Y, B])  # one eviction: an orphan
    reply = pb.StatsReply(boot_epoch=1, **cache.figures())  # as the service builds it
    assert (reply.orphaned_blocks, reply.orphans_evicted) == (1, 1)
    snap = {**to_dict(reply), "rpc_errors": {}, "rpc_latency": {}}
    families = {f.name: f for f in KvtierCollector(lambda: snap).collect()}
    assert families["kvtier_orphaned_blocks"].samples[0].value == 1
    assert families["kvtier_orphans_evicted"].samples[0].value == 1

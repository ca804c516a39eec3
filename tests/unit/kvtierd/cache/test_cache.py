"""TieredCache scenarios over a tiny host tier, each one run under every eviction policy.

The default arena is 4 slabs of 4 KiB and blocks are 4 KiB: one slot per slab, so the cache holds
exactly four blocks and every eviction is visible. Keys are small integers (``keys(1, 2, 3)``);
expected state is written in comments as ``[1 2 3 4]`` (resident, victim order) with ``1*``
for pinned and ``5w`` for a block being written.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtier_contract.identity import Namespace
from kvtierd.cache import LoadJob, TieredCache
from kvtierd.cache.lookup import LookupOptions
from kvtierd.domain import StoreStatus, Transport
from kvtierd.index import EntryState, NamespaceState
from kvtierd.policies import PolicyName, make_policy
from kvtierd.sessions import Session
from kvtierd.stats import Counters
from kvtierd.tiers import Arena, HostTier

KIB = 1024
BLOCK = 4 * KIB
TOKENS_PER_BLOCK = 4
SHM, TCP = Transport.SHM, Transport.TCP
RESERVED, PRESENT, REJECTED = StoreStatus.RESERVED, StoreStatus.ALREADY_PRESENT, StoreStatus.REJECTED
POLICIES: list[PolicyName] = ["lru", "arc"]

MakeCache = Callable[..., TieredCache]
T = TypeVar("T")


def done(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the host-only cache awaits nothing)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the coroutine suspended")


def pin_prefix(
    cache: TieredCache, session: Session, ns: NamespaceState, ks: list[bytes]
) -> tuple[LoadJob | None, bytes]:
    """A lookup holding its hit prefix: (the hold, each hit's tier)."""
    found = done(cache.lookup(ns, ks, LookupOptions(pin=session)))
    return found.job, found.tiers


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


def spec(block_bytes: int = BLOCK, model: str = "m") -> Namespace:
    """A namespace of ``block_bytes`` blocks of 4 tokens (float16, one layer, one head)."""
    head_dim, rest = divmod(block_bytes, 2 * 2 * TOKENS_PER_BLOCK)
    assert rest == 0
    return Namespace(
        model_id=model,
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=TOKENS_PER_BLOCK,
        num_layers=1,
        num_kv_heads=1,
        head_dim=head_dim,
    )


def session(sid: int = 1, transport: Transport = SHM) -> Session:
    return Session(sid, f"s{sid}", ttl_s=10.0, deadline=1e12, transport=transport)


@pytest.fixture(params=POLICIES)
def make_cache(request: pytest.FixtureRequest) -> Iterator[MakeCache]:
    arenas: list[Arena] = []

    def make(
        slabs: int = 4,
        slab_bytes: int = BLOCK,
        align: int = BLOCK,
        max_namespaces: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> TieredCache:
        arena = Arena(slabs * slab_bytes, prefault=False)
        arenas.append(arena)
        host = HostTier(arena, slab_bytes=slab_bytes, slot_align_bytes=align)
        policy = make_policy(request.param, ghost_capacity=16)
        return TieredCache(
            host, policy, max_namespaces=max_namespaces, policy_name=request.param, clock=clock
        )

    yield make
    for a in arenas:
        a.close()


@pytest.fixture
def cache(make_cache: MakeCache) -> TieredCache:
    return make_cache()


@pytest.fixture
def ns(cache: TieredCache) -> NamespaceState:
    return cache.register_namespace(spec())


def put(cache: TieredCache, ns: NamespaceState, ks: Sequence[bytes], s: Session | None = None) -> bytes:
    """Prepare and complete a store of ``ks`` (shm); returns the per-key status."""
    s = s or session()
    job, status, _ = cache.stores.reserve(s, ns, ks, SHM)
    if job is not None:
        cache.complete_store(s, job.id, ok=True)
    return status


def pin(cache: TieredCache, ns: NamespaceState, ks: Sequence[bytes], s: Session | None = None) -> int:
    """Pin ``ks`` with a load job that is left open; returns its id."""
    job = load_job(cache, s or session(), ns, ks)
    assert job is not None and len(job.items) == len(ks)
    return job.id


def load_job(
    cache: TieredCache, s: Session, ns: NamespaceState, ks: Sequence[bytes], transport: Transport = SHM
) -> LoadJob | None:
    """prepare_load of a host-only cache: nothing is ever deferred."""
    job, deferred = done(cache.prepare_load(s, ns, ks, transport))
    assert deferred == {}
    return job


def resident(ns: NamespaceState) -> set[bytes]:
    return {k for k, e in ns.entries.items() if e.state is EntryState.READY}


def st(*codes: int) -> bytes:
    return bytes(codes)


# ---- lookups -------------------------------------------------------------------------------


def test_lookup_answers_the_longest_ready_prefix(cache: TieredCache, ns: NamespaceState) -> None:
    assert put(cache, ns, keys(1, 2, 3)) == st(RESERVED, RESERVED, RESERVED)
    assert done(cache.lookup(ns, keys(1, 2, 3))).hit == 3
    assert done(cache.lookup(ns, keys(1, 2, 9, 3))).hit == 2  # 3 is there but after a miss
    assert done(cache.lookup(ns, keys(9, 1))).hit == 0
    assert done(cache.lookup(ns, [])).hit == 0


def test_keys_never_match_across_namespaces(cache: TieredCache, ns: NamespaceState) -> None:
    other = cache.register_namespace(spec(model="other"))
    put(cache, ns, keys(1, 2))
    assert done(cache.lookup(other, keys(1, 2))).hit == 0
    assert load_job(cache, session(), other, keys(1)) is None
    # the same key bytes can be stored in the other namespace independently
    assert put(cache, other, keys(1)) == st(RESERVED)


def test_pin_prefix_pins_exactly_the_hit_prefix(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    put(cache, ns, keys(1, 2, 4))
    job, tiers = pin_prefix(cache, s, ns, keys(1, 2, 3, 4))
    # [1* 2* 4]: 4 is resident but after the miss at 3
    assert job is not None and sorted(job.items) == [0, 1] and tiers == bytes([1, 1])  # host
    assert [ns.entries[k].holds for k in keys(1, 2, 4)] == [1, 1, 0]  # held, not read-pinned
    assert cache.pinned_blocks == 2 and s.load_jobs == {job.id}
    assert pin_prefix(cache, s, ns, keys(3, 1)) == (None, b"")  # nothing hit, nothing pinned
    put(cache, ns, keys(5, 6, 7, 8))  # a host-only cache: held blocks have no other copy
    assert done(cache.lookup(ns, keys(1, 2))).hit == 2  # [1* 2* 7 8]: never evicted while held
    assert cache.complete_load(s, job.id) == 2
    assert cache.pinned_blocks == 0


# ---- two-phase stores ----------------------------------------------------------------------


def test_writing_entries_are_invisible_until_committed(cache: TieredCache, ns: NamespaceState) -> None:
    s1, s2 = session(1), session(2)
    job, status, offsets = cache.stores.reserve(s1, ns, keys(1, 2), SHM)
    # [1w 2w]
    assert job is not None and status == st(RESERVED, RESERVED)
    assert len(set(offsets)) == 2 and all(o % BLOCK == 0 for o in offsets)
    assert done(cache.lookup(ns, keys(1))).hit == 0
    assert load_job(cache, s2, ns, keys(1, 2)) is None
    assert pin_prefix(cache, s2, ns, keys(1, 2))[0] is None
    # another writer is told there is nothing to do (someone is already writing it)
    assert cache.stores.reserve(s2, ns, keys(2), SHM)[1] == st(PRESENT)
    assert cache.writing_blocks == 2
    assert cache.complete_store(s1, job.id, ok=True) == (2, 0)
    # [1 2]
    assert done(cache.lookup(ns, keys(1, 2))).hit == 2
    assert cache.writing_blocks == 0


def test_writing_entries_are_never_evicted(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    job, _, _ = cache.stores.reserve(s, ns, keys(1, 2, 3, 4), SHM)
    # [1w 2w 3w 4w]: the arena is full of blocks being written
    assert job is not None
    job5, status, offsets = cache.stores.reserve(s, ns, keys(5), SHM)
    assert job5 is None and status == st(REJECTED) and offsets == [0]
    assert all(ns.entries[k].state is EntryState.WRITING for k in keys(1, 2, 3, 4))
    assert ns.counters.evictions == 0
    assert cache.complete_store(s, job.id, ok=True) == (4, 0)


def test_pinned_entries_are_never_evicted(cache: TieredCache, ns: NamespaceState) -> None:
    put(cache, ns, keys(1, 2, 3, 4))
    pin(cache, ns, keys(1, 2))
    # [3 4 1* 2*]
    status = put(cache, ns, keys(5, 6, 7))
    # 5 and 6 take the slots of 3 and 4; nothing is left for 7
    assert status == st(RESERVED, RESERVED, REJECTED)
    assert resident(ns) == set(keys(1, 2, 5, 6))
    assert ns.counters.evictions == 2
    assert done(cache.lookup(ns, keys(1, 2))).hit == 2


def test_store_is_rejected_as_a_value_when_only_pinned_and_writing_remain(
    cache: TieredCache, ns: NamespaceState
) -> None:
    s = session()
    put(cache, ns, keys(1, 2))
    pin(cache, ns, keys(1, 2))
    writing, _, _ = cache.stores.reserve(s, ns, keys(3, 4), SHM)
    # [1* 2* 3w 4w]
    assert writing is not None
    used = cache.host.used_bytes
    job, status, offsets = cache.stores.reserve(s, ns, keys(5, 6), SHM)
    assert job is None and status == st(REJECTED, REJECTED) and offsets == [0, 0]
    # nothing changed
    assert resident(ns) == set(keys(1, 2)) and keys(5)[0] not in ns.entries
    assert cache.host.used_bytes == used == 4 * BLOCK
    assert cache.writing_blocks == 2 and cache.pinned_blocks == 2
    assert s.store_jobs == {writing.id}
    assert ns.counters.stores_rejected == 2 and ns.counters.evictions == 0


def test_already_present_keys_are_reported_and_not_rewritten(cache: TieredCache, ns: NamespaceState) -> None:
    put(cache, ns, keys(1, 2))
    before = {k: ns.entries[k].offset for k in keys(1, 2)}
    job, status, offsets = cache.stores.reserve(session(), ns, keys(1, 3, 2), SHM)
    assert status == st(PRESENT, RESERVED, PRESENT)
    assert offsets[0] == offsets[2] == 0  # nothing to write for present keys
    assert offsets[1] not in before.values()
    assert job is not None and sorted(job.items) == [1]  # only 3 is reserved
    assert {k: ns.entries[k].offset for k in keys(1, 2)} == before
    assert ns.counters.stores_already_present == 2


def test_a_key_twice_in_one_batch_is_reserved_once(cache: TieredCache, ns: NamespaceState) -> None:
    job, status, _ = cache.stores.reserve(session(), ns, keys(1, 1), SHM)
    assert status == st(RESERVED, PRESENT)
    assert job is not None and len(job.items) == 1
    assert cache.host.used_bytes == BLOCK


def test_a_failed_complete_store_frees_its_slots_and_leaves_nothing_visible(
    cache: TieredCache, ns: NamespaceState
) -> None:
    s = session()
    job, _, _ = cache.stores.reserve(s, ns, keys(1, 2), SHM)
    assert job is not None
    assert cache.complete_store(s, job.id, ok=False) == (0, 2)
    # []
    assert ns.entries == {}
    assert done(cache.lookup(ns, keys(1))).hit == 0
    assert cache.host.used_bytes == 0 and cache.host.free_slabs() == 4
    assert cache.writing_blocks == 0 and s.store_jobs == set()
    assert ns.counters.stores_dropped == 2 and ns.counters.stores_accepted == 0
    assert ns.counters.resident_blocks == 0
    # the keys can be stored again
    assert put(cache, ns, keys(1, 2)) == st(RESERVED, RESERVED)


def test_item_ok_commits_part_of_a_job(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    put(cache, ns, keys(2))
    job, status, _ = cache.stores.reserve(s, ns, keys(1, 2, 3, 4), SHM)
    assert status == st(RESERVED, PRESENT, RESERVED, RESERVED)
    assert job is not None
    # item_ok follows the reserved keys only: 1, 3, 4
    assert cache.complete_store(s, job.id, ok=True, item_ok=[True, False, True]) == (2, 1)
    # [2 1 4]
    assert resident(ns) == set(keys(1, 2, 4))
    assert keys(3)[0] not in ns.entries
    assert cache.host.used_bytes == 3 * BLOCK
    assert ns.counters.stores_accepted == 3 and ns.counters.stores_dropped == 1


def test_ok_false_overrides_item_ok(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    job, _, _ = cache.stores.reserve(s, ns, keys(1, 2), SHM)
    assert job is not None
    assert cache.complete_store(s, job.id, ok=False, item_ok=[True, True]) == (0, 2)
    assert ns.entries == {}


def test_item_ok_of_the_wrong_length_changes_nothing(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    job, _, _ = cache.stores.reserve(s, ns, keys(1, 2), SHM)
    assert job is not None
    with pytest.raises(InvalidArgument) as exc:
        cache.complete_store(s, job.id, ok=True, item_ok=[True])
    assert exc.value.field == "item_ok"
    # the job is still open and can be completed properly
    assert cache.writing_blocks == 2 and s.store_jobs == {job.id}
    assert cache.complete_store(s, job.id, ok=True, item_ok=[True, True]) == (2, 0)


def test_a_job_completes_once(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    job, _, _ = cache.stores.reserve(s, ns, keys(1), SHM)
    assert job is not None
    cache.complete_store(s, job.id, ok=True)
    with pytest.raises(NotFound) as exc:
        cache.complete_store(s, job.id, ok=False)
    assert exc.value.field == "job_id"
    assert resident(ns) == set(keys(1))  # the second call did not abort the committed block
    assert ns.counters.stores_accepted == 1 and ns.counters.stores_dropped == 0


def test_jobs_belong_to_their_session_and_kind(cache: TieredCache, ns: NamespaceState) -> None:
    owner, other = session(1), session(2)
    put(cache, ns, keys(1))
    store, _, _ = cache.stores.reserve(owner, ns, keys(2), SHM)
    load = load_job(cache, owner, ns, keys(1))
    assert store is not None and load is not None
    # another session's job answers as an absent one (an id tells nothing)
    with pytest.raises(NotFound, match=f"unknown or finished job {store.id}"):
        cache.complete_store(other, store.id, ok=False)
    with pytest.raises(NotFound, match=f"unknown or finished job {load.id}"):
        cache.complete_load(other, load.id)
    with pytest.raises(FailedPrecondition):
        cache.complete_load(owner, store.id)
    with pytest.raises(FailedPrecondition):
        cache.complete_store(owner, load.id, ok=True)
    with pytest.raises(NotFound):
        cache.complete_store(owner, 10_000, ok=True)
    # none of those changed anything
    assert cache.writing_blocks == 1 and cache.pinned_blocks == 1
    assert cache.complete_store(owner, store.id, ok=True) == (1, 0)
    assert cache.complete_load(owner, load.id) == 1


def test_tcp_store_job_whose_bytes_never_arrived_is_aborted(cache: TieredCache, ns: NamespaceState) -> None:
    s = session(transport=TCP)
    job, _, _ = cache.stores.reserve(s, ns, keys(1, 2, 3), TCP)
    assert job is not None
    for first in (0, 2):  # what the data channel does once a frame's bytes are in
        run_job, _ = cache.jobs.store_run(s.id, job.id, first, 1, BLOCK)
        run_job.arrived([first])
    with pytest.raises(NotFound):
        cache.jobs.store_run(99, job.id, 1, 1, BLOCK)  # another session's data channel
    # the client claims success for all three, but the bytes of 2 never arrived
    assert cache.complete_store(s, job.id, ok=True) == (2, 1)
    assert resident(ns) == set(keys(1, 3))
    assert ns.counters.bytes_in_tcp == 2 * BLOCK and ns.counters.bytes_in_shm == 0


def test_store_run_checks_session_index_and_length(cache: TieredCache, ns: NamespaceState) -> None:
    s = session(transport=TCP)
    put(cache, ns, keys(1))
    job, _, offsets = cache.stores.reserve(s, ns, keys(1, 2, 3), TCP)
    assert job is not None
    run_job, entries = cache.jobs.store_run(s.id, job.id, 1, 2, 2 * BLOCK)  # keys 2 and 3
    assert run_job is job and [e.offset for e in entries] == offsets[1:]
    for args, field in [
        ((99, job.id, 1, 1, BLOCK), "job_id"),  # another session
        ((s.id, job.id + 1, 1, 1, BLOCK), "job_id"),
        ((s.id, job.id, 0, 1, BLOCK), "index"),  # present, not reserved
        ((s.id, job.id, 1, 3, 3 * BLOCK), "index"),  # runs past the job
        ((s.id, job.id, 1, 1, BLOCK - 1), "length"),
        ((s.id, job.id, 1, 2, 3 * BLOCK), "length"),  # not one size per block
        ((s.id, job.id, 1, 0, 0), "length"),
    ]:
        with pytest.raises((NotFound, InvalidArgument)) as exc:
            cache.jobs.store_run(*args)
        assert exc.value.field == field, args
    assert job.received == set()  # validating changed nothing


# ---- eviction ------------------------------------------------------------------------------


def test_eviction_makes_room_in_policy_order(cache: TieredCache, ns: NamespaceState) -> None:
    put(cache, ns, keys(1, 2, 3, 4))
    # [1 2 3 4]
    assert put(cache, ns, keys(5)) == st(RESERVED)
    # [2 3 4 5]: 1 was never hit, it goes first under both policies
    assert resident(ns) == set(keys(2, 3, 4, 5))
    assert done(cache.lookup(ns, keys(2))).hit == 1
    assert put(cache, ns, keys(6)) == st(RESERVED)
    # [4 5 2 6] (lru) / T1 [4 5 6], T2 [2] (arc): 3 goes; the hit on 2 saved it
    assert resident(ns) == set(keys(2, 4, 5, 6))
    assert ns.counters.evictions == 2
    assert cache.host.used_bytes == 4 * BLOCK


def test_prepare_store_never_evicts_ready_keys_of_its_own_batch(
    cache: TieredCache, ns: NamespaceState
) -> None:
    put(cache, ns, keys(1, 2, 3, 4))
    # [1 2 3 4]: 1 is the first victim, but it is part of the batch
    status = put(cache, ns, keys(5, 1))
    assert status == st(RESERVED, PRESENT)
    assert resident(ns) == set(keys(1, 3, 4, 5))  # 2 made room, not 1
    # a batch that names every resident key cannot make room at all
    status = put(cache, ns, keys(1, 3, 4, 5, 6))
    assert status == st(PRESENT, PRESENT, PRESENT, PRESENT, REJECTED)
    assert resident(ns) == set(keys(1, 3, 4, 5))
    assert ns.counters.evictions == 1


def test_once_full_the_rest_of_the_batch_is_rejected(cache: TieredCache, ns: NamespaceState) -> None:
    put(cache, ns, keys(1, 2))
    pin(cache, ns, keys(1, 2))
    status = put(cache, ns, keys(3, 4, 5, 1, 6))
    # [1* 2* 3 4]: 5 and 6 find no room; 1 is still reported present
    assert status == st(RESERVED, RESERVED, REJECTED, PRESENT, REJECTED)
    assert ns.counters.stores_rejected == 2


def test_a_starving_class_takes_the_slab_of_another_class(make_cache: MakeCache) -> None:
    # 4 slabs of 4 KiB, 1 KiB alignment: big blocks fill a slab, small ones take half of one
    cache = make_cache(slabs=4, slab_bytes=BLOCK, align=KIB)
    big = cache.register_namespace(spec(BLOCK, "big"))
    small = cache.register_namespace(spec(BLOCK // 2, "small"))
    assert (big.slot_bytes, small.slot_bytes) == (BLOCK, BLOCK // 2)
    put(cache, big, keys(1, 2, 3, 4))
    # slabs: [1] [2] [3] [4], no free slab, nothing of the small class to evict
    assert put(cache, small, keys(10)) == st(RESERVED)
    # the slab of 1 moved to the small class: [10 _] [2] [3] [4]
    assert resident(big) == set(keys(2, 3, 4))
    assert big.counters.evictions == 1 and big.counters.resident_blocks == 3
    assert put(cache, small, keys(11)) == st(RESERVED)
    # [10 11] [2] [3] [4]: the second small block fits the moved slab, nothing evicted
    assert big.counters.evictions == 1
    load = pin(cache, small, keys(10, 11))
    # [10* 11*] [2] [3] [4]: the small class starves again
    assert put(cache, small, keys(12, 13)) == st(RESERVED, RESERVED)
    # [10* 11*] [12 13] [3] [4]
    assert resident(big) == set(keys(3, 4)) and big.counters.evictions == 2
    assert cache.host.used_bytes == 4 * (BLOCK // 2) + 2 * BLOCK
    cache.complete_load(session(), load)
    assert put(cache, small, keys(14)) == st(RESERVED)
    # victims go in policy order across classes: 3 of the big class is older than every small
    # block and its slab holds nothing else, so that slab moves: [10 11] [12 13] [14 _] [4]
    # (slabs follow demand instead of staying with the class that took them first)
    assert resident(big) == set(keys(4)) and big.counters.evictions == 3
    assert resident(small) == set(keys(10, 11, 12, 13, 14))
    assert small.counters.evictions == 0
    assert put(cache, small, keys(15)) == st(RESERVED)
    # [10 11] [12 13] [14 15] [4]: the moved slab's second slot, nothing evicted
    assert big.counters.evictions == 3 and small.counters.evictions == 0


def test_a_starving_class_empties_only_a_slab_it_can_take(make_cache: MakeCache) -> None:
    # 2 slabs of 8 KiB: the 4 KiB class puts two blocks in each, the 8 KiB class one
    cache = make_cache(slabs=2, slab_bytes=2 * BLOCK, align=BLOCK)
    small = cache.register_namespace(spec(BLOCK, "small"))
    large = cache.register_namespace(spec(2 * BLOCK, "large"))
    put(cache, small, keys(1, 2, 3, 4))
    pin(cache, small, keys(1))
    # slabs [1* 2] [3 4]; victim order 2 3 4 (1 pinned)
    assert put(cache, large, keys(9)) == st(RESERVED)
    # evicting 2 cannot free slab 0 (1 is pinned): only slab 1's blocks go
    assert resident(small) == set(keys(1, 2))
    assert small.counters.evictions == 2


def test_a_store_that_cannot_get_a_slab_evicts_nothing(make_cache: MakeCache) -> None:
    cache = make_cache(slabs=2, slab_bytes=2 * BLOCK, align=BLOCK)
    small = cache.register_namespace(spec(BLOCK, "small"))
    large = cache.register_namespace(spec(2 * BLOCK, "large"))
    put(cache, small, keys(1, 2, 3, 4))
    pin(cache, small, keys(1, 3))
    # slabs [1* 2] [3* 4]: no slab can be emptied
    assert put(cache, large, keys(9)) == st(REJECTED)
    assert resident(small) == set(keys(1, 2, 3, 4))
    assert small.counters.evictions == 0
    assert large.counters.stores_rejected == 1


# ---- loads ---------------------------------------------------------------------------------


def test_prepare_load_pins_what_is_ready_and_complete_load_unpins(
    cache: TieredCache, ns: NamespaceState
) -> None:
    s = session()
    put(cache, ns, keys(1, 3))
    job = load_job(cache, s, ns, keys(1, 2, 3))
    assert job is not None and sorted(job.items) == [0, 2]
    assert cache.pinned_blocks == 2
    assert [i for i, _ in cache.jobs.load_run(s.id, job.id)[1]] == [0, 2]
    with pytest.raises(NotFound):
        cache.jobs.load_run(99, job.id)
    assert cache.complete_load(s, job.id) == 2
    assert cache.pinned_blocks == 0 and s.load_jobs == set()
    assert all(ns.entries[k].pins == 0 for k in keys(1, 3))
    assert ns.counters.loads == 2 and ns.counters.bytes_out_shm == 2 * BLOCK
    with pytest.raises(NotFound):
        cache.complete_load(s, job.id)
    assert load_job(cache, s, ns, keys(7)) is None


def test_two_load_jobs_pin_a_block_twice(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    put(cache, ns, keys(1, 2, 3, 4))
    a = pin(cache, ns, keys(1), s)
    b = pin(cache, ns, keys(1), s)
    cache.complete_load(s, a)
    # [2 3 4 1*]: still pinned by b
    assert put(cache, ns, keys(5, 6, 7, 8)) == st(RESERVED, RESERVED, RESERVED, REJECTED)
    assert keys(1)[0] in resident(ns)
    cache.complete_load(s, b)
    pin(cache, ns, keys(5, 6, 7), s)
    # [1 5* 6* 7*]: 1 is the only block left to evict
    assert put(cache, ns, keys(8)) == st(RESERVED)
    assert keys(1)[0] not in ns.entries


# ---- sessions ------------------------------------------------------------------------------


def test_release_session_frees_reservations_and_unpins(cache: TieredCache, ns: NamespaceState) -> None:
    s, other = session(1), session(2)
    put(cache, ns, keys(1, 2))
    pin(cache, ns, keys(1, 2), s)
    pin(cache, ns, keys(2), other)
    job, _, _ = cache.stores.reserve(s, ns, keys(3, 4), SHM)
    assert job is not None
    # [1* 2** 3w 4w]
    cache.release_session(s)
    # [1 2*]: s's reservations are gone, its pins released, other's pin kept
    assert resident(ns) == set(keys(1, 2)) and len(ns.entries) == 2
    assert [ns.entries[k].pins for k in keys(1, 2)] == [0, 1]
    assert s.store_jobs == set() and s.load_jobs == set()
    assert cache.writing_blocks == 0 and cache.pinned_blocks == 1
    assert cache.host.used_bytes == 2 * BLOCK
    assert ns.counters.stores_dropped == 2
    with pytest.raises(NotFound):
        cache.complete_store(s, job.id, ok=True)
    # 1 is evictable again, 2 is not
    assert put(cache, ns, keys(5, 6, 7)) == st(RESERVED, RESERVED, RESERVED)
    assert resident(ns) == set(keys(2, 5, 6, 7))


# ---- namespaces ----------------------------------------------------------------------------


def test_register_namespace_is_idempotent_and_bounded(make_cache: MakeCache) -> None:
    cache = make_cache(max_namespaces=2)
    a = cache.register_namespace(spec(model="a"))
    assert cache.register_namespace(spec(model="a")) is a
    assert a.id == spec(model="a").namespace_id and a.block_bytes == BLOCK
    cache.register_namespace(spec(model="b"))
    with pytest.raises(ResourceExhausted):
        cache.register_namespace(spec(model="c"))
    with pytest.raises(InvalidArgument) as exc:
        make_cache().register_namespace(spec(2 * BLOCK))  # larger than a 4 KiB slab
    assert exc.value.field == "namespace.block_bytes"
    with pytest.raises(NotFound) as nf:
        cache.namespace(12345)
    assert nf.value.field == "namespace_id"
    assert set(cache.namespaces) == {a.id, spec(model="b").namespace_id}


# ---- counters ------------------------------------------------------------------------------


def test_counters_are_exact(cache: TieredCache, ns: NamespaceState) -> None:
    s = session()
    other = cache.register_namespace(spec(model="other"))
    assert done(cache.lookup(ns, keys(1, 2))).hit == 0  # 2 missed
    put(cache, ns, keys(1, 2, 3))  # 3 accepted
    assert done(cache.lookup(ns, keys(1, 2, 9))).hit == 2  # 2 hit, 1 missed
    job, _, _ = cache.stores.reserve(s, ns, keys(3, 4), SHM)  # 1 present
    assert job is not None
    cache.complete_store(s, job.id, ok=False)  # 1 dropped
    pin(cache, ns, keys(1, 2, 3))
    put(cache, other, keys(7))  # other: 1 accepted
    load = load_job(cache, s, other, keys(7))
    assert load is not None
    # [1* 2* 3*] [7*]: full
    assert put(cache, ns, keys(5)) == st(REJECTED)  # 1 rejected
    cache.complete_load(s, load.id)  # other: 1 loaded
    assert put(cache, ns, keys(8)) == st(RESERVED)  # evicts 7 of other
    tpb = TOKENS_PER_BLOCK
    assert ns.counters == Counters(
        lookups=2,
        blocks_requested=5,
        blocks_hit_host=2,
        blocks_missed=3,
        tokens_requested=5 * tpb,
        tokens_hit=2 * tpb,
        tokens_missed=3 * tpb,
        stores_accepted=4,
        stores_already_present=1,
        stores_rejected=1,
        stores_dropped=1,
        bytes_in_shm=4 * BLOCK,
        resident_blocks=4,
        resident_bytes=4 * BLOCK,
    )
    assert other.counters == Counters(
        stores_accepted=1, loads=1, evictions=1, bytes_in_shm=BLOCK, bytes_out_shm=BLOCK
    )
    total = cache.totals()
    assert total.stores_accepted == 5 and total.evictions == 1 and total.resident_blocks == 4
    assert total.lookups == 2 and total.loads == 1
    assert cache.host.used_bytes == 4 * BLOCK


def test_slots_of_an_expired_writer_are_held_back_one_lease(make_cache: MakeCache) -> None:
    now = [100.0]
    cache = make_cache(clock=lambda: now[0])  # a fake clock for the limbo deadline
    ns = cache.register_namespace(spec())
    put(cache, ns, keys(1, 2))
    writer = session(2)
    cache.stores.reserve(writer, ns, keys(3, 4), SHM)
    # [1 2 3w 4w]; the writer's lease lapses (it may only be stalled, still copying over shm)
    writer.expired = True
    cache.release_session(writer)
    assert cache.writing_blocks == 0 and cache.limbo_blocks == 2
    assert resident(ns) == set(keys(1, 2))
    # the two slots are not handed out again: a new store must evict instead
    assert put(cache, ns, keys(5)) == st(RESERVED)
    assert ns.counters.evictions == 1 and cache.limbo_blocks == 2
    now[0] += writer.ttl_s - 1
    assert cache.sweep_limbo() == 0
    now[0] += 1
    assert cache.sweep_limbo() == 2
    assert put(cache, ns, keys(6, 7)) == st(RESERVED, RESERVED)
    assert ns.counters.evictions == 1  # the returned slots took them


def test_reserved_and_held_back_slots_count_against_the_tenants_host_quota(make_cache: MakeCache) -> None:
    """Issue 26: a store prepared and never completed held its slots outside the tenant's
    ``host_bytes``, and so did the slots held back after its lease lapsed."""
    now = [100.0]
    cache = make_cache(clock=lambda: now[0])
    ns = cache.register_namespace(dataclasses.replace(spec(), tenant="t"))
    slot = ns.slot_bytes
    cache.stores.fit_tenant("t", 2 * slot, 3 * slot)  # nothing held: two fit a quota of three
    writer = session(2)
    cache.stores.reserve(writer, ns, keys(1, 2), SHM)  # [1w 2w]
    with pytest.raises(ResourceExhausted, match="quota host_bytes"):
        cache.stores.fit_tenant("t", 2 * slot, 3 * slot)  # 2 reserved + 2 more > 3
    writer.expired = True
    cache.release_session(writer)  # [] with 2 slots in limbo for one more lease
    assert ns.writing_blocks == 0 and ns.limbo_blocks == 2
    with pytest.raises(ResourceExhausted, match="quota host_bytes"):
        cache.stores.fit_tenant("t", 2 * slot, 3 * slot)
    now[0] += writer.ttl_s
    assert cache.sweep_limbo() == 2 and ns.limbo_blocks == 0
    cache.stores.fit_tenant("t", 2 * slot, 3 * slot)  # the tenant's slots are back


def test_a_closed_session_frees_its_slots_at_once(cache: TieredCache, ns: NamespaceState) -> None:
    writer = session(2)
    cache.stores.reserve(writer, ns, keys(3, 4), SHM)
    cache.release_session(writer)  # closed, not expired: its process said it is done
    assert cache.limbo_blocks == 0 and cache.host.used_bytes == 0


def test_no_job_attaches_to_a_released_session(cache: TieredCache, ns: NamespaceState) -> None:
    put(cache, ns, keys(1))
    gone = session(3)
    gone.released = True  # its lease lapsed while the request awaited flushes or promotions
    with pytest.raises(NotFound, match="session_id"):
        cache.stores.reserve(gone, ns, keys(2), SHM)
    with pytest.raises(NotFound, match="session_id"):
        load_job(cache, gone, ns, keys(1))
    assert cache.writing_blocks == 0 and cache.pinned_blocks == 0
    assert ns.entries.keys() == set(keys(1))


def test_an_empty_idle_namespace_is_forgotten_and_its_counters_stay_in_the_totals(
    make_cache: MakeCache,
) -> None:
    now = [100.0]
    cache = make_cache(max_namespaces=2, clock=lambda: now[0])
    empty = cache.register_namespace(spec(model="empty"))
    full = cache.register_namespace(spec(model="full"))
    put(cache, full, [bytes([7]) * 32])
    empty.counters.lookups += 5
    with pytest.raises(ResourceExhausted):  # the table is full
        cache.register_namespace(spec(model="third"))
    now[0] += 9
    cache.used(empty)  # an RPC named it: idle from now
    now[0] += 9
    assert cache.expire_idle(10.0, busy=lambda _id: False) == []
    now[0] += 2
    assert cache.expire_idle(10.0, busy=lambda _id: True) == []  # an index reader holds it
    assert cache.expire_idle(10.0, busy=lambda _id: False) == [empty]
    assert empty.id not in cache.namespaces and full.id in cache.namespaces  # (it holds a block)
    assert cache.totals().lookups == 5 and cache.totals().stores_accepted == 1
    again = cache.register_namespace(spec(model="empty"))  # room again: registered anew
    assert again is not empty and again.counters.lookups == 0


def test_room_for_promotions_keeps_to_the_tenants_quota(make_cache: MakeCache) -> None:
    """Blocks promoted from below or imported from the cluster take host slots too: the
    tenant's quota lets in as many as its own coldest blocks can make room for, never evicting
    the blocks of the lookup itself (``protect``) nor pinned ones."""
    cache = make_cache()
    ns = cache.register_namespace(dataclasses.replace(spec(), tenant="t"))
    cache.admission.host_quota = lambda _ns: 3 * ns.slot_bytes
    put(cache, ns, keys(1, 2, 3))  # [1 2 3]: the quota is full
    assert cache.stores.room_for(ns, 2) == 2 and resident(ns) == set(keys(3))  # 1 and 2 made room
    put(cache, ns, keys(4, 5))  # [3 4 5]
    held = {ns.entries[k] for k in keys(3, 4)}
    assert cache.stores.room_for(ns, 2, held) == 1 and resident(ns) == set(keys(3, 4))  # 5 only
    pin = load_job(cache, session(7), ns, keys(3, 4))  # pinned: not evictable either
    assert pin is not None and cache.stores.room_for(ns, 2) == 1  # the slot 5 left
    cache.admission.host_quota = lambda _ns: None
    assert cache.stores.room_for(ns, 50) == 50  # no quota: the host tier alone decides


def test_a_namespace_with_held_back_slots_does_not_expire(make_cache: MakeCache) -> None:
    """Its limbo slots count against its tenant's host_bytes: forgetting it would drop them out
    of the count (and a namespace registered anew would start from zero)."""
    now = [100.0]
    cache = make_cache(clock=lambda: now[0])
    ns = cache.register_namespace(spec())
    writer = session(2)
    cache.stores.reserve(writer, ns, keys(1), SHM)
    writer.expired = True
    cache.release_session(writer)  # [] and one slot in limbo for a lease
    now[0] += 20
    assert not ns.entries and ns.limbo_blocks == 1
    assert cache.expire_idle(10.0, busy=lambda _id: False) == []
    cache.sweep_limbo()
    assert cache.expire_idle(10.0, busy=lambda _id: False) == [ns]

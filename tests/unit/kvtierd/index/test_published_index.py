"""The published index: the daemon's writer (kvtierd.index.published) against the client's reader
(kvtier.local_index), in one process: same table, same answers as the dict they mirror."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import random
import struct
import time
from collections.abc import Callable

import pytest

from kvtier.local_index import Segment as ReaderSegment
from kvtier_contract import published_index as pi
from kvtierd.index.entry import NamespaceState
from kvtierd.index.published import Publishers, ReadyMap


def _key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(8, "little")).digest()


def _ns(ns_id: int = 7) -> NamespaceState:
    return NamespaceState(ns_id, None, 4096, 4096)  # type: ignore[arg-type]


def _reader(publishers: Publishers, ns: NamespaceState) -> ReaderSegment:
    fd, size, _gen = publishers.handout(ns)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return ReaderSegment(m, time.monotonic)


def _truth(ready: ReadyMap, keys: list[bytes]) -> int:
    for i, k in enumerate(keys):
        if k not in ready:
            return i
    return len(keys)


def test_the_reader_answers_the_dicts_longest_prefix_through_changes_and_rebuilds() -> None:
    rng = random.Random(5)
    ns, pubs = _ns(), Publishers(boot_epoch=3)
    for i in range(300):
        ns.ready[_key(i)] = object()
    reader = _reader(pubs, ns)  # built from the 300 present
    gens = {ns.ready.publisher.generation}  # type: ignore[union-attr]
    for step in range(40):
        for i in rng.sample(range(20_000), 400):  # grow well past a rebuild
            ns.ready[_key(i)] = object()
        for k in rng.sample(list(ns.ready), 150 if step % 2 else 20):  # vectorized, one by one
            if rng.random() < 0.5:
                del ns.ready[k]
            else:
                ns.ready.pop(k)
        for k in rng.sample(list(ns.ready), 5):  # gone and back within one flush
            v = ns.ready.pop(k)
            ns.ready[k] = v
        pubs.flush()
        gen = ns.ready.publisher.generation  # type: ignore[union-attr]
        if gen not in gens:  # the old segment says retired; a client asks for the new one
            assert reader.state(time.monotonic()) == "retired"
            reader = _reader(pubs, ns)
            gens.add(gen)
        for _ in range(20):
            start = rng.randrange(20_000)
            chain = [_key(i) for i in range(start, start + rng.randrange(1, 200))]
            assert reader.hits(b"".join(chain), len(chain)) == _truth(ns.ready, chain), step
        present = list(ns.ready)
        rng.shuffle(present)
        assert reader.hits(b"".join(present), len(present)) == len(present)
    assert len(gens) > 2, "the table should have been rebuilt (grown) on the way"


def test_full_buckets_overflow_to_the_next_and_a_key_past_the_probe_bound_is_left_out() -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    reader = _reader(pubs, ns)
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    # Keys that all share one home bucket: they spill into the following buckets.
    home = b"\x11" * 8
    same = [os.urandom(8) + home + os.urandom(16) for _ in range(pi.BUCKET * pi.MAX_PROBE + 3)]
    for k in same:
        ns.ready[k] = object()
    pubs.flush()
    assert seg.left_out == 3
    published = same[: pi.BUCKET * pi.MAX_PROBE]
    assert reader.hits(b"".join(published), len(published)) == len(published)
    assert reader.hits(b"".join(same), len(same)) == len(published)  # the rest: misses
    # Removing one from the first bucket leaves a tombstone: the ones behind stay reachable.
    del ns.ready[same[0]]
    pubs.flush()
    assert reader.hits(b"".join(same[1:]), len(same) - 1) == len(published) - 1
    assert reader.hits(same[0], 1) == 0


def test_keys_whose_fingerprint_bytes_are_zero_or_one_are_found_and_never_match_empty() -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    reader = _reader(pubs, ns)
    zero, one = bytes(8) + os.urandom(24), b"\x01" + bytes(7) + os.urandom(24)
    absent = bytes(8) + os.urandom(24)  # its home bucket is empty: fingerprint 2 != EMPTY
    assert reader.hits(zero + absent, 2) == 0
    ns.ready[zero] = ns.ready[one] = object()
    pubs.flush()
    assert reader.hits(zero + one, 2) == 2
    assert reader.hits(absent, 1) == 0


def test_the_vectorized_build_places_every_key_where_inserts_would_find_it() -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    keys = [_key(i, b"build") for i in range(5000)]
    # Crowd a few buckets so the build has to spill over, as inserts do.
    keys += [os.urandom(8) + b"\x22" * 8 + os.urandom(16) for _ in range(20)]
    for k in keys:
        ns.ready[k] = object()
    reader = _reader(pubs, ns)  # built in one vectorized pass
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    assert seg.left_out == 0  # 20 crowding one bucket fit in the 8 buckets from there
    assert reader.hits(b"".join(keys), len(keys)) == len(keys)
    for k in keys[::7]:  # and the writer's remove finds what the build placed
        del ns.ready[k]
    pubs.flush()
    gone = set(keys[::7])
    for i, k in enumerate(keys[:300]):
        assert reader.hits(k, 1) == (0 if k in gone else 1), i


def test_the_segment_is_sealed_and_its_handed_out_descriptor_is_read_only() -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    ns.ready[_key(1)] = object()
    fd, size, _ = pubs.handout(ns)
    try:
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises((OSError, PermissionError)):
            mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # Not even reopening it for writing gives a writable mapping (F_SEAL_FUTURE_WRITE).
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        if seals & 0x0010:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.write(rw, b"x")
            finally:
                os.close(rw)
    finally:
        os.close(fd)


def test_the_stamp_marks_a_daemon_that_stopped_and_close_marks_retired() -> None:
    now_ns = [5_000_000_000]  # the daemon's monotonic clock (the segments' stamps)

    def later(fraction_of_stale: float) -> None:
        now_ns[0] += int(pi.STALE_AFTER_S * fraction_of_stale * 1e9)

    ns, pubs = _ns(), Publishers(boot_epoch=9, stamp_clock=lambda: now_ns[0])
    fd, size, _ = pubs.handout(ns)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    skew = 1e6  # the reader's clock runs in another clock namespace: only the offset matters

    def reader_now() -> float:
        return now_ns[0] / 1e9 + skew

    reader = ReaderSegment(m, reader_now)
    assert reader.epoch == 9
    assert reader.state(reader_now()) == "ok"
    later(0.5)
    pubs.tick()
    later(0.6)  # ticked half-way: still fresh
    assert reader.state(reader_now()) == "ok"
    later(0.6)  # no tick for longer than STALE_AFTER_S: stale
    assert reader.state(reader_now()) == "stale"
    pubs.tick()
    assert reader.state(reader_now()) == "ok"
    pubs.close()
    assert reader.state(reader_now()) == "retired"


def test_ready_map_refuses_changes_the_index_would_not_see() -> None:
    ready = ReadyMap()
    for change in (
        ready.clear,
        lambda: ready.update({b"k": 1}),
        lambda: ready.setdefault(b"k", 1),
        ready.popitem,
    ):
        with pytest.raises(TypeError):
            change()


def test_a_reader_refuses_a_segment_that_is_not_one() -> None:
    m = mmap.mmap(-1, 4096)
    struct.pack_into("<4s", m, 0, b"NOPE")
    with pytest.raises(ValueError):
        ReaderSegment(m, time.monotonic)


@pytest.mark.parametrize("n", [5, 400])  # one by one, and vectorized
def test_changes_reach_readers_at_the_flush_and_batches_land_where_single_ones_would(n: int) -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    reader = _reader(pubs, ns)
    keys = [_key(i, b"flush") for i in range(n)]
    # crowd one bucket past full so a batch spills over, as single inserts do
    keys += [os.urandom(8) + b"\x33" * 8 + os.urandom(16) for _ in range(6)]
    for k in keys:
        ns.ready[k] = object()
    assert reader.hits(keys[0], 1) == 0  # not published before the flush
    pubs.flush()
    assert reader.hits(b"".join(keys), len(keys)) == len(keys)
    for k in keys[1::2]:
        del ns.ready[k]
    pubs.flush()
    for i, k in enumerate(keys):
        assert reader.hits(k, 1) == (i % 2 == 0), i
    for k in keys[1::2]:  # back in their old slots' tombstones or elsewhere
        ns.ready[k] = object()
    pubs.flush()
    assert reader.hits(b"".join(keys), len(keys)) == len(keys)
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    assert seg.keys == len(keys)  # each key once: nothing published twice


def test_lookup_tallies_saturate_instead_of_wrapping_a_counter() -> None:
    """A client repeating huge tallies cannot push a counter past what Stats can carry."""
    from types import SimpleNamespace

    from kvtier_contract.v1 import kvtier_pb2 as pb
    from kvtierd.service.sessions import SessionHandlers
    from kvtierd.stats import Counters

    counters = Counters(tokens_hit=(1 << 63) - 5)
    ns = SimpleNamespace(id=7, counters=counters, spec=SimpleNamespace(tokens_per_block=16))
    fake = SimpleNamespace(
        cache=SimpleNamespace(namespaces={7: ns}),
        scope=SimpleNamespace(visible=lambda: [ns], scope=lambda: None, sees=lambda _ns: True),
    )
    t = pb.LookupTally(namespace_id=7, lookups=1, blocks_requested=1 << 32, blocks_hit=1 << 32)
    SessionHandlers._count_local_lookups(fake, [t])  # type: ignore[arg-type]
    assert counters.tokens_hit == (1 << 63) - 1
    assert counters.blocks_hit_local == 1 << 32
    pb.Counters(tokens_hit=counters.tokens_hit)  # still fits the wire


def test_two_keys_of_one_fingerprint_and_bucket_both_leave_in_one_batch() -> None:
    ns, pubs = _ns(), Publishers(boot_epoch=1)
    reader = _reader(pubs, ns)
    k = _key(1, b"twin")
    twin = bytes([k[0] ^ 2]) + k[1:]  # the same fingerprint (bit 1 is set anyway), same home
    others = [_key(i, b"crowd") for i in range(60)]  # enough for the vectorized path
    for key in [k, twin, *others]:
        ns.ready[key] = object()
    pubs.flush()
    assert reader.hits(k, 1) == 1 and reader.hits(twin, 1) == 1
    for key in [k, twin, *others]:
        del ns.ready[key]
    pubs.flush()
    assert reader.hits(k, 1) == 0 and reader.hits(twin, 1) == 0
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    assert seg.keys == 0


def test_a_failure_while_publishing_drops_that_index_and_the_next_handout_builds_it_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtierd.index import published

    ns, pubs = _ns(), Publishers(boot_epoch=1)
    keys = [_key(i, b"fail") for i in range(100)]
    for key in keys:
        ns.ready[key] = object()
    old = _reader(pubs, ns)
    for key in keys:
        del ns.ready[key]

    def broken(self: object, keys: list[bytes]) -> None:
        raise MemoryError("simulated")

    monkeypatch.setattr(published.Segment, "remove_many", broken)
    new = _reader(pubs, ns)  # the handout's flush fails: that index goes, a new one is built
    monkeypatch.undo()
    assert old.state(time.monotonic()) == "retired"
    assert new.generation == 1 and new.state(time.monotonic()) == "ok"  # (a new Publisher)
    assert new.hits(b"".join(keys), len(keys)) == 0  # built from ns.ready as it is now


def test_a_big_namespace_is_built_off_the_loop_and_changes_made_meanwhile_are_not_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """background_from = 1,000: the first build and a rebuild run on a thread while the loop
    keeps changing the namespace; the installed segment answers exactly as the dict does
    (no key lost, none left twice: removing it once leaves no stale hit)."""
    import asyncio
    import threading

    from kvtierd.index import published

    gate = threading.Event()
    fill = published.Segment.fill

    def slow_fill(self: published.Segment, keys: list[bytes], count: int) -> None:
        assert threading.current_thread() is not threading.main_thread()
        gate.wait(10)
        fill(self, keys, count)

    monkeypatch.setattr(published.Segment, "fill", slow_fill)
    installed = published.Publisher._built
    built: list[asyncio.Event] = []

    def built_and_tell(
        self: published.Publisher, seg: published.Segment, error: BaseException | None
    ) -> None:
        installed(self, seg, error)
        built[0].set()

    monkeypatch.setattr(published.Publisher, "_built", built_and_tell)

    async def until(done: Callable[[], bool]) -> None:
        """Wait for installs on the loop until ``done()`` (checked on the loop: no race)."""
        while not done():
            built[0].clear()
            await asyncio.wait_for(built[0].wait(), 10)

    async def run() -> None:
        built.append(asyncio.Event())
        ns, pubs = _ns(), Publishers(boot_epoch=1, background_from=1000)
        keys = [_key(i, b"bg") for i in range(5000)]
        for key in keys[:2000]:
            ns.ready[key] = object()
        with pytest.raises(OSError, match="being built"):
            pubs.handout(ns)  # the first build runs on its thread: refused, ask again
        del ns.ready[keys[0]]  # changes while it builds: replayed onto the new segment
        ns.ready[keys[0]] = object()  # (removed and added back: must be there once)
        del ns.ready[keys[1]]
        ns.ready[keys[2000]] = object()
        pubs.flush()
        pubs.tick()  # a building publisher is kept
        gate.set()
        await until(lambda: ns.ready.publisher is not None and ns.ready.publisher.segment is not None)
        reader = _reader(pubs, ns)
        assert reader.generation == 1
        for k in keys[:2001]:
            assert reader.hits(k, 1) == (k in ns.ready)
        del ns.ready[keys[0]]
        pubs.flush()
        assert reader.hits(keys[0], 1) == 0  # only one copy of it was there
        # a rebuild (past half full) also runs on its thread; the old segment answers meanwhile
        gate.clear()
        for key in keys[2001:]:
            ns.ready[key] = object()
        pubs.flush()
        pub = ns.ready.publisher
        assert pub is not None and pub.building is not None
        assert reader.state(time.monotonic()) == "ok"
        for key in keys[3000:3100]:
            del ns.ready[key]
        pubs.flush()
        gate.set()
        await until(lambda: pub.building is None)
        assert reader.state(time.monotonic()) == "retired"
        new = _reader(pubs, ns)
        assert new.generation == 2
        assert sum(new.hits(k, 1) for k in keys) == len(ns.ready) == 4898
        pubs.close()

    asyncio.run(run())

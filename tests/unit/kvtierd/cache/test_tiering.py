"""Chain scenarios: a TieredCache of 4 KiB blocks over a real NVMe tier in a temp directory.

The host tier holds ``host`` blocks (one 4 KiB slot per slab, so every eviction is visible); the
NVMe tier holds ``nvme`` slots of 8 KiB (header region + payload, one slot per slab) in one block
file. Every byte goes through FaultyFileSystem / FaultyDevice, so a scenario can flip bytes on
disk, tear writes, fail syncs, or hold the disk at a gate (a slow disk without a sleep in the test).
The scenarios drive the cache API the way the service does (ensure_room, prepare/complete_store,
prepare_load, lookup) on one asyncio loop.

Keys are small integers (``keys(1, 2)``); a block's bytes follow from its key (``payload(1)``), so
every read is checked byte for byte. ``rig.lookup(...)`` answers ``(hits, tiers, durable)`` with
one letter per hit: tier ``h`` (host) / ``n`` (NVMe only), durable ``d`` / ``-``. Expected state
is in comments: ``host [1 2 3]`` (victim order), ``nvme [1 2]`` (NVMe LRU order).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tests_helpers import feed

from kvtier_contract import wire
from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace
from kvtier_contract.wire import Op, Status
from kvtierd.cache import LoadJob, TieredCache, TierLink
from kvtierd.cache.lookup import PREFETCH, LookupOptions
from kvtierd.cache.read_figures import ReadFigures
from kvtierd.domain import StoreStatus, TierId, Transport
from kvtierd.index import Entry, NamespaceState
from kvtierd.policies import PolicyName, WritePolicyName, make_policy, make_write_policy
from kvtierd.sessions import Session, SessionTable
from kvtierd.testing.faults import FaultyDevice, FaultyFileSystem
from kvtierd.tiers import Arena, HostTier
from kvtierd.tiers.nvme.device import Device, DiskError, DiskFull, DiskIOError, FileSystem, SyncFailed
from kvtierd.tiers.nvme.format import data_file_name, encode_header, new_header, parse_data_file_name
from kvtierd.tiers.nvme.journal import parse_journal_name
from kvtierd.tiers.nvme.tier import NvmeConfig, NvmeTier
from kvtierd.transports.tcp import DataChannelProtocol

KIB = 1024
A = 4 * KIB  # io_align: the header region of a slot
BLOCK = 4 * KIB
NVME_SLOT = A + BLOCK
SHM = Transport.SHM
RESERVED, PRESENT = StoreStatus.RESERVED, StoreStatus.ALREADY_PRESENT
DRAIN_S = 5.0


T = TypeVar("T")


def _now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (a lookup without a shared tier awaits nothing)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the coroutine suspended")


def pin_prefix(
    cache: TieredCache, session: Session, ns: NamespaceState, ks: list[bytes], *, promote: bool = True
) -> tuple[LoadJob | None, bytes]:
    """A lookup holding its hit prefix: (the hold, each hit's tier)."""
    found = _now(cache.lookup(ns, ks, LookupOptions(pin=session, promote=promote)))
    return found.job, found.tiers


def prefetch(cache: TieredCache, ns: NamespaceState, ks: list[bytes]) -> tuple[int, int]:
    """A prefetch: (the READY prefix, promotions started)."""
    found = _now(cache.lookup(ns, ks, PREFETCH))
    return found.hit, found.promoting


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


def payload(i: int) -> bytes:
    """The bytes of block ``i``: distinct per key, never all zero."""
    return hashlib.shake_256(b"block %d" % i).digest(BLOCK)


def spec() -> Namespace:
    """4 KiB blocks: 4 tokens x 1 layer x 1 head x 256 dim x float16 x (k, v)."""
    return Namespace(
        model_id="m",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=256,
    )


def scenario(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test on a fresh event loop (the bridge spawns its flushes on it)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 60))

    return run


class Rig:
    """One cache with an NVMe tier in its chain, wired as the daemon's composition root does."""

    def __init__(
        self,
        directory: Path,
        *,
        host: int = 8,
        nvme: int = 16,
        write_policy: WritePolicyName = "write-through",
        watermark: float = 0.8,
        hits: int = 2,
        policy: PolicyName = "lru",
        fs_factory: Callable[..., FileSystem] = FaultyFileSystem,
    ) -> None:
        self.arena = Arena(host * BLOCK, prefault=False)
        self.cache = TieredCache(
            HostTier(self.arena, slab_bytes=BLOCK, slot_align_bytes=A),
            make_policy(policy, ghost_capacity=16),
            max_namespaces=4,
            policy_name=policy,
        )
        self.nvme = NvmeTier(
            NvmeConfig(
                directory=str(directory),
                capacity_bytes=nvme * NVME_SLOT,
                io_align=A,
                file_bytes=nvme * NVME_SLOT,
                slab_bytes=NVME_SLOT,
                io_threads=2,
            ),
            fs_factory=fs_factory,
        )
        self.link: TierLink = self.cache.add_storage_tier(
            self.nvme, make_write_policy(write_policy, flush_watermark=watermark, write_after_hits=hits)
        )
        self.restored = self.link.recovery.restored
        self.ns = self.cache.register_namespace(spec())
        self.session = Session(1, "s1", ttl_s=10.0, deadline=1e12, transport=SHM)
        self._closed = False

    # -- the disk ---------------------------------------------------------------------------------

    @property
    def fs(self) -> FaultyFileSystem:
        assert isinstance(self.nvme.fs, FaultyFileSystem)
        return self.nvme.fs

    @property
    def disk(self) -> FaultyDevice:
        """The block file as the tier has it open now (a probe reopens it)."""
        return self.fs.devices[data_file_name(0)]

    @property
    def journal(self) -> FaultyDevice:
        """The journal file being appended to."""
        name = max((n for n in self.fs.devices if parse_journal_name(n) is not None), key=parse_journal_name)
        return self.fs.devices[name]

    def entry(self, i: int) -> Entry:
        return self.ns.entries[keys(i)[0]]

    def where(self, i: int) -> int:
        """Offset of block ``i``'s slot in the block file."""
        loc = self.entry(i).copy_in(0)
        assert loc is not None, f"block {i} has no NVMe copy"
        return int(loc.offset) % self.nvme.cfg.file_bytes

    # -- the cache API, as the service drives it --------------------------------------------------

    async def store(self, *ids: int) -> bytes:
        """Put blocks ``ids`` (backpressure first, as PrepareStore does); per-key status."""
        ks = keys(*ids)
        job, status, _ = await self.cache.prepare_store(self.session, self.ns, ks, SHM)
        if job is not None:
            for i, e in job.items.items():
                self.cache.host.arena.slot(e.offset, BLOCK)[:] = payload(ids[i])
            self.cache.complete_store(self.session, job.id, ok=True)
        return status

    async def read(self, *ids: int) -> list[bytes | None]:
        """Load blocks ``ids`` as a client does: one round, then again for the deferred keys
        (present on NVMe, not placed in the host tier that round) while rounds make progress.
        Their bytes, None for a miss."""
        out: list[bytes | None] = [None] * len(ids)
        todo = list(range(len(ids)))
        while todo:
            got, deferred = await self.read_round(*(ids[i] for i in todo))
            for j, data in enumerate(got):
                if data is not None:
                    out[todo[j]] = data
            if not any(d is not None for d in got):
                break  # no progress: the rest are misses
            todo = [todo[j] for j in sorted(deferred)]
        return out

    async def read_round(self, *ids: int) -> tuple[list[bytes | None], dict[int, int]]:
        """One prepare/complete load of ``ids``: their bytes (None if not served this round) and
        the deferred ones (index -> tier)."""
        out: list[bytes | None] = [None] * len(ids)
        job, deferred = await self.cache.prepare_load(self.session, self.ns, keys(*ids), SHM)
        if job is not None:
            for i, e in job.items.items():
                out[i] = bytes(self.cache.host.arena.slot(e.offset, BLOCK))
            self.cache.complete_load(self.session, job.id)
        return out, deferred

    def lookup(self, *ids: int) -> tuple[int, str, str]:
        found = _now(self.cache.lookup(self.ns, keys(*ids)))
        hit, tiers, durable = found.hit, found.tiers, found.durable
        return (
            hit,
            "".join("h" if t == TierId.HOST else "n" for t in tiers),
            "".join("d" if d else "-" for d in durable),
        )

    async def one_on_nvme_only(self) -> None:
        """Block 1 on NVMe only (a 4-block host tier): stored, flushed, then pushed out of the
        host tier by 2..5."""
        await self.store(1)
        await self.settle()
        await self.store(2, 3, 4, 5)
        await self.settle()

    async def settle(self) -> None:
        """Wait until every flush and promotion the chain started has ended."""
        await self.link.settle()

    async def drain(self) -> int:
        n = await self.link.flush_all(time.monotonic() + DRAIN_S)
        await self.settle()
        return n

    # -- lifecycle --------------------------------------------------------------------------------

    def stop(self) -> None:
        """A clean stop: checkpoint, then close (as drain_and_stop does after flush_all)."""
        self.link.recovery.checkpoint()
        self.close()

    def crash(self) -> None:
        """Stop without a checkpoint: the next start replays the journal."""
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.nvme.close()
            self.arena.close()


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """Rigs over one directory: a second rig is the same disk after a restart."""
    rigs: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        rigs.append(Rig(tmp_path / "nvme", **kwargs))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


class Gate:
    """Holds every ``op`` ("read" / "write") on the block file until ``open()``: a disk as slow
    as the scenario needs, ordered by events. ``entered`` is set when an I/O thread waits at it."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.entered = threading.Event()
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), f"no {self.op} reached the disk"

    def filesystem(self, directory: str, **kwargs: Any) -> FileSystem:
        gate = self

        class GatedDevice(FaultyDevice):
            def _enter(self, op: str, offset: int | None) -> None:
                if op == gate.op:
                    gate.entered.set()
                    assert gate._open.wait(10), "the gate was never opened"
                super()._enter(op, offset)

        class GatedFileSystem(FaultyFileSystem):
            def open_file(self, name: str, **kw: Any) -> Device:
                dev = super().open_file(name, **kw)
                if parse_data_file_name(name) is not None:
                    assert isinstance(dev, FaultyDevice)
                    return GatedDevice(dev)
                return dev

        return GatedFileSystem(directory, **kwargs)


# -- write policies -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc", "prefix"])
@scenario
async def test_write_back_loses_no_block_while_nvme_keeps_up(
    make_rig: Callable[..., Rig], policy: PolicyName
) -> None:
    rig = make_rig(host=8, nvme=32, write_policy="write-back", watermark=0.5, policy=policy)
    for i in range(1, 25):  # a stream three times the host tier, one block at a time
        assert await rig.store(i) == bytes([RESERVED])
    await rig.settle()
    hits, tiers, _ = rig.lookup(*range(1, 25))
    assert hits == 24  # nothing was dropped: host eviction took only blocks NVMe held
    assert tiers.count("n") == 16 and rig.ns.counters.evictions == 16
    assert rig.ns.counters.demotions >= 16
    for i in range(1, 25):
        assert await rig.read(i) == [payload(i)]
    # Drain: the dirty rest of the host tier is flushed, then a clean stop keeps all of it.
    await rig.drain()
    assert rig.lookup(*range(1, 25))[2] == "d" * 24
    rig.stop()
    again = make_rig(host=8, nvme=32, write_policy="write-back", policy=policy)
    assert again.nvme.figures.recovery_mode == "warm" and again.restored == 24
    assert again.lookup(*range(1, 25)) == (24, "n" * 24, "d" * 24)
    for i in (1, 12, 24):
        assert await again.read(i) == [payload(i)]


@scenario
async def test_write_through_makes_every_stored_block_durable(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    await rig.store(1, 2, 3)
    await rig.settle()
    assert rig.lookup(1, 2, 3) == (3, "hhh", "ddd")  # host [1 2 3], nvme [1 2 3]
    f = rig.nvme.figures
    assert (f.writes, f.bytes_written) == (3, 3 * BLOCK)
    assert (rig.ns.counters.demotions, rig.ns.counters.nvme_bytes_written) == (3, 3 * BLOCK)
    assert rig.ns.counters.nvme_resident_blocks == 3


@scenario
async def test_selective_flushes_a_block_at_its_nth_hit(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(write_policy="selective", hits=3)
    await rig.store(1, 2)
    for _ in range(2):
        rig.lookup(1, 2)  # hits: 1 -> 2, 2 -> 2
    await rig.settle()
    assert rig.nvme.figures.writes == 0
    assert rig.lookup(1) == (1, "h", "-")  # 1's third hit: its flush starts
    await rig.settle()
    assert rig.nvme.figures.writes == 1
    assert (rig.entry(1).copies is not None, rig.entry(2).copies is None) == (True, True)
    for _ in range(3):
        rig.lookup(1)  # later hits of 1 write nothing
    await rig.settle()
    assert rig.nvme.figures.writes == 1
    assert rig.lookup(1, 2) == (2, "hh", "d-")  # 2's third hit
    await rig.settle()
    assert rig.lookup(1, 2) == (2, "hh", "dd")
    assert rig.nvme.figures.writes == 2


@scenario
async def test_selective_flushes_a_block_whose_nth_hit_came_while_degraded(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(write_policy="selective", hits=2)
    await rig.store(1, 2)
    rig.disk.fail_writes(1)
    rig.lookup(1)
    rig.lookup(1)  # 1's second hit: its flush fails, the tier stops admitting
    await rig.settle()
    assert not rig.nvme.admitting
    rig.lookup(2)
    rig.lookup(2)  # 2's second hit, while nothing is admitted
    assert rig.nvme.probe()
    assert rig.lookup(1, 2) == (2, "hh", "--")  # the next hit after the tier is back ...
    await rig.settle()
    assert rig.lookup(1, 2) == (2, "hh", "dd")  # ... flushes both


@scenario
async def test_a_block_already_on_nvme_is_never_written_again(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    await rig.store(1)
    await rig.settle()
    written = rig.nvme.figures.bytes_written
    assert written == BLOCK
    assert await rig.store(1) == bytes([PRESENT])
    rig.link.schedule_flush(rig.entry(1))
    assert await rig.drain() == 0
    # Out of the host tier and promoted back: host and NVMe copies again, still one write.
    await rig.store(2, 3, 4, 5)
    await rig.settle()
    assert rig.lookup(1) == (1, "n", "d")
    assert await rig.read(1) == [payload(1)]
    assert rig.lookup(1) == (1, "h", "d")
    assert await rig.drain() == 0
    assert rig.nvme.figures.bytes_written == written + 4 * BLOCK  # only 2..5
    assert rig.nvme.figures.writes == 5


# -- NVMe eviction ------------------------------------------------------------------------------


@scenario
async def test_full_nvme_drops_lru_copies_and_blocks_left_with_no_copy(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4, nvme=4)
    await rig.store(1, 2, 3, 4)
    await rig.settle()  # host [1 2 3 4], nvme [1 2 3 4]: both full
    await rig.store(5, 6, 7, 8)
    await rig.settle()
    # Host eviction took 1..4 (clean); their flushes then needed NVMe slots: LRU copies 1..4 went,
    # and with no copy left anywhere the entries left the index.
    assert rig.lookup(1) == (0, "", "") and rig.lookup(4) == (0, "", "")
    assert not any(k in rig.ns.entries for k in keys(1, 2, 3, 4))
    assert rig.lookup(5, 6, 7, 8) == (4, "hhhh", "dddd")
    c = rig.ns.counters
    assert (c.nvme_evictions, c.evictions, c.nvme_resident_blocks) == (4, 4, 4)
    assert await rig.read(1, 5) == [None, payload(5)]


@scenario
async def test_full_nvme_keeps_an_entry_whose_host_copy_remains(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=8, nvme=4)
    await rig.store(1, 2, 3, 4)
    await rig.settle()
    rig.lookup(1, 2, 3, 4)  # host [1 2 3 4], nvme [1 2 3 4]
    rig.lookup(1)  # nvme [2 3 4 1]
    await rig.store(5, 6)
    await rig.settle()  # nvme [4 1 5 6]: 2 and 3 lost their NVMe copies, not their host ones
    assert rig.lookup(2, 3) == (2, "hh", "--")
    assert rig.lookup(1, 4, 5, 6) == (4, "hhhh", "dddd")
    assert rig.ns.counters.nvme_evictions == 2
    assert await rig.read(2, 3) == [payload(2), payload(3)]


# -- promotion ----------------------------------------------------------------------------------


@scenario
async def test_prefetch_promotes_ahead_of_the_load(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    await rig.store(1, 2, 3)
    await rig.settle()
    await rig.store(4, 5, 6, 7)
    await rig.settle()  # host [4 5 6 7]; 1..3 on NVMe only
    assert rig.lookup(1, 2, 3) == (3, "nnn", "ddd")
    assert prefetch(rig.cache, rig.ns, keys(9, 1)) == (0, 0)  # only the ready prefix
    assert prefetch(rig.cache, rig.ns, keys(1, 2, 3)) == (3, 3)
    await rig.settle()
    assert rig.lookup(1, 2, 3) == (3, "hhh", "ddd")
    reads = rig.nvme.figures.reads
    assert (reads, rig.ns.counters.promotions) == (3, 3)
    assert await rig.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    assert rig.nvme.figures.reads == reads  # the load read nothing from disk


class Ticks:
    """A clock that moves one second at each look: the n-th time read is n."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


@scenario
async def test_promotions_feed_the_tiers_read_figures(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    rig.link.promotion.read_figures = ReadFigures(weight=1.0, clock=Ticks())  # the latest batch alone
    await rig.store(1, 2, 3)
    await rig.settle()
    await rig.store(4, 5, 6, 7)
    await rig.settle()  # host [4 5 6 7]; 1..3 on NVMe only
    assert await rig.read(4, 5) == [payload(4), payload(5)]
    assert rig.cache.read_figures() == {}  # host hits read nothing below
    assert await rig.read(1, 2) == [payload(1), payload(2)]
    # a load: asked (t=1), read submitted (t=2), bytes in the host tier (t=3): one second
    # waiting (latency), one reading two blocks (bandwidth)
    fig = rig.cache.read_figures()[TierId.NVME]
    assert (fig.latency_s, fig.bytes_per_s, fig.reads) == (1.0, 2 * BLOCK, 1)
    # a prefetch (a pinned lookup's promotion too): asked when it is started, not when it runs
    assert prefetch(rig.cache, rig.ns, keys(3)) == (1, 1)
    await rig.settle()
    fig = rig.cache.read_figures()[TierId.NVME]
    assert (fig.latency_s, fig.bytes_per_s, fig.reads) == (1.0, BLOCK, 2)
    # a failed read is no figure of the tier's speed
    await rig.store(8, 9, 10, 11)
    await rig.settle()  # 1..3 pushed out again
    rig.disk.fail_reads(1, errno.EIO)
    assert await rig.read(1) == [None]
    assert rig.link.promotion.read_figures.reads == 2


@scenario
async def test_a_load_larger_than_the_host_tier_streams_in_rounds(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4, nvme=32)
    for first in (1, 5, 9):
        await rig.store(*range(first, min(first + 4, 11)))
        await rig.settle()  # write-through: nvme [1..10]; host [7 8 9 10] at the end
    assert rig.lookup(*range(1, 11)) == (10, "n" * 6 + "h" * 4, "d" * 10)
    # One round places what the host tier can hold now; the rest is deferred, not missed.
    got, deferred = await rig.read_round(*range(1, 11))
    served = [i for i, data in enumerate(got) if data is not None]
    assert len(served) == 4 and all(got[i] == payload(i + 1) for i in served)
    assert set(deferred) == set(range(10)) - set(served)
    assert set(deferred.values()) == {TierId.NVME}
    # Round after round, every block the lookup reported is served, byte for byte.
    assert await rig.read(*range(1, 11)) == [payload(i) for i in range(1, 11)]
    assert rig.lookup(*range(1, 11))[0] == 10  # nothing was lost on the way
    assert rig.ns.counters.checksum_failures == 0


@scenario
async def test_a_pinned_lookup_answers_real_tiers_at_once_and_promotes_behind(
    make_rig: Callable[..., Rig],
) -> None:
    gate = Gate("read")
    rig = make_rig(host=4, fs_factory=gate.filesystem)
    await rig.store(1, 2)
    await rig.settle()
    await rig.store(3, 4, 5, 6)
    await rig.settle()  # host [3 4 5 6]; 1, 2 on NVMe only
    # Answered without waiting on the disk (every read is held at the gate meanwhile).
    job, tiers = pin_prefix(rig.cache, rig.session, rig.ns, keys(1, 2, 3))
    assert job is not None and list(tiers) == [TierId.NVME, TierId.NVME, TierId.HOST]
    assert rig.ns.counters.blocks_hit_nvme == 2 and rig.ns.counters.blocks_hit_host == 1
    assert all(e.holds == 1 and e.pins == 0 for e in job.items.values())
    await gate.wait_entered()  # the promotion runs in the background
    gate.open()
    await rig.settle()
    assert rig.lookup(1, 2, 3) == (3, "hhh", "ddd")
    assert await rig.read(1, 2) == [payload(1), payload(2)]
    assert rig.cache.complete_load(rig.session, job.id) == 3
    assert rig.cache.pinned_blocks == 0


async def one_and_two_below(make_rig: Callable[..., Rig]) -> Rig:
    """A 4-block host tier holding [3 4 5 6], with 1 and 2 on NVMe only."""
    rig = make_rig(host=4)
    await rig.store(1, 2)
    await rig.settle()
    await rig.store(3, 4, 5, 6)
    await rig.settle()
    return rig


@scenario
async def test_a_hold_only_pin_starts_no_promotion_and_the_load_promotes(
    make_rig: Callable[..., Rig],
) -> None:
    """``Lookup(pin, hold_only)`` (issue 30): a client that may recompute NVMe hits holds them
    without making the daemon read them; the load that does take them promotes them then."""
    rig = await one_and_two_below(make_rig)
    reads = rig.disk.reads
    job, tiers = pin_prefix(rig.cache, rig.session, rig.ns, keys(1, 2, 3), promote=False)
    assert job is not None and list(tiers) == [TierId.NVME, TierId.NVME, TierId.HOST]
    await rig.settle()
    assert rig.lookup(1, 2, 3) == (3, "nnh", "ddd")  # nothing was promoted
    assert rig.disk.reads == reads  # nor read
    assert rig.cache.read_figures() == {}
    assert await rig.read(1, 2) == [payload(1), payload(2)]  # the load promotes them
    assert rig.cache.complete_load(rig.session, job.id) == 3
    assert rig.cache.pinned_blocks == 0


@scenario
async def test_a_host_only_load_pins_what_the_host_tier_holds_and_reads_nothing(
    make_rig: Callable[..., Rig],
) -> None:
    """``PrepareLoad(host_only)`` (issue 30): a sync load planned from host hits must not wait
    on a disk; a block that left the host tier since the lookup is deferred at once."""
    rig = await one_and_two_below(make_rig)
    reads = rig.disk.reads
    job, deferred = await rig.cache.prepare_load(rig.session, rig.ns, keys(1, 2, 3), SHM, host_only=True)
    assert job is not None and sorted(job.items) == [2]  # key 3 only
    assert deferred == {0: TierId.NVME, 1: TierId.NVME}
    assert rig.disk.reads == reads and rig.lookup(1, 2, 3) == (3, "nnh", "ddd")
    rig.cache.complete_load(rig.session, job.id)
    assert rig.cache.pinned_blocks == 0
    assert await rig.read(1, 2) == [payload(1), payload(2)]  # without it: promoted, loaded


@scenario
async def test_a_slow_promotion_blocks_neither_the_loop_nor_a_second_load(
    make_rig: Callable[..., Rig],
) -> None:
    gate = Gate("read")
    rig = make_rig(host=4, fs_factory=gate.filesystem)
    await rig.one_on_nvme_only()  # host [2 3 4 5]; 1 on NVMe only
    first = asyncio.create_task(rig.read(1))
    await gate.wait_entered()  # the promotion of 1 is on the disk (it evicted 2 for its slot)
    second = asyncio.create_task(rig.read(1))
    # The loop answers meanwhile: lookups and loads of host blocks.
    assert rig.lookup(4, 5) == (2, "hh", "dd")
    assert await rig.read(5) == [payload(5)]
    assert not first.done() and not second.done()
    gate.open()
    assert await first == [payload(1)] and await second == [payload(1)]
    assert (rig.nvme.figures.reads, rig.ns.counters.promotions) == (1, 1)  # read once


@scenario
async def test_flushes_and_promotions_complete_on_a_slow_disk(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=2)
    rig.disk.latency_s = 0.05  # every read, write and sync of the block file
    await rig.store(1, 2)
    await rig.settle()
    await rig.store(3, 4)
    await rig.settle()  # host [3 4]; 1, 2 on NVMe only
    assert rig.lookup(1, 2, 3, 4) == (4, "nnhh", "dddd")
    assert await rig.read(1, 2) == [payload(1), payload(2)]


@scenario
async def test_write_back_backpressure_gives_up_at_its_deadline(make_rig: Callable[..., Rig]) -> None:
    gate = Gate("write")
    rig = make_rig(host=4, write_policy="write-back", watermark=1.0, fs_factory=gate.filesystem)
    await rig.store(1, 2, 3, 4)  # host [1 2 3 4], all dirty: nothing over the watermark
    t0 = time.monotonic()
    assert await rig.store(5) == bytes([RESERVED])
    waited = time.monotonic() - t0
    assert gate.entered.is_set()  # the store flushed 1 first, and waited for it ...
    assert 0.4 < waited < 2.0  # ... until the backpressure deadline (0.5 s), not for the disk
    # The block being flushed stayed; the store took the slot of the coldest other block (2),
    # lost as in a host-only cache: the disk did not keep up.
    assert rig.lookup(1) == (1, "h", "-") and rig.lookup(2) == (0, "", "")
    gate.open()
    await rig.settle()
    assert rig.lookup(1, 3, 4, 5) == (4, "hhhh", "d---")
    assert await rig.read(1) == [payload(1)]


# -- corruption ---------------------------------------------------------------------------------


def _flip_payload(rig: Rig) -> None:
    rig.disk.flip_byte(rig.where(1) + A + 100)


def _flip_header(rig: Rig) -> None:
    rig.disk.flip_byte(rig.where(1) + 40)  # inside the namespace digest: header checksum fails


def _other_namespace(rig: Rig) -> None:  # a valid header, of another namespace
    h = new_header(b"\x99" * 32, keys(1)[0], payload(1), sequence=rig.entry(1).copy_in(0).seq)
    rig.disk.poke(rig.where(1), encode_header(h))


def _other_key(rig: Rig) -> None:  # a valid header, of another key
    h = new_header(rig.ns.spec.digest, keys(77)[0], payload(1), sequence=rig.entry(1).copy_in(0).seq)
    rig.disk.poke(rig.where(1), encode_header(h))


def _torn_header(rig: Rig) -> None:  # the write reports success with 64 header bytes on disk
    rig.disk.tear_next_write(64, succeed=True)


def _torn_payload(rig: Rig) -> None:  # ... with the header and half the payload on disk
    rig.disk.tear_next_write(A + BLOCK // 2, succeed=True)


DAMAGE: dict[str, tuple[str, Callable[[Rig], None]]] = {
    "flipped payload byte": ("after", _flip_payload),
    "flipped header byte": ("after", _flip_header),
    "wrong namespace in header": ("after", _other_namespace),
    "wrong key in header": ("after", _other_key),
    "torn header": ("before", _torn_header),
    "torn payload": ("before", _torn_payload),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@scenario
async def test_a_damaged_slot_is_a_miss_and_is_quarantined(make_rig: Callable[..., Rig], damage: str) -> None:
    when, damage_slot = DAMAGE[damage]
    rig = make_rig(host=4)
    if when == "before":
        damage_slot(rig)  # the next write of the block file is block 1's
    await rig.store(1)
    await rig.settle()
    await rig.store(2)
    await rig.settle()  # nvme [1 2]
    if when == "after":
        damage_slot(rig)
    bad = rig.where(1)
    await rig.store(3, 4, 5, 6)
    await rig.settle()  # host [3 4 5 6]; 1 and 2 on NVMe only
    assert rig.lookup(1, 2) == (2, "nn", "dd")  # the tier believes its write
    assert await rig.read(1, 2) == [None, payload(2)]  # never the damaged bytes
    assert rig.lookup(1) == (0, "", "")  # no copy left: the block left the index
    f = rig.nvme.figures
    assert (f.checksum_failures, f.quarantined_slots, f.reads) == (1, 1, 1)
    assert rig.ns.counters.checksum_failures == 1
    assert rig.ns.counters.nvme_resident_blocks == 5  # 2..6
    # Stored again, block 1 is written to another slot: a quarantined slot is never reused.
    assert await rig.store(1) == bytes([RESERVED])
    await rig.settle()
    assert rig.where(1) != bad
    assert rig.nvme.space.used_bytes == 7 * NVME_SLOT  # 1..6 and the quarantined slot
    await rig.store(7, 8, 9, 10)
    await rig.settle()
    assert await rig.read(1) == [payload(1)]


# -- the directory -----------------------------------------------------------------------------


def _truncated(d: Path, outside: Path) -> None:
    os.truncate(d / data_file_name(0), 2 * NVME_SLOT)  # block 3's slot is gone


def _zero_length(d: Path, outside: Path) -> None:
    os.truncate(d / data_file_name(0), 0)


def _symlinked(d: Path, outside: Path) -> None:  # the block file is a symlink to a real one
    os.rename(d / data_file_name(0), outside / "blocks")
    (d / data_file_name(0)).symlink_to(outside / "blocks")


def _foreign(d: Path, outside: Path) -> None:  # files the tier does not own
    (d / "notes.txt").write_text("not a block file")
    (d / "blocks-00001.kvt.bak").symlink_to(outside / "target")


DIRECTORY: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "truncated block file": (_truncated, "DiskIOError"),
    "zero-length block file": (_zero_length, "DiskIOError"),
    "symlink as block file": (_symlinked, "UnsafeFile"),
    "foreign file and symlink": (_foreign, ""),
}


def _tree(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("damage", list(DIRECTORY))
@scenario
async def test_a_damaged_directory_never_stops_the_host_tier(
    make_rig: Callable[..., Rig], tmp_path: Path, damage: str
) -> None:
    damage_dir, error = DIRECTORY[damage]
    rig = make_rig(host=4)
    await rig.store(1, 2, 3)
    await rig.settle()  # slots 0, 1, 2 of the block file
    rig.stop()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_bytes(b"someone else's file")
    damage_dir(tmp_path / "nvme", outside)
    before = _tree(outside)
    again = make_rig(host=4)
    if not error:  # ignored: the tier is whole
        assert again.nvme.admitting and again.lookup(1, 2, 3) == (3, "nnn", "ddd")
        assert await again.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    else:  # never written past its end, never followed: degraded, the host tier serves
        assert not again.nvme.admitting and again.nvme.degraded_reason.startswith(error)
        assert again.lookup(1) == (0, "", "") and again.nvme.figures.recovery_quarantined == 3
        assert await again.store(4) == bytes([RESERVED])
        await again.settle()
        assert again.lookup(4) == (1, "h", "-") and await again.read(4) == [payload(4)]
        assert not again.nvme.probe()
    assert _tree(outside) == before


# -- disk faults --------------------------------------------------------------------------------


FAULTS: dict[str, tuple[Callable[[FaultyDevice], None], type[DiskError]]] = {
    "EIO on fdatasync": (lambda d: d.fail_syncs(1, errno.EIO), SyncFailed),
    "EIO on write": (lambda d: d.fail_writes(1, errno.EIO), DiskIOError),
    "ENOSPC on write": (lambda d: d.fail_writes(1, errno.ENOSPC), DiskFull),
}


@pytest.mark.parametrize("fault", list(FAULTS))
@scenario
async def test_a_disk_fault_stops_admission_until_a_probe_succeeds(
    make_rig: Callable[..., Rig], fault: str
) -> None:
    arm, error = FAULTS[fault]
    rig = make_rig()
    await rig.store(1)
    await rig.settle()  # nvme [1]
    arm(rig.disk)
    await rig.store(2)
    await rig.settle()  # the flush of 2 fails
    assert not rig.nvme.admitting
    assert rig.nvme.degraded_reason.startswith(error.__name__)
    assert rig.lookup(1, 2) == (2, "hh", "d-")  # 2 was never reported durable
    assert rig.entry(2).copy_in(0) is None and rig.ns.counters.demotions == 1
    assert rig.nvme.figures.write_errors == 1
    assert rig.nvme.space.used_bytes == NVME_SLOT  # the failed write's slot is free again
    # The host tier keeps serving, and nothing more is sent to the degraded tier.
    writes = rig.disk.writes
    assert await rig.store(3) == bytes([RESERVED])
    await rig.settle()
    assert await rig.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    assert rig.disk.writes == writes and rig.lookup(3) == (1, "h", "-")
    # The fault is gone: a probe resumes admission and the dirty blocks are flushed.
    assert rig.nvme.probe()
    assert rig.nvme.admitting and rig.nvme.degraded_reason == ""
    assert await rig.drain() == 2
    assert rig.lookup(1, 2, 3) == (3, "hhh", "ddd")
    rig.crash()
    again = make_rig()
    assert again.nvme.figures.recovery_quarantined == 0
    assert again.lookup(1, 2, 3) == (3, "nnn", "ddd")
    assert await again.read(1, 2, 3) == [payload(1), payload(2), payload(3)]


@scenario
async def test_no_room_for_the_block_file_serves_from_host_until_a_probe_succeeds(
    make_rig: Callable[..., Rig],
) -> None:
    def no_room_once(directory: str, **kwargs: Any) -> FileSystem:
        fs = FaultyFileSystem(directory, **kwargs)
        fs.fail_allocate(errno.ENOSPC)  # the block file's preallocation, at open
        return fs

    rig = make_rig(fs_factory=no_room_once)
    assert not rig.nvme.admitting and rig.nvme.degraded_reason.startswith("DiskFull")
    assert await rig.store(1, 2) == bytes([RESERVED, RESERVED])
    await rig.settle()
    assert rig.lookup(1, 2) == (2, "hh", "--")
    assert await rig.read(1, 2) == [payload(1), payload(2)]
    assert rig.nvme.probe()  # the space is back: the block file is created now
    assert await rig.drain() == 2
    assert rig.lookup(1, 2) == (2, "hh", "dd")


@scenario
async def test_a_namespace_record_lost_to_a_failed_journal_sync_is_journaled_again(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    rig.journal.tear_next_write(0, succeed=True)  # the journal page never reaches the disk ...
    rig.journal.fail_syncs(1)  # ... and fdatasync says so
    await rig.store(1)
    await rig.settle()  # the first flush journals the namespace: that commit fails
    assert not rig.nvme.admitting and rig.lookup(1) == (1, "h", "-")
    assert rig.nvme.probe()  # continues in a new journal generation
    assert await rig.drain() == 1
    assert rig.lookup(1) == (1, "h", "d")
    rig.crash()
    again = make_rig()
    assert again.nvme.figures.recovery_quarantined == 0
    assert again.lookup(1) == (1, "n", "d")  # reported durable, so it must come back
    assert await again.read(1) == [payload(1)]


@scenario
async def test_a_read_error_is_a_miss_and_keeps_the_durable_copy(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    await rig.one_on_nvme_only()  # host [2 3 4 5]; 1 on NVMe only
    rig.disk.fail_reads(1, errno.EIO)  # a transient error: the copy itself is fine
    assert await rig.read(1) == [None]
    assert rig.lookup(1) == (1, "n", "d") and rig.nvme.figures.quarantined_slots == 0
    assert await rig.read(1) == [payload(1)]


@scenario
async def test_a_probe_reopening_the_block_file_spares_the_reads_in_progress(
    make_rig: Callable[..., Rig],
) -> None:
    gate = Gate("read")
    rig = make_rig(host=4, fs_factory=gate.filesystem)
    await rig.one_on_nvme_only()  # host [2 3 4 5]; 1 on NVMe only
    rig.disk.fail_syncs(1)
    await rig.store(6)
    await rig.settle()  # the flush of 6 fails at fdatasync: degraded, the file must be reopened
    assert not rig.nvme.admitting and rig.lookup(6) == (1, "h", "-")
    old = rig.nvme.files[0]
    first = asyncio.create_task(rig.read(1))
    await gate.wait_entered()  # the promotion of 1 is about to read the block file
    assert await asyncio.to_thread(rig.nvme.probe)  # reopens it: a new Device, the old closed
    assert rig.nvme.files[0] is not old
    gate.open()
    assert await first == [payload(1)]  # read on the new Device: no closed fd, no lost copy
    assert rig.lookup(1) == (1, "h", "d") and rig.ns.counters.checksum_failures == 0
    assert await rig.drain() == 1  # 6 is flushed now
    assert rig.lookup(1, 6) == (2, "hh", "dd")


# -- restart ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["clean", "crash"])
@scenario
async def test_blocks_on_nvme_come_back_after_a_restart(make_rig: Callable[..., Rig], stop: str) -> None:
    rig = make_rig(host=4)
    await rig.store(1, 2, 3)
    await rig.settle()
    rig.stop() if stop == "clean" else rig.crash()
    again = make_rig(host=4)
    f = again.nvme.figures
    assert (f.recovery_mode, f.recovered_blocks) == ("warm" if stop == "clean" else "replay", 3)
    assert again.lookup(1, 2, 3) == (3, "nnn", "ddd")
    assert await again.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    assert (again.ns.counters.promotions, again.ns.counters.blocks_hit_nvme) == (3, 3)


@scenario
async def test_recovery_after_a_crash_compacts_the_journal(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    await rig.store(1, 2, 3)
    await rig.settle()
    rig.crash()
    again = make_rig(host=4)
    assert again.nvme.figures.recovery_mode == "replay"
    # what the journal held is a checkpoint now: one (empty) journal left, not one per crash
    names = sorted(os.listdir(again.nvme.cfg.directory))
    assert "checkpoint.kvc" in names
    assert [n for n in names if n.startswith("journal-")] == [f"journal-{again.nvme._journal_gen:08d}.kvj"]
    again.crash()
    third = make_rig(host=4)
    assert (third.nvme.figures.recovery_mode, third.nvme.figures.recovered_blocks) == ("warm", 3)
    assert await third.read(1, 2, 3) == [payload(1), payload(2), payload(3)]


# -- pinned lookups, cancelled loads and the data channel ------------------------------------------


@scenario
async def test_every_hit_of_a_pinned_lookup_can_be_loaded(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4, nvme=32)
    for first in (1, 5):
        await rig.store(*range(first, first + 4))
        await rig.settle()  # nvme [1..8]; host [5 6 7 8]
    # A hold keeps blocks in the index, not in the host tier: the prefix is all eight, though
    # the host tier holds four, and the load of it streams through the host tier in rounds.
    job, tiers = pin_prefix(rig.cache, rig.session, rig.ns, keys(*range(1, 9)))
    assert job is not None and len(job.items) == 8
    assert list(tiers) == [TierId.NVME] * 4 + [TierId.HOST] * 4
    await rig.settle()
    assert await rig.read(*range(1, 9)) == [payload(i) for i in range(1, 9)]
    assert rig.cache.complete_load(rig.session, job.id) == 8
    assert rig.cache.pinned_blocks == 0 and all(rig.entry(i).holds == 0 for i in range(1, 9))


@scenario
async def test_a_held_block_keeps_its_last_copy(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=2, nvme=4)
    for pair in ((1, 2), (3, 4)):
        await rig.store(*pair)
        await rig.settle()  # write-through: nvme [1 2 3 4] (full); host [3 4]
    job, tiers = pin_prefix(rig.cache, rig.session, rig.ns, keys(1))
    assert job is not None and list(tiers) == [TierId.NVME]
    await rig.settle()  # 1's promotion took a host slot (evicting 3, which NVMe holds)
    for pair in ((5, 6), (7, 8)):
        await rig.store(*pair)
        await rig.settle()  # NVMe full: its LRU copies go, never the held block's
    assert rig.lookup(1)[0] == 1 and rig.entry(1).copies is not None
    assert await rig.read(1) == [payload(1)]
    rig.cache.complete_load(rig.session, job.id)


@scenario
async def test_a_cancelled_load_leaves_no_pin_and_no_endless_promotion(make_rig: Callable[..., Rig]) -> None:
    gate = Gate("read")
    rig = make_rig(host=4, fs_factory=gate.filesystem)
    await rig.one_on_nvme_only()  # 1 on NVMe only
    task = asyncio.create_task(rig.cache.prepare_load(rig.session, rig.ns, keys(1), SHM))
    await gate.wait_entered()  # its promotion is on the disk
    task.cancel()  # the RPC's deadline
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rig.entry(1).pins == 0  # the pin went with the request ...
    gate.open()
    await rig.settle()  # ... and the read finished on its own
    assert rig.entry(1).promoting is None and rig.lookup(1) == (1, "h", "d")
    assert await rig.read(1) == [payload(1)]


class FakeTransport:
    """What the data channel writes, and whether it closed the connection."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out.append(bytes(data))

    def writelines(self, frames: Any) -> None:
        self.out.extend(bytes(f) for f in frames)

    def close(self) -> None:
        self.closed = True


def data_channel(rig: Rig) -> tuple[DataChannelProtocol, FakeTransport]:
    """The tcp data channel over the rig's cache, HELLO done for the rig's session."""
    sessions = SessionTable(
        max_sessions=4, default_ttl_s=10, min_ttl_s=1, max_ttl_s=100, on_release=rig.cache.release_session
    )
    rig.session = sessions.open("c", 10, SHM)
    channel, transport = DataChannelProtocol(rig.cache, sessions), FakeTransport()
    channel.connection_made(transport)  # type: ignore[arg-type]
    feed(channel, wire.hello(rig.session.id, rig.session.data_secret, wire.FEATURE_RUNS))
    transport.out.clear()
    return channel, transport


@scenario
async def test_a_pinned_lookup_job_sends_no_bytes(make_rig: Callable[..., Rig]) -> None:
    """A pinned lookup's job only holds blocks (some may still be on their way from NVMe, their
    slots not filled yet): a READ of it is refused; loads go through PrepareLoad."""
    rig = make_rig(host=4)
    channel, transport = data_channel(rig)
    await rig.one_on_nvme_only()  # 1 on NVMe only
    job, tiers = pin_prefix(rig.cache, rig.session, rig.ns, keys(1, 2))
    assert job is not None and list(tiers) == [TierId.NVME, TierId.HOST]
    feed(channel, wire.pack(Op.READ, job.id))
    assert transport.closed and wire.unpack(transport.out[0][:32])[0] is Op.ERROR
    assert b"PrepareLoad" in transport.out[0]
    await rig.settle()
    rig.cache.complete_load(rig.session, job.id)


@scenario
async def test_a_write_run_header_is_bounded_before_anything_is_walked(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=4)
    channel, transport = data_channel(rig)
    job, _, _ = await rig.cache.prepare_store(rig.session, rig.ns, keys(9), Transport.TCP)
    assert job is not None
    count = (1 << 32) - 1  # the largest a header carries: one byte per "block"
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument) as exc:
        rig.cache.jobs.store_run(rig.session.id, job.id, 0, count, count)
    assert exc.value.field == "index" and time.perf_counter() - t0 < 0.05
    feed(channel, wire.pack(Op.WRITE_RUN, job.id, 0, 2, 2 * BLOCK))  # 2 keys, 1 reserved
    feed(channel, payload(1) + payload(2))  # discarded
    feed(channel, wire.pack(Op.FLUSH, job.id))
    assert wire.unpack(transport.out[-1])[3] == Status.BAD_INDEX and not transport.closed

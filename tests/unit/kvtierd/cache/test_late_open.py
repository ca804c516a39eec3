"""An NVMe tier that cannot be opened at start (its index unreadable) is opened by a later probe,
and its copies join the live index: scenarios over test_tiering's Rig (4 KiB blocks, tiny tiers).
"""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_tiering
from test_tiering import BLOCK, NVME_SLOT, RESERVED, SHM, Rig, keys, payload, scenario

from kvtierd.app import Daemon, build
from kvtierd.config import DaemonConfig
from kvtierd.domain import Transport
from kvtierd.testing.faults import FaultyFileSystem
from kvtierd.tiers.nvme.device import DiskIOError, FileSystem
from kvtierd.tiers.nvme.tier import NvmeTier

make_rig = test_tiering.make_rig  # the fixture: rigs over one directory (a restart)


def unreadable_until(healed: list[bool]) -> Callable[..., FileSystem]:
    """A filesystem factory whose directory cannot be opened (EIO) until ``healed[0]``."""

    def factory(directory: str, **kwargs: Any) -> FileSystem:
        if not healed[0]:
            raise DiskIOError(f"open directory {directory}: injected", err=errno.EIO)
        return FaultyFileSystem(directory, **kwargs)

    return factory


async def restarted_unreadable(make_rig: Callable[..., Rig], *ids: int) -> tuple[Rig, list[bool]]:
    """Blocks ``ids`` stored and durable on NVMe, then a restart on a directory that cannot be
    opened until ``healed[0]``: (the restarted rig, healed)."""
    rig = make_rig()
    await rig.store(*ids)
    await rig.settle()
    rig.stop()
    healed = [False]
    return make_rig(fs_factory=unreadable_until(healed)), healed


@scenario
async def test_a_tier_opened_late_restores_its_copies_into_the_live_index(
    make_rig: Callable[..., Rig],
) -> None:
    again, healed = await restarted_unreadable(make_rig, 1, 2)
    assert (again.restored, again.nvme.admitting) == (0, False)
    assert again.nvme.degraded_reason.startswith("DiskIOError")
    assert again.lookup(1, 2) == (0, "", "")
    assert await again.store(2, 3) == bytes([RESERVED, RESERVED])  # the host tier serves
    assert again.lookup(2, 3) == (2, "hh", "--")
    assert not await again.link.recovery.probe()  # still unreadable: nothing changes
    healed[0] = True
    assert await again.link.recovery.probe()  # opened now: copies restored, admitting
    assert again.link.recovery.restored == 2
    # 1: back from NVMe; 2: stored meanwhile, now with its durable copy; 3: host only (flushed
    # by the next write-through, not by the probe).
    assert again.lookup(1, 2) == (2, "nh", "dd")
    assert await again.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    assert again.ns.counters.nvme_resident_blocks == 2


class HeldOpen:
    """A filesystem factory: unreadable (EIO) until ``heal()``, then its first read of the
    metadata waits at a gate until ``release()``: a late open as slow as the scenario needs."""

    def __init__(self) -> None:
        self.healed = False
        self.entered = threading.Event()  # the open is reading the index, held
        self._gate = threading.Event()

    def heal(self) -> None:
        self.healed = True

    def release(self) -> None:
        self._gate.set()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "no late open started"

    def __call__(self, directory: str, **kwargs: Any) -> FileSystem:
        if not self.healed:
            raise DiskIOError(f"open directory {directory}: injected", err=errno.EIO)
        held = self

        class HeldFileSystem(FaultyFileSystem):
            def read_file(self, name: str, **kw: Any) -> bytes | None:
                held.entered.set()
                assert held._gate.wait(10), "the gate was never opened"
                return super().read_file(name, **kw)

        return HeldFileSystem(directory, **kwargs)


@scenario
async def test_a_checkpoint_while_a_late_open_runs_keeps_every_durable_block(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    await rig.store(1, 2)
    await rig.settle()  # nvme [1 2]
    rig.stop()
    held = HeldOpen()
    again = make_rig(fs_factory=held)
    held.heal()
    caller = asyncio.ensure_future(again.link.recovery.probe())
    await held.wait_entered()  # the open reads the index, off the loop
    caller.cancel()  # the sweeper is cancelled (a drain): the open goes on regardless
    # A drain's checkpoint now would record the live index, which lacks 1 and 2, and delete the
    # journals that hold them: it is skipped, and flush_all writes nothing either.
    assert await asyncio.to_thread(again.link.recovery.checkpoint) is False  # skipped, and says so
    assert await again.link.flush_all(time.monotonic() + 1) == 0
    held.release()
    await again.settle()  # the open ends and puts its copies back
    assert again.link.recovery.restored == 2 and again.lookup(1, 2) == (2, "nn", "dd")
    again.stop()
    third = make_rig()
    assert third.restored == 2 and third.lookup(1, 2) == (2, "nn", "dd")
    assert await third.read(1, 2) == [payload(1), payload(2)]


@scenario
async def test_a_late_open_that_fails_unforeseen_can_be_repeated(make_rig: Callable[..., Rig]) -> None:
    again, healed = await restarted_unreadable(make_rig, 1, 2)
    healed[0] = True
    claim = again.nvme.space.claim
    calls = [0]

    def claim_then_fail(offset: int, slot_bytes: int) -> bool:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: a bug half-way through the rebuild")
        return claim(offset, slot_bytes)

    again.nvme.space.claim = claim_then_fail  # type: ignore[method-assign]
    assert not await again.link.recovery.probe()  # logged, not raised; slot of 1 claimed, then the bug
    assert again.nvme.fs is None and not again.link.recovery.indexed
    assert await again.link.recovery.probe()  # all over again: no slot is taken by the failed attempt
    assert again.link.recovery.restored == 2 and again.nvme.figures.recovery_quarantined == 0
    assert again.lookup(1, 2) == (2, "nn", "dd")


def _daemon_over(directory: Path, held: HeldOpen, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    """A daemon (no server started) whose NVMe tier is the Rig's disk, opened through ``held``."""
    make = build._nvme_tier

    def tier(cfg: DaemonConfig) -> NvmeTier:
        t = make(cfg)
        t._fs_factory = held
        return t

    monkeypatch.setattr(build, "_nvme_tier", tier)
    # The Rig's geometry: 4 KiB host slots, 8 KiB NVMe slots in one 128 KiB block file.
    return Daemon(
        DaemonConfig.from_flat(
            host_bytes=8 * BLOCK,
            slab_bytes=BLOCK,
            prefault=False,
            metrics_port=-1,
            disk_dir=str(directory),
            disk_bytes=16 * NVME_SLOT,
            disk_file_bytes=16 * NVME_SLOT,
            io_align_bytes=BLOCK,
            write_policy="write-through",
            lease_sweep_s=0.01,
            probe_interval_s=0.01,
            min_lease_ttl_s=0.01,
            disk_optional=True,
        )
    )  # (it starts with the tier not open)


@scenario
async def test_the_sweeper_keeps_expiring_leases_while_a_late_open_runs(
    make_rig: Callable[..., Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldOpen()
    daemon = _daemon_over(tmp_path / "nvme", held, monkeypatch)
    held.heal()
    daemon._sweeper = asyncio.get_running_loop().create_task(daemon._sweep())
    await held.wait_entered()  # a probe is opening the tier, held
    expired = asyncio.Event()  # set by the sweeper once it expired a lease
    sweep = daemon.sessions.sweep

    def sweep_and_tell() -> int:
        n = sweep()
        if n:
            expired.set()
        return n

    monkeypatch.setattr(daemon.sessions, "sweep", sweep_and_tell)
    daemon.sessions.open("c", 0.01, Transport.SHM)
    # well before the held open would give up (10 s)
    await asyncio.wait_for(expired.wait(), 3)
    assert daemon.sessions.expired_total == 1  # swept while the open is still held
    assert not daemon.cache.chain[0].tier.admitting
    held.release()
    await daemon.drain_and_stop()
    assert daemon.cache.chain[0].recovery.restored == 0  # an empty directory, formatted


@scenario
async def test_a_drain_during_a_late_open_waits_for_it_and_checkpoints_every_block(
    make_rig: Callable[..., Rig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = make_rig()
    await rig.store(1, 2)
    await rig.settle()  # nvme [1 2]
    rig.stop()
    held = HeldOpen()
    daemon = _daemon_over(tmp_path / "nvme", held, monkeypatch)
    held.heal()
    sweeper = daemon._sweeper = asyncio.get_running_loop().create_task(daemon._sweep())
    await held.wait_entered()  # the sweeper's probe is opening the tier, held
    drain = asyncio.create_task(daemon.drain_and_stop())
    await asyncio.wait({sweeper})  # (cancelled by the drain)
    held.release()  # the open ends while the drain runs
    await drain
    again = make_rig()
    assert again.restored == 2 and again.lookup(1, 2) == (2, "nn", "dd")


@scenario
async def test_a_store_aborted_after_a_late_open_found_its_block_keeps_the_durable_copy(
    make_rig: Callable[..., Rig],
) -> None:
    again, healed = await restarted_unreadable(make_rig, 1)
    job, status, _ = await again.cache.prepare_store(again.session, again.ns, keys(1), SHM)
    assert job is not None and status == bytes([RESERVED])  # 1 is WRITING
    healed[0] = True
    assert await again.link.recovery.probe()  # the late open finds 1 on disk: the entry gets the copy
    again.cache.complete_store(again.session, job.id, ok=False)  # the client's write failed
    assert again.lookup(1) == (1, "n", "d")  # the block stays, held on NVMe
    assert await again.read(1) == [payload(1)]

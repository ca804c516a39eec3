"""An NVMe tier that cannot be opened at start (its index unreadable) is opened by a later probe,
and its copies join the live index: scenarios over test_tiering's Rig (4 KiB blocks, tiny tiers).
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import test_tiering
from test_tiering import RESERVED, Rig, payload, scenario

from kvtierd.testing.faults import FaultyFileSystem
from kvtierd.tiers.nvme.device import DiskIOError, FileSystem

make_rig = test_tiering.make_rig  # the fixture: rigs over one directory (a restart)


def unreadable_until(healed: list[bool]) -> Callable[..., FileSystem]:
    """A filesystem factory whose directory cannot be opened (EIO) until ``healed[0]``."""

    def factory(directory: str, **kwargs: Any) -> FileSystem:
        if not healed[0]:
            raise DiskIOError(f"open directory {directory}: injected", err=errno.EIO)
        return FaultyFileSystem(directory, **kwargs)

    return factory


@scenario
async def test_a_tier_opened_late_restores_its_copies_into_the_live_index(
        make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    await rig.store(1, 2)
    await rig.settle()  # nvme [1 2]
    rig.stop()
    healed = [False]
    again = make_rig(fs_factory=unreadable_until(healed))
    assert (again.restored, again.nvme.admitting) == (0, False)
    assert again.nvme.degraded_reason.startswith("DiskIOError")
    assert again.lookup(1, 2) == (0, "", "")
    assert await again.store(2, 3) == bytes([RESERVED, RESERVED])  # the host tier serves
    assert again.lookup(2, 3) == (2, "hh", "--")
    assert not await again.link.probe()  # still unreadable: nothing changes
    healed[0] = True
    assert await again.link.probe()  # opened now: copies restored, admitting
    assert again.link.restored == 2
    # 1: back from NVMe; 2: stored meanwhile, now with its durable copy; 3: host only (flushed
    # by the next write-through, not by the probe).
    assert again.lookup(1, 2) == (2, "nh", "dd")
    assert await again.read(1, 2, 3) == [payload(1), payload(2), payload(3)]
    assert again.ns.counters.nvme_resident_blocks == 2

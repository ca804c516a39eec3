"""A tenant's ``host_bytes`` quota evicts only what the chain wrote down first (issue 39), over
test_tiering's Rig (4 KiB blocks, a real NVMe tier in a temp directory, a gate to hold its writes).

The tenant's namespace is held to 4 blocks of a 16-block host tier (the write-back watermark never
reached: the arena alone would never flush), as a tcp-only tenant is held to its share of the
shared arena. Stores go through ``TieredCache.prepare_store`` as PrepareStore does, loads through the
cache's ``prepare_load`` (promotions):

* blocks a store evicts to fit the quota are on NVMe first, and read back byte for byte;
* a promotion (a load of blocks on NVMe only) evicts the tenant's blocks only once written down;
* write-through: a store whose room is the previous store's blocks, still being written, waits
  for them instead of being refused; a disk that stays held past the wait refuses it (the quota
  stays bounded).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest
import test_tiering
from test_tiering import RESERVED, SHM, Gate, Rig, keys, payload, scenario, spec

from kvtier_contract.errors import ResourceExhausted
from kvtierd.index import NamespaceState

make_rig = test_tiering.make_rig  # the fixture
QUOTA = 4  # blocks of the tenant's host_bytes


def tenanted(rig: Rig) -> NamespaceState:
    """The rig's cache given tenant ``t`` with a quota of QUOTA host slots: its namespace."""
    ns = rig.cache.register_namespace(dataclasses.replace(spec(), tenant="t"))
    rig.cache.admission.host_quota = lambda n: QUOTA * n.slot_bytes if n.spec.tenant == "t" else None
    return ns


async def put(rig: Rig, ns: NamespaceState, *ids: int) -> bytes:
    """Store blocks ``ids`` of ``ns`` the way PrepareStore and CompleteStore do."""
    ks = keys(*ids)
    job, status, _ = await rig.cache.prepare_store(rig.session, ns, ks, SHM)
    if job is not None:
        for i, e in job.items.items():
            rig.cache.host.arena.slot(e.offset, ns.block_bytes)[:] = payload(ids[i])
        rig.cache.complete_store(rig.session, job.id, ok=True)
    return status


async def read(rig: Rig, ns: NamespaceState, *ids: int) -> list[bytes | None]:
    """One load of ``ids`` (promoting what is on NVMe only): their bytes, None when not served."""
    out: list[bytes | None] = [None] * len(ids)
    job, _deferred = await rig.cache.prepare_load(rig.session, ns, keys(*ids), SHM)
    if job is not None:
        for i, e in job.items.items():
            out[i] = bytes(rig.cache.host.arena.slot(e.offset, ns.block_bytes))
        rig.cache.complete_load(rig.session, job.id)
    return out


def tiers(rig: Rig, ns: NamespaceState, *ids: int) -> str:
    """Each block's place: ``h`` host (with or without a copy), ``n`` NVMe only, ``-`` gone."""
    got = [ns.entries.get(k) for k in keys(*ids)]
    return "".join("-" if e is None else "h" if e.in_host else "n" for e in got)


@scenario
async def test_blocks_evicted_to_fit_the_quota_are_written_down_first(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=16, nvme=32, write_policy="write-back", watermark=1.0)
    ns = tenanted(rig)
    assert await put(rig, ns, 1, 2, 3, 4) == bytes([RESERVED] * 4)
    assert await put(rig, ns, 5, 6, 7, 8) == bytes([RESERVED] * 4)  # evicts 1-4: flushed first
    assert tiers(rig, ns, *range(1, 9)) == "nnnnhhhh"
    assert ns.counters.demotions == 4
    assert await read(rig, ns, 3, 4) == [payload(3), payload(4)]


@scenario
async def test_a_promotion_evicts_the_tenants_blocks_once_written_down(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(host=16, nvme=32, write_policy="write-back", watermark=1.0)
    ns = tenanted(rig)
    await put(rig, ns, 1, 2, 3, 4)
    await put(rig, ns, 5, 6, 7, 8)  # 1-4 on NVMe only; 5-8 fill the quota, not written down
    assert await read(rig, ns, 1, 2) == [payload(1), payload(2)]  # evicts 5 and 6 for them
    await rig.settle()
    assert tiers(rig, ns, *range(1, 9)) == "hhnnnnhh"
    assert await read(rig, ns, 5, 6) == [payload(5), payload(6)]


@scenario
async def test_a_write_through_store_waits_for_the_blocks_being_written(make_rig: Callable[..., Rig]) -> None:
    gate = Gate("write")
    rig = make_rig(host=16, nvme=32, write_policy="write-through", fs_factory=gate.filesystem)
    ns = tenanted(rig)
    await put(rig, ns, 1, 2, 3, 4)  # its quota, all being written (held at the gate)
    await gate.wait_entered()
    second = asyncio.ensure_future(put(rig, ns, 5, 6, 7, 8))
    done, _ = await asyncio.wait({second}, timeout=0)  # its first step: it waits for 1-4
    assert not done  # (refused there at once before)
    gate.open()
    assert await second == bytes([RESERVED] * 4)
    await rig.settle()
    assert tiers(rig, ns, *range(1, 9)) == "nnnnhhhh"
    assert await read(rig, ns, 1, 2, 3, 4) == [payload(i) for i in (1, 2, 3, 4)]


@scenario
async def test_blocks_still_being_written_past_the_wait_refuse_the_store(
    make_rig: Callable[..., Rig],
) -> None:
    gate = Gate("write")
    rig = make_rig(host=16, nvme=32, write_policy="write-through", fs_factory=gate.filesystem)
    ns = tenanted(rig)
    await put(rig, ns, 1, 2, 3, 4)
    await gate.wait_entered()
    with pytest.raises(ResourceExhausted, match="quota host_bytes"):
        await put(rig, ns, 5, 6, 7, 8)  # the disk held past ROOM_WAIT_S: never over the quota
    assert tiers(rig, ns, *range(1, 9)) == "hhhh----"
    gate.open()
    await rig.settle()
    assert await put(rig, ns, 5, 6, 7, 8) == bytes([RESERVED] * 4)

"""kvtierd.service.transfers' completions that hash, over a host tier of 4 blocks (no chain): a
store's digests are the client's when it is trusted, else hashed from the slots; a load's corrupt
claims are rehashed, so a block that is fine is never dropped and one whose bytes differ is."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier_contract.digests import block_digest
from kvtier_contract.identity import Namespace
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.index import NamespaceState
from kvtierd.policies import make_policy
from kvtierd.service import transfers
from kvtierd.service.transfers import complete_load_verified, complete_store_hashed
from kvtierd.sessions import Session, SessionTable
from kvtierd.tiers import Arena, HostTier

BLOCK = 4096


@pytest.fixture
def rig() -> Iterator[tuple[TieredCache, Session, NamespaceState]]:
    arena = Arena(4 * BLOCK, prefault=False)
    host = HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
    cache = TieredCache(host, make_policy("lru", ghost_capacity=4), max_namespaces=2, policy_name="lru")
    sessions = SessionTable(
        max_sessions=4, default_ttl_s=10, min_ttl_s=1, max_ttl_s=10, on_release=cache.release_session
    )
    ns = cache.register_namespace(
        Namespace(
            model_id="m",
            model_revision="r",
            tokenizer_digest="none",
            kv_dtype="float16",
            layout="contiguous",
            tokens_per_block=8,
            num_layers=1,
            num_kv_heads=1,
            head_dim=128,
        )
    )
    yield cache, sessions.open("c", None, Transport.SHM), ns
    arena.close()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def store(
    cache: TieredCache, s: Session, ns: NamespaceState, *, trust_client: bool, given: list[int]
) -> list[int | None]:
    """Store blocks 1 and 2 (filled with 1s and 2s): each one's digest once committed."""

    async def run() -> list[int | None]:
        job, _, offsets = await cache.prepare_store(s, ns, [key(1), key(2)], Transport.SHM)
        assert job is not None
        for n, off in enumerate(offsets):
            cache.host.view(off, BLOCK)[:] = bytes([n + 1]) * BLOCK
        assert await complete_store_hashed(cache, s, job.id, True, [], given, trust_client=trust_client) == (
            2,
            0,
        )
        return [ns.entries[key(i)].digest for i in (1, 2)]

    return asyncio.run(run())


def test_a_stores_digests_are_hashed_here_unless_the_client_is_trusted(rig: Any) -> None:
    cache, s, ns = rig
    assert store(cache, s, ns, trust_client=True, given=[11, 22]) == [11, 22]
    for k in (key(1), key(2)):
        cache.drop_corrupt([ns.entries[k]])  # (start again with empty slots)
    assert store(cache, s, ns, trust_client=False, given=[11, 22]) == [
        block_digest(bytes([1]) * BLOCK),
        block_digest(bytes([2]) * BLOCK),
    ]


def test_a_corrupt_claim_drops_only_a_block_whose_bytes_differ(rig: Any) -> None:
    cache, s, ns = rig
    store(cache, s, ns, trust_client=False, given=[])

    async def claim(index: int) -> tuple[int, int]:
        job, _ = await cache.prepare_load(s, ns, [key(1), key(2)], Transport.SHM)
        assert job is not None
        return await complete_load_verified(cache, s, job.id, [index])

    assert asyncio.run(claim(0)) == (0, 0)  # block 1 is fine: kept
    assert ns.counters.corrupt_blocks == 0
    e = ns.entries[key(2)]
    cache.host.view(e.offset, BLOCK)[:1] = b"\x09"
    assert asyncio.run(claim(1)) == (1, ns.id)
    assert ns.counters.corrupt_blocks == 1 and key(1) in ns.ready and key(2) not in ns.ready


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
@pytest.mark.parametrize("count", [1, 5, 16])
def test_hashing_in_one_part_per_core_gives_every_digest_in_order(
    monkeypatch: pytest.MonkeyPatch, cores: int, count: int
) -> None:
    """A job's hashing is cut into up to one part per core: the digests are each view's, in
    order, whatever the cut (parts of at least HASH_PART_BYTES, here one block)."""
    monkeypatch.setattr(transfers, "usable_cores", lambda: cores)
    monkeypatch.setattr(transfers, "HASH_PART_BYTES", BLOCK)
    payloads = [bytes([i]) * BLOCK + bytes([i, 255 - i]) for i in range(count)]
    views = [memoryview(p) for p in payloads]
    assert asyncio.run(transfers.hashed_on_cores(views)) == [block_digest(p) for p in payloads]
    assert asyncio.run(transfers.hashed_on_cores([])) == []

"""The cache's events sink is always there: the composition root picks ``BlockEvents`` (events
on) or the shared no-op ``NO_EVENTS`` (off), and the cache calls it without asking which.

With the no-op sink a store keeps no token ids or parents on its entries (nothing will publish
them) and nothing is queued; with ``BlockEvents`` the same store keeps them and queues its
``BlockStored``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier_contract.identity import Namespace
from kvtierd.app import build
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.events import MEDIUM_CPU, NO_EVENTS, BlockEvents, EventQueue, EventSink, NoEvents
from kvtierd.index import Entry
from kvtierd.policies import make_policy
from kvtierd.sessions import Session
from kvtierd.tiers import Arena, HostTier

BLOCK = 4096
TPB = 4


@pytest.fixture
def cache() -> Iterator[TieredCache]:
    arena = Arena(64 * BLOCK, prefault=False)
    yield TieredCache(
        HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK),
        make_policy("lru", ghost_capacity=16),
        max_namespaces=4,
    )
    arena.close()


def store(cache: TieredCache, *ids: int) -> list[Entry]:
    """Blocks ``ids`` stored and committed, with their token ids; their entries."""
    ns = cache.register_namespace(
        Namespace(
            model_id="m",
            model_revision="r",
            tokenizer_digest="none",
            kv_dtype="float16",
            layout="contiguous",
            tokens_per_block=TPB,
            num_layers=1,
            num_kv_heads=1,
            head_dim=BLOCK // (4 * TPB),
        )
    )
    s = Session(1, "s1", ttl_s=10.0, deadline=1e12, transport=Transport.SHM)
    ks = [i.to_bytes(32, "big") for i in ids]
    job, _, _ = cache.stores.reserve(s, ns, ks, Transport.SHM, token_ids=list(range(len(ks) * TPB)))
    assert job is not None
    cache.complete_store(s, job.id, ok=True)
    return [ns.entries[k] for k in ks]


def test_a_cache_holds_the_no_op_sink_until_told_otherwise(cache: TieredCache) -> None:
    assert cache.residency.events is NO_EVENTS and not NO_EVENTS.publishing
    entries = store(cache, 1, 2)  # stored, committed: told to the sink, which drops it
    assert [e.origin for e in entries] == [None, None]  # no token ids kept for nobody


def test_with_block_events_the_same_store_keeps_origins_and_is_queued(cache: TieredCache) -> None:
    queue = EventQueue(100)
    cache.residency.events = BlockEvents(queue)  # (no loop runs: queued at once)
    entries = store(cache, 1, 2)
    assert all(e.origin is not None for e in entries)
    assert [(kind, medium, len(es)) for kind, medium, es in queue.take(0)] == [("stored", MEDIUM_CPU, 2)]


def test_the_composition_root_picks_the_sink_once() -> None:
    assert build.event_sink(None) is NO_EVENTS
    publisher: Any = SimpleNamespace(queue=EventQueue(10))
    sink = build.event_sink(publisher)
    assert isinstance(sink, BlockEvents) and sink.queue is publisher.queue and sink.publishing


def test_the_no_op_sink_has_the_interface_and_does_nothing() -> None:
    sink: EventSink = NoEvents()
    sink.stored([], MEDIUM_CPU)
    sink.removed([], MEDIUM_CPU)
    sink.cleared()
    sink.flush()
    assert not sink.publishing

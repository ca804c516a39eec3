"""KV events: the wire encoding, the bounded queue, what the cache tells, the publisher's
batching, routing and replay (real ZMQ sockets over ipc:// in a temporary directory).

A 4-slot host tier, integer keys, expected records in comments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.events import BlockEvents, EventQueue
from kvtierd.events.publisher import EventPublisher, EventSettings, tenant_endpoint
from kvtierd.events.records import events_of
from kvtierd.events.wire import (
    END_SEQ,
    Cleared,
    Removed,
    Stored,
    decode_batch,
    encode_batch,
    event_map,
    pack_tokens,
)
from kvtierd.index import NamespaceState
from kvtierd.policies import make_policy
from kvtierd.sessions import Session
from kvtierd.tiers import Arena, HostTier

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")

BLOCK = 4096
TPB = 4
# vLLM 0.32's field order (vllm/distributed/kv_events.py), those without a default first
VLLM_STORED = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
]


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


def spec(**kw: Any) -> Namespace:
    return Namespace(
        model_id="m",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=TPB,
        num_layers=1,
        num_kv_heads=1,
        head_dim=BLOCK // (4 * TPB),
        **kw,
    )


@pytest.fixture
def cache() -> Iterator[TieredCache]:
    arena = Arena(4 * BLOCK, prefault=False)
    c = TieredCache(
        HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK),
        make_policy("lru", ghost_capacity=16),
        max_namespaces=8,
    )
    yield c
    arena.close()


def put(cache: TieredCache, ns: NamespaceState, ks: list[bytes], **kw: Any) -> None:
    s = Session(1, "s1", ttl_s=10.0, deadline=1e12, transport=Transport.SHM)
    job, _, _ = cache.stores.reserve(s, ns, ks, Transport.SHM, **kw)
    assert job is not None
    cache.complete_store(s, job.id, ok=True)


# ---- wire -----------------------------------------------------------------------------------


def test_block_stored_is_a_tagged_map_in_vllms_field_order() -> None:
    ev = Stored(
        keys(1, 2), None, [1, 2, 3, 4, 5, 6, 7, 8], TPB, "CPU", "lora-a", [("lora-a", "salt")] * 2, "team-a"
    )
    m = event_map(ev)
    assert list(m)[: len(VLLM_STORED)] == VLLM_STORED
    assert list(m)[len(VLLM_STORED) :] == ["tenant_id"]  # kvtier's own, after vLLM's
    batch = [ev, Removed(keys(3), "STORAGE", None), Cleared()]
    ts, events, rank = decode_batch(encode_batch(12.5, batch, hashes="bytes"))
    assert (ts, rank) == (12.5, 0)
    assert events[0]["block_hashes"] == keys(1, 2)  # msgpack bin, 32 bytes each
    assert events[0]["extra_keys"] == [["lora-a", "salt"]] * 2
    assert events[1] == {"type": "BlockRemoved", "block_hashes": keys(3), "medium": "STORAGE"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_block_hashes_go_as_vllms_default_int64_form() -> None:
    """vLLM sends ``int.from_bytes(hash, "big") & (2**64 - 1)`` unless told otherwise
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), and Dynamo's indexer decodes nothing else."""
    k1, k2, k3 = (bytes(range(i, i + 32)) for i in (0, 40, 80))
    ev = Stored([k2, k3], k1, [], TPB, "CPU", None, None, None)
    _, events, _ = decode_batch(encode_batch(1.0, [ev, Removed([k3], "CPU", None)]))
    low64 = [int.from_bytes(k, "big") & ((1 << 64) - 1) for k in (k1, k2, k3)]
    assert low64[0] == 0x18191A1B1C1D1E1F
    assert events[0]["parent_block_hash"] == low64[0] and events[0]["block_hashes"] == low64[1:]
    assert events[1]["block_hashes"] == low64[2:]
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in low64)


def test_defaults_are_left_out_like_vllms_omit_defaults() -> None:
    m = event_map(Stored(keys(1), None, [], TPB, "STORAGE", None, None, None))
    assert "extra_keys" not in m and "tenant_id" not in m
    assert m["parent_block_hash"] is None and m["lora_id"] is None  # required: always there


# ---- the queue ------------------------------------------------------------------------------


def test_the_queue_drops_whole_records_past_its_bound_and_counts_their_blocks(cache: TieredCache) -> None:
    ns = cache.register_namespace(spec())
    put(cache, ns, keys(1, 2, 3))
    entries = list(ns.entries.values())
    q = EventQueue(max_blocks=4)
    assert q.put([("stored", "CPU", entries)])  # 3 blocks queued
    assert not q.put([("removed", "CPU", entries[:2])])  # 3 + 2 > 4: dropped whole
    assert (q.dropped_blocks, q.dropped_records, q.queued_blocks) == (2, 1, 3)
    assert q.take(0.0) == [("stored", "CPU", entries)]
    assert q.queued_blocks == 0
    assert q.put([("removed", "CPU", entries[:2])])  # room again
    assert q.put([("stored", "CPU", entries * 3)]) is False  # 9 blocks, 2 queued: dropped
    q.take(0.0)
    assert q.put([("stored", "CPU", entries * 3)])  # larger than the queue, into an empty one


# ---- what the cache tells -------------------------------------------------------------------


def test_the_cache_tells_commits_and_evictions_in_order_one_queue_put_per_loop_turn(
    cache: TieredCache,
) -> None:
    q = EventQueue(max_blocks=100)
    events = BlockEvents(q)
    cache.residency.events = events
    ns = cache.register_namespace(spec())
    puts: list[int] = []
    real_put = q.put
    q.put = lambda records, wait=False: puts.append(len(records)) or real_put(records)  # type: ignore[method-assign]

    async def run() -> None:
        put(cache, ns, keys(1, 2, 3, 4))  # host full
        put(cache, ns, keys(5))  # evicts 1 (LRU)
        assert puts == []  # nothing handed over inside the loop turn
        turn = asyncio.get_running_loop().create_future()  # queued after the flush (FIFO)
        asyncio.get_running_loop().call_soon(turn.set_result, None)
        await turn  # the turn ends: the flush runs
        assert puts == [3]  # stored 1-4, removed 1, stored 5: one put

    asyncio.run(run())
    got = [(kind, medium, [e.key for e in es]) for kind, medium, es in q.take(0.0)]
    assert got == [
        ("stored", "CPU", keys(1, 2, 3, 4)),
        ("removed", "CPU", keys(1)),
        ("stored", "CPU", keys(5)),
    ]


def test_token_ids_and_parent_ride_with_the_entries_when_events_are_on(cache: TieredCache) -> None:
    cache.residency.events = BlockEvents(EventQueue(100))
    ns = cache.register_namespace(spec(cache_salt="s", adapter_id="a", adapter_revision="1"))
    parent = keys(99)[0]
    put(cache, ns, keys(1, 2, 3), token_ids=list(range(12)), parent=parent)
    e1, e2, e3 = (ns.entries[k] for k in keys(1, 2, 3))
    assert e1.origin == (parent, pack_tokens([0, 1, 2, 3]))
    assert e3.origin == (keys(2)[0], pack_tokens([8, 9, 10, 11]))
    [(tenant, [ev])] = list(events_of("stored", "CPU", [e1, e2, e3]))
    assert isinstance(ev, Stored)
    assert (ev.keys, ev.parent, list(ev.token_ids)) == (keys(1, 2, 3), parent, list(range(12)))
    # vLLM's rule: the adapter on every block, the salt only where a chain starts without a
    # parent (the parent's key carries it from there)
    assert ev.extra_keys == [("a",)] * 3 and ev.lora_name == "a" and tenant is None
    put(cache, ns, keys(5, 6), token_ids=list(range(8)))  # no parent: a prompt's start
    [(_t, [head])] = list(events_of("stored", "CPU", [ns.entries[k] for k in keys(5, 6)]))
    assert isinstance(head, Stored) and head.parent is None
    assert head.extra_keys == [("a", "s"), ("a",)]
    # a run broken by a block from elsewhere: two events; no tokens unless all have them
    runs = [e.keys for _t, [e] in events_of("stored", "STORAGE", [e1, e3, e2])]  # type: ignore[attr-defined]
    assert runs == [keys(1), keys(3), keys(2)]


def test_token_ids_past_their_share_of_a_slot_are_not_kept(cache: TieredCache) -> None:
    """A namespace of tiny blocks and many tokens per block (a client's choice) would make each
    block's token ids outweigh the block the quotas count: past 1/64 of its slot they are not
    kept, and its events carry no tokens (the parent still rides)."""
    cache.residency.events = BlockEvents(EventQueue(100))
    ns = cache.register_namespace(
        Namespace(
            model_id="m",
            model_revision="r",
            tokenizer_digest="none",
            kv_dtype="uint8",
            layout="contiguous",
            tokens_per_block=512,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
        )
    )
    assert ns.slot_bytes == BLOCK  # 1 KiB of bytes, 2 KiB of token ids: 4 KiB slot
    parent = keys(99)[0]
    put(cache, ns, keys(1, 2), token_ids=list(range(1024)), parent=parent)
    e1, e2 = (ns.entries[k] for k in keys(1, 2))
    assert e1.origin == (parent, b"") and e2.origin == (keys(1)[0], b"")
    [(_t, [ev])] = list(events_of("stored", "CPU", [e1, e2]))
    assert isinstance(ev, Stored) and list(ev.token_ids) == [] and ev.parent == parent


def test_bad_token_ids_or_parent_are_refused_naming_the_field_and_change_nothing(cache: TieredCache) -> None:
    ns = cache.register_namespace(spec())
    s = Session(1, "s1", ttl_s=10.0, deadline=1e12, transport=Transport.SHM)
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(cache.prepare_store(s, ns, keys(1, 2), Transport.SHM, token_ids=[1, 2, 3]))
    assert err.value.field == "token_ids"
    with pytest.raises(InvalidArgument) as err:
        asyncio.run(cache.prepare_store(s, ns, keys(1, 2), Transport.SHM, parent=b"short"))
    assert err.value.field == "parent_key"
    assert not ns.entries and not s.store_jobs and cache.writing_blocks == 0


# ---- the publisher --------------------------------------------------------------------------


def test_tenant_names_that_cannot_be_paths_get_no_endpoint() -> None:
    assert tenant_endpoint("ipc:///r/ev-{tenant}.sock", "team-a") == "ipc:///r/ev-team-a.sock"
    assert tenant_endpoint("ipc:///r/ev-{tenant}.sock", "../etc") is None
    assert tenant_endpoint("ipc:///r/ev-{tenant}.sock", "..") is None


def recv(sock: Any) -> list[bytes]:
    assert sock.poll(5000), "nothing came"
    return list(sock.recv_multipart())


def test_publisher_batches_routes_per_tenant_and_replays_a_bounded_buffer(
    cache: TieredCache, tmp_path: Path
) -> None:
    q = EventQueue(1000)
    pub = EventPublisher(
        EventSettings(
            endpoint=f"ipc://{tmp_path}/op",
            replay_endpoint=f"ipc://{tmp_path}/op-r",
            tenant_endpoint=f"ipc://{tmp_path}/t-{{tenant}}",
            topic="kv",
            buffer_batches=2,
            block_hashes="bytes",
        ),
        q,
    )
    a = cache.register_namespace(spec(tenant="a"))
    b = cache.register_namespace(spec(tenant="b"))
    put(cache, a, keys(1, 2))
    put(cache, b, keys(3))
    ctx = zmq.Context()
    subs = {}
    try:
        pub.start(["a"])  # b's stream comes with b's first block
        for name in ("op", "t-a", "t-b"):
            subs[name] = ctx.socket(zmq.SUB)
            subs[name].setsockopt(zmq.SUBSCRIBE, b"")
            subs[name].connect(f"ipc://{tmp_path}/{name}")
        # ZMQ's slow joiner: messages published before a subscription lands are not seen (b's
        # socket is bound only with b's first block): publish until every subscriber got one
        both = [("stored", "CPU", list(a.entries.values())), ("stored", "CPU", list(b.entries.values()))]
        waiting = set(subs)
        for _ in range(100):
            q.put(both)
            waiting -= {n for n in waiting if subs[n].poll(50)}
            if not waiting:
                break
        put(cache, a, keys(4))  # the last round: told apart by key 4
        q.put([("stored", "CPU", [a.entries[keys(4)[0]]]), both[1]])

        def last(name: str) -> tuple[bytes, bytes, list[dict[str, Any]]]:
            while True:
                topic, seq, payload = recv(subs[name])
                evs = decode_batch(payload)[1]
                if (
                    any(keys(4)[0] in e.get("block_hashes", ()) for e in evs)
                    or name == "t-b"
                    and any(e["type"] == "BlockStored" for e in evs)
                ):
                    return topic, seq, evs

        topic, seq, events = last("op")
        assert topic == b"kv"
        assert [(e["type"], e.get("tenant_id")) for e in events] == [  # both records, one batch
            ("BlockStored", "a"),
            ("BlockStored", "b"),
        ]
        assert {e["tenant_id"] for e in last("t-a")[2]} == {"a"}
        assert {e["tenant_id"] for e in last("t-b")[2] if e["type"] != "AllBlocksCleared"} == {"b"}
        req = ctx.socket(zmq.DEALER)
        req.connect(f"ipc://{tmp_path}/op-r")
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        answer = [recv(req) for _ in range(3)]
        assert [len(f) for f in answer] == [4, 4, 4]
        assert answer[-1] == [b"", b"", END_SEQ, b""]
        # the buffer keeps 2 messages: the last two seqs, the last one the one just received
        assert answer[1][2] == seq and int.from_bytes(answer[0][2], "big") + 1 == int.from_bytes(seq, "big")
        deadline = time.monotonic() + 5
        while pub.figures()["event_replay_requests"] < 1 and time.monotonic() < deadline:
            req.poll(10)
        figures = pub.figures()
        assert figures["event_replay_requests"] == 1 and figures["event_streams"] == 3
        req.close(0)
    finally:
        for s in subs.values():
            s.close(0)
        ctx.term()
        pub.close()


def test_an_idle_stream_repeats_its_last_seq_with_no_events(cache: TieredCache, tmp_path: Path) -> None:
    """A router that (re)connected after a stream's last message sees a seq within a heartbeat:
    the last one again, no events, nothing buffered, so one that has it skips it."""
    q = EventQueue(1000)
    pub = EventPublisher(
        EventSettings(
            endpoint=f"ipc://{tmp_path}/op", replay_endpoint=f"ipc://{tmp_path}/op-r", heartbeat_s=0.1
        ),
        q,
    )
    ns = cache.register_namespace(spec())
    put(cache, ns, keys(1))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        pub.start()
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/op")

        def until_heartbeat() -> tuple[bytes | None, bytes]:
            """The seq of the last message with events before a heartbeat, and the heartbeat's."""
            last = None
            while True:
                _topic, seq, payload = recv(sub)
                if not decode_batch(payload)[1]:
                    return last, seq
                last = seq

        seen, beat = until_heartbeat()  # no store yet: AllBlocksCleared (if not missed), then a beat
        assert seen in (None, beat)
        beats = pub.heartbeats
        q.put([("stored", "CPU", list(ns.entries.values()))])
        stored, beat = until_heartbeat()
        assert stored is not None and beat == stored  # the store's seq again, not a new one
        assert int.from_bytes(stored, "big") == int.from_bytes(beat, "big")
        assert pub.heartbeats > beats
        assert pub.figures()["event_batches_published"] == 2  # AllBlocksCleared, the store
    finally:
        sub.close(0)
        ctx.term()
        pub.close()

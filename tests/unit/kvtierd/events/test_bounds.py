"""KV events under bounds: what the publisher holds is bounded in bytes, whoever subscribes.

Replay buffers in bytes per stream and in total (oldest first, counted); messages at most
``max_message_bytes`` (a long chain split, its parents kept); replay answers bounded; at most
``max_peers`` connections per socket; a flood with no subscriber and with stalled subscribers
and unread replays stays within the configured bytes. Real ZMQ sockets over ipc:// in a
temporary directory; waits poll sockets, never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier_contract.identity import Namespace
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.events import BlockEvents, EventQueue
from kvtierd.events.publisher import EventPublisher, EventSettings
from kvtierd.events.replay import ENTRY_OVERHEAD_BYTES, ReplayBuffers
from kvtierd.events.wire import END_SEQ, decode_batch
from kvtierd.index import NamespaceState
from kvtierd.policies import make_policy
from kvtierd.sessions import Session
from kvtierd.tiers import Arena, HostTier

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

BLOCK = 4096
TPB = 4
LONG = "x" * 256  # the longest adapter id and salt a namespace may have


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


@pytest.fixture
def cache() -> Iterator[TieredCache]:
    arena = Arena(4096 * BLOCK, prefault=False)
    c = TieredCache(
        HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK),
        make_policy("lru", ghost_capacity=16),
        max_namespaces=8,
    )
    c.residency.events = BlockEvents(EventQueue(1 << 20))  # entries keep tokens and parents
    yield c
    arena.close()


def namespace(cache: TieredCache, **kw: Any) -> NamespaceState:
    return cache.register_namespace(
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
            **kw,
        )
    )


def put(cache: TieredCache, ns: NamespaceState, ks: list[bytes], parent: bytes | None = None) -> None:
    s = Session(1, "s1", ttl_s=10.0, deadline=1e12, transport=Transport.SHM)
    job, _, _ = cache.stores.reserve(
        s, ns, ks, Transport.SHM, token_ids=list(range(len(ks) * TPB)), parent=parent
    )
    assert job is not None
    cache.complete_store(s, job.id, ok=True)


def until(check: Callable[[], bool], what: str) -> None:
    """Wait until ``check()`` (asked every 10 ms of a ZMQ poll), at most 20 s."""
    deadline = time.monotonic() + 20
    while not check():
        assert time.monotonic() < deadline, what
        zmq.Poller().poll(10)


def replay(ctx: Any, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """One replay request: the messages of the answer (the end marker seen)."""
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    try:
        req.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert req.poll(5000), "no end marker"
            _, _, seq, payload = req.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        req.close(0)


# ---- the replay buffers ---------------------------------------------------------------------


def test_replay_buffers_keep_each_streams_bytes_and_the_total_dropping_the_oldest_first() -> None:
    bufs = ReplayBuffers(total_cap_bytes=3 * (100 + ENTRY_OVERHEAD_BYTES))
    a = bufs.new(cap_bytes=2 * (100 + ENTRY_OVERHEAD_BYTES), max_messages=100)
    b = bufs.new(cap_bytes=10_000, max_messages=100)
    for seq in range(3):
        bufs.append(a, seq, bytes(100))  # a keeps 1, 2: its own cap
    assert [s for s, _ in a.since(0, 1 << 20, 100)] == [1, 2]
    assert (bufs.dropped_messages, bufs.held_bytes) == (1, a.held_bytes)
    bufs.append(b, 10, bytes(100))  # 3 messages: the total
    bufs.append(b, 11, bytes(100))  # 4 > total: the fattest (a, 2 messages) drops its oldest
    assert [s for s, _ in a.since(0, 1 << 20, 100)] == [2]
    assert bufs.held_bytes == 3 * (100 + ENTRY_OVERHEAD_BYTES) == a.held_bytes + b.held_bytes
    # an answer: from the seq asked, within the bytes and messages asked (at least one)
    assert [s for s, _ in b.since(11, 0, 100)] == [11]
    assert [s for s, _ in b.since(0, 150, 100)] == [10]
    assert [s for s, _ in b.since(0, 1 << 20, 1)] == [10]
    bufs.forget(a)
    assert bufs.held_bytes == b.held_bytes


# ---- the publisher --------------------------------------------------------------------------


def settings(tmp: Path, **kw: Any) -> EventSettings:
    return EventSettings(
        endpoint=f"ipc://{tmp}/op",
        replay_endpoint=f"ipc://{tmp}/op-r",
        tenant_endpoint=f"ipc://{tmp}/t-{{tenant}}",
        tenant_replay_endpoint=f"ipc://{tmp}/t-{{tenant}}-r",
        **{"block_hashes": "bytes", **kw},  # (whole keys: the tests compare them)
    )


def test_a_long_chain_is_split_into_messages_within_the_bound_its_parents_kept(
    cache: TieredCache, tmp_path: Path
) -> None:
    ns = namespace(cache, adapter_id=LONG, adapter_revision="1", cache_salt=LONG)
    chain = keys(*range(1, 1025))
    put(cache, ns, chain)  # one 1,024-block chain, 256-char adapter id and salt
    q = EventQueue(1 << 20)
    pub = EventPublisher(settings(tmp_path, max_message_bytes=16 << 10), q)
    ctx = zmq.Context()
    try:
        pub.start()
        q.put([("stored", "CPU", [ns.entries[k] for k in chain])])
        got: list[dict[str, Any]] = []

        def replayed() -> bool:  # the whole chain, once the thread has sent its last part
            got.clear()
            start = 0
            while answer := replay(ctx, f"ipc://{tmp_path}/op-r", start):  # bounded: ask on
                for _seq, payload in answer:
                    assert len(payload) <= 16 << 10
                    got.extend(e for e in decode_batch(payload)[1] if e["type"] == "BlockStored")
                start = answer[-1][0] + 1
            return sum(len(e["block_hashes"]) for e in got) >= len(chain)

        until(replayed, "the chain was never all buffered")
        assert len(got) > 16  # ~300 bytes a block: many messages
        assert [k for e in got for k in e["block_hashes"]] == chain
        for prev, ev in zip(got, got[1:], strict=False):
            assert ev["parent_block_hash"] == prev["block_hashes"][-1]
        # the salt only on the chain's first block, the adapter on every block
        assert got[0]["extra_keys"][0] == [LONG, LONG]
        assert all(x == [LONG] for e in got for x in e["extra_keys"][1 if e is got[0] else 0 :])
    finally:
        ctx.term()
        pub.close()


def test_a_flood_with_no_subscriber_and_with_stalled_ones_stays_within_the_bounds(
    cache: TieredCache, tmp_path: Path
) -> None:
    """Operator and tenant streams, 1,024-block chains with the longest adapter id and salt:
    the replay buffers never hold more than their caps, connections past ``max_peers`` are
    refused, and replay requesters that never read get their answers cut."""
    a = namespace(cache, tenant="a", adapter_id=LONG, adapter_revision="1", cache_salt=LONG)
    b = namespace(cache, tenant="b", adapter_id=LONG, adapter_revision="1", cache_salt=LONG)
    for ns, base in ((a, 1), (b, 5000)):
        put(cache, ns, keys(*range(base, base + 1024)))
    q = EventQueue(1 << 22)
    s = settings(
        tmp_path,
        stream_buffer_bytes=256 << 10,
        buffer_bytes=640 << 10,
        max_message_bytes=16 << 10,
        replay_max_bytes=32 << 10,
        send_hwm=4,
        max_peers=2,
    )
    pub = EventPublisher(s, q)
    ctx = zmq.Context()
    stalled: list[Any] = []
    try:
        pub.start({"a": 128 << 10, "b": 1 << 30})  # a's buffered_bytes quota: 128 KiB
        for _ in range(3):  # subscribers that never read: one more than max_peers
            sub = ctx.socket(zmq.SUB)
            sub.set_hwm(1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp_path}/op")
            stalled.append(sub)
        until(lambda: pub.figures()["event_connections_refused"] >= 1, "no refusal")
        records = [("stored", "CPU", list(ns.entries.values())) for ns in (a, b)]
        for _ in range(20):  # ~20 x 2 x 600 KiB of messages, twice: far past every bound
            q.put(records)
            held = pub.figures()["event_buffered_bytes"]
            assert held <= s.buffer_bytes, held
        # (asked once the buffers are full: a request served before the flood is answered from
        # an empty buffer, and nothing is cut)
        until(lambda: pub.figures()["event_buffer_dropped_messages"] > 0, "buffers never full")
        for _ in range(2):  # requesters that ask and never read
            req = ctx.socket(zmq.DEALER)
            req.set_hwm(1)
            req.connect(f"ipc://{tmp_path}/op-r")
            for _ in range(20):
                req.send_multipart([b"", bytes(8)])
            stalled.append(req)
        until(lambda: pub.figures()["event_replay_requests"] >= 40, "requests unread")
    finally:
        pub.close(5.0)  # everything queued sent
        for sock in stalled:
            sock.close(0)
        ctx.term()
    f = pub.figures()
    assert f["event_batches_published"] > 1000  # it did publish the flood
    assert f["event_buffered_bytes"] <= s.buffer_bytes
    assert f["event_buffer_dropped_messages"] > 0
    assert f["event_replays_cut"] >= 1  # 40 answers of 32 KiB, none read
    streams = pub._streams  # noqa: SLF001  (each stream's share: white-box on purpose)
    assert streams[""].buffer.held_bytes <= s.stream_buffer_bytes
    assert streams["a"].buffer.held_bytes <= 128 << 10  # its quota, not the stream cap
    assert streams["b"].buffer.held_bytes <= s.stream_buffer_bytes


def test_a_replay_answer_is_bounded_and_the_next_request_goes_on(cache: TieredCache, tmp_path: Path) -> None:
    ns = namespace(cache)
    q = EventQueue(1 << 20)
    pub = EventPublisher(settings(tmp_path, replay_max_bytes=1 << 10, send_hwm=8), q)
    ctx = zmq.Context()
    try:
        pub.start()
        for i in range(10):  # ten messages (one a turn: each put waits for the last)
            put(cache, ns, keys(100 + i))
            q.put([("stored", "CPU", [ns.entries[keys(100 + i)[0]]])])
            until(lambda: pub.figures()["event_blocks_queued"] == 0, "not taken")
        until(lambda: pub.figures()["event_batches_published"] >= 2, "not sent")
        first = replay(ctx, f"ipc://{tmp_path}/op-r", 0)
        assert 1 <= len(first) <= 7  # 1 KiB, and the end marker's room in a queue of 8
        rest = replay(ctx, f"ipc://{tmp_path}/op-r", first[-1][0] + 1)
        assert rest and rest[0][0] == first[-1][0] + 1
    finally:
        ctx.term()
        pub.close()


def test_only_prefixes_of_the_topic_are_applied_and_a_stray_one_closes_its_connection(tmp_path: Path) -> None:
    """Subscriptions "", "k" and "kv" to the topic "kv" receive; "kv-other" (no message could
    match it) is dropped and counted, its connection closed: libzmq keeps each one a peer sends
    until it disconnects (distinct ones grew a daemon 5.7 GiB). Subscribers of this process are
    closed with it (a peer is its process) and receive again once they reconnect."""
    q = EventQueue(1 << 20)
    pub = EventPublisher(EventSettings(endpoint=f"ipc://{tmp_path}/op", topic="kv"), q)
    ctx = zmq.Context()
    socks: list[Any] = []

    def sub(topic: bytes) -> Any:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, topic)
        s.connect(f"ipc://{tmp_path}/op")
        socks.append(s)
        return s

    def received(subs: list[Any]) -> bool:
        q.put([("cleared", None, [])])  # one more message (AllBlocksCleared) on the stream
        return all(s.poll(10) for s in subs)

    try:
        pub.start()
        stray = sub(b"kv-other")
        until(lambda: pub.figures()["event_subscriptions_dropped"] >= 1, "a stray subscription applied")
        good = [sub(b""), sub(b"k"), sub(b"kv")]
        until(lambda: received(good), "a prefix of the topic received nothing")
        assert not stray.poll(0)
        for s in good:
            topic, seq, payload = s.recv_multipart()
            assert topic == b"kv" and len(seq) == 8 and payload
    finally:
        for s in socks:
            s.close(0)
        pub.close()
        ctx.term()

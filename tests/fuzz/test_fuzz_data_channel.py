"""Fuzz target: the tcp data channel's parser (``DataChannelProtocol``), driven in process.

Each example builds a fresh rig (a TieredCache of 16 slots of 4 KiB, two namespaces, two
sessions), connects one channel to a fake transport that records what the daemon writes, and
feeds it one byte stream cut into chunks at arbitrary points (as the kernel would hand it over),
with control-plane events between chunks (the store job aborted and its slots given to another
session, the load job completed, the session closed or its lease lapsed, another client storing
enough to evict every unpinned block and write its own bytes into their slots). Half the
examples have a client that does not read: replies wait in the transport as the views the
protocol handed over and reach the "kernel" only at a ``drain`` event or at the end, so a slot
reused meanwhile would send its new bytes (issue 12, finding 1).

The rig, in slots (``me`` is the fuzzed connection's session, ``other`` another client)::

    canary  other's 4 committed blocks in another namespace        never change (until evicted)
    loaded  3 committed blocks, pinned by me's load job            DATA carries them, whenever sent
    store   4 slots reserved by me's store job (tcp)               the only bytes me may change
    foreign 2 slots reserved by other's store job (tcp)            never change
    pinned  me's pinned-lookup job on loaded block 1                a READ of it is refused

Streams are drawn two ways: arbitrary bytes (after a HELLO or not), and structured frames (valid
headers with random ops, job ids, indexes, counts and lengths, and well-formed WRITE / WRITE_RUN
/ FLUSH / READ sequences), then optionally corrupted by byte flips. Properties, every example:

* the parser never raises, and never offers an empty buffer;
* no byte of the arena changes outside me's store slots (canary, loaded, foreign, free slots;
  a slot handed to other keeps other's bytes);
* what the daemon wrote parses as whole reply frames (HELLO_OK, ACK with a known status, DATA /
  DATA_RUN carrying exactly the loaded blocks, ERROR with a UTF-8 message of at most 4096
  bytes), and the connection was closed exactly when the last frame is an ERROR;
* afterwards the index is consistent: committing me's store job commits exactly the keys whose
  bytes arrived, and once both sessions are gone nothing is pinned or being written.

Inputs worth keeping live in ``tests/fuzz/corpus/data_channel/*.json`` (replayed first, by
``test_corpus``); the format is the ``Case`` below. Run length: tests/fuzz/fuzzing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from fuzzing import corpus_json, fuzz_settings, note
from hypothesis import given
from hypothesis import strategies as st

from kvtier_contract import wire
from kvtier_contract.errors import KvtierError
from kvtier_contract.identity import Namespace
from kvtier_contract.wire import Op, Status
from kvtierd.cache import TieredCache
from kvtierd.cache.lookup import LookupOptions
from kvtierd.domain import StoreStatus, Transport
from kvtierd.policies import make_policy
from kvtierd.sessions import SessionTable
from kvtierd.tiers import Arena, HostTier
from kvtierd.transports.tcp import DataChannelProtocol

KIB = 1024
BLOCK = 4 * KIB
SLOTS = 16
MAX_SENT = 3 * BLOCK  # payload bytes a drawn frame carries at most (its header may claim more)
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
REPLY_OPS = {Op.HELLO_OK, Op.ACK, Op.DATA, Op.DATA_RUN, Op.ERROR}
JOB_NAMES = ("store", "load", "foreign", "pinned")
SESSION_NAMES = ("me", "other", "gone")
ACTIONS = ("abort", "unpin", "close", "expire", "drain", "evict", "complete+evict")


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


def payload(i: int) -> bytes:
    """The committed bytes of block ``i``: distinct per key, never all zero."""
    return hashlib.shake_256(b"block %d" % i).digest(BLOCK)


def spec(model: str) -> Namespace:
    """4 KiB blocks: 4 tokens x 1 layer x 1 head x 256 dim x float16 x (k, v)."""
    return Namespace(
        model_id=model,
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=256,
    )


class FakeTransport:
    """What the channel wrote and whether it closed the connection; answers the transport calls
    a protocol may make.

    Fast (the default): every write is copied at once, as the kernel copies an accepted send.
    Slow (a client that does not read): writes wait in ``queue`` as the objects handed over (a
    DATA frame is a view of its slot) and count in ``get_write_buffer_size``; ``drain`` hands
    them to the "kernel" (copies them into ``out``, then tells the protocol the buffer emptied),
    so a slot reused before the drain would send its new bytes, as a real socket would.
    """

    def __init__(self, slow: bool = False) -> None:
        self.slow = slow
        self.out = bytearray()
        self.queue: list[Any] = []
        self.closed = False
        self.paused = False
        self.protocol: Any = None

    def write(self, data: Any) -> None:
        assert not self.closed, "a write after close"
        if self.slow:
            self.queue.append(data)
        else:
            self.out += bytes(data)

    def writelines(self, frames: Any) -> None:
        for f in frames:
            self.write(f)

    def drain(self) -> None:
        if not self.queue:
            return
        for data in self.queue:
            self.out += bytes(data)
        self.queue.clear()
        if self.protocol is not None and not self.closed:
            self.protocol.resume_writing()

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return sum(len(memoryview(d)) for d in self.queue)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Rig:
    """The cache, sessions and jobs of the module docstring, built for one example."""

    def __init__(self) -> None:
        self.arena = Arena(SLOTS * BLOCK, prefault=False)
        host = HostTier(self.arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
        self.cache = TieredCache(
            host, make_policy("lru", ghost_capacity=16), max_namespaces=4, policy_name="lru"
        )
        self.sessions = SessionTable(
            max_sessions=8,
            default_ttl_s=10,
            min_ttl_s=1,
            max_ttl_s=100,
            on_release=self.cache.release_session,
        )
        self.ns = self.cache.register_namespace(spec("fuzz"))
        self.canary_ns = self.cache.register_namespace(spec("canary"))
        self.me = self.sessions.open("fuzzer", 10, Transport.TCP)
        self.other = self.sessions.open("other", 10, Transport.TCP)
        gone = self.sessions.open("gone", 10, Transport.TCP)
        self.gone_id = gone.id
        self.sessions.close(gone.id)
        self.canary = self.commit(self.canary_ns, 101, 102, 103, 104)
        self.loaded = self.commit(self.ns, 1, 2, 3)
        load, deferred = _done(self.cache.prepare_load(self.me, self.ns, keys(1, 2, 3), Transport.TCP))
        assert load is not None and not deferred
        pinned = _done(self.cache.lookup(self.ns, keys(1), LookupOptions(pin=self.me))).job
        assert pinned is not None
        store, status, self.store_slots = self.cache.stores.reserve(
            self.me, self.ns, keys(11, 12, 13, 14), Transport.TCP
        )
        assert store is not None and set(status) == {StoreStatus.RESERVED}
        self.jobs = {
            "store": store.id,
            "load": load.id,
            "pinned": pinned.id,
            "foreign": self.reserve_foreign(21, 22),
        }
        self.store_job = store
        self.snapshot = bytes(self.arena.mm)
        self.foreign: dict[int, bytes] = {}  # slot offset -> marker bytes other wrote there
        self.as_other = False  # the stream says HELLO with other's session id: it *is* other
        self.evicted = False  # an "evict" action ran: canary and loaded blocks may be gone
        self.mark_foreign()

    def commit(self, ns: Any, *ids: int) -> dict[int, bytes]:
        """Store blocks ``ids`` whole (shm: the client writes the slot itself): offset -> bytes."""
        job, _, offsets = self.cache.stores.reserve(self.other, ns, keys(*ids), Transport.SHM)
        assert job is not None
        for off, i in zip(offsets, ids, strict=True):
            self.arena.mm[off : off + BLOCK] = payload(i)
        self.cache.complete_store(self.other, job.id, ok=True)
        return {off: payload(i) for off, i in zip(offsets, ids, strict=True)}

    def reserve_foreign(self, *ids: int) -> int:
        """Other's tcp store job on ``ids`` (its slots get marker bytes: mark_foreign)."""
        job, _, offsets = self.cache.stores.reserve(self.other, self.ns, keys(*ids), Transport.TCP)
        assert job is not None
        self._pending = [o for o in offsets if o]
        return job.id

    def mark_foreign(self) -> None:
        for off in self._pending:
            marker = hashlib.shake_256(b"foreign %d" % off).digest(BLOCK)
            self.arena.mm[off : off + BLOCK] = marker
            self.foreign[off] = marker
        self._pending = []

    def ident(self, name: str | int) -> int:
        """The id a frame's symbolic job or session name stands for."""
        if isinstance(name, int):
            return name
        sessions = {"me": self.me.id, "other": self.other.id, "gone": self.gone_id}
        return self.jobs.get(name) or sessions[name]

    def act(self, action: str, transport: FakeTransport) -> None:
        """A control-plane event between two chunks of the stream (or the slow client reads)."""
        if action == "abort" and self.cache.jobs.is_live(self.store_job):
            self.cache.complete_store(self.me, self.store_job.id, ok=False)
            self.reserve_foreign(31, 32, 33, 34)  # the freed slots go to another client
            self.mark_foreign()
        elif action == "unpin" and self.jobs["load"] in self.me.load_jobs:
            with contextlib.suppress(KvtierError):  # refused while its bytes are queued
                self.cache.complete_load(self.me, self.jobs["load"])
        elif action == "close" and not self.me.released:
            self.sessions.close(self.me.id)
        elif action == "expire" and not self.me.released:
            self.me.deadline = 0.0
            self.sessions.sweep()
        elif action == "drain":
            transport.drain()
        elif action == "evict":
            self.evict()
        elif action == "complete+evict":  # the client ends its load, the tier gets busy
            self.act("unpin", transport)
            self.evict()
            self.evict()

    def evict(self) -> None:
        """Other commits 8 new blocks: the cache evicts unpinned blocks (the canary, and the
        loaded ones once unpinned) and other writes its bytes into their slots."""
        self.evicted = True
        base = 1000 + 8 * len(self.foreign)
        job, _, _ = self.cache.stores.reserve(
            self.other, self.ns, keys(*range(base, base + 8)), Transport.SHM
        )
        if job is None:
            return
        self._pending = [e.offset for e in job.items.values()]
        self.mark_foreign()
        self.cache.complete_store(self.other, job.id, ok=True)

    def close(self) -> None:
        self.arena.close()


def _done(coro: Any) -> Any:
    """Run a coroutine that never suspends (the host-only cache awaits nothing)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("the coroutine suspended")


# ---- one input ---------------------------------------------------------------------------------


@dataclass
class Case:
    """One fuzz input. ``frames``: dicts ``{op, job, index, status, length, sent, fill}`` (job a
    JOB_NAMES name or an id, for HELLO a SESSION_NAMES name or an id; ``sent`` payload bytes that
    follow the header, None for ``min(length, MAX_SENT)``) or ``{raw: hex}``. ``flips``: (byte
    position, xor mask) applied to the encoded stream. ``chunks``: sizes the stream is cut into
    (the rest in one chunk). ``actions``: (chunk number, ACTIONS name) run before that chunk.
    ``slow``: the client does not read its socket (replies wait as views until a "drain")."""

    frames: list[dict[str, Any]]
    flips: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    actions: list[tuple[int, str]] = field(default_factory=list)
    slow: bool = False

    def encode(self, rig: Rig) -> bytes:
        out = bytearray()
        for f in self.frames:
            if "raw" in f:
                out += bytes.fromhex(f["raw"])
                continue
            op, length = f["op"], f["length"]
            ident = rig.ident(f["job"])
            if op == Op.HELLO and f.get("secret", True) and f["job"] in ("me", "other"):
                secret = (rig.me if f["job"] == "me" else rig.other).data_secret
                rig.as_other |= f["job"] == "other"
                out += wire.HEADER.pack(wire.MAGIC, op, ident, f["index"], f["status"], len(secret)) + secret
                continue
            out += wire.HEADER.pack(wire.MAGIC, op, ident & U64, f["index"], f["status"], length)
            sent = f.get("sent")
            out += bytes([f.get("fill", 0x5A)]) * min(length, MAX_SENT if sent is None else sent)
        for pos, mask in self.flips:
            if out:
                out[pos % len(out)] ^= mask
        return bytes(out)


def frame(
    op: int,
    job: str | int,
    index: int = 0,
    status: int = 0,
    length: int = 0,
    sent: int | None = None,
    fill: int = 0x5A,
    secret: bool = True,
) -> dict[str, Any]:
    """``secret``: a HELLO for a live named session carries that session's data secret (else
    ``length`` fill bytes)."""
    return dict(
        op=int(op), job=job, index=index, status=status, length=length, sent=sent, fill=fill, secret=secret
    )


HELLO = frame(Op.HELLO, "me", status=wire.FEATURE_RUNS)

# ---- strategies --------------------------------------------------------------------------------

jobs = st.one_of(st.sampled_from(JOB_NAMES), st.integers(0, 8), st.integers(0, U64))
lengths = st.one_of(
    st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK, 4 * BLOCK, 5 * BLOCK]),
    st.integers(0, 3 * BLOCK),
    st.integers(0, U64),
)
random_frame = st.builds(
    frame,
    op=st.one_of(st.sampled_from([int(o) for o in Op]), st.integers(0, 255)),
    job=jobs,
    index=st.one_of(st.integers(0, 5), st.integers(0, U32)),
    status=st.one_of(st.integers(0, 5), st.integers(0, U32)),
    length=lengths,
    sent=st.one_of(st.none(), st.integers(0, MAX_SENT)),
    fill=st.integers(0, 255),
)


@st.composite
def store_frames(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A WRITE or WRITE_RUN of reserved-looking keys of a store job (its length now and then a
    little off, its payload now and then cut short), then its FLUSH."""
    job = draw(st.sampled_from(["store", "store", "foreign", "load"]))
    first = draw(st.integers(0, 4))
    count = draw(st.integers(1, 4))
    fill = draw(st.integers(0, 255))
    length = max(0, count * BLOCK + draw(st.sampled_from([0, 0, 0, 0, 0, -1, 1, BLOCK // 2])))
    sent = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, length)))
    if count == 1 and draw(st.booleans()):
        out = [frame(Op.WRITE, job, first, 0, length, sent=sent, fill=fill)]
    else:
        out = [frame(Op.WRITE_RUN, job, first, count, length, sent=sent, fill=fill)]
    return out + [frame(Op.FLUSH, job)]


random_hello = st.builds(
    frame,
    op=st.just(int(Op.HELLO)),
    job=st.one_of(st.sampled_from(SESSION_NAMES), st.integers(0, U64)),
    status=st.integers(0, U32),
    length=st.one_of(st.just(wire.DATA_SECRET_BYTES), lengths),
    secret=st.booleans(),
)
hello = st.one_of(st.just(HELLO), st.just(HELLO), st.just(HELLO), random_hello)
read = st.sampled_from([[frame(Op.READ, "load")], [frame(Op.READ, "pinned")]])
structured = st.builds(  # most steps well formed, so that inputs get past the first frame
    lambda first, rest: [first, *(f for group in rest for f in group)],
    hello,
    st.lists(
        st.one_of(store_frames(), store_frames(), store_frames(), read, random_frame.map(lambda f: [f])),
        max_size=8,
    ),
)
raw = st.builds(
    lambda first, data: first + [{"raw": data.hex()}], st.sampled_from([[], [HELLO]]), st.binary(max_size=200)
)
cases = st.builds(
    Case,
    frames=st.one_of(structured, structured, raw),
    flips=st.one_of(
        st.just([]),
        st.just([]),
        st.just([]),
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=3),
    ),
    chunks=st.lists(st.one_of(st.integers(1, 40), st.integers(1, 2 * BLOCK)), max_size=12),
    actions=st.one_of(
        st.just([]), st.lists(st.tuples(st.integers(0, 12), st.sampled_from(ACTIONS)), max_size=4)
    ),
    slow=st.booleans(),
)


# ---- the target --------------------------------------------------------------------------------


def run_case(case: Case) -> None:
    """Feed one case to a fresh rig and check every property of the module docstring."""
    rig = Rig()
    try:
        asyncio.run(_drive(rig, case))  # a running loop, for a protocol that sets timers
    finally:
        rig.close()


async def _drive(rig: Rig, case: Case) -> None:
    channel, transport = DataChannelProtocol(rig.cache, rig.sessions), FakeTransport(case.slow)
    transport.protocol = channel
    channel.connection_made(transport)  # type: ignore[arg-type]
    data = case.encode(rig)
    actions: dict[int, list[str]] = {}
    for n, name in case.actions:
        actions.setdefault(n, []).append(name)
    pos, chunk_no = 0, 0
    while pos < len(data) and not transport.closed and not transport.paused:
        for name in actions.get(chunk_no, []):
            rig.act(name, transport)
        size = case.chunks[chunk_no] if chunk_no < len(case.chunks) else len(data) - pos
        chunk, pos, chunk_no = data[pos : pos + size], pos + size, chunk_no + 1
        while chunk and not transport.closed:
            buf = channel.get_buffer(len(chunk))
            assert len(buf) > 0, "get_buffer offered no room"
            n = min(len(buf), len(chunk))
            buf[:n] = chunk[:n]
            channel.buffer_updated(n)
            chunk = chunk[n:]
    for name in (a for n, names in actions.items() if n >= chunk_no for a in names):
        rig.act(name, transport)  # what the stream did not reach still happens
    transport.drain()  # the client reads at last
    channel.connection_lost(None)
    check_replies(rig, bytes(transport.out), transport.closed)
    check_arena(rig)
    check_index(rig)


def check_replies(rig: Rig, out: bytes, closed: bool) -> None:
    """Whole reply frames, DATA carrying exactly the loaded blocks; ERROR last, iff closed."""
    loaded = [payload(i) for i in (1, 2, 3)]  # the load job's key indexes 0, 1, 2
    pos, errored = 0, False
    while pos < len(out):
        assert not errored, "a frame after ERROR"
        assert len(out) - pos >= wire.HEADER.size, "a torn reply header"
        op, job, index, status, length = wire.unpack(out[pos : pos + wire.HEADER.size])
        body = out[pos + wire.HEADER.size : pos + wire.HEADER.size + length]
        assert len(body) == length, "a torn reply payload"
        pos += wire.HEADER.size + length
        assert op in REPLY_OPS, f"the daemon sent {op.name}"
        note(f"reply {op.name}" + (f" {Status(status).name}" if op is Op.ACK else ""))
        if op is Op.HELLO_OK:
            assert job in (rig.me.id, rig.other.id) and status & ~wire.FEATURE_RUNS == 0
        elif op is Op.ACK:
            assert status in set(Status), status
        elif op in (Op.DATA, Op.DATA_RUN):
            n = 1 if op is Op.DATA else status
            assert job == rig.jobs["load"] and length == n * BLOCK and index + n <= len(loaded)
            for k in range(n):
                assert body[k * BLOCK : (k + 1) * BLOCK] == loaded[index + k], "foreign bytes sent"
        else:
            errored = True
            assert length <= wire.MAX_ERROR_BYTES
            body.decode()
    assert closed == errored, "closed without an ERROR" if closed else "ERROR but left open"


def check_arena(rig: Rig) -> None:
    """Only me's store slots may have changed; the foreign slots hold other's markers (unless
    the stream bound the connection to other's session: its id is the credential)."""
    after = rig.arena.mm
    for off in range(0, SLOTS * BLOCK, BLOCK):
        if off in rig.foreign:  # also a slot of me's aborted job, handed to other since
            assert rig.as_other or after[off : off + BLOCK] == rig.foreign[off], f"foreign slot {off} written"
        elif off not in rig.store_slots:
            assert after[off : off + BLOCK] == rig.snapshot[off : off + BLOCK], (
                f"slot {off} (not me's) written"
            )
    for off, data in {**rig.canary, **rig.loaded}.items():
        assert off in rig.foreign or after[off : off + BLOCK] == data


def check_index(rig: Rig) -> None:
    """Commit what me's store job received; after both sessions go, nothing is held."""
    cache = rig.cache
    if cache.jobs.is_live(rig.store_job):
        committed, aborted = cache.complete_store(rig.me, rig.store_job.id, ok=True)
        assert committed + aborted == 4
        assert committed == len(rig.store_job.received)
        note(f"store job committed {committed} of 4")
    rig.sessions.close_all()
    assert cache.writing_blocks == 0 and cache.pinned_blocks == 0
    if not rig.evicted:
        assert _done(cache.lookup(rig.canary_ns, keys(101, 102, 103, 104))).hit == 4
        assert _done(cache.lookup(rig.ns, keys(1, 2, 3))).hit == 3


# ---- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", corpus_json("data_channel"), ids=lambda e: e["name"])
def test_corpus(entry: dict[str, Any]) -> None:
    """Every kept input still holds every property."""
    run_case(
        Case(
            frames=entry["frames"],
            flips=[tuple(f) for f in entry.get("flips", [])],
            chunks=entry.get("chunks", []),
            actions=[tuple(a) for a in entry.get("actions", [])],
            slow=entry.get("slow", False),
        )
    )


@fuzz_settings(400)
@given(case=cases)
def test_any_stream_keeps_every_property(case: Case) -> None:
    run_case(case)

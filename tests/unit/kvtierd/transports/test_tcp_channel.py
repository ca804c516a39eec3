"""The tcp data channel's sending side and limits, driven in process over a tiny cache.

The host tier holds exactly four 4 KiB blocks. ``Kernel`` stands in for the transport: the
kernel takes ``room`` bytes at once (copied, as a send copies), the rest waits in the write buffer
as the views themselves (as uvloop holds them) until the peer reads. Expected state in comments:
``[1* 2* 3* 4*]`` resident blocks, ``*`` pinned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tests_helpers import feed

from kvtier_contract import wire
from kvtier_contract.identity import Namespace
from kvtier_contract.wire import Op
from kvtierd.cache import TieredCache
from kvtierd.domain import StoreStatus, Transport
from kvtierd.index import NamespaceState
from kvtierd.policies import make_policy
from kvtierd.sessions import SessionTable
from kvtierd.tiers import Arena, HostTier
from kvtierd.transports.tcp import DataChannelLimits, DataChannelProtocol, DataChannelServer
from kvtierd.transports.tcp_admission import ConnectionTable

BLOCK = 4096
HDR = wire.HEADER.size
RESERVED, REJECTED = StoreStatus.RESERVED, StoreStatus.REJECTED


class Kernel:
    """A transport with write limits 0/0: ``pause_writing`` once anything waits, ``resume_writing``
    when the peer has taken it all."""

    def __init__(self, room: int) -> None:
        self.room = room  # bytes the kernel still takes at once
        self.received = bytearray()  # what reached the peer's side
        self.queue: list[memoryview] = []  # views waiting in the write buffer
        self.protocol: DataChannelProtocol | None = None
        self.limits: tuple[int, int] | None = None
        self.reading = True
        self.closed = False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        self.limits = (high, low)

    def write(self, data: Any) -> None:
        self.writelines([data])

    def writelines(self, frames: Any) -> None:
        self.queue += [memoryview(f) for f in frames]
        self._push()

    def _push(self) -> None:
        while self.queue and self.room:
            v = self.queue[0]
            n = min(len(v), self.room)
            self.received += v[:n]
            self.room -= n
            if n == len(v):
                self.queue.pop(0)
            else:
                self.queue[0] = v[n:]

    def get_write_buffer_size(self) -> int:
        return sum(len(v) for v in self.queue)

    def peer_reads_all(self) -> None:
        waited = bool(self.queue)
        self.room = 1 << 40
        self._push()
        if waited and self.protocol is not None:
            self.protocol.resume_writing()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True
        self.queue = []  # the views are dropped
        if self.protocol is not None:
            self.protocol.connection_lost(None)


class Rig:
    def __init__(self) -> None:
        self.arena = Arena(4 * BLOCK, prefault=False)
        host = HostTier(self.arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
        self.cache = TieredCache(host, make_policy("lru", ghost_capacity=16), max_namespaces=4)
        self.sessions = SessionTable(
            max_sessions=8,
            default_ttl_s=10,
            min_ttl_s=0.1,
            max_ttl_s=100,
            on_release=self.cache.release_session,
        )
        self.a = self.cache.register_namespace(spec("a"))
        self.b = self.cache.register_namespace(spec("b"))
        self.s = self.sessions.open("reader", 10, Transport.TCP)

    def put(self, ns: NamespaceState, *ids: int) -> bytes:
        """Store blocks ``ids`` of ``ns``, block ``i`` being 4 KiB of byte ``i``."""
        job, status, offsets = self.cache.stores.reserve(self.s, ns, keys(*ids), Transport.SHM)
        if job is not None:
            for i, st, off in zip(ids, status, offsets, strict=True):
                if st == RESERVED:
                    self.cache.host.view(off, BLOCK)[:] = bytes([i]) * BLOCK
            self.cache.complete_store(self.s, job.id, ok=True)
        return status

    def connect(self, room: int, server: ConnectionTable | None = None) -> tuple[DataChannelProtocol, Kernel]:
        channel, kernel = DataChannelProtocol(self.cache, self.sessions, server), Kernel(1 << 20)
        kernel.protocol = channel
        channel.connection_made(kernel)  # type: ignore[arg-type]
        feed(channel, wire.hello(self.s.id, self.s.data_secret))
        if wire.unpack(bytes(kernel.received[:HDR]))[0] is Op.HELLO_OK:
            del kernel.received[:HDR]
        kernel.room = room  # from here on
        return channel, kernel


def spec(model: str) -> Namespace:
    return Namespace(
        model_id=model,
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=BLOCK // 16,
    )


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


def blocks_of(received: bytes | bytearray) -> list[bytes]:
    """The payloads of the DATA frames in ``received``."""
    out, pos = [], 0
    while pos < len(received):
        op, _job, _index, _status, length = wire.unpack(received[pos : pos + HDR])
        assert op is Op.DATA
        out.append(bytes(received[pos + HDR : pos + HDR + length]))
        pos += HDR + length
    return out


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.arena.close()


def test_complete_load_keeps_the_pins_until_the_queued_bytes_leave(rig: Rig) -> None:
    rig.put(rig.a, 1, 2, 3, 4)
    job = rig.cache.prepare_load(rig.s, rig.a, keys(1, 2, 3, 4), Transport.TCP)
    load, _ = asyncio.run(job)
    assert load is not None
    channel, kernel = rig.connect(room=HDR + BLOCK)  # the kernel takes the first block only
    feed(channel, wire.pack(Op.READ, load.id))
    assert kernel.get_write_buffer_size() == 3 * (HDR + BLOCK)
    rig.cache.complete_load(rig.s, load.id)  # at once; the job is gone
    # [1* 2* 3* 4*]: blocks 2..4 still wait on the connection, and block 1 with them
    assert rig.cache.pinned_blocks == 4
    assert rig.put(rig.b, 9) == bytes([REJECTED])
    kernel.peer_reads_all()
    assert blocks_of(kernel.received) == [bytes([i]) * BLOCK for i in (1, 2, 3, 4)]
    # [1 2 3 4]: every byte left, the pins went
    assert rig.cache.pinned_blocks == 0
    assert rig.put(rig.b, 9) == bytes([RESERVED])


def test_a_lost_connection_drops_its_views_and_the_pins(rig: Rig) -> None:
    rig.put(rig.a, 1, 2)
    load, _ = asyncio.run(rig.cache.prepare_load(rig.s, rig.a, keys(1, 2), Transport.TCP))
    assert load is not None
    channel, kernel = rig.connect(room=0)
    feed(channel, wire.pack(Op.READ, load.id))
    rig.sessions.close(rig.s.id)  # the session ends: its job with it, not the pins
    assert rig.cache.pinned_blocks == 2 and rig.s.load_jobs == set()
    kernel.abort()  # the connection goes, and the views queued on it
    assert rig.cache.pinned_blocks == 0
    assert kernel.received == b""


def test_a_job_read_on_two_connections_keeps_its_pins_until_both_drain(rig: Rig) -> None:
    rig.put(rig.a, 1)
    load, _ = asyncio.run(rig.cache.prepare_load(rig.s, rig.a, keys(1), Transport.TCP))
    assert load is not None
    (c1, k1), (c2, k2) = rig.connect(room=0), rig.connect(room=0)
    feed(c1, wire.pack(Op.READ, load.id))
    feed(c2, wire.pack(Op.READ, load.id))
    rig.cache.complete_load(rig.s, load.id)
    k1.peer_reads_all()
    assert rig.cache.pinned_blocks == 1  # c2 still holds views of block 1
    k2.peer_reads_all()
    assert rig.cache.pinned_blocks == 0


def test_a_bare_protocol_that_sends_everything_at_once_pins_nothing_longer(rig: Rig) -> None:
    rig.put(rig.a, 1)
    load, _ = asyncio.run(rig.cache.prepare_load(rig.s, rig.a, keys(1), Transport.TCP))
    assert load is not None
    channel, kernel = rig.connect(room=1 << 20)
    feed(channel, wire.pack(Op.READ, load.id))
    rig.cache.complete_load(rig.s, load.id)
    assert rig.cache.pinned_blocks == 0 and blocks_of(kernel.received) == [bytes([1]) * BLOCK]


# ---- limits (a server owns the connection) ----------------------------------------------------


class Timer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """The connections' timers on a hand-driven clock: ``advance`` runs the timers due, in
    order, each at its own time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[Timer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(self.now + delay, callback)
        self._timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while due := [t for t in self._timers if not t.cancelled and t.when <= end]:
            timer = min(due, key=lambda t: t.when)
            self._timers.remove(timer)
            self.now = timer.when
            timer.callback()
        self.now = end


def server(rig: Rig, clock: Clock | None = None, **limits: Any) -> ConnectionTable:
    """The connection table of a data-channel server (what its connections are handed)."""
    srv = DataChannelServer(
        "127.0.0.1", 0, rig.cache, rig.sessions, DataChannelLimits(**limits), timers=clock
    )
    return srv.table


def error_of(kernel: Kernel) -> str:
    op, *_, length = wire.unpack(bytes(kernel.received[:HDR]))
    assert op is Op.ERROR
    return bytes(kernel.received[HDR : HDR + length]).decode()


def test_reading_pauses_while_replies_go_unread(rig: Rig) -> None:
    async def scenario() -> None:
        rig.put(rig.a, 1, 2)
        load, _ = await rig.cache.prepare_load(rig.s, rig.a, keys(1, 2), Transport.TCP)
        assert load is not None
        channel, kernel = rig.connect(0, server(rig, max_queued_bytes=BLOCK))
        assert kernel.limits == (0, 0)
        feed(channel, wire.pack(Op.READ, load.id))
        assert not kernel.reading  # 2 blocks wait, more than max_queued_bytes
        kernel.peer_reads_all()
        assert kernel.reading
        kernel.abort()

    asyncio.run(scenario())


def test_no_hello_in_time_and_idle_connections_are_closed(rig: Rig) -> None:
    async def scenario() -> None:
        clock = Clock()
        srv = server(rig, clock, hello_timeout_s=0.05, idle_timeout_s=0.1)
        silent = Kernel(1 << 20)
        channel = DataChannelProtocol(rig.cache, rig.sessions, srv)
        silent.protocol = channel
        channel.connection_made(silent)  # type: ignore[arg-type]
        _, idle = rig.connect(1 << 20, srv)
        clock.advance(0.08)
        assert silent.closed and "no HELLO" in error_of(silent)
        assert not idle.closed
        clock.advance(0.2)
        assert idle.closed and "idle" in error_of(idle)
        assert srv.timed_out == 2

    asyncio.run(scenario())


def test_a_peer_that_stops_reading_is_dropped_at_the_idle_timeout(rig: Rig) -> None:
    async def scenario() -> None:
        rig.put(rig.a, 1)
        load, _ = await rig.cache.prepare_load(rig.s, rig.a, keys(1), Transport.TCP)
        assert load is not None
        clock = Clock()
        channel, kernel = rig.connect(0, server(rig, clock, idle_timeout_s=0.1))
        feed(channel, wire.pack(Op.READ, load.id))
        rig.cache.complete_load(rig.s, load.id)
        assert rig.cache.pinned_blocks == 1
        clock.advance(0.3)
        assert kernel.closed and rig.cache.pinned_blocks == 0

    asyncio.run(scenario())


def test_one_connection_beyond_the_cap_is_refused(rig: Rig) -> None:
    async def scenario() -> None:
        srv = server(rig, max_connections=1)
        first, k1 = rig.connect(1 << 20, srv)
        second, k2 = rig.connect(1 << 20, srv)
        assert k2.closed and "too many data connections" in error_of(k2)
        assert (srv.accepted, srv.refused) == (1, 1)
        first.connection_lost(None)
        second.connection_lost(None)
        _third, k3 = rig.connect(1 << 20, srv)
        assert not k3.closed and srv.figures()["tcp_connections"] == 1

    asyncio.run(scenario())

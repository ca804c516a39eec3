"""kvtierd.transports.control.ControlChannel against its tenant's ledger, without sockets: a fake
transport and a fake service. Every byte the channel holds is counted while it holds it (a
frame not yet whole, the request being served, a reply the peer has not read) and given back,
and the channel itself is one of its tenant's ``control_channels``."""

from __future__ import annotations

import asyncio
from typing import Any

from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.gate import ChannelDispatch
from kvtierd.tenancy import Tenancy
from kvtierd.transports.control import BUFFERED, CHANNELS, ControlChannel

BEAT = wire.CONTROL_METHODS.index("Heartbeat") + 1


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.unread = 0  # what get_write_buffer_size says: the peer's unread replies
        self.closing = False

    def set_write_buffer_limits(self, high: int, low: int) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def get_write_buffer_size(self) -> int:
        return self.unread

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


class FakeService:
    """What a channel calls: the tenancy, the handlers, the error counts."""

    def __init__(self) -> None:
        self.tenancy = Tenancy(None)
        self.gate = asyncio.Event()  # a call waits on it: "being served"

    async def Heartbeat(self, request: Any, context: Any) -> Any:  # noqa: N802 (the RPC's name)
        await self.gate.wait()
        return pb.HeartbeatReply(boot_epoch=7)

    def count_error(self, method: str, code: str) -> None: ...


def frame(session_id: int = 5) -> bytes:
    body = pb.HeartbeatRequest(session_id=session_id).SerializeToString()
    return wire.CALL.pack(len(body), BEAT, 1000) + body


async def served() -> None:
    """Until every call the channel started has ended (no sleeps: the tasks themselves)."""
    await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))


def opened() -> tuple[FakeService, FakeTransport, ControlChannel]:
    svc, t = FakeService(), FakeTransport()
    ch = ControlChannel(ChannelDispatch(svc), 5, None, lambda _c: None)  # type: ignore[arg-type]
    ch.connection_made(t)  # type: ignore[arg-type]
    return svc, t, ch


def test_every_byte_held_is_counted_and_given_back() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        ledger = svc.tenancy.ledger
        assert ledger.held(None, CHANNELS) == 1
        f = frame()
        ch.data_received(f[:4])  # half a head: held
        assert ledger.held(None, BUFFERED) == 4
        ch.data_received(f[4:])  # whole: being served (its task started), still held
        assert ledger.held(None, BUFFERED) == len(f)
        t.unread = 100  # the peer does not read the reply
        svc.gate.set()
        await served()
        assert len(t.written) == 1 and ledger.held(None, BUFFERED) == 100
        t.unread = 0  # it read it: noticed with the next bytes
        ch.data_received(f[:3])
        assert ledger.held(None, BUFFERED) == 3
        ch.connection_lost(None)
        assert ledger.held(None, BUFFERED) == 0 and ledger.held(None, CHANNELS) == 0

    asyncio.run(scenario())


def test_a_call_in_flight_gives_its_bytes_back_after_the_connection_is_lost() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        ledger = svc.tenancy.ledger
        ch.data_received(frame())
        ch.connection_lost(None)  # the call is still waiting
        assert ledger.held(None, BUFFERED) == len(frame())
        svc.gate.set()
        await served()
        assert ledger.held(None, BUFFERED) == 0 and not t.written  # nothing sent, all given

    asyncio.run(scenario())


def test_a_closed_channel_serves_nothing_more() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        svc.gate.set()
        ch.close()
        t.closing = False  # (a TLS transport flushing: still delivers what it decrypts)
        ch.data_received(frame())
        await served()
        assert not t.written and svc.tenancy.ledger.held(None, BUFFERED) == 0

    asyncio.run(scenario())

"""kvtierd.transports.control.ControlChannel against the cache's admission, without sockets: a
fake transport and a fake service. Every byte the channel holds is counted while it holds it (a
frame not yet whole, the request being served, a reply the peer has not read) and given back,
and the channel itself is one of its tenant's ``control_channels``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache.admission import Admission
from kvtierd.cache.jobs import JobTable
from kvtierd.service.gate import ChannelDispatch
from kvtierd.tenancy import Tenancy
from kvtierd.tenants import token_digest
from kvtierd.tenants_file import load_tenants
from kvtierd.transports.control import ControlChannel

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


class FakeCache:
    def __init__(self, tenancy: Tenancy) -> None:
        self.admission = Admission(tenancy, {}, JobTable())


class FakeService:
    """What a channel calls: the cache's admission, the handlers, the error counts."""

    def __init__(self, tenancy: Tenancy | None = None) -> None:
        self.cache = FakeCache(tenancy or Tenancy(None))
        self.bad_frames = 0
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


def opened(
    svc: FakeService | None = None, tenant: str | None = None
) -> tuple[FakeService, FakeTransport, ControlChannel]:
    svc, t = svc or FakeService(), FakeTransport()
    ch = ControlChannel(ChannelDispatch(svc), 5, tenant, lambda _c: None)  # type: ignore[arg-type]
    ch.connection_made(t)  # type: ignore[arg-type]
    return svc, t, ch


def test_every_byte_held_is_counted_and_given_back() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        adm = svc.cache.admission
        assert adm.held_channels(None) == 1
        f = frame()
        ch.data_received(f[:4])  # half a head: held
        assert adm.held_buffered(None) == 4
        ch.data_received(f[4:])  # whole: being served (its task started), still held
        assert adm.held_buffered(None) == len(f)
        t.unread = 100  # the peer does not read the reply
        svc.gate.set()
        await served()
        assert len(t.written) == 1 and adm.held_buffered(None) == 100
        t.unread = 0  # it read it: noticed with the next bytes
        ch.data_received(f[:3])
        assert adm.held_buffered(None) == 3
        ch.connection_lost(None)
        assert adm.held_buffered(None) == 0 and adm.held_channels(None) == 0

    asyncio.run(scenario())


def test_a_call_in_flight_gives_its_bytes_back_after_the_connection_is_lost() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        adm = svc.cache.admission
        ch.data_received(frame())
        ch.connection_lost(None)  # the call is still waiting
        assert adm.held_buffered(None) == len(frame())
        svc.gate.set()
        await served()
        assert adm.held_buffered(None) == 0 and not t.written  # nothing sent, all given

    asyncio.run(scenario())


def test_a_closed_channel_serves_nothing_more() -> None:
    async def scenario() -> None:
        svc, t, ch = opened()
        svc.gate.set()
        ch.close()
        t.closing = False  # (a TLS transport flushing: still delivers what it decrypts)
        ch.data_received(frame())
        await served()
        assert not t.written and svc.cache.admission.held_buffered(None) == 0

    asyncio.run(scenario())


def test_a_tenants_channel_past_its_quota_is_closed_and_a_closed_ones_bytes_come_back(tmp_path: Path) -> None:
    """Tenant ``t`` may hold 2 channels: the third is closed once made and counted as a
    ``control_channels`` refusal; a channel closed mid-frame gives every byte back."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[[tenant]]\nname = "t"\ntokens_sha256 = ["{token_digest("tok")}"]\n'
        "[tenant.quotas]\ncontrol_channels = 2\n"
    )
    svc = FakeService(Tenancy(load_tenants(path)))
    adm = svc.cache.admission

    async def scenario() -> None:
        _, _, one = opened(svc, "t")
        _, _, _two = opened(svc, "t")
        _, t3, _ = opened(svc, "t")  # (its transport)
        assert t3.closing and adm.held_channels("t") == 2
        assert adm.tenancy.refusals("t", "control_channels") == 1
        one.data_received(frame()[:7])  # half a frame held
        assert adm.held_buffered("t") == 7
        one.connection_lost(None)
        assert adm.held_buffered("t") == 0 and adm.held_channels("t") == 1

    asyncio.run(scenario())

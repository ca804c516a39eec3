"""TCP data channel server (framing: kvtier.wire; protocol: docs/tcp_data_channel.md).

One connection per client session. A BufferedProtocol hands uvloop either the 32-byte header
buffer or the destination arena slot itself, so WRITE payloads land in the slot with no copy in
Python; DATA replies are written straight from pinned slots.
"""

from __future__ import annotations

import asyncio
import logging

from kvtier import wire
from kvtier.errors import KvtierError
from kvtier.wire import Op, Status
from kvtierd.cache import TieredCache
from kvtierd.index import Entry, EntryState
from kvtierd.sessions import SessionTable

log = logging.getLogger("kvtierd.tcp")
_SCRATCH = 1 << 20


class DataChannelProtocol(asyncio.BufferedProtocol):
    """State of one data connection: HEADER -> (PAYLOAD | DISCARD) -> HEADER ...

    Owns only its buffers; asks the cache where bytes go. Event-loop thread only.
    """

    def __init__(self, cache: TieredCache, sessions: SessionTable) -> None:
        self.cache = cache
        self.sessions = sessions
        self.transport: asyncio.Transport | None = None
        self.session_id = 0
        self._hdr = bytearray(wire.HEADER.size)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._target: memoryview | None = None  # payload destination (arena slot)
        self._entry: Entry | None = None
        self._job = 0
        self._index = 0
        self._pos = 0
        self._left = 0  # payload bytes still to come
        self._errors: dict[int, int] = {}  # job -> first error status, reported on FLUSH

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._target = None
        self.transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._left:
            e = self._entry
            if self._target is not None and e is not None and (
                    e.job != self._job or e.state is not EntryState.WRITING):
                # The job was aborted (lease expiry) while its bytes were arriving: discard.
                self._target, self._entry = None, None
                self._errors.setdefault(self._job, Status.UNKNOWN_JOB)
            if self._target is None:
                return self._scratch[: min(self._left, _SCRATCH)]
            return self._target[self._pos : self._pos + self._left]
        return self._hdr_view[self._hdr_got :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._left:
            self._pos += nbytes
            self._left -= nbytes
            if self._left == 0 and self._target is not None:
                self.cache.mark_received(self.session_id, self._job, self._index)
                self._target = None
            return
        self._hdr_got += nbytes
        if self._hdr_got == len(self._hdr):
            self._hdr_got = 0
            self._on_header()

    def _fail(self, message: str) -> None:
        assert self.transport is not None
        body = message.encode()[: wire.MAX_ERROR_BYTES]
        self.transport.write(wire.pack(Op.ERROR, length=len(body)) + body)
        self.transport.close()

    def _on_header(self) -> None:
        try:
            op, job, index, _status, length = wire.unpack(self._hdr)
        except ValueError as e:
            return self._fail(str(e))
        assert self.transport is not None
        if op is Op.HELLO:
            try:
                self.sessions.get(job)
            except KvtierError as e:
                return self._fail(str(e))
            self.session_id = job
            self.transport.write(wire.pack(Op.HELLO_OK, job))
            return None
        if not self.session_id:
            return self._fail("HELLO first")
        try:
            self.sessions.get(self.session_id)  # renews the lease
        except KvtierError as e:
            return self._fail(str(e))
        if op is Op.WRITE:
            return self._on_write(job, index, length)
        if op is Op.FLUSH:
            status = self._errors.pop(job, Status.OK)
            self.transport.write(wire.pack(Op.ACK, job, status=status))
            return None
        if op is Op.READ:
            return self._on_read(job)
        return self._fail(f"unexpected op {op.name}")

    def _on_write(self, job: int, index: int, length: int) -> None:
        self._job, self._index, self._pos, self._left = job, index, 0, length
        self._target = self._entry = None
        if length == 0:
            return
        try:
            self._target = self.cache.store_target(self.session_id, job, index, length)
            self._entry = self.cache.store_entry(job, index)
        except KvtierError as e:
            if length > (1 << 32):
                return self._fail(f"frame length {length} too large")
            status = Status.BAD_LENGTH if e.field == "length" else (
                Status.BAD_INDEX if e.field == "index" else Status.UNKNOWN_JOB)
            self._errors.setdefault(job, status)

    def _on_read(self, job: int) -> None:
        assert self.transport is not None
        try:
            sources = self.cache.load_sources(self.session_id, job)
        except KvtierError as e:
            return self._fail(str(e))
        write = self.transport.write
        for index, view in sources:
            write(wire.pack(Op.DATA, job, index, length=len(view)))
            write(view)
        return None


class DataChannelServer:
    """Listens for data connections; owns the asyncio server. Event-loop thread only."""

    def __init__(self, host: str, port: int, cache: TieredCache, sessions: SessionTable) -> None:
        self.host, self.port = host, port
        self._cache, self._sessions = cache, sessions
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: DataChannelProtocol(self._cache, self._sessions), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server:
            self._server.close()

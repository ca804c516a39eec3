"""TCP data channel server (framing: kvtier_contract.wire; protocol: docs/tcp_data_channel.md).

One connection per client session. A BufferedProtocol hands uvloop either the 32-byte header
buffer or the destination arena memory itself, so WRITE payloads land in their slots with no
copy in Python. A WRITE_RUN (many consecutive keys under one header) is laid out as segments of
adjacent slots, and uvloop reads each segment whole: a run of 16 KiB blocks in adjacent slots
costs a few large reads instead of two system calls and a header parse per block. The DATA
frames of a load job go to the transport in one ``writelines`` call (one gathered write under
uvloop), straight from the pinned slots, as runs when the client accepts them. At start the
server maps the whole (prefaulted) arena into the daemon's page tables, so recv never faults.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any

from kvtier_contract import wire
from kvtier_contract.errors import KvtierError
from kvtier_contract.wire import Op, Status
from kvtierd.cache import StoreJob, TieredCache
from kvtierd.sessions import SessionTable
from kvtierd.transports.base import ServerTransport

log = logging.getLogger("kvtierd.tcp")
_SCRATCH = 1 << 20
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it
_FEATURES = wire.FEATURE_RUNS  # what this daemon accepts of a client's HELLO offer
_MAX_FRAME = 1 << 32  # a frame longer than any job could be is a protocol error
# Most bytes handed to one read of a segment (a read holds the socket while it copies; like the
# client's calls, kept small; 1 and 4 MiB measured alike).
_READ_CHUNK = 1 << 20


@dataclass(eq=False)
class _Segment:
    """Arena bytes of one or more adjacent slots of one store job, filled in order."""

    view: memoryview
    job: StoreJob
    indexes: range  # key indexes whose blocks the segment holds


class DataChannelProtocol(asyncio.BufferedProtocol):
    """State of one data connection: HEADER -> (PAYLOAD | DISCARD) -> HEADER ...

    A payload is a list of segments (one for a WRITE, one per run of adjacent slots for a
    WRITE_RUN), or none to discard it. Owns only its buffers; asks the cache's job table where
    bytes go, once per frame, and tells the job which keys arrived. Event-loop thread only.
    """

    def __init__(self, cache: TieredCache, sessions: SessionTable) -> None:
        self.cache = cache
        self.sessions = sessions
        self.transport: asyncio.Transport | None = None
        self.session_id = 0
        self.features = 0  # wire.FEATURE_* agreed at HELLO
        self._hdr = bytearray(wire.HEADER.size)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._segments: list[_Segment] = []  # payload destinations; empty = discard
        self._seg = 0  # current segment
        self._job = 0
        self._pos = 0  # bytes of the current segment received
        self._left = 0  # payload bytes still to come
        self._errors: dict[int, int] = {}  # job -> first error status, reported on FLUSH

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._segments = []
        self.transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if not self._left:
            return self._hdr_view[self._hdr_got :]
        if self._segments:
            seg = self._segments[self._seg]
            if seg.job.live(seg.indexes.start):
                return seg.view[self._pos : self._pos + _READ_CHUNK]
            # The job was aborted (lease expiry) while its bytes were arriving: discard the rest.
            self._segments = []
            self._errors.setdefault(self._job, Status.UNKNOWN_JOB)
        return self._scratch[: min(self._left, _SCRATCH)]

    def buffer_updated(self, nbytes: int) -> None:
        if not self._left:
            self._hdr_got += nbytes
            if self._hdr_got == len(self._hdr):
                self._hdr_got = 0
                self._on_header()
            return
        self._left -= nbytes
        if not self._segments:
            return
        self._pos += nbytes
        seg = self._segments[self._seg]
        if self._pos == len(seg.view):
            seg.job.arrived(seg.indexes)
            self._seg += 1
            self._pos = 0
            if self._seg == len(self._segments):
                self._segments = []

    def _fail(self, message: str) -> None:
        assert self.transport is not None
        body = message.encode()[: wire.MAX_ERROR_BYTES]
        self.transport.write(wire.pack(Op.ERROR, length=len(body)) + body)
        self.transport.close()

    def _on_header(self) -> None:
        try:
            op, job, index, status, length = wire.unpack(self._hdr)
        except ValueError as e:
            return self._fail(str(e))
        assert self.transport is not None
        if op is Op.HELLO:
            return self._on_hello(job, status)
        if not self.session_id:
            return self._fail("HELLO first")
        try:
            self.sessions.get(self.session_id)  # renews the lease
        except KvtierError as e:
            return self._fail(str(e))
        if op is Op.WRITE:
            return self._on_write(job, index, 1, length)
        if op is Op.WRITE_RUN and self.features & wire.FEATURE_RUNS:
            return self._on_write(job, index, status, length)
        if op is Op.FLUSH:
            self.transport.write(wire.pack(Op.ACK, job, status=self._errors.pop(job, Status.OK)))
            return None
        if op is Op.READ:
            return self._on_read(job)
        return self._fail(f"unexpected op {op.name}")

    def _on_hello(self, session_id: int, offered: int) -> None:
        assert self.transport is not None
        try:
            self.sessions.get(session_id)
        except KvtierError as e:
            return self._fail(str(e))
        self.session_id = session_id
        self.features = offered & _FEATURES
        self.transport.write(wire.pack(Op.HELLO_OK, session_id, status=self.features))
        return None

    def _on_write(self, job: int, first: int, count: int, length: int) -> None:
        """A payload of ``count`` blocks for consecutive key indexes from ``first``."""
        self._job, self._seg, self._pos, self._left = job, 0, 0, length
        self._segments = []
        if length == 0:  # no block is empty: report it at FLUSH, the key is not received
            self._errors.setdefault(job, Status.BAD_LENGTH)
            return None
        if length > _MAX_FRAME:
            return self._fail(f"frame length {length} too large")
        try:
            self._segments = self._plan_segments(job, first, count, length)
        except KvtierError as e:
            status = Status.BAD_LENGTH if e.field == "length" else (
                Status.BAD_INDEX if e.field == "index" else Status.UNKNOWN_JOB)
            self._errors.setdefault(job, status)
        return None

    def _plan_segments(self, job_id: int, first: int, count: int, length: int) -> list[_Segment]:
        """Where the run's bytes go: adjacent slots merged into one segment each (one call to
        the job table validates the whole run)."""
        job, entries = self.cache.jobs.store_run(self.session_id, job_id, first, count, length)
        block = length // count
        host = self.cache.host
        segments: list[_Segment] = []
        end = -1  # arena offset just past the last segment
        for index, e in enumerate(entries, first):
            if e.offset == end:  # adjacent to the previous slot: grow that segment
                last = segments[-1]
                start = e.offset - len(last.view)
                last.view = host.view(start, len(last.view) + block)
                last.indexes = range(last.indexes.start, index + 1)
            else:
                segments.append(_Segment(host.view(e.offset, block), job, range(index, index + 1)))
            end = e.offset + block
        return segments

    def _on_read(self, job_id: int) -> None:
        assert self.transport is not None
        try:
            job, entries = self.cache.jobs.load_run(self.session_id, job_id)
        except KvtierError as e:
            return self._fail(str(e))
        nb, host = job.ns.block_bytes, self.cache.host
        sources = [(i, host.view(e.offset, nb)) for i, e in entries]
        if self.features & wire.FEATURE_RUNS:
            self.transport.writelines(wire.run_frames(Op.DATA_RUN, job_id, sources))
        else:
            self.transport.writelines(wire.block_frames(Op.DATA, job_id, sources))
        return None


class DataChannelServer(ServerTransport):
    """Listens for data connections; owns the asyncio server. Event-loop thread only."""

    name = "tcp"

    def __init__(self, host: str, port: int, cache: TieredCache, sessions: SessionTable) -> None:
        self.host, self.port = host, port
        self._cache, self._sessions = cache, sessions
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        populate_arena(self._cache.host.arena.mm, self._cache.host.arena.fd)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: DataChannelProtocol(self._cache, self._sessions), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def advertise(self) -> dict[str, Any]:
        return {"data_host": self.host, "data_port": self.port}

    def close(self) -> None:
        if self._server:
            self._server.close()


def populate_arena(mm: mmap.mmap, fd: int) -> bool:
    """Map every page of a prefaulted arena into this process's page tables, once, at start.

    The data channel is the one path on which the daemon itself copies payloads (recv into
    slots, send from them), through its own mapping of the arena. ``fallocate`` gave the memfd
    its pages but not this mapping its page-table entries, so each first copy into a 4 KiB page
    faulted (measured: 43 ms per 64 MiB on first touch, 7 ms once mapped; docs/benchmarks.md).
    Skipped when the arena was not prefaulted (``prefault = false``: the operator asked that
    pages be allocated only when used) and on kernels without MADV_POPULATE_WRITE.
    """
    allocated = os.fstat(fd).st_blocks * 512
    if allocated < len(mm):
        return False
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError as e:
        log.info("cannot populate the arena mapping (%s); first copies will fault", e)
        return False
    return True

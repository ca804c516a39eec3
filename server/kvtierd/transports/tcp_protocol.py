"""The data channel's per-connection protocol: frames in, payload bytes into arena slots, DATA
frames out (framing: kvtier_contract.wire; protocol: docs/tcp_data_channel.md).

Role: one :class:`DataChannelProtocol` per connection, built by
:class:`kvtierd.transports.tcp.DataChannelServer` (which re-exports it); admission and limits are
asked of the server's :class:`~kvtierd.transports.tcp_admission.ConnectionTable`; where a
payload's bytes go (arena segments of a store job, or the scratch buffer for discarded bytes),
of :mod:`~kvtierd.transports.tcp_segments`. Ownership: a protocol owns only its buffers and
parser state; the arena, the jobs and the sessions are the cache's. Concurrency: event-loop
thread only.
"""

from __future__ import annotations

import asyncio

from kvtier_contract import wire
from kvtier_contract.errors import KvtierError
from kvtier_contract.wire import Op, Status
from kvtierd.cache import LoadJob, TieredCache
from kvtierd.sessions import SessionTable
from kvtierd.transports.base import CONTROL_CHANNELS_PER_SESSION
from kvtierd.transports.tcp_admission import Cancellable, ConnectionTable
from kvtierd.transports.tcp_segments import SCRATCH_BYTES, PayloadSegment, plan_segments, scratch

_FEATURES = wire.FEATURE_RUNS  # what this daemon accepts of a client's HELLO offer
_MAX_FRAME = 1 << 32  # a frame longer than any job could be is a protocol error
# Most bytes handed to one read of a segment (a read holds the socket while it copies; like the
# client's calls, kept small; 1 and 4 MiB measured alike).
_READ_CHUNK = 1 << 20
_CONTROL_READ = 64 << 10  # bytes per read of a control connection


class DataChannelProtocol(asyncio.BufferedProtocol):
    """State of one data connection: HEADER -> (PAYLOAD | DISCARD) -> HEADER ...

    A payload is a list of segments (one for a WRITE, one per run of adjacent slots for a
    WRITE_RUN), or none to discard it. Owns only its buffers; asks the cache's job table where
    bytes go, once per frame, and tells the job which keys arrived.

    Replies: the transport's write limits are 0/0, so ``pause_writing`` means "bytes queued" and
    ``resume_writing`` "queue empty". A READ whose frames did not all reach the kernel at once
    makes its job *sending* here until the queue empties or the connection is lost; reading is
    paused while more than ``max_queued_bytes`` wait.

    Limits apply when a :class:`DataChannelServer` owns the connection (a bare protocol, built
    by tests to drive the parser, has no timer and no cap). One timer per connection: at the
    HELLO deadline, then every half idle period (activity is stamped at ticks, so an idle
    connection closes 1 to 1.5 idle periods after its last frame). Event-loop thread only.
    """

    def __init__(
        self, cache: TieredCache, sessions: SessionTable, server: ConnectionTable | None = None
    ) -> None:
        self.cache = cache
        self.sessions = sessions
        self.transport: asyncio.Transport | None = None
        self.session_id = 0
        self.features = 0  # wire.FEATURE_* agreed at HELLO
        self._server = server
        self._hdr = bytearray(wire.HEADER.size)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_got = 0
        self._hello: bytearray | None = None  # HELLO's payload (the data secret) being read
        self._hello_got = 0
        self._hello_args = (0, 0)  # its session id and offered features
        self._segments: list[PayloadSegment] = []  # payload destinations; empty = discard
        self._seg = 0  # current segment
        self._job = 0
        self._pos = 0  # bytes of the current segment received
        self._left = 0  # payload bytes still to come
        self._errors: dict[int, int] = {}  # job -> first error status, reported on FLUSH
        self._sending: list[LoadJob] = []  # jobs with views in the write buffer (once per READ)
        self._reading_paused = False
        self._closed = False  # we closed it (ERROR sent or timed out); waiting for the loss
        self._timer: Cancellable | None = None
        self._active = False  # a frame or payload bytes arrived since the last tick
        self._seen = 0.0  # loop time of the last tick that saw activity
        self._queued_seen = 0  # write buffer size at the last tick
        self._control: asyncio.Protocol | None = None  # a control channel's, after its HELLO
        self._control_buf: memoryview | None = None
        self.tenant: str | None = None  # the tenant whose share it counts against, after HELLO

    # -- asyncio callbacks ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        if self._server is None:
            return
        transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[attr-defined]
        limits = self._server.limits
        self._arm(limits.hello_timeout_s)
        if not self._server.admit(self):
            self._fail(f"too many data connections (max {limits.max_connections})")

    def connection_lost(self, exc: Exception | None) -> None:
        """The queued views are gone (sent or dropped): the jobs they held may be unpinned."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._segments = []
        self._release_sending()
        if self._server is not None:
            self._server.forget(self)
        self.transport = None
        if self._control is not None:
            self._control.connection_lost(exc)

    @property
    def is_control(self) -> bool:
        """A control connection (its HELLO asked for FEATURE_CONTROL)."""
        return self._control is not None

    def pause_writing(self) -> None:
        if self._control is not None:
            self._control.pause_writing()

    def resume_writing(self) -> None:
        """The write buffer is empty (low water 0): every queued byte is in the kernel."""
        if self._control is not None:
            self._control.resume_writing()
            return
        if self.transport is None or self.transport.get_write_buffer_size():
            return
        self._release_sending()
        if self._reading_paused:
            self._reading_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._control_buf is not None:
            return self._control_buf
        if not self._left:
            return self._hdr_view[self._hdr_got :]
        if self._hello is not None:
            return memoryview(self._hello)[self._hello_got :]
        if self._segments:
            seg = self._segments[self._seg]
            if seg.job.live(seg.indexes.start):
                return seg.view[self._pos : self._pos + _READ_CHUNK]
            # The job was aborted (lease expiry) while its bytes were arriving: discard the rest.
            self._segments = []
            self._errors.setdefault(self._job, Status.UNKNOWN_JOB)
        return scratch()[: min(self._left, SCRATCH_BYTES)]

    def buffer_updated(self, nbytes: int) -> None:
        if self._control is not None and self._control_buf is not None:
            self._active = True
            self._control.data_received(bytes(self._control_buf[:nbytes]))
            return
        if not self._left:
            self._hdr_got += nbytes
            if self._hdr_got == len(self._hdr):
                self._hdr_got = 0
                self._active = True
                self._on_header()
            return
        self._active = True
        self._left -= nbytes
        if self._hello is not None:
            self._hello_got += nbytes
            if not self._left:
                secret, self._hello = bytes(self._hello), None
                self._on_hello(*self._hello_args, secret)
            return
        if not self._segments:
            return
        self._pos += nbytes
        seg = self._segments[self._seg]
        if self.cache.verify_bytes:  # (a read takes at most _READ_CHUNK: bytes still cached)
            seg.hash_arrived(self._pos)
        if self._pos == len(seg.view):
            seg.job.arrived(seg.indexes)
            self._seg += 1
            self._pos = 0
            if self._seg == len(self._segments):
                self._segments = []

    # -- limits -----------------------------------------------------------------------------------

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        assert self._server is not None
        self._timer = self._server.timers.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        t, server = self.transport, self._server
        if t is None or server is None:
            return
        if self._closed:  # an ERROR and close that did not complete in the grace period
            t.abort()
            return
        if not self.session_id:
            server.timed_out += 1
            return self._fail(f"no HELLO within {server.limits.hello_timeout_s:g} s")
        now, idle = server.timers.time(), server.limits.idle_timeout_s
        queued = t.get_write_buffer_size()
        if self._active or queued < self._queued_seen:  # frames in, or the peer took bytes
            self._active, self._seen = False, now
        self._queued_seen = queued
        if now - self._seen < idle:
            return self._arm(idle / 2)
        server.timed_out += 1
        if queued:  # the peer stopped reading: drop its replies (connection_lost unpins)
            t.abort()
            return None
        return self._fail(f"idle for {idle:g} s")

    def end_session(self, session_id: int) -> None:
        """The bound session closed or lapsed: close the connection; replies still queued are
        dropped (the peer stopped before its lease did), so their pins go at once."""
        if self.session_id != session_id or self.transport is None:
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self._fail(f"session {session_id} closed or expired")

    def _release_sending(self) -> None:
        jobs, self._sending = self._sending, []
        for job in jobs:
            self.cache.load_sent(job)

    # -- frames -----------------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        """Answer ERROR and close (queued replies are flushed first, for a grace period of one
        HELLO timeout, then dropped)."""
        if self._closed or self.transport is None:
            return
        self._closed = True
        if self._control is None:  # (no KVD1 frame on a control channel: just closed)
            body = message.encode()[: wire.MAX_ERROR_BYTES]
            self.transport.write(wire.pack(Op.ERROR, length=len(body)) + body)
        self.transport.close()
        if self._server is not None:
            self._arm(self._server.limits.hello_timeout_s)

    def _bad_frame(self, message: str) -> None:
        """A frame that breaks the protocol: counted (kvtier_bad_frames_total), then _fail."""
        if self._server is not None and not self._closed:
            self._server.bad_frames += 1
        self._fail(message)

    def _on_header(self) -> None:
        if self._closed:
            return None
        try:
            op, job, index, status, length = wire.unpack(self._hdr)
        except ValueError as e:
            return self._bad_frame(str(e))
        assert self.transport is not None
        if op is Op.HELLO:
            if length != wire.DATA_SECRET_BYTES:
                return self._bad_frame(
                    "HELLO carries the session's data secret "
                    f"({wire.DATA_SECRET_BYTES} bytes, OpenSessionReply.data_secret)"
                )
            self._hello, self._hello_got = bytearray(length), 0
            self._hello_args, self._left = (job, status), length
            return None
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
        return self._bad_frame(f"unexpected op {op.name}")

    def _on_hello(self, session_id: int, offered: int, secret: bytes) -> None:
        """Bind the connection to ``session_id`` if ``secret`` is its data secret (a session id
        alone is no credential: it appears in every control request). A wrong secret and an
        unknown session get the same answer."""
        if self.transport is None or self._closed:
            return None
        s = self.sessions.with_secret(session_id, secret)
        if s is None or (self.session_id and session_id != self.session_id):
            return self._fail("unknown session or wrong data secret")
        server = self._server
        control = server.control if server is not None else None
        if (
            control is not None
            and offered & wire.FEATURE_CONTROL
            and server is not None
            and server.controls_of(session_id) >= CONTROL_CHANNELS_PER_SESSION
        ):
            return self._fail(
                f"session {session_id} has {CONTROL_CHANNELS_PER_SESSION} control connections open already"
            )
        if not self.session_id and server is not None:
            if not server.bind(self, s.tenant):
                return self._fail(
                    f"tenant {s.tenant} has {server.limits.per_tenant} data "
                    "connections open (data_max_connections_per_tenant)"
                )
            self._arm(server.limits.idle_timeout_s / 2)  # from now on: idle ticks
        self.session_id = session_id
        self.features = offered & (_FEATURES | (wire.FEATURE_CONTROL if control else 0))
        self.transport.write(wire.pack(Op.HELLO_OK, session_id, status=self.features))
        if control is not None and self.features & wire.FEATURE_CONTROL:
            # From now on a control channel: its bytes are calls (kvtierd.transports.control).
            self._control = control(s, lambda _channel: None)
            self._control_buf = memoryview(bytearray(_CONTROL_READ))
            self._control.connection_made(self.transport)
        return None

    def _on_write(self, job: int, first: int, count: int, length: int) -> None:
        """A payload of ``count`` blocks for consecutive key indexes from ``first``."""
        self._job, self._seg, self._pos, self._left = job, 0, 0, length
        self._segments = []
        if length == 0:  # no block is empty: report it at FLUSH, the key is not received
            self._errors.setdefault(job, Status.BAD_LENGTH)
            return None
        if length > _MAX_FRAME:
            return self._bad_frame(f"frame length {length} too large")
        try:
            self._segments = plan_segments(self.cache, self.session_id, job, first, count, length)
        except KvtierError as e:
            status = (
                Status.BAD_LENGTH
                if e.field == "length"
                else (Status.BAD_INDEX if e.field == "index" else Status.UNKNOWN_JOB)
            )
            self._errors.setdefault(job, status)
        return None

    def _on_read(self, job_id: int) -> None:
        t = self.transport
        assert t is not None
        try:
            job, entries = self.cache.jobs.load_run(self.session_id, job_id)
        except KvtierError as e:
            return self._fail(str(e))
        nb, host = job.ns.block_bytes, self.cache.host
        sources = [(i, host.view(e.offset, nb)) for i, e in entries]
        if self.features & wire.FEATURE_RUNS:
            t.writelines(wire.run_frames(Op.DATA_RUN, job_id, sources))
        else:
            t.writelines(wire.block_frames(Op.DATA, job_id, sources))
        queued = t.get_write_buffer_size()
        if queued:  # views of the job's slots wait in the transport: keep them pinned
            self.cache.load_queued(job)
            self._sending.append(job)
            server = self._server
            if server is not None and queued > server.limits.max_queued_bytes and not self._reading_paused:
                self._reading_paused = True  # resumed when the buffer empties
                t.pause_reading()
        return None

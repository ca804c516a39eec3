"""Control channel: one session's control calls as framed protobufs (``kvtier_contract.wire``:
``CALL`` / ``RESULT``) on a Unix socket or TCP connection, served by the same KvtierService
handlers as gRPC: the transfers' hot path (docs/shm_transport.md "The control channel").

Why: a gRPC call from the Python client through grpc.aio costs about 1-1.4 ms of round trip
and ~0.5 ms of daemon CPU here, whatever it carries; a transfer makes two per batch
(docs/benchmarks.md §5.1, §19). A frame on a Unix socket served by the event loop costs a
fraction of that.

Lifecycle: :class:`kvtierd.transports.shm.ShmFdServer` checks a ``CONTROL_MAGIC`` handshake
(a live session, its data secret, the Unix peer allowed for its tenant), or the TCP data
channel a HELLO offering ``FEATURE_CONTROL`` (the session's data secret), and hands the
connection to a ``ControlChannel`` bound to that session; it lives until the peer closes it,
a bad frame, the daemon's close, or its session's end (``close()``, or the data channel's).

This module frames and paces; it knows no method's meaning. Each whole frame is handed to the
channel's :class:`ControlDispatcher` (the daemon's: :class:`kvtierd.service.gate.ChannelDispatch`,
wired by kvtierd.app), which serves it through the service's call gate as a gRPC call is served
(admission, the deadline, error mapping, latency histograms, the published indexes' flush): the
caller is the session's tenant, and a request must name the channel's own session.

Bounded: one call at a time (reading pauses while a call is served, and while the peer leaves
replies unread past ``CONTROL_MAX_BYTES``), so a peer holds at most one request, one reply and
a socket buffer here; a frame longer than ``CONTROL_MAX_BYTES`` or naming an unknown method
closes the connection; the bytes received and not yet a whole frame count against the tenant's
``buffered_bytes`` quota over all its channels (counted by the cache's admission,
kvtierd.cache.admission: one that would pass it is closed), so half-sent frames park at most
that much per tenant, not 4 MiB per channel (the request being served and replies the peer
leaves unread count there too: a tenant over it gets no further bytes in); at most its
``control_channels`` quota per tenant (one more is closed once made: its client uses gRPC;
counted there too), 8 per session on the shm socket (``ShmFdServer``) and 8 on the
data port, where the data channel's limits apply too (``data_max_connections``, idle timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, cast

import grpc

from kvtier_contract import wire
from kvtier_contract.errors import ResourceExhausted
from kvtierd.ratelog import RateLimitedLog

log = logging.getLogger("kvtierd.control")
_BAD_LOG = RateLimitedLog(log, 10.0)  # per daemon: a peer opening channel after channel floods nothing


class ChannelAdmission(Protocol):
    """Where a channel counts itself and the bytes it holds, by its session's tenant (the
    cache's admission: kvtierd.cache.admission.Admission, which owns the counts, the quotas
    ``control_channels`` and ``buffered_bytes``, and the refusals' counting). ``admit_channel``
    and ``take_buffered`` raise ResourceExhausted (counted) and change nothing when a quota
    refuses. Event-loop thread only."""

    def admit_channel(self, tenant: str | None) -> None: ...
    def release_channel(self, tenant: str | None) -> None: ...
    def take_buffered(self, tenant: str | None, nbytes: int) -> None: ...
    def hold_unread(self, tenant: str | None, nbytes: int) -> None: ...
    def give_buffered(self, tenant: str | None, nbytes: int) -> None: ...


class ControlDispatcher(Protocol):
    """What serves a control channel's calls and admits it and its bytes (the daemon's:
    kvtierd.service.gate.ChannelDispatch). Event-loop thread only."""

    @property
    def admission(self) -> ChannelAdmission:
        """The daemon's one admission: counts and quotas of ``control_channels`` and
        ``buffered_bytes``."""
        ...

    def bad_frame(self) -> None:
        """A frame broke the protocol (the channel closes)."""

    async def call(
        self, session_id: int, tenant: str | None, name: str, body: bytes, timeout_ms: int
    ) -> tuple[int, bytes]:
        """Serve one call of method ``name`` of session ``session_id`` (its tenant ``tenant``):
        (status code, reply or error bytes). Raises only on a bug."""
        ...


class ControlChannel(asyncio.Protocol):
    """One control connection of one session. Owns its receive buffer; event-loop thread only.
    States: serving one call (reading paused) or idle; closed for good."""

    def __init__(
        self,
        dispatch: ControlDispatcher,
        session_id: int,
        tenant: str | None,
        on_close: Callable[[ControlChannel], None],
    ) -> None:
        self.session_id = session_id
        self._dispatch = dispatch
        self._tenant = tenant
        self._on_close = on_close
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._busy = False  # a call is being served
        self._write_paused = False  # the peer leaves replies unread
        self._closed = False  # close() was called: nothing more is served
        self._counted = False  # it holds one of its tenant's control_channels
        self._reply_held = 0  # bytes of replies the peer has not read, counted in the admission

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)
        self._transport.set_write_buffer_limits(high=wire.CONTROL_MAX_BYTES, low=0)
        try:
            self._dispatch.admission.admit_channel(self._tenant)
        except ResourceExhausted as e:  # (its client goes on over gRPC)
            _BAD_LOG.warning("control channel of tenant %s: %s: closed", self._tenant, e)
            self.close()
            return
        self._counted = True

    def data_received(self, data: bytes) -> None:
        if self._closed:  # (a TLS transport still delivers what it decrypts while closing)
            return
        t = self._transport
        if self._reply_held and t is not None and not t.get_write_buffer_size():
            self._replies_read()  # (drained below the pause mark: no callback said so)
        try:
            self._dispatch.admission.take_buffered(self._tenant, len(data))
        except ResourceExhausted as e:
            _BAD_LOG.warning(
                "control channel of tenant %s: %s (frames not yet whole): closed", self._tenant, e
            )
            self.close()
            return
        self._buf += data  # (every byte of _buf is counted in the admission)
        self._next()

    def _consumed(self, n: int) -> None:
        """``n`` bytes left the receive buffer: no longer held against the tenant."""
        del self._buf[:n]
        self._dispatch.admission.give_buffered(self._tenant, n)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._replies_read()
        self._next()

    def _replies_read(self) -> None:
        if self._reply_held:
            self._dispatch.admission.give_buffered(self._tenant, self._reply_held)
            self._reply_held = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._consumed(len(self._buf))
        self._replies_read()
        if self._counted:
            self._counted = False
            self._dispatch.admission.release_channel(self._tenant)
        self._on_close(self)

    def close(self) -> None:
        self._closed = True  # no call starts after this, whatever still arrives
        if self._transport is not None:
            self._transport.close()

    # -- calls ------------------------------------------------------------------------------------

    def _next(self) -> None:
        """Start serving the next whole frame, if any and none is being served."""
        t = self._transport
        if t is None or self._busy or self._closed or t.is_closing():
            return
        if self._write_paused:
            t.pause_reading()  # until the peer reads its replies
            return
        buf = self._buf
        if len(buf) < wire.CALL.size:
            t.resume_reading()
            return
        length, method, timeout_ms = wire.CALL.unpack_from(buf)
        if length > wire.CONTROL_MAX_BYTES or not 1 <= method <= len(wire.CONTROL_METHODS):
            _BAD_LOG.warning(
                "control channel of tenant %s: bad frame (method %d, %d bytes): closed",
                self._tenant,
                method,
                length,
            )
            self._dispatch.bad_frame()
            self.close()
            return
        end = wire.CALL.size + length
        if len(buf) < end:
            t.resume_reading()
            return
        body = bytes(buf[wire.CALL.size : end])
        del buf[:end]  # (its bytes stay counted while the call is served: _serve gives them)
        self._busy = True
        t.pause_reading()
        asyncio.get_running_loop().create_task(
            self._serve(wire.CONTROL_METHODS[method - 1], body, timeout_ms)
        )

    async def _serve(self, name: str, body: bytes, timeout_ms: int) -> None:
        admission = self._dispatch.admission
        try:
            status, out = await self._dispatch.call(self.session_id, self._tenant, name, body, timeout_ms)
        except Exception:  # noqa: BLE001  (a bug: answered, logged; the channel stays)
            log.exception("control channel: %s failed", name)
            status, out = grpc.StatusCode.INTERNAL.value[0], b"internal error"
        finally:
            admission.give_buffered(self._tenant, wire.CALL.size + len(body))
        t = self._transport
        if t is None or t.is_closing():
            return
        t.write(wire.RESULT.pack(len(out), status) + out)
        unread = t.get_write_buffer_size()  # what the kernel did not take: the peer's to read
        if unread > self._reply_held:
            admission.hold_unread(self._tenant, unread - self._reply_held)
            self._reply_held = unread
        elif not unread:
            self._replies_read()
        self._busy = False
        self._next()

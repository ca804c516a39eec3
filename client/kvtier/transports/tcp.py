"""tcp transport: the framed data channel (kvtier_contract.wire) to the daemon's data port.

Stores send the job's blocks, then FLUSH, and wait for the ACK; loads send READ and receive the
blocks straight into the caller's buffers. When the daemon accepts runs (HELLO feature bits),
consecutive keys travel under one header (WRITE_RUN / DATA_RUN): the whole job goes out in a
few gathered ``sendmsg`` calls (headers and caller views, no concatenation) and comes back
through ``recvmsg_into`` scattering into the caller's views, instead of two system calls and a
header per block. Older daemons get one WRITE frame per block.

The daemon closes a data connection that stayed idle for ``data_idle_timeout_s`` (an ERROR frame,
then EOF). Between transfers nothing is due from it, so a readable socket before a transfer means
just that: the transport reconnects (HELLO for the same session) before sending, instead of
failing the engine's next transfer.

When the daemon's reply says ``data_tls`` (its gRPC TCP listener serves TLS), the connection is
TLS, verified with ``tls_context`` (set by the session from its ``tls_ca`` / ``tls_cert`` /
``tls_key``; the system's CAs without one) against ``tls_server_name`` (the host the session
reached gRPC at). An SSL socket has no ``sendmsg`` / ``recvmsg_into``: its buffers go one
``sendall`` / ``recv_into`` at a time (TLS records are 16 KiB either way).
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Sequence
from typing import Any

from kvtier.transports.base import DataTransport, Item
from kvtier_contract import wire
from kvtier_contract.digests import StreamingDigests, block_digest
from kvtier_contract.errors import TransportError
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.wire import Buffer, Op

_SOCK_BUF = 4 << 20
_IOV = 64  # buffers per sendmsg / recvmsg_into call at most (well under IOV_MAX)
# Bytes per sendmsg / recvmsg_into call, about: the socket is held while the kernel copies, so
# 64 MiB calls starve the other side (measured: 1 MiB puts 2.25 GB/s with 64 MiB calls,
# 3.39 GB/s with 4 MiB calls; 16 MiB calls lose again; docs/benchmarks.md).
_CALL_BYTES = 4 << 20
# Bytes per recvmsg_into call while a read is verified: each piece is hashed as soon as it lands,
# while it is still in the core's L2 (512 KiB here), instead of after a whole frame of up to
# 64 MiB that has left it (docs/benchmarks.md "Verified tcp gets").
_HOT_BYTES = 256 << 10


class TcpTransport(DataTransport):
    """Owns one data connection of one session."""

    name = "tcp"
    proto_value = pb.TRANSPORT_TCP

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._hdr = bytearray(wire.HEADER.size)
        self._runs = False  # the daemon accepted wire.FEATURE_RUNS
        self._attached: tuple[int, Any, float] | None = None  # to reconnect after an idle close
        self.reconnects = 0  # data connections reopened after the daemon closed an idle one

    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None:
        self._attached = (session_id, reply, timeout_s)
        if not reply.data_port:
            raise TransportError("daemon does not offer a TCP data channel")
        try:
            s = socket.create_connection((reply.data_host, reply.data_port), timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            if reply.data_tls:
                ctx = self.tls_context or ssl.create_default_context()
                s = ctx.wrap_socket(s, server_hostname=self.tls_server_name or reply.data_host)
            self._sock = s
            s.sendall(wire.hello(session_id, bytes(reply.data_secret), wire.FEATURE_RUNS))
            op, _job, _index, features, _length = self._recv_header()
        except OSError as e:
            self.close()
            raise TransportError(f"data channel to {reply.data_host}:{reply.data_port}: {e}") from e
        if op is not Op.HELLO_OK:
            self.close()
            raise TransportError(f"data channel handshake refused ({op.name})")
        self._runs = bool(features & wire.FEATURE_RUNS)
        # Transfers get the session's own timeout, not the open's (a probe's 250 ms, or the
        # last milliseconds of an engine step's budget).
        s.settimeout(self.io_timeout_s)

    def write(self, job_id: int, items: list[Item], *, digest: bool = False) -> list[int] | None:
        """``digest`` is ignored: the daemon hashes the blocks as they arrive."""
        s = self._live_socket()
        frames = self._write_frames(job_id, items)
        frames.append(wire.pack(Op.FLUSH, job_id))
        try:
            _send_buffers(s, frames)
            op, _job, _index, status, _length = self._recv_header()
        except OSError as e:
            self.close()
            raise TransportError(f"data channel write failed: {e}") from e
        if op is not Op.ACK or status != wire.Status.OK:
            raise TransportError(f"store job {job_id} not acknowledged: {op.name} status {status}")
        return None

    def _write_frames(self, job_id: int, items: list[Item]) -> list[Buffer]:
        """One WRITE per block, or (runs) one WRITE_RUN per run of consecutive key indexes."""
        blocks = ((index, view) for index, _offset, view in items)
        if self._runs:
            return wire.run_frames(Op.WRITE_RUN, job_id, blocks)
        return wire.block_frames(Op.WRITE, job_id, blocks)

    def read(self, job_id: int, items: list[Item], digests: Sequence[int] = ()) -> list[int]:
        """Each block is checked against its digest in ``digests`` (0: not checked), hashed
        piece by piece as it arrives (``_recv_checked``)."""
        s = self._live_socket()
        dest = {index: view for index, _offset, view in items}
        expect = {index: (k, digests[k]) for k, (index, _o, _v) in enumerate(items) if digests and digests[k]}
        bad: list[int] = []
        try:
            s.sendall(wire.pack(Op.READ, job_id))
            while dest:
                op, _job, index, count, length = self._recv_header()
                views = self._frame_views(dest, op, index, count, length)
                want = [expect.get(i, (0, 0)) for i in range(index, index + len(views))]
                if any(d for _k, d in want):
                    bad += [want[j][0] for j in _recv_checked(s, views, [d for _k, d in want])]
                else:
                    _recv_views(s, views)
        except OSError as e:
            self.close()
            raise TransportError(f"data channel read failed: {e}") from e
        return sorted(bad)

    def _frame_views(
        self, dest: dict[int, memoryview], op: Op, index: int, count: int, length: int
    ) -> list[memoryview]:
        """The caller views a DATA (one key) or DATA_RUN (``count`` keys) frame fills."""
        if op is Op.DATA:
            count = 1
        elif op is not Op.DATA_RUN or not self._runs:
            raise TransportError(f"unexpected {op.name} frame for key {index}")
        views = [dest.pop(i, None) for i in range(index, index + min(count, len(dest)))]
        if (
            not 0 < count <= len(views)
            or any(v is None for v in views)
            or sum(len(v) for v in views if v is not None) != length
        ):
            raise TransportError(
                f"unexpected {op.name} frame for keys {index}..{index + count - 1} ({length} B)"
            )
        return [v for v in views if v is not None]

    def _recv_header(self) -> tuple[Op, int, int, int, int]:
        s = self._socket()
        _recv_views(s, [memoryview(self._hdr)])
        try:
            op, job, index, status, length = wire.unpack(self._hdr)
        except ValueError as e:
            raise TransportError(str(e)) from e
        if op is Op.ERROR:
            body = bytearray(min(length, wire.MAX_ERROR_BYTES))
            _recv_views(s, [memoryview(body)])
            self.close()
            raise TransportError(f"daemon closed the data channel: {body.decode(errors='replace')}")
        return op, job, index, status, length

    def _live_socket(self) -> socket.socket:
        """The connection, reopened first if the daemon closed it while idle (readable now:
        nothing is due between transfers, so it is an ERROR frame or EOF)."""
        s = self._socket()
        if not select.select([s], [], [], 0)[0] or self._attached is None:
            return s
        self.close()
        self.reconnects += 1
        self.attach(*self._attached)
        return self._socket()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise TransportError("tcp transport is not attached")
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _send_buffers(s: socket.socket, bufs: list[Buffer]) -> None:
    """Send every buffer in order, gathered into calls of about ``_CALL_BYTES`` (at most
    ``_IOV`` buffers); resumes after partial sends."""
    if isinstance(s, ssl.SSLSocket):
        for b in bufs:
            s.sendall(b)
        return
    i, n = 0, len(bufs)
    while i < n:
        sent = s.sendmsg(bufs[i : _call_end(bufs, i)])
        if sent == 0:
            raise TransportError("data channel closed by the daemon")
        while sent:
            size = len(bufs[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                bufs[i] = memoryview(bufs[i])[sent:]
                sent = 0


def _call_end(bufs: list[Buffer] | list[memoryview], i: int) -> int:
    """End of the buffers one system call takes from ``i``: up to ``_CALL_BYTES``, at least one."""
    end, total, stop = i, 0, min(len(bufs), i + _IOV)
    while end < stop and total < _CALL_BYTES:
        total += len(bufs[end])
        end += 1
    return end


def _recv_views(s: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order, scattered like ``_send_buffers`` gathers."""
    views = [v for v in views if len(v)]
    if isinstance(s, ssl.SSLSocket):
        for v in views:
            while len(v):
                got = s.recv_into(v)
                if got == 0:
                    raise TransportError("data channel closed by the daemon")
                v = v[got:]
        return
    i, n = 0, len(views)
    while i < n:
        got = s.recvmsg_into(views[i : _call_end(views, i)])[0]
        if got == 0:
            raise TransportError("data channel closed by the daemon")
        while got:
            size = len(views[i])
            if got >= size:
                got -= size
                i += 1
            else:
                views[i] = views[i][got:]
                got = 0


def _recv_checked(s: socket.socket, views: list[memoryview], digests: list[int]) -> list[int]:
    """Fill ``views`` in order like ``_recv_views``, in calls of about ``_HOT_BYTES``, each
    piece hashed as soon as it lands (``StreamingDigests``: the same digest as
    ``block_digest`` of the whole block); the positions whose digest differs from ``digests``
    (0: not checked)."""
    if isinstance(s, ssl.SSLSocket):  # TLS records are hashed once the frame is in
        _recv_views(s, views)
        return [k for k, (v, d) in enumerate(zip(views, digests, strict=True)) if d and block_digest(v) != d]
    stream = StreamingDigests([len(v) for v in views], [bool(d) for d in digests])
    while not stream.done:
        pieces = _pieces(views, stream.index, stream.offset)
        got = s.recvmsg_into(pieces)[0]
        if got == 0:
            raise TransportError("data channel closed by the daemon")
        for piece in pieces:  # the filled ones, the last maybe in part
            if got <= len(piece):
                stream.feed(piece[:got] if got < len(piece) else piece)
                break
            stream.feed(piece)
            got -= len(piece)
    return [k for k, (h, d) in enumerate(zip(stream.digests, digests, strict=True)) if d and h != d]


def _pieces(views: list[memoryview], i: int, off: int) -> list[memoryview]:
    """The scatter list of one verified receive: about ``_HOT_BYTES`` from ``views[i][off:]``."""
    out: list[memoryview] = []
    total = 0
    while i < len(views) and total < _HOT_BYTES and len(out) < _IOV:
        take = min(len(views[i]) - off, _HOT_BYTES - total)
        out.append(views[i][off : off + take])
        total += take
        i, off = i + 1, 0
    return out

"""tcp transport: the framed data channel (kvtier.wire) to the daemon's data port.

Stores send WRITE frames (header and payload gathered in one sendmsg, no concatenation), then
FLUSH and wait for the ACK. Loads send READ and receive DATA frames straight into the caller's
buffers with recv_into.
"""

from __future__ import annotations

import socket
from typing import Any

from kvtier import wire
from kvtier.errors import TransportError
from kvtier.transports.base import DataTransport, Item
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.wire import Op

_SOCK_BUF = 4 << 20


class TcpTransport(DataTransport):
    """Owns one data connection of one session."""

    name = "tcp"
    proto_value = pb.TRANSPORT_TCP

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._hdr = bytearray(wire.HEADER.size)

    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None:
        if not reply.data_port:
            raise TransportError("daemon does not offer a TCP data channel")
        try:
            s = socket.create_connection((reply.data_host, reply.data_port), timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            self._sock = s
            s.sendall(wire.pack(Op.HELLO, session_id))
            op, *_ = self._recv_header()
        except OSError as e:
            self.close()
            raise TransportError(f"data channel to {reply.data_host}:{reply.data_port}: {e}") from e
        if op is not Op.HELLO_OK:
            self.close()
            raise TransportError(f"data channel handshake refused ({op.name})")

    def write(self, job_id: int, items: list[Item]) -> None:
        s = self._socket()
        try:
            for index, _offset, view in items:
                header = wire.pack(Op.WRITE, job_id, index, length=len(view))
                sent = s.sendmsg([header, view])
                if sent < len(header) + len(view):
                    self._send_rest(s, header, view, sent)
            s.sendall(wire.pack(Op.FLUSH, job_id))
            op, _job, _index, status, _length = self._recv_header()
        except OSError as e:
            self.close()
            raise TransportError(f"data channel write failed: {e}") from e
        if op is not Op.ACK or status != wire.Status.OK:
            raise TransportError(f"store job {job_id} not acknowledged: {op.name} status {status}")

    @staticmethod
    def _send_rest(s: socket.socket, header: bytes, view: memoryview, sent: int) -> None:
        if sent < len(header):
            s.sendall(header[sent:])
            sent = len(header)
        s.sendall(view[sent - len(header) :])

    def read(self, job_id: int, items: list[Item]) -> None:
        s = self._socket()
        dest = {index: view for index, _offset, view in items}
        try:
            s.sendall(wire.pack(Op.READ, job_id))
            for _ in range(len(items)):
                op, _job, index, _status, length = self._recv_header()
                view = dest.pop(index, None)
                if op is not Op.DATA or view is None or length != len(view):
                    raise TransportError(f"unexpected {op.name} frame for key {index} ({length} B)")
                self._recv_into(s, view)
        except OSError as e:
            self.close()
            raise TransportError(f"data channel read failed: {e}") from e

    def _recv_header(self) -> tuple[Op, int, int, int, int]:
        s = self._socket()
        self._recv_into(s, memoryview(self._hdr))
        try:
            op, job, index, status, length = wire.unpack(self._hdr)
        except ValueError as e:
            raise TransportError(str(e)) from e
        if op is Op.ERROR:
            body = bytearray(min(length, wire.MAX_ERROR_BYTES))
            self._recv_into(s, memoryview(body))
            self.close()
            raise TransportError(f"daemon closed the data channel: {body.decode(errors='replace')}")
        return op, job, index, status, length

    @staticmethod
    def _recv_into(s: socket.socket, view: memoryview) -> None:
        got, n = 0, len(view)
        while got < n:
            k = s.recv_into(view[got:], n - got)
            if k == 0:
                raise TransportError("data channel closed by the daemon")
            got += k

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise TransportError("tcp transport is not attached")
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

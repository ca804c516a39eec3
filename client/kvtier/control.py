"""Control channels: a same-host session's control calls as framed protobufs on the daemon's shm
socket instead of gRPC (``kvtier_contract.wire``: ``CONTROL_*``, ``CALL``, ``RESULT``;
docs/shm_transport.md "Control channel").

A gRPC unary call costs this client ~1-1.4 ms of round trip here whatever it carries, and a
transfer makes two per batch; a frame on a Unix socket a fraction of that (docs/benchmarks.md
§19). The daemon serves the frames with its gRPC handlers, so replies, errors and their status
codes are the same; a failure is reported as a :class:`ControlError`, a ``grpc.RpcError`` with
``code()`` and ``details()``, so callers handle both paths alike.

Lifecycle: a :class:`ControlChannels` belongs to one session of one Session (made when the
session opens, closed when it is dropped). Each connection carries one call at a time; a thread
takes an idle one or opens one (at most ``MAX_CHANNELS``; beyond that, or after the daemon
refused the handshake, ``call`` answers None and the caller uses gRPC). A connection whose call
got no whole answer (a timeout, the daemon gone) is closed, never reused.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import grpc

from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb

MAX_CHANNELS = 4  # connections of one session (threads calling at once: the SDK's RPC threads)
METHODS = {name: n + 1 for n, name in enumerate(wire.CONTROL_METHODS)}
_SERVICE = pb.DESCRIPTOR.services_by_name["Kvtier"]
_REPLY = {name: getattr(pb, _SERVICE.methods_by_name[name].output_type.name)
          for name in wire.CONTROL_METHODS}
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ControlError(grpc.RpcError):  # type: ignore[misc]
    """A control-channel call that failed: its gRPC status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ControlChannels:
    """The control connections of one session. Thread-safety: any thread may ``call``; a
    connection is used by one thread at a time (taken from, and given back to, the idle list
    under the lock)."""

    def __init__(self, path: str, session_id: int, data_secret: bytes, timeout_s: float) -> None:
        self.session_id = session_id
        self._path = path
        self._hello = (wire.SHM_REQUEST.pack(wire.CONTROL_MAGIC, session_id) + data_secret)
        self._timeout_s = timeout_s  # a handshake's
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._open = 0
        self._closed = False
        self.refused = ""  # why the daemon refused a handshake (then gRPC for this session)
        self.calls = 0

    def call(self, method: str, request: Any, timeout: float) -> Any | None:
        """The reply of ``method``, or None when no channel can carry it (use gRPC); ControlError
        when the daemon answered an error, or gave no whole answer within ``timeout`` (then
        DEADLINE_EXCEEDED) or went away (UNAVAILABLE)."""
        number = METHODS.get(method)
        if number is None:
            return None
        sock = self._take()
        if sock is None:
            return None
        body = request.SerializeToString()
        deadline = time.monotonic() + timeout
        try:
            sock.settimeout(timeout)
            sock.sendall(wire.CALL.pack(len(body), number, max(1, int(timeout * 1000))) + body)
            length, status = wire.RESULT.unpack(_recv(sock, wire.RESULT.size, deadline))
            if length > wire.CONTROL_MAX_BYTES:
                raise ValueError(f"reply of {length} bytes")
            data = _recv(sock, length, deadline)
        except TimeoutError:
            self._drop(sock)
            raise ControlError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{method}: no answer on the control channel within "
                               f"{timeout:.3f} s") from None
        except (OSError, ValueError) as e:
            self._drop(sock)
            raise ControlError(grpc.StatusCode.UNAVAILABLE,
                               f"{method}: control channel: {e}") from None
        self._give_back(sock)
        self.calls += 1
        if status:
            raise ControlError(_CODES.get(status, grpc.StatusCode.UNKNOWN),
                               data.decode(errors="replace"))
        return _REPLY[method].FromString(data)

    def _take(self) -> socket.socket | None:
        with self._lock:
            if self._closed or self.refused:
                return None
            if self._idle:
                return self._idle.pop()
            if self._open >= MAX_CHANNELS:
                return None
            self._open += 1
        try:
            return self._connect()
        except (OSError, ValueError) as e:
            with self._lock:
                self._open -= 1
                self.refused = str(e) or type(e).__name__
            return None

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self._path)
            sock.sendall(self._hello)
            reply = sock.recv(wire.CONTROL_REPLY.size + wire.SHM_MAX_ERROR_BYTES)
            if reply[:4] == wire.SHM_REFUSED:
                raise ValueError(f"refused: {reply[4:].decode(errors='replace')}")
            if len(reply) != wire.CONTROL_REPLY.size or reply[:4] != wire.CONTROL_MAGIC:
                raise ValueError("bad control channel handshake reply")
        except BaseException:
            sock.close()
            raise
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
            self._open -= 1
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._open -= 1
        sock.close()

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes by ``deadline`` (TimeoutError), ValueError when the daemon closes."""
    if n == 0:
        return b""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if not k:
            raise ValueError("closed by the daemon")
        got += k
    return bytes(buf)

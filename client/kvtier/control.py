"""Control channels: a session's control calls as framed protobufs instead of gRPC
(``kvtier_contract.wire``: ``CALL``, ``RESULT``): on the daemon's shm socket for a same-host
session (``CONTROL_MAGIC`` handshake, :func:`unix_dialer`; docs/shm_transport.md "The control
channel"), on its TCP data port for a remote one (HELLO offering ``FEATURE_CONTROL``, over TLS
when the data channel is; :func:`tcp_dialer`; docs/tcp_data_channel.md).

A gRPC unary call costs this client ~1-1.4 ms of round trip here whatever it carries, and a
transfer makes two per batch; a frame on a Unix socket a fraction of that (docs/benchmarks.md
§19). The daemon serves the frames with its gRPC handlers, so replies, errors and their status
codes are the same; a failure is reported as a :class:`ControlError`, a ``grpc.RpcError`` with
``code()`` and ``details()``, so callers handle both paths alike.

Lifecycle: a :class:`ControlChannels` belongs to one daemon session of one
:class:`kvtier.connection.Connection` (made by :func:`session_channels` when the session opens,
closed when it is dropped). Each connection carries one call at a time; a thread
takes an idle one or opens one (at most ``MAX_CHANNELS``; beyond that, or after the daemon
refused the handshake, ``call`` answers None and the caller uses gRPC; for ``RETRY_S`` after a
connection could not be made). A connection whose call
got no whole answer (a timeout, the daemon gone) is closed, never reused; an idle one the daemon
closed meanwhile (its session ended, its idle timeout) is noticed before use and replaced.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb

MAX_CHANNELS = 4  # connections of one session (threads calling at once: the SDK's RPC threads)
RETRY_S = 1.0  # after a connection could not be made, the session's calls use gRPC this long
METHODS = {name: n + 1 for n, name in enumerate(wire.CONTROL_METHODS)}
_SERVICE = pb.DESCRIPTOR.services_by_name["Kvtier"]
_REPLY = {name: getattr(pb, _SERVICE.methods_by_name[name].output_type.name) for name in wire.CONTROL_METHODS}
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

    def __init__(self, dial: Callable[[float], socket.socket], session_id: int, timeout_s: float) -> None:
        """``dial(timeout_s)``: a new connection that passed the handshake (OSError or
        ValueError when it cannot be made or was refused)."""
        self.session_id = session_id
        self._dial = dial
        self._timeout_s = timeout_s  # a handshake's
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._open = 0
        self._closed = False
        self._retry_at = 0.0  # after a connection could not be made: gRPC until then
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
            raise ControlError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{method}: no answer on the control channel within {timeout:.3f} s",
            ) from None
        except (OSError, ValueError) as e:
            self._drop(sock)
            raise ControlError(grpc.StatusCode.UNAVAILABLE, f"{method}: control channel: {e}") from None
        self._give_back(sock)
        if status:
            raise ControlError(_CODES.get(status, grpc.StatusCode.UNKNOWN), data.decode(errors="replace"))
        return _REPLY[method].FromString(data)

    def _take(self) -> socket.socket | None:
        with self._lock:
            if self._closed or self.refused or time.monotonic() < self._retry_at:
                return None
            while self._idle:
                sock = self._idle.pop()
                if not _readable(sock):
                    return sock
                self._open -= 1  # the daemon closed it while idle: nothing is due on it
                with contextlib.suppress(OSError):
                    sock.close()
            if self._open >= MAX_CHANNELS:
                return None
            self._open += 1
        try:
            return self._dial(self._timeout_s)
        except ValueError as e:  # refused, or not served: gRPC for the rest of the session
            with self._lock:
                self._open -= 1
                self.refused = str(e) or type(e).__name__
            return None
        except OSError:  # not reachable now (a restart, descriptors): gRPC for a while
            with self._lock:
                self._open -= 1
                self._retry_at = time.monotonic() + RETRY_S
            return None

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self.calls += 1
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


def unix_dialer(path: str, session_id: int, data_secret: bytes) -> Callable[[float], socket.socket]:
    """Control connections on the daemon's shm socket ``path`` (``CONTROL_MAGIC``)."""
    hello = wire.SHM_REQUEST.pack(wire.CONTROL_MAGIC, session_id) + data_secret

    def dial(timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(hello)
            reply = sock.recv(wire.CONTROL_REPLY.size + wire.SHM_MAX_ERROR_BYTES)
            if not reply:  # (closed at once: the socket's handshake cap, a restart)
                raise ConnectionError("closed during the control channel handshake")
            if reply[:4] == wire.SHM_REFUSED:
                raise ValueError(f"refused: {reply[4:].decode(errors='replace')}")
            if len(reply) != wire.CONTROL_REPLY.size or reply[:4] != wire.CONTROL_MAGIC:
                raise ValueError("bad control channel handshake reply")
        except BaseException:
            sock.close()
            raise
        return sock

    return dial


def tcp_dialer(
    host: str,
    port: int,
    session_id: int,
    data_secret: bytes,
    *,
    tls: ssl.SSLContext | None = None,
    server_name: str | None = None,
) -> Callable[[float], socket.socket]:
    """Control connections on the daemon's TCP data port (HELLO offering FEATURE_CONTROL;
    ``tls``: the data channel serves TLS, verified against ``server_name``)."""
    hello = wire.hello(session_id, data_secret, wire.FEATURE_CONTROL)

    def dial(timeout_s: float) -> socket.socket:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_name or host)
            sock.sendall(hello)
            try:
                head = _recv(sock, wire.HEADER.size, time.monotonic() + timeout_s)
            except ValueError as e:  # closed at once
                raise ConnectionError(str(e)) from None
            op, _job, _index, features, _length = wire.unpack(head)
            if op is wire.Op.ERROR:  # (the data port's connection cap, a restart)
                raise ConnectionError("the data port refused a control connection")
            if op is not wire.Op.HELLO_OK or not features & wire.FEATURE_CONTROL:
                raise ValueError(f"the daemon serves no control channel here ({op.name})")
        except BaseException:
            sock.close()
            raise
        return sock

    return dial


def session_channels(
    reply: Any, transport_name: str, tls: ssl.SSLContext | None, server_name: str, timeout: float
) -> ControlChannels | None:
    """The control channels of the session ``reply`` (OpenSessionReply) opened, its data
    transport being ``transport_name``: on the daemon's shm socket (same host), on its data port
    (tcp; TLS with ``tls`` when the port serves it, verified against ``server_name``), or None
    (gRPC only)."""
    secret, dial = bytes(reply.data_secret), None
    if transport_name != "tcp" and reply.shm_socket:  # same host: the shm socket
        dial = unix_dialer(reply.shm_socket, reply.session_id, secret)
    elif transport_name == "tcp" and reply.data_port:  # the data port (TLS if it is)
        dial = tcp_dialer(
            reply.data_host,
            reply.data_port,
            reply.session_id,
            secret,
            tls=tls if reply.data_tls else None,
            server_name=server_name,
        )
    return ControlChannels(dial, reply.session_id, timeout) if dial is not None else None


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the daemon closed it (nothing else is
    ever due on an idle control connection)."""
    try:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


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

"""The daemon's address asked itself, not gRPC: whether its socket is there and answers now.

gRPC reports the last error of a connection attempt, and a channel can share the connection
(the subchannel) of another channel to the same target, still backing off after an earlier
attempt: its words ("No such file or directory") can be that attempt's, not this one's (the
socket created since). So a diagnosis that needs to know whether anything is at the address
asks the socket:

* ``reach(target, timeout_s)``: a Unix socket: ``os.stat`` of its file, then a non-blocking
  connect; a ``host:port``: the host's first address resolved, then a connect, all within
  ``timeout_s``. One of ``REACH`` (``None``: nothing could be told: a gRPC scheme target, a
  timeout, another error);
* ``speaks_tls(host, port, timeout_s)``: whether a TCP port answers a TLS handshake (told apart:
  a plaintext client on a TLS port from a daemon that just closed the connection);
* ``first_address(host, port, timeout_s)``: a host's first address, the name lookup (unbounded
  in the C library) on a helper thread waited for at most ``timeout_s``.

Each call opens at most one socket and closes it before it returns. Thread-safe (no state).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
import stat
import threading
import time
from typing import Any, Literal

from kvtier.addresses import socket_path, tcp_endpoint

Reach = Literal["missing", "not-socket", "permission", "refused", "listening", "unresolved"]
REACH: tuple[Reach, ...] = ("missing", "not-socket", "permission", "refused", "listening", "unresolved")
_BUSY = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINPROGRESS)  # a full backlog: someone listens


def reach(target: str, timeout_s: float) -> Reach | None:
    """What is at gRPC ``target`` now (see the module docstring): ``missing`` (no file at the
    socket path), ``not-socket`` (a file of another kind), ``permission`` (the path or the socket
    is not this user's to use), ``refused`` (nothing listens: a Unix socket left behind, or a
    TCP port closed), ``listening`` (a connection was accepted), ``unresolved`` (the host has
    no address); None when nothing could be told within ``timeout_s``."""
    path = socket_path(target)
    if path is not None:
        return _unix(path)
    endpoint = tcp_endpoint(target)
    if endpoint is None or timeout_s <= 0:
        return None
    return _tcp(*endpoint, timeout_s)


def _unix(path: str) -> Reach | None:
    """A Unix socket file asked: stat, then one connect that never waits (local: refused or
    accepted at once; a full backlog answers EAGAIN, which says someone listens)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except PermissionError:
        return "permission"
    except OSError:
        return None
    if not stat.S_ISSOCK(mode):
        return "not-socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        code = s.connect_ex(path)
    return "listening" if code in _BUSY else _connected(code)


def _tcp(host: str, port: int, timeout_s: float) -> Reach | None:
    deadline = time.monotonic() + timeout_s
    address = first_address(host, port, timeout_s)
    left = deadline - time.monotonic()
    if address is None:
        return "unresolved" if left > 0 else None  # unresolved in time: said by the resolver
    if left <= 0:
        return None
    family, sockaddr = address
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(left)
        try:
            return _connected(s.connect_ex(sockaddr))  # a timeout (a silent host) tells nothing
        except OSError:
            return None


def _connected(code: int) -> Reach | None:
    if code == 0:
        return "listening"
    if code == errno.ECONNREFUSED:
        return "refused"
    if code == errno.ENOENT:  # removed between the stat and the connect
        return "missing"
    if code in (errno.EACCES, errno.EPERM):
        return "permission"
    return None


def speaks_tls(host: str, port: int, timeout_s: float) -> bool | None:
    """Whether ``host:port`` answers a TLS handshake (certificates unchecked: only the protocol
    is asked), all within ``timeout_s``: one address of the host (its first), resolved on a
    helper thread unless it is an IP address; None when it cannot be resolved or reached."""
    deadline = time.monotonic() + timeout_s
    address = first_address(host, port, timeout_s)
    left = deadline - time.monotonic()
    if address is None or left <= 0:
        return None
    family, sockaddr = address
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.socket(family, socket.SOCK_STREAM) as raw:
        try:
            raw.settimeout(left)
            raw.connect(sockaddr)
            raw.settimeout(max(0.001, deadline - time.monotonic()))  # the handshake: what is left
        except OSError:
            return None
        try:
            with ctx.wrap_socket(raw, server_hostname=host):
                return True
        except ssl.SSLError as e:  # an alert is TLS talking (a required client certificate)
            return "ALERT" in str(e.reason or "").upper()
        except TimeoutError:  # accepted, then silent: tells nothing
            return None
        except OSError:
            return False


def first_address(host: str, port: int, timeout_s: float) -> tuple[int, Any] | None:
    """(family, sockaddr) of ``host:port``'s first address; the name lookup (unbounded in the
    C library) runs on a daemon thread waited for at most ``timeout_s``."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        box: list[Any] = []
        done = threading.Event()

        def resolve() -> None:
            try:
                box.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except (OSError, UnicodeError):
                pass
            done.set()

        threading.Thread(target=resolve, daemon=True, name="kvtier-resolve").start()
        if not done.wait(timeout_s) or not box:
            return None
        found = box
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr

"""Daemon addresses as the client takes them: ``unix:///absolute/path``, ``unix:relative/path``
(relative to the working directory), a bare socket path (``/run/kvtier.sock``,
``run/kvtier.sock``: anything with a ``/`` and no scheme, taken as that Unix socket) or
``host:port`` (``[v6addr]:port``).

``address_target`` checks one and turns it into a gRPC target, or raises ``InvalidArgument``
(field ``address``) naming the fix: a host without a port (gRPC would dial 443), a port outside
1..65535 (gRPC would wrap 99999 to 34463), an empty host, an unbracketed IPv6 address, a URL
scheme (``http://``, ``tcp://``). gRPC's own schemes (``dns:``, ``ipv4:``, ``ipv6:``,
``unix-abstract:``, ``vsock:``) pass through unchecked. ``grpc_host`` names the host that answered
there, where a daemon that advertises a wildcard data host (``0.0.0.0``) is reached for its data
channel.
"""

from __future__ import annotations

import os
import re
from typing import NoReturn

from kvtier_contract import errors

FORMS = "unix:///path/to/kvtier.sock, unix:relative/path or host:port"
_GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix-abstract:", "vsock:")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def address_target(address: str) -> str:
    """``unix:///path`` stays, ``unix:path`` and a bare path become ``unix:///absolute/path``,
    ``host:port`` stays once checked. InvalidArgument(field="address") naming the fix otherwise.

    ``unix://path`` (two slashes, relative) is refused: gRPC reads ``path``'s first part as an
    authority and fails later with a C-core message naming nothing."""
    if not isinstance(address, str) or not address.strip():
        _bad(repr(address), f"empty; expected {FORMS}")
    if address != address.strip() or any(c.isspace() for c in address):
        _bad(repr(address), "contains white space; write it without spaces")
    if address.startswith("unix://"):
        if not address.startswith("unix:///") or len(address) == len("unix:///"):
            _bad(
                repr(address),
                "a Unix socket address is unix:///absolute/path or "
                f"unix:relative/path (did you mean unix:///{address[7:].lstrip('/')}?)",
            )
        return address
    if address.startswith("unix:"):
        if not address[5:]:
            _bad(repr(address), "no socket path after unix:")
        return "unix://" + os.path.abspath(address[5:])
    if address.startswith(_GRPC_SCHEMES):
        return address
    m = _URL.match(address)
    if m:
        _bad(
            repr(address),
            f"{m.group(1)}:// is not an address scheme here; write host:port "
            "(TLS is chosen with tls_ca=, not https://) or unix:///path",
        )
    if "/" in address:  # no host name or IP address holds a slash: the socket file it names
        return "unix://" + os.path.abspath(address)
    return _host_port(address)


def _host_port(address: str) -> str:
    """``host:port`` / ``[v6]:port`` checked: the host is not empty, the port is 1..65535."""
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            _bad(repr(address), f"write an IPv6 address as [{host}]:port")
        port = rest[1:]
    else:
        host, sep, port = address.rpartition(":")
        if not sep and address.endswith(".sock"):
            _bad(repr(address), f"a socket file? write unix:{address} (host:port for TCP)")
        if not sep:
            _bad(
                repr(address),
                f"no port: write {address}:PORT (the port of kvtierd's --listen), "
                f"or unix:///path for its Unix socket (gRPC would dial port 443)",
            )
        if ":" in host:
            _bad(repr(address), f"write an IPv6 address in brackets: [{host}]:{port}")
    if not host:
        _bad(repr(address), f"no host before the port: write 127.0.0.1:{port} or the daemon's host name")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        _bad(repr(address), f"port {port!r} is not a number in 1..65535")
    return address


def _bad(shown: str, message: str) -> NoReturn:
    raise errors.InvalidArgument(f"{shown}: {message}", field="address")


def grpc_host(address: str) -> str:
    """The host part of a gRPC target (127.0.0.1 for a Unix socket: the daemon is local)."""
    if address.startswith("unix:"):
        return "127.0.0.1"
    host = address.rpartition(":")[0]
    return host.strip("[]") or "127.0.0.1"


def tcp_endpoint(target: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` / ``[v6]:port`` target; None for a Unix socket or a gRPC
    scheme target (``dns:///h:p``, ``ipv4:a:p,b:p``...), which name no one endpoint."""
    if target.startswith(("unix:", *_GRPC_SCHEMES)):
        return None
    host, _, port = target.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def socket_path(target: str) -> str | None:
    """The socket file of a ``unix:///path`` target (None for a TCP one)."""
    return target[len("unix://") :] if target.startswith("unix:///") else None

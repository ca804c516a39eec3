"""Daemon addresses as the client takes them: ``unix:///absolute/path``, ``unix:relative/path``
(relative to the working directory) or ``host:port`` (``[v6addr]:port``).

``address_target`` turns one into a gRPC target; ``grpc_host`` names the host that answered there,
where a daemon that advertises a wildcard data host (``0.0.0.0``) is reached for its data channel.
"""

from __future__ import annotations

import os

from kvtier_contract import errors


def address_target(address: str) -> str:
    """``unix:///path`` stays, ``unix:path`` becomes absolute, ``host:port`` stays.

    ``unix://path`` (two slashes, relative) is refused: gRPC reads ``path``'s first part as an
    authority and fails later with a C-core message naming nothing."""
    if address.startswith("unix://"):
        if not address.startswith("unix:///"):
            raise errors.InvalidArgument(
                f"{address!r}: a Unix socket address is unix:///absolute/path or "
                "unix:relative/path", field="address")
        return address
    if address.startswith("unix:"):
        return "unix://" + os.path.abspath(address[5:])
    return address


def grpc_host(address: str) -> str:
    """The host part of a gRPC target (127.0.0.1 for a Unix socket: the daemon is local)."""
    if address.startswith("unix:"):
        return "127.0.0.1"
    host = address.rpartition(":")[0]
    return host.strip("[]") or "127.0.0.1"

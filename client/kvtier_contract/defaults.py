"""Where the default daemon listens, stated once for both halves.

``kvtierd serve`` with no flags (``make serve``) binds :data:`SOCKET_PATH` (relative to its working
directory, mode 0600: its owner only) and no TCP gRPC listener (:data:`LISTEN`); every client-side
command that takes an address defaults to that socket (:func:`default_address`).
"""

from __future__ import annotations

SOCKET_PATH = "run/kvtier.sock"
"""The daemon's default gRPC Unix socket, relative to the directory it was started in."""
LISTEN = ""
"""The daemon's default gRPC TCP listener: none. Loopback TCP would let every local user in;
the Unix socket lets only its owner (docs/security.md "The local default")."""
ADDRESS = f"unix:{SOCKET_PATH}"
"""The default daemon's Unix socket as a client address (``unix:`` + a relative path)."""


def default_address() -> str:
    """The default daemon's Unix socket, under the working directory (where ``make serve``
    started it); ``--address`` names any other daemon."""
    return ADDRESS

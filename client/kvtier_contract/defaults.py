"""Where the default daemon listens, stated once for both halves.

``kvtierd serve`` with no flags (``make serve``) binds :data:`SOCKET_PATH` (relative to its working
directory) and :data:`LISTEN`; every client-side command that takes an address defaults to one
that reaches that daemon (:func:`default_address`).
"""

from __future__ import annotations

import os

SOCKET_PATH = "run/kvtier.sock"
"""The daemon's default gRPC Unix socket, relative to the directory it was started in."""
LISTEN = "127.0.0.1:50051"
"""The daemon's default gRPC TCP listener."""
ADDRESS = f"unix:{SOCKET_PATH}"
"""The default daemon's Unix socket as a client address (``unix:`` + a relative path)."""


def default_address() -> str:
    """The default daemon's Unix socket when it exists under the working directory (started
    there by ``make serve``), else its TCP listener (reachable from any directory)."""
    return ADDRESS if os.path.exists(SOCKET_PATH) else LISTEN

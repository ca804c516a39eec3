"""Unix-socket helpers of the shm fd server's handshakes: exact reads, refusals, peer credentials.

Role: shared by :mod:`kvtierd.transports.shm` and :mod:`kvtierd.transports.shm_index`.
Ownership: none (the sockets are the caller's). Concurrency: event-loop thread (``recv_exactly``)
or any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

from kvtier_contract import wire


def refuse(conn: socket.socket, e: Exception) -> None:
    """Say why (never blocks: a peer that does not read gets nothing)."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(wire.SHM_REFUSED + str(e).encode()[: wire.SHM_MAX_ERROR_BYTES])


async def recv_exactly(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (ValueError when the peer stops sending before)."""
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(conn, n - len(data))
        if not chunk:
            raise ValueError("bad shm handshake (short)")
        data += chunk
    return data


def peer(conn: socket.socket) -> tuple[int, int]:
    """The connected peer's uid and gid (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    return uid, gid

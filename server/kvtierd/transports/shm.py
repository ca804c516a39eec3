"""shm fd server: gives the host arena's memfd to same-host clients.

Handshake on a Unix stream socket (one exchange per connection, then the daemon closes it),
stated once in :mod:`kvtier_contract.wire` (``SHM_REQUEST`` / ``SHM_REPLY`` / ``SHM_REFUSED``).

The peer's credentials (SO_PEERCRED) are logged; the socket file's mode (0660) decides who may
connect. Bounded: a handshake must arrive within ``handshake_timeout_s``, at most
``max_connections`` handshakes are served at once (one more is closed at once, counted in
``refused``), and running out of descriptors pauses accepting instead of ending it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from kvtier_contract import wire
from kvtier_contract.errors import KvtierError
from kvtierd.ratelog import RateLimitedLog
from kvtierd.sessions import SessionTable
from kvtierd.transports.base import ServerTransport

log = logging.getLogger("kvtierd.shm")


class ShmFdServer(ServerTransport):
    """Owns the listening socket and its file. Event-loop thread only."""

    name = "shm"

    def __init__(self, path: str, arena_fd: int, arena_bytes: int, boot_epoch: int,
                 sessions: SessionTable, *, handshake_timeout_s: float = 5.0,
                 max_connections: int = 128) -> None:
        self.path = os.path.abspath(path)
        self._fd = arena_fd
        self._bytes = arena_bytes
        self._epoch = boot_epoch
        self._sessions = sessions
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._timeout_s = handshake_timeout_s
        self._max = max_connections
        self._open = 0  # connections being served
        self.handed_out = 0
        self.refused = 0
        self._accept_log = RateLimitedLog(log, 10.0)

    def figures(self) -> dict[str, int]:
        return {"shm_connections": self._open, "shm_connections_refused": self.refused}

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o660)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: wait for descriptors to come back
                self._accept_log.warning("shm fd socket: accept failed (%s); retrying", e)
                await asyncio.sleep(0.1)
                continue
            if self._open >= self._max:
                self.refused += 1
                conn.close()
                continue
            self._open += 1
            loop.create_task(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn, wire.SHM_REQUEST.size),
                                              self._timeout_s)
                if len(data) != wire.SHM_REQUEST.size or data[:4] != wire.SHM_MAGIC:
                    raise ValueError("bad shm handshake")
                _, session_id = wire.SHM_REQUEST.unpack(data)
                self._sessions.get(session_id)
                conn.setblocking(True)
                reply = wire.SHM_REPLY.pack(wire.SHM_MAGIC, self._bytes, self._epoch)
                socket.send_fds(conn, [reply], [self._fd])
                self.handed_out += 1
            except (KvtierError, ValueError) as e:
                with contextlib.suppress(OSError):
                    conn.setblocking(True)
                    conn.sendall(wire.SHM_REFUSED + str(e).encode()[: wire.SHM_MAX_ERROR_BYTES])
            except (OSError, TimeoutError) as e:
                log.debug("shm handshake failed: %s", e)
            finally:
                self._open -= 1

    def advertise(self) -> dict[str, Any]:
        return {"shm_socket": self.path}

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        if self._sock:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

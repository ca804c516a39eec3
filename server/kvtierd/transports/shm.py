"""shm fd server: gives the host arena's memfd to same-host clients.

Handshake on a Unix stream socket (one exchange per connection, then the daemon closes it)::

    client -> daemon:  "KVS1" session_id:u64le
    daemon -> client:  "KVS1" arena_bytes:u64le boot_epoch:u64le   + the fd (SCM_RIGHTS)
                   or  "KVE1" utf-8 message                          (unknown session)

The peer's credentials (SO_PEERCRED) are logged; the socket file's mode (0660) decides who may
connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct

from kvtier.errors import KvtierError
from kvtierd.sessions import SessionTable

log = logging.getLogger("kvtierd.shm")
REQUEST = struct.Struct("<4sQ")
REPLY = struct.Struct("<4sQQ")


class ShmFdServer:
    """Owns the listening socket and its file. Event-loop thread only."""

    def __init__(self, path: str, arena_fd: int, arena_bytes: int, boot_epoch: int,
                 sessions: SessionTable) -> None:
        self.path = os.path.abspath(path)
        self._fd = arena_fd
        self._bytes = arena_bytes
        self._epoch = boot_epoch
        self._sessions = sessions
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.handed_out = 0

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
            conn, _ = await loop.sock_accept(self._sock)
            loop.create_task(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                data = await asyncio.wait_for(loop.sock_recv(conn, REQUEST.size), 5.0)
                if len(data) != REQUEST.size or data[:4] != b"KVS1":
                    raise ValueError("bad shm handshake")
                _, session_id = REQUEST.unpack(data)
                self._sessions.get(session_id)
                conn.setblocking(True)
                socket.send_fds(conn, [REPLY.pack(b"KVS1", self._bytes, self._epoch)], [self._fd])
                self.handed_out += 1
            except (KvtierError, ValueError) as e:
                with contextlib.suppress(OSError):
                    conn.setblocking(True)
                    conn.sendall(b"KVE1" + str(e).encode()[:1000])
            except (OSError, TimeoutError) as e:
                log.debug("shm handshake failed: %s", e)

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        if self._sock:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

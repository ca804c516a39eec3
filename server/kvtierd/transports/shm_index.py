"""Index channels of the shm fd server: read-only descriptors of namespaces' published
indexes handed to same-host clients (``INDEX_REQUEST`` / ``INDEX_REPLY``,
:mod:`kvtier_contract.published_index`), and the one channel per live session that stays open.

Role: the index half of :class:`kvtierd.transports.shm.ShmFdServer` (which owns the socket, the
accept loop and the session check it passes in). Ownership: the table of channel tasks (session
id -> task) and, per channel, the namespaces it holds (``hold(namespace, +1 / -1)``); the
descriptors come from ``index`` and are closed here once sent. Concurrency: event-loop thread
only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

from kvtier_contract import published_index as pi
from kvtier_contract.errors import KvtierError
from kvtierd.sessions import Session
from kvtierd.transports.shm_socket import recv_exactly, refuse

log = logging.getLogger("kvtierd.shm")


class IndexChannels:
    """Serves index requests and keeps each session's index channel (see the module docstring).
    ``index(session_id, namespace_id)``: a read-only descriptor of that namespace's published
    index, its size and generation (KvtierError or OSError: refused). ``session(conn, id,
    secret)``: the live session, or a KvtierError (the server's check of peer and secret)."""

    def __init__(
        self,
        index: Callable[[int, int], tuple[int, int, int]],
        hold: Callable[[int, int], None],
        epoch: int,
        session: Callable[[socket.socket, int, bytes], Session],
    ) -> None:
        self._index, self._hold, self._epoch, self._session = index, hold, epoch, session
        self._channels: dict[int, asyncio.Task[None]] = {}  # session id -> its index channel

    def __len__(self) -> int:
        return len(self._channels)

    def unhold(self, held: dict[int, int]) -> None:
        """A channel ended: it reads none of the namespaces it held any more."""
        for ns_id in held:
            self._hold(ns_id, -1)

    async def serve(self, conn: socket.socket, session_id: int, held: dict[int, int]) -> None:
        """The session's index channel: it stays open while the session lives (the client
        reads the daemon's liveness from it: a dead daemon's end closes) and takes further
        index requests of that session; one per session (a newer one replaces it)."""
        task = asyncio.current_task()
        assert task is not None
        old = self._channels.get(session_id)
        if old is not None:
            old.cancel()
        self._channels[session_id] = task
        try:
            while True:
                data = await recv_exactly(conn, pi.INDEX_REQUEST.size)  # no timeout: idle is normal
                if data[:4] != pi.INDEX_MAGIC or pi.INDEX_REQUEST.unpack(data)[1] != session_id:
                    raise ValueError("bad index request on the session's index channel")
                try:
                    self.answer(conn, data, held)
                except (KvtierError, ValueError) as e:  # (this namespace only: the channel stays)
                    refuse(conn, e)
        except (ValueError, OSError) as e:
            log.debug("index channel of session %d ended: %s", session_id, e)
        finally:
            if self._channels.get(session_id) is task:
                del self._channels[session_id]

    def answer(self, conn: socket.socket, data: bytes, held: dict[int, int]) -> int:
        """Answer one index request (its session's id) of a live session whose data secret it
        carries, from a peer its tenant allows; a KvtierError or ValueError refuses.
        A namespace handed out on this channel for the first time is held (``hold``)
        until the channel ends; one generation of a namespace is handed out once per channel
        (so a client that asks without reading cannot pile descriptors up in the socket)."""
        _, session_id, namespace_id, secret = pi.INDEX_REQUEST.unpack(data)
        self._session(conn, session_id, secret)  # (the peer and the secret, every request)
        try:
            fd, size, generation = self._index(session_id, namespace_id)
        except OSError as e:
            raise ValueError(f"no published index: {e}") from None
        try:  # non-blocking: a few bytes fit the socket buffer unless the peer never reads
            if held.get(namespace_id) == generation:
                raise ValueError(
                    f"generation {generation} of namespace {namespace_id} was "
                    "handed out on this channel already"
                )
            if namespace_id not in held:
                self._hold(namespace_id, +1)
            held[namespace_id] = generation
            reply = pi.INDEX_REPLY.pack(pi.INDEX_MAGIC, size, self._epoch, generation)
            if socket.send_fds(conn, [reply], [fd]) != len(reply):
                raise OSError("short send")
        finally:
            os.close(fd)
        return int(session_id)

    def release(self, session_id: int) -> None:
        task = self._channels.pop(session_id, None)
        if task is not None:
            task.cancel()  # its client sees the channel close and stops reading the index

    def close(self) -> None:
        for task in self._channels.values():
            task.cancel()
        self._channels.clear()

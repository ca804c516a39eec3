"""TCP data channel server (framing: kvtier_contract.wire; protocol: docs/tcp_data_channel.md).

One connection per client session. A BufferedProtocol hands uvloop either the 32-byte header
buffer or the destination arena memory itself, so WRITE payloads land in their slots with no
copy in Python. A WRITE_RUN (many consecutive keys under one header) is laid out as segments of
adjacent slots, and uvloop reads each segment whole: a run of 16 KiB blocks in adjacent slots
costs a few large reads instead of two system calls and a header parse per block. The DATA
frames of a load job go to the transport in one ``writelines`` call (one gathered write under
uvloop), straight from the pinned slots, as runs when the client accepts them. At start the
server maps the whole (prefaulted) arena into the daemon's page tables, so recv never faults.

Views, not copies, wait in a transport's write buffer, so a load job stays pinned until its
queued bytes reach the kernel or are dropped with the connection (``TieredCache.load_queued`` /
``load_sent``): a slot is never reused while its bytes may still leave. Every connection is
bounded (:class:`DataChannelLimits`): HELLO in time, an idle timeout, a global cap, reading
paused while too many reply bytes wait; connections waiting for HELLO have a budget of their
own (the oldest waiting one makes room for a new one), and those past HELLO count against their
tenant's share of the cap.

Modules: this one holds the server (listening, arena mapping, session release, shutdown);
:mod:`~kvtierd.transports.tcp_protocol` the per-connection protocol (with
:mod:`~kvtierd.transports.tcp_segments`, where payload bytes go) and
:mod:`~kvtierd.transports.tcp_admission` the connection table and its limits (both re-exported).

A HELLO offering ``FEATURE_CONTROL`` (when the server has a ``control`` factory) makes the
connection a control channel of its session instead (:mod:`kvtierd.transports.control`): from
HELLO_OK on, its bytes go to a ControlChannel, under the same limits (cap, idle timeout,
session end).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import ssl
from typing import Any

from kvtierd.cache import TieredCache
from kvtierd.sessions import SessionTable
from kvtierd.transports.base import ChannelFactory, ServerTransport
from kvtierd.transports.tcp_admission import CONNECTIONS, ConnectionTable, DataChannelLimits, Timers
from kvtierd.transports.tcp_protocol import DataChannelProtocol

__all__ = [
    "CONNECTIONS",
    "DataChannelLimits",
    "DataChannelProtocol",
    "DataChannelServer",
    "Timers",
    "populate_arena",
]
log = logging.getLogger("kvtierd.tcp")
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it


class DataChannelServer(ServerTransport):
    """Listens for data connections; owns the asyncio server and the :class:`ConnectionTable`
    (``table``: every open connection, for the cap, session release and shutdown, and its
    counts of connections refused at the cap and closed by a timeout, ``figures``), which each
    connection's protocol is handed. Event-loop thread only."""

    name = "tcp"

    def __init__(
        self,
        host: str,
        port: int,
        cache: TieredCache,
        sessions: SessionTable,
        limits: DataChannelLimits | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        control: ChannelFactory | None = None,
        timers: Timers | None = None,
    ) -> None:
        """``ssl_context``: serve TLS (every connection; advertised as ``data_tls``).
        ``control(session, on_close)``: the protocol of a control channel of that session, for
        a HELLO offering FEATURE_CONTROL (None: not offered back). ``timers``: the connections'
        clock and timers (None: the running loop's; tests drive their own)."""
        self.table = ConnectionTable(limits, control, timers)
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        self._cache, self._sessions = cache, sessions
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        for arena in self._cache.host.arenas:  # (an arena made by a later reload is not)
            populate_arena(arena.mm, arena.fd)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: DataChannelProtocol(self._cache, self._sessions, self.table),
            self.host,
            self.port,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.table.limits.hello_timeout_s if self.ssl_context else None,
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def release_session(self, session_id: int) -> None:
        for conn in self.table.connections():
            conn.end_session(session_id)

    def figures(self) -> dict[str, int]:
        return self.table.figures()

    def advertise(self) -> dict[str, Any]:
        return {"data_host": self.host, "data_port": self.port, "data_tls": self.ssl_context is not None}

    def close(self) -> None:
        """Stop listening and drop every connection (queued replies included: the arena is
        about to be unmapped)."""
        if self._server:
            self._server.close()
        for conn in self.table.connections():
            if conn.transport is not None:
                conn.transport.abort()


def populate_arena(mm: mmap.mmap, fd: int) -> bool:
    """Map every page of a prefaulted arena into this process's page tables, once, at start.

    The data channel is the one path on which the daemon itself copies payloads (recv into
    slots, send from them), through its own mapping of the arena. ``fallocate`` gave the memfd
    its pages but not this mapping its page-table entries, so each first copy into a 4 KiB page
    faulted (measured: 43 ms per 64 MiB on first touch, 7 ms once mapped; docs/benchmarks.md).
    Skipped when the arena was not prefaulted (``prefault = false``: the operator asked that
    pages be allocated only when used) and on kernels without MADV_POPULATE_WRITE.
    """
    allocated = os.fstat(fd).st_blocks * 512
    if allocated < len(mm):
        return False
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except OSError as e:
        log.info("cannot populate the arena mapping (%s); first copies will fault", e)
        return False
    return True

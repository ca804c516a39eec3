"""The server-transport seam: how a client's bytes reach the host tier, daemon side.

Three implement it: :class:`~kvtierd.transports.shm.ShmFdServer` (hands the arena's memfd to
same-host clients; they copy themselves), :class:`~kvtierd.transports.tcp.DataChannelServer`
(the TCP data channel; the daemon receives into and sends from slots) and
:class:`~kvtierd.transports.cuda_ipc.CudaIpcTransport` (the daemon copies between clients' CUDA
buffers and slots). None of them writes the index: they ask the cache's job table where a job's
bytes go and report which arrived.

Lifecycle, driven by the composition root (kvtierd.app)::

    built -> await start()      bind, prepare (before the daemon reports ready)
          -> serving            advertise() fills OpenSession replies;
                                release_session(id) when a session closes or its lease lapses
          -> close()            after the sessions are released, before the arena is unmapped

Every method runs on the daemon's event-loop thread.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtierd.sessions import Session

CONTROL_CHANNELS_PER_SESSION = 8
"""Control channels of one session on each transport that serves them (the SDK opens at most 4)."""
ChannelFactory = Callable[["Session", Callable[[Any], None]], asyncio.Protocol]
"""(session, on_close(channel)) -> the protocol serving a control channel of that session
(kvtierd.transports.control.ControlChannel; the shm socket and the TCP data port take one)."""


class ServerTransport(ABC):
    """See the module docstring."""

    name: str

    @abstractmethod
    async def start(self) -> None:
        """Bind and prepare; raises if the transport cannot serve (the daemon does not start)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release what the transport holds (sockets, CUDA mappings)."""

    def advertise(self) -> dict[str, Any]:
        """The OpenSessionReply fields this transport fills (its address for clients)."""
        return {}

    def release_session(self, session_id: int) -> None:
        """A session closed or lapsed: drop what it held here (nothing, by default)."""
        return None

    def figures(self) -> dict[str, int]:
        """Connection gauges and counters for Stats and /metrics (``<name>_connections...``)."""
        return {}

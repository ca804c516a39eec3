"""DataChannel: the data transport of one session, attached and retired.

Lifecycle: ``attach`` (after OpenSession: a transport of the session's kind attached to the session
the reply opened, TLS when the daemon's data port serves it) -> transfers, each inside
``transfer()`` (``get()`` is the attached transport) -> ``retire`` (the session is gone: the
transport is closed now, or, while a transfer is in flight, when that transfer ends: never under
it; cuda_ipc makes RPCs inside a transfer, so that transfer may be on the retiring thread).

Owned by a :class:`kvtier.connection.Connection`. Thread-safety: ``transfer`` holds the channel's
lock (transfers are serialized); ``attach`` and ``retire`` run under the connection's lock and
never wait for this one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.addresses import grpc_host
from kvtier.calls import Away
from kvtier.credentials import data_tls_context
from kvtier.diagnose import Peer, explain_attach
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors


class DataChannel:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transport: DataTransport | None = None
        self._retired: list[DataTransport] = []  # detached during a transfer, closed after it

    def attach(
        self,
        reply: Any,
        kind: str,
        *,
        peer: Peer,
        tls_files: tuple[str | None, ...],
        io_timeout_s: float,
        timeout: float,
        rpc: Callable[[str, Any], Any],
    ) -> DataTransport:
        """A ``kind`` transport attached to the session ``reply`` (OpenSessionReply) opened,
        within ``timeout``, making its RPCs through ``rpc``; Away (explained) when it cannot be.
        It becomes the channel's transport once the caller calls ``use``."""
        transport = make_transport(kind)
        transport.io_timeout_s = io_timeout_s
        if reply.data_host in ("0.0.0.0", "::", ""):
            # The daemon listens on every interface: reach it where we reached its gRPC port.
            reply.data_host = grpc_host(peer.address)
        try:
            if reply.data_tls:
                transport.tls_context = data_tls_context(*tls_files[:3])
                transport.tls_server_name = grpc_host(peer.address)
            transport.attach(reply.session_id, reply, timeout)
        except errors.TransportError as e:
            raise Away(str(e), explain_attach(peer, e)) from None
        transport.bind_rpc(rpc)
        return transport

    def use(self, transport: DataTransport) -> None:
        self._transport = transport

    def retire(self) -> None:
        """Detach the transport: closed now, or when the transfer in flight ends."""
        if self._transport is not None:
            transport, self._transport = self._transport, None
            self._retired.append(transport)
            if self._lock.acquire(blocking=False):
                try:
                    self._close_retired()
                finally:
                    self._lock.release()

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        """Hold the data channel for one transfer; close what was detached meanwhile."""
        with self._lock:
            try:
                yield
            finally:
                self._close_retired()

    def _close_retired(self) -> None:
        """Close detached transports (the caller holds the lock)."""
        while self._retired:
            self._retired.pop().close()

    def get(self) -> DataTransport:
        """The attached transport; TransportError when none is."""
        if self._transport is None:
            raise errors.TransportError("no data transport attached")
        return self._transport

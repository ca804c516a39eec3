"""Admission to the data port: who may hold a data connection, and for how long.

Role: the connection table behind :class:`kvtierd.transports.tcp.DataChannelServer` (which holds
it): the global cap, the budget of connections still waiting for HELLO (the oldest waiting one
makes room), each tenant's share past HELLO, and the counters of refused, timed-out and
misbehaving connections. The limits are :class:`DataChannelLimits`; the connections are anything
with the few members of :class:`Connection` (:class:`kvtierd.transports.tcp_protocol.
DataChannelProtocol`). Ownership: the table owns its sets and the per-tenant ledger, never the
connections (it only closes the oldest waiting one). Concurrency: event-loop thread only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvtierd.ratelog import RateLimitedLog
from kvtierd.tenancy import Ledger
from kvtierd.transports.base import ChannelFactory

log = logging.getLogger("kvtierd.tcp")
CONNECTIONS = "data_connections"  # what a tenant holds of the data port (its ledger's resource)


@dataclass(frozen=True)
class DataChannelLimits:
    """What one daemon allows its data connections (DaemonConfig ``handshake_timeout_s`` and
    ``data_*``; docs/configuration.md)."""

    hello_timeout_s: float = 5.0
    """A connection that has not sent HELLO this long after it opened is closed."""
    idle_timeout_s: float = 300.0
    """No frame received and no queued reply byte taken by the peer for this long: closed (the
    queued replies dropped)."""
    max_connections: int = 1024
    """Open connections at most; one more is answered ERROR and closed at once."""
    max_queued_bytes: int = 16 << 20
    """Reading pauses while more reply bytes than this wait in a connection's write buffer."""
    max_unauthenticated: int = 64
    """Connections without a valid HELLO yet, at most; one more (or one more at the cap while
    some wait) closes the oldest waiting one, so they never keep a client out."""
    per_tenant: int = 0
    """Connections bound (at HELLO) to the sessions of one tenant, at most (0: no cap; a
    session without a tenant, on a single-tenant daemon, is never capped)."""


class Timers(Protocol):
    """Where connections' timers run: the running event loop, or a hand-driven clock in tests."""

    def time(self) -> float: ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable: ...


class Cancellable(Protocol):
    """A timer that may be cancelled (asyncio.TimerHandle)."""

    def cancel(self) -> None: ...


class Connection(Protocol):
    """What the table needs of a data connection."""

    session_id: int
    tenant: str | None
    transport: asyncio.Transport | None

    @property
    def is_control(self) -> bool: ...

    def _fail(self, message: str) -> None: ...

    def end_session(self, session_id: int) -> None: ...


class ConnectionTable:
    """Every open data connection, and the limits that admit them (see the module docstring).
    Counts connections accepted, refused at the cap, closed by a timeout and closed for a bad
    frame (the protocol counts the last two). Event-loop thread only."""

    def __init__(
        self,
        limits: DataChannelLimits | None = None,
        control: ChannelFactory | None = None,
        timers: Timers | None = None,
    ) -> None:
        """``timers``: None (the running event loop's clock and timers) or a stand-in."""
        self.limits = limits or DataChannelLimits()
        self.control = control
        self._timers = timers
        self._conns: set[Connection] = set()
        self._waiting: dict[Connection, None] = {}  # no HELLO yet, oldest first
        self._tenants = Ledger()  # connections past HELLO (CONNECTIONS) per tenant
        self.accepted = 0
        self.refused = 0  # beyond max_connections
        self.timed_out = 0  # no HELLO in time, or idle
        self.bad_frames = 0  # connections closed for a frame that breaks the protocol
        self._cap_log = RateLimitedLog(log, 10.0)

    @property
    def timers(self) -> Timers:
        """The connections' clock and timers (event-loop thread)."""
        if self._timers is not None:
            return self._timers
        return asyncio.get_running_loop()

    def admit(self, conn: Connection) -> bool:
        """Count a new connection in, or refuse it at the cap (the caller closes it). Room is
        made first by closing the oldest connection still waiting for HELLO, when
        ``max_unauthenticated`` wait or the cap is reached with some waiting: a flood of
        connections that prove no session never keeps a client out (one that sends its HELLO
        at once is past it long before ``max_unauthenticated`` newer ones arrive)."""
        full = len(self._conns) >= self.limits.max_connections
        if self._waiting and (full or len(self._waiting) >= self.limits.max_unauthenticated):
            oldest = next(iter(self._waiting))
            self.forget(oldest)
            self.refused += 1
            oldest._fail(
                f"too many data connections waiting for HELLO (max "
                f"{self.limits.max_unauthenticated}): the oldest is closed"
            )
        if len(self._conns) >= self.limits.max_connections:
            self.refused += 1
            self._cap_log.warning(
                "data channel at its cap of %d connections: refusing more (%d so far)",
                self.limits.max_connections,
                self.refused,
            )
            return False
        self._conns.add(conn)
        self._waiting[conn] = None
        self.accepted += 1
        return True

    def bind(self, conn: Connection, tenant: str | None) -> bool:
        """``conn`` passed HELLO for a session of ``tenant``: it counts against that tenant's
        share (``per_tenant``) from now on, or False when the tenant holds its share (the
        caller closes it). None (a single-tenant daemon): no share."""
        self._waiting.pop(conn, None)
        if tenant is not None:
            if not self._tenants.take(tenant, CONNECTIONS, 1, self.limits.per_tenant or None):
                self.refused += 1
                return False
            conn.tenant = tenant
        return True

    def connections(self) -> list[Connection]:
        """Every open connection (a copy: the caller may close them)."""
        return list(self._conns)

    def controls_of(self, session_id: int) -> int:
        """Control connections of a session (a HELLO asking for one more than
        ``CONTROL_CHANNELS_PER_SESSION`` is refused)."""
        return sum(1 for c in self._conns if c.session_id == session_id and c.is_control)

    def forget(self, conn: Connection) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            self._waiting.pop(conn, None)
            if conn.tenant is not None:
                self._tenants.give(conn.tenant, CONNECTIONS, 1)
                conn.tenant = None

    def figures(self) -> dict[str, int]:
        """Gauges and counters of the data channel (for Stats and /metrics)."""
        return {
            "tcp_connections": len(self._conns),
            "tcp_connections_accepted": self.accepted,
            "tcp_connections_refused": self.refused,
            "tcp_connections_timed_out": self.timed_out,
            "tcp_bad_frames": self.bad_frames,
        }

"""The gate of the event sockets: at most ``max_peers`` connections on each PUB and replay socket.

libzmq has no per-socket connection limit, but it asks a ZAP handler (ZeroMQ's authentication
protocol, RFC 27: a ROUTER on ``inproc://zeromq.zap.01`` of the socket's context) about every
connection's handshake on a socket that has a ZAP domain, even with the NULL mechanism. The
gate is that handler: a socket monitor counts each watched socket's open connections
(accepted, not yet disconnected), and a handshake that would make more than ``max_peers`` is
denied (status 400: libzmq closes it; the peer's reconnects are denied alike while the socket
is full). What a subscriber can make the daemon hold is then bounded by the sockets: at most
``max_peers`` x the send high-water mark x the largest message, per socket.

Primitives: ``watch(sock, domain)`` (before the socket binds), ``forget(sock)`` (before it
closes), ``serve()`` (the monitors read, then every waiting handshake answered), ``close()``.

Ownership: the ZAP socket and the monitors; the publisher thread alone once started (``watch``
of the sockets bound at start runs in the caller's thread, before the thread starts).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvtierd.events")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: the one address libzmq asks


class ConnectionGate:
    """See the module docstring."""

    def __init__(self, ctx: Any, max_peers: int) -> None:
        import zmq

        self._zmq = zmq
        self.max_peers = max_peers
        self._zap = ctx.socket(zmq.ROUTER)
        self._zap.bind(ZAP_ENDPOINT)
        self._monitors: dict[bytes, Any] = {}  # ZAP domain -> its socket's monitor
        self._open: dict[bytes, set[int]] = {}  # ZAP domain -> fds of open connections
        self._domain_of: dict[int, bytes] = {}  # id(socket) -> its domain
        self.refused = 0

    def watch(self, sock: Any, domain: str) -> None:
        """Count ``sock``'s connections and gate its handshakes (call before it binds)."""
        zmq = self._zmq
        d = domain.encode()
        sock.setsockopt(zmq.ZAP_DOMAIN, d)
        self._monitors[d] = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._open[d] = set()
        self._domain_of[id(sock)] = d

    def forget(self, sock: Any) -> None:
        d = self._domain_of.pop(id(sock), None)
        if d is not None:
            sock.disable_monitor()
            self._monitors.pop(d).close(linger=0)
            del self._open[d]

    def connections(self) -> int:
        """Open connections of every watched socket."""
        return sum(len(fds) for fds in self._open.values())

    def serve(self) -> None:
        """Read the monitors, then answer every handshake waiting (never blocks)."""
        self._read_monitors()
        zap = self._zap
        while zap.poll(0):
            frames = zap.recv_multipart()
            if len(frames) < 6:
                continue
            peer, _, version, request_id, domain = frames[:5]
            ok = len(self._open.get(domain, ())) <= self.max_peers
            if not ok:
                self.refused += 1
                log.debug("KV-event socket %s: %d connections open: one more refused", domain, self.max_peers)
            status = (b"200", b"OK") if ok else (b"400", b"too many connections")
            zap.send_multipart([peer, b"", version, request_id, *status, b"", b""])

    def close(self) -> None:
        for mon in self._monitors.values():
            mon.close(linger=0)
        self._monitors.clear()
        self._zap.close(linger=0)

    def _read_monitors(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        zmq = self._zmq
        for d, mon in self._monitors.items():
            fds = self._open[d]
            while mon.poll(0):
                msg = parse_monitor_message(mon.recv_multipart())
                if msg["event"] == zmq.EVENT_ACCEPTED:
                    fds.add(msg["value"])
                elif msg["event"] == zmq.EVENT_DISCONNECTED:
                    fds.discard(msg["value"])

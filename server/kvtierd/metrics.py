"""Prometheus exposition: the /metrics HTTP server. With :mod:`kvtierd.metric_families` (the
families), the only modules that import prometheus_client.

Metrics are pulled: at scrape time the collector asks the daemon loop for one consistent snapshot
(``StatsReply`` plus RPC latency histograms) and turns it into families. A scrape with the
operator's credential or a scrape token (kvtierd.tenants: ``metrics_tokens_sha256``), or any
scrape of a daemon without tenants, also gets the process (``process_*``: CPU, memory,
descriptors, start time) and platform (``python_info``) figures; a tenant's gets only its own
namespaces and tenant.

The HTTP server is our own (:class:`MetricsServer`), not prometheus_client's, which starts a
thread per connection with no read timeout: here a listener thread reads every request head with
a deadline, a small pool renders the replies, and open connections are capped.
"""

from __future__ import annotations

import asyncio
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvtierd.metric_families import KvtierCollector, Snapshot
from kvtierd.ratelog import RateLimitedLog

log = logging.getLogger("kvtierd.metrics")
_MAX_HEAD_BYTES = 8192  # a request head longer than this is closed unanswered
ACCEPT_BACKOFF_S = 0.1  # accept() failed (out of descriptors): stop selecting the listener this long
LOG_INTERVAL_S = 10.0  # at most one line per this many seconds for a failure that repeats


class MetricsServer:
    """Owns the /metrics HTTP server: one listener thread and a pool of ``workers`` threads.

    ``start()`` -> ``port`` -> ``close()``. The listener thread accepts and reads request heads
    for every connection at once (non-blocking, one ``selectors`` loop), so a peer that sends
    half a request costs a socket, never a thread: it is closed ``read_timeout_s`` after it
    connected, and when ``max_connections`` are open the oldest unfinished one is closed to
    make room for a new one. When accepting fails (out of descriptors) the listener stops
    selecting the listening socket for ``ACCEPT_BACKOFF_S`` (logged at most every
    ``LOG_INTERVAL_S``), and a failing round is logged and survived, never the end of the thread.
    A complete request goes to the worker pool (``workers`` threads; at
    most ``max_connections`` requests queued, more are closed unanswered),
    which takes the snapshot (on the daemon loop), renders it and writes the reply with a
    ``write_timeout_s`` socket timeout, then closes the connection (no keep-alive).
    Thread-safety: the listener thread owns the pending connections; workers own the
    connection they are handed; ``close()`` may be called from any thread, once.
    """

    def __init__(
        self,
        host: str,
        port: int,
        loop: asyncio.AbstractEventLoop,
        snapshot: Callable[[Any], Snapshot],
        *,
        workers: int = 4,
        read_timeout_s: float = 5.0,
        write_timeout_s: float = 5.0,
        max_connections: int = 64,
        authorize: Callable[[str | None], tuple[bool, Any]] = lambda _t: (True, None),
    ) -> None:
        """``snapshot(caller)`` (on the loop): the figures ``caller`` may see.
        ``authorize(bearer token or None)`` -> (allowed, caller): a request that is not
        allowed is answered 401 (a daemon with tenants: kvtierd.app)."""
        self.host, self.port = host, port
        self._loop = loop
        self._snapshot = snapshot
        self._authorize = authorize
        self.workers, self.max_connections = workers, max_connections
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        self.registry = self._registry(None, daemon_wide=True)
        self._sock: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[socket.socket, tuple[float, bytearray]] = {}  # conn -> (deadline, head)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-metrics")
        self._thread: threading.Thread | None = None
        self._closed = False
        self.closed_idle = 0  # connections closed for a read timeout or to make room
        self._lock = threading.Lock()
        self._queued = 0  # requests handed to the pool and not answered yet
        self._accept_paused_until = 0.0  # accept() failed (EMFILE): the listener rests till then
        self._accept_log = RateLimitedLog(log, LOG_INTERVAL_S)
        self._error_log = RateLimitedLog(log, LOG_INTERVAL_S)

    def _registry(self, caller: Any, *, daemon_wide: bool) -> CollectorRegistry:
        """The families ``caller`` may see; ``daemon_wide``: with the process's own figures."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(KvtierCollector(lambda: self._threadsafe_snapshot(caller)))
        if daemon_wide:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
        return registry

    def _threadsafe_snapshot(self, caller: Any) -> Snapshot:
        async def take() -> Snapshot:
            return self._snapshot(caller)

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=5)

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._selector.register(sock, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="kvtier-metrics-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                self._serve_once()
            except Exception:  # noqa: BLE001  (a bug here must not end /metrics for good)
                self._error_log.error("metrics: listener round failed", exc_info=True)
                time.sleep(ACCEPT_BACKOFF_S)  # never a busy loop on a repeating failure
        for conn in list(self._pending):
            self._drop(conn)

    def _serve_once(self) -> None:
        """One select round: accept, read the heads that arrived, close the expired."""
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            assert self._sock is not None
            self._selector.register(self._sock, selectors.EVENT_READ, "accept")
        deadlines = [d for d, _ in self._pending.values()]
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        timeout = min(deadlines, default=now + 1.0) - now
        for key, _ in self._selector.select(max(0.0, timeout)):
            if key.data == "accept":
                self._accept()
            elif key.data == "read" and key.fileobj in self._pending:
                # (not pending: closed earlier this round to make room; its event is stale)
                self._read(key.fileobj)
        now = time.monotonic()
        for conn in [c for c, (d, _) in self._pending.items() if d <= now]:
            self._drop(conn)

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: stop accepting for a while, then retry
                self._accept_log.warning(
                    "metrics: accept failed (%s); retrying in %.1fs", e, ACCEPT_BACKOFF_S
                )
                self._selector.unregister(self._sock)
                self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                return
            if len(self._pending) >= self.max_connections:
                oldest = min(self._pending, key=lambda c: self._pending[c][0])
                self._drop(oldest)
            conn.setblocking(False)
            self._pending[conn] = (time.monotonic() + self.read_timeout_s, bytearray())
            self._selector.register(conn, selectors.EVENT_READ, "read")

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        pending = self._pending.get(conn)
        if pending is None:  # dropped meanwhile
            return
        head = pending[1]
        head += data
        if data and b"\r\n\r\n" not in head and len(head) < _MAX_HEAD_BYTES:
            return
        self._selector.unregister(conn)
        del self._pending[conn]
        if not data or len(head) >= _MAX_HEAD_BYTES and b"\r\n\r\n" not in head:
            conn.close()
            return
        with self._lock:
            full = self._queued >= self.max_connections
            self._queued += not full
        if full:  # replies are not keeping up: refuse rather than queue without bound
            conn.close()
            return
        try:
            self._pool.submit(self._respond, conn, bytes(head))
        except RuntimeError:  # closing
            conn.close()

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.close()
        self.closed_idle += 1

    def _respond(self, conn: socket.socket, head: bytes) -> None:
        """Worker thread: answer one request and close the connection."""
        try:
            self._reply(conn, head)
        finally:
            with self._lock:
                self._queued -= 1

    def _reply(self, conn: socket.socket, head: bytes) -> None:
        with conn:
            conn.setblocking(True)
            conn.settimeout(self.write_timeout_s)
            method, path = _request_line(head)
            allowed, caller = self._authorize(_bearer(head))
            extra = ""
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
            elif path.split("?", 1)[0] not in ("/metrics", "/"):
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            elif not allowed:
                status, ctype = "401 Unauthorized", "text/plain"
                body = b"a valid bearer token is needed (docs/metrics.md, Who sees what)\n"
                extra = 'WWW-Authenticate: Bearer realm="kvtier"\r\n'
            else:
                registry = self.registry
                if caller is not None:  # this caller's own figures (a registry per request)
                    registry = self._registry(caller, daemon_wide=bool(caller.operator))
                try:
                    status, body, ctype = "200 OK", generate_latest(registry), CONTENT_TYPE_LATEST
                except Exception as e:  # noqa: BLE001  (a scrape must never kill a worker)
                    log.warning("metrics: rendering failed: %s", e)
                    status, body, ctype = "500 Internal Server Error", b"error\n", "text/plain"
            reply = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{extra}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            try:
                conn.sendall(reply + (body if method != "HEAD" else b""))
            except OSError:
                pass  # the scraper went away or stopped reading

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sock is not None:
            self._sock.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _bearer(head: bytes) -> str | None:
    """The bearer token of a request head's ``Authorization`` header, or None."""
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip().decode("latin-1")
    return None


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path) of a request head; ("", "") when it has no valid request line."""
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "", ""
    return parts[0].decode("latin-1"), parts[1].decode("latin-1")

"""Prometheus exposition. The only module that imports prometheus_client.

Metrics are pulled: at scrape time the collector asks the daemon loop for one consistent snapshot
(``StatsReply`` plus RPC latency histograms) and turns it into families. Names carry the
``kvtier_`` prefix and base units; counters end in ``_total``.

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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvtierd.ratelog import RateLimitedLog
from kvtierd.stats import COUNTER_FIELDS, GAUGE_FIELDS

log = logging.getLogger("kvtierd.metrics")
Snapshot = dict[str, Any]
_MAX_HEAD_BYTES = 8192  # a request head longer than this is closed unanswered
ACCEPT_BACKOFF_S = 0.1  # accept() failed (out of descriptors): stop selecting the listener this long
LOG_INTERVAL_S = 10.0  # at most one line per this many seconds for a failure that repeats

# Counter field -> (metric name, help, extra labels). Several fields share one family by label.
_FAMILIES: dict[str, tuple[str, str, dict[str, str]]] = {
    "lookups": ("kvtier_lookups_total", "Lookup RPCs", {}),
    "blocks_requested": ("kvtier_lookup_blocks_requested_total", "Blocks asked for by lookups", {}),
    "blocks_hit_host": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier", {"tier": "host"}),
    "blocks_hit_nvme": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier", {"tier": "nvme"}),
    "blocks_hit_local": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier",
                         {"tier": "unknown"}),
    "blocks_hit_cluster": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier",
                           {"tier": "cluster"}),
    "cluster_imports": ("kvtier_cluster_imports_total",
                        "Blocks fetched from the cluster tier into the host tier", {}),
    "cluster_corrupt": ("kvtier_cluster_corrupt_total",
                        "Cluster values that failed verification (a miss; deleted)", {}),
    "corrupt_blocks": ("kvtier_corrupt_blocks_total",
                       "Host blocks whose bytes no longer matched their digest (dropped)", {}),
    "local_lookups": ("kvtier_local_lookups_total",
                      "Lookups answered by clients from the published index", {}),
    "blocks_missed": ("kvtier_lookup_blocks_missed_total", "Blocks not found", {}),
    "tokens_requested": ("kvtier_lookup_tokens_requested_total", "Tokens asked for", {}),
    "tokens_hit": ("kvtier_lookup_tokens_hit_total", "Tokens found", {}),
    "tokens_missed": ("kvtier_lookup_tokens_missed_total", "Tokens not found", {}),
    "stores_accepted": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "accepted"}),
    "stores_already_present": ("kvtier_store_blocks_total", "Store outcomes",
                               {"outcome": "already_present"}),
    "stores_rejected": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "rejected"}),
    "stores_dropped": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "dropped"}),
    "loads": ("kvtier_load_blocks_total", "Blocks loaded by clients", {}),
    "evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "host"}),
    "bytes_in_shm": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                     {"transport": "shm", "direction": "in"}),
    "bytes_out_shm": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                      {"transport": "shm", "direction": "out"}),
    "bytes_in_tcp": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                     {"transport": "tcp", "direction": "in"}),
    "bytes_out_tcp": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                      {"transport": "tcp", "direction": "out"}),
    "bytes_in_cuda_ipc": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                          {"transport": "cuda_ipc", "direction": "in"}),
    "bytes_out_cuda_ipc": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                           {"transport": "cuda_ipc", "direction": "out"}),
    "resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "host"}),
    "resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "host"}),
    "nvme_resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "nvme"}),
    "nvme_resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "nvme"}),
    "promotions": ("kvtier_promotions_total", "Blocks promoted NVMe -> host", {}),
    "demotions": ("kvtier_demotions_total", "Blocks written host -> NVMe", {}),
    "nvme_evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "nvme"}),
    "checksum_failures": ("kvtier_checksum_failures_total", "NVMe reads failing verification", {}),
    "nvme_bytes_read": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes", {"direction": "read"}),
    "nvme_bytes_written": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes",
                           {"direction": "write"}),
}
assert set(_FAMILIES) == set(COUNTER_FIELDS)


def _cluster_families(cl: dict[str, Any]) -> Iterator[Any]:
    """The cluster tier's figures, per node (``node`` = the master's host:port)."""
    if not cl.get("enabled"):
        return
    g, c = GaugeMetricFamily, CounterMetricFamily
    yield g("kvtier_cluster_connected", "1 while a slot map is known and a master answers",
            value=1 if cl.get("connected") else 0)
    yield g("kvtier_cluster_queued_bytes", "Bytes waiting to be written to the cluster",
            value=cl.get("queued_bytes", 0))
    yield c("kvtier_cluster_writes_total", "Blocks written to the cluster",
            value=cl.get("writes", 0))
    yield c("kvtier_cluster_mac_failures_total", "Cluster values refused because their MAC did "
            "not verify (not written by a daemon of this fleet and tenant): misses",
            value=cl.get("mac_failures", 0))
    yield c("kvtier_cluster_write_drops_total", "Blocks not written: queue full, node down, late",
            value=cl.get("write_drops", 0))
    yield c("kvtier_cluster_corrupt_exports_total", "Blocks not written to the cluster: their "
            "bytes no longer matched their digest", value=cl.get("corrupt_exports", 0))
    yield c("kvtier_cluster_lookup_timeouts_total",
            "Lookups whose cluster part ran past the deadline", value=cl.get("lookup_timeouts", 0))
    per_node = [
        ("kvtier_cluster_node_keys_total", "Keys asked of a node, by outcome", "outcome",
         (("hit", "hits"), ("miss", "misses"))),
        ("kvtier_cluster_node_bytes_total", "Value bytes moved, by direction", "direction",
         (("read", "bytes_read"), ("write", "bytes_written"))),
    ]
    nodes = cl.get("nodes", [])
    for name, help_, label, pairs in per_node:
        fam = c(name, help_, labels=["node", label])
        for n in nodes:
            for value, key in pairs:
                fam.add_metric([n["address"], value], n.get(key, 0))
        yield fam
    errors = c("kvtier_cluster_node_errors_total", "Pipelines failed or late", labels=["node"])
    requests = c("kvtier_cluster_node_requests_total", "Pipelines sent", labels=["node"])
    latency = c("kvtier_cluster_node_latency_seconds_total",
                "Time of answered pipelines (divide by requests - errors)", labels=["node"])
    healthy = g("kvtier_cluster_node_healthy", "0 while a node's breaker is open",
                labels=["node"])
    for n in nodes:
        errors.add_metric([n["address"]], n.get("errors", 0))
        requests.add_metric([n["address"]], n.get("requests", 0))
        latency.add_metric([n["address"]], n.get("latency_seconds_sum", 0.0))
        healthy.add_metric([n["address"]], 1 if n.get("healthy") else 0)
    yield from (errors, requests, latency, healthy)


class KvtierCollector:
    """Turns a snapshot into metric families at scrape time. Called on the HTTP server thread."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        try:
            snap = self._snapshot()
        except Exception as e:  # the daemon is shutting down: expose nothing rather than fail
            log.debug("metrics snapshot failed: %s", e)
            return
        yield from _counter_families(snap)
        g = GaugeMetricFamily
        yield g("kvtier_host_capacity_bytes", "Host tier capacity", value=snap["host_capacity_bytes"])
        yield g("kvtier_host_used_bytes", "Host tier bytes in use (slots)",
                value=snap["host_used_bytes"])
        yield g("kvtier_sessions", "Open sessions", value=snap["sessions"])
        yield g("kvtier_pinned_blocks", "Blocks pinned by loads", value=snap["pinned_blocks"])
        yield g("kvtier_writing_blocks", "Blocks reserved and being written",
                value=snap["writing_blocks"])
        yield g("kvtier_limbo_blocks", "Slots held back after a lease expiry",
                value=snap["limbo_blocks"])
        nv = snap["nvme"]
        if nv["enabled"]:
            yield g("kvtier_nvme_capacity_bytes", "NVMe tier capacity", value=nv["capacity_bytes"])
            yield g("kvtier_nvme_used_bytes", "NVMe tier bytes in slots", value=nv["used_bytes"])
            yield g("kvtier_nvme_degraded", "1 while the NVMe tier does not admit blocks",
                    value=0 if nv["admitting"] else 1)
            yield CounterMetricFamily("kvtier_nvme_quarantined_slots", "Slots quarantined",
                                      value=nv["quarantined_slots"])
            yield g("kvtier_nvme_recovery_seconds", "Time the last recovery took",
                    value=nv["recovery_seconds"])
            yield g("kvtier_nvme_recovered_blocks", "Blocks the last recovery restored",
                    value=nv["recovered_blocks"])
        cu = snap["cuda_ipc"]
        if cu["enabled"]:
            yield g("kvtier_cuda_ipc_buffers", "Client CUDA buffers opened by the daemon",
                    value=cu["buffers"])
            yield CounterMetricFamily("kvtier_cuda_ipc_copies_total",
                                      "cudaMemcpyAsync calls of cuda_ipc transfers",
                                      value=cu["copies"])
            yield CounterMetricFamily("kvtier_cuda_ipc_copy_errors_total",
                                      "cuda_ipc transfers failed by a CUDA error (job aborted)",
                                      value=cu["copy_errors"])
        yield from _cluster_families(snap.get("cluster") or {})
        yield from _connection_families(snap.get("connections", {}))
        pub = snap.get("published", {})
        if pub:
            yield g("kvtier_published_indexes", "Namespaces whose index is published in shared "
                    "memory", value=pub["published_indexes"])
            yield g("kvtier_published_index_bytes", "Shared memory of the published indexes",
                    value=pub["published_index_bytes"])
            yield g("kvtier_published_index_left_out", "Blocks left out of a published index "
                    "(no slot within the probe bound)", value=pub["published_index_left_out"])
            yield g("kvtier_published_index_building", "Published indexes being built on a "
                    "thread (big namespaces)", value=pub["published_index_building"])
        yield g("kvtier_boot_epoch", "Boot epoch of this daemon", value=snap["boot_epoch"])
        yield g("kvtier_uptime_seconds", "Seconds since start", value=snap["uptime_s"])
        yield CounterMetricFamily("kvtier_leases_expired_total", "Sessions whose lease lapsed",
                                  value=snap["leases_expired"])
        errors = CounterMetricFamily("kvtier_rpc_errors", "RPC errors by method and status",
                                     labels=["method", "code"])
        for method, by_code in sorted(snap["rpc_errors"].items()):
            for code, n in sorted(by_code.items()):
                errors.add_metric([method, code], n)
        yield errors
        h = HistogramMetricFamily("kvtier_rpc_duration_seconds", "RPC service time", labels=["method"])
        for method, (buckets, total) in sorted(snap["rpc_latency"].items()):
            h.add_metric([method], buckets, total)
        yield h


def _counter_families(snap: Snapshot) -> Iterator[Any]:
    families: dict[str, Any] = {}
    for field, (name, help_, labels) in _FAMILIES.items():
        fam = families.get(name)
        keys = ["namespace", "model", *labels]
        if fam is None:
            cls = GaugeMetricFamily if field in GAUGE_FIELDS else CounterMetricFamily
            fam = families[name] = cls(name.removesuffix("_total") if cls is CounterMetricFamily
                                       else name, help_, labels=keys)
        for ns in snap["namespaces"]:
            fam.add_metric([str(ns["namespace_id"]), ns["model_id"], *labels.values()],
                           ns["counters"][field])
    yield from families.values()


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

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop,
                 snapshot: Callable[[Any], Snapshot], *, workers: int = 4,
                 read_timeout_s: float = 5.0, write_timeout_s: float = 5.0,
                 max_connections: int = 64,
                 authorize: Callable[[str | None], tuple[bool, Any]] = lambda _t: (True, None)
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
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(KvtierCollector(lambda: self._threadsafe_snapshot(None)))
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
        self._thread = threading.Thread(target=self._serve, name="kvtier-metrics-listener",
                                        daemon=True)
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
                self._accept_log.warning("metrics: accept failed (%s); retrying in %.1fs", e,
                                         ACCEPT_BACKOFF_S)
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
                body = b"a bearer token of a tenant or the operator is needed\n"
                extra = 'WWW-Authenticate: Bearer realm="kvtier"\r\n'
            else:
                registry = self.registry
                if caller is not None:  # this caller's own figures (a registry per request)
                    registry = CollectorRegistry(auto_describe=False)
                    registry.register(KvtierCollector(
                        lambda: self._threadsafe_snapshot(caller)))
                try:
                    status, body, ctype = "200 OK", generate_latest(registry), \
                        CONTENT_TYPE_LATEST
                except Exception as e:  # noqa: BLE001  (a scrape must never kill a worker)
                    log.warning("metrics: rendering failed: %s", e)
                    status, body, ctype = "500 Internal Server Error", b"error\n", "text/plain"
            reply = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n{extra}"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
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


def _connection_families(figures: dict[str, int]) -> Iterator[Any]:
    """Open connections and refusals per transport (``<transport>_connections[_what]``)."""
    open_ = GaugeMetricFamily("kvtier_connections", "Open transport connections",
                              labels=["transport"])
    closed = CounterMetricFamily("kvtier_connections_closed", "Connections the daemon closed",
                                 labels=["transport", "reason"])
    for key, n in sorted(figures.items()):
        transport, _, what = key.partition("_connections")
        if not what:
            open_.add_metric([transport], n)
        elif what in ("_refused", "_timed_out"):
            closed.add_metric([transport, what[1:]], n)
    yield open_
    yield closed

"""Session: the connection half of :class:`kvtier.Client`: channel, session, breaker, transport.

Never hang the engine: every RPC has a deadline (``timeout_s``). When the daemon is down or
restarting, a call raises :class:`Away` (the client's operations turn it into misses and drops);
a circuit breaker waits ``backoff`` before trying again, then the session reopens, re-registers
its namespaces and reattaches its data transport by itself (also when a reply shows a new boot
epoch). Caller mistakes the daemon reports still raise :mod:`kvtier_contract.errors` types.

The underscore methods are the package's internal API: :mod:`kvtier.client` and
:mod:`kvtier.batches` make their RPCs and transfers through ``_call``, ``_transfer``, ``_data``
and ``_trip``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from kvtier.addresses import address_target, grpc_host
from kvtier.results import ClientCounters
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors
from kvtier_contract.identity import Namespace
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName, namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

DOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


class Away(Exception):
    """The daemon is unreachable right now (internal: callers get misses and drops)."""


class Registered(Protocol):
    """A namespace the session registers on every (re)open (``kvtier.client.NamespaceHandle``)."""

    namespace: Namespace
    namespace_id: int
    block_bytes: int
    registered_epoch: int


class Session:
    """Owns the gRPC channel, the daemon session, the breaker, the heartbeat thread and the data
    transport of one Client.

    States: AWAY (no session) -> ``_ensure`` when the breaker allows (now >= retry_at) ->
    ``_open`` (OpenSession, attach the transport, register every namespace) -> CONNECTED, backoff
    reset; a failed open stays AWAY with ``retry_at = now + backoff`` and the backoff doubled up to
    its maximum (``_trip``). CONNECTED -> AWAY by ``_trip`` (the daemon did not answer, or a
    transfer failed) or ``_reset_session`` (a reply with a new boot epoch, or a daemon that forgot
    the session or a namespace: retried at once). ``close()`` -> CLOSED, for good.

    Thread-safety: shared by the caller's threads and the heartbeat thread. Control calls run
    concurrently; reconnects hold ``_conn_lock`` (reentrant); transfers on the data channel hold
    ``_data_lock``. A transport detached during a transfer is retired, and closed when the
    transfer ends (never under it).
    """

    def __init__(self, address: str, transport: TransportName = "shm", *, timeout_s: float = 1.0,
                 lease_ttl_s: float = 10.0, client_name: str = "", heartbeat: bool = True,
                 backoff_s: tuple[float, float] = (0.05, 2.0), tenant_key: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = tuple(TRANSPORT_NAMES.values())
        if transport not in names:
            raise errors.InvalidArgument(f"unknown transport {transport!r} (expected one of "
                                         f"{', '.join(names)})", field="transport")
        self.address = address_target(address)
        self.transport_name = transport
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.client_name = client_name or f"pid{os.getpid()}"
        self.tenant_key = tenant_key
        self.counters = ClientCounters()
        self._clock = clock
        self._backoff_min, self._backoff_max = backoff_s
        self._backoff = self._backoff_min
        self._retry_at = 0.0
        self._conn_lock = threading.RLock()
        self._data_lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._session_id = 0
        self._epoch = 0
        self._max_batch = 1024
        self._transport: DataTransport | None = None
        self._retired: list[DataTransport] = []  # detached during a transfer, closed after it
        self._namespaces: list[Registered] = []
        self._closed = False
        self._last_call = 0.0
        self._hb_stop = threading.Event()
        self._hb: threading.Thread | None = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="kvtier-heartbeat")
            self._hb.start()

    @property
    def connected(self) -> bool:
        return self._session_id != 0

    @property
    def boot_epoch(self) -> int:
        return self._epoch

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self._max_batch

    def close(self) -> None:
        self._closed = True
        self._hb_stop.set()
        with self._conn_lock:
            if self._session_id and self._stub is not None:
                try:
                    self._stub.CloseSession(pb.CloseSessionRequest(session_id=self._session_id),
                                            timeout=self.timeout_s)
                except grpc.RpcError:
                    pass
            self._disconnect()

    # -- connection management --------------------------------------------------------------------

    def _ensure(self) -> None:
        """Connected, or Away (without waiting while the breaker is open)."""
        if self._session_id:
            return
        with self._conn_lock:
            if self._session_id:
                return
            if self._closed:
                raise Away("client closed")
            if self._clock() < self._retry_at:
                raise Away(self.counters.last_error or "daemon away (backing off)")
            try:
                self._open()
            except Away as e:
                self._trip(str(e))
                raise
            self._backoff = self._backoff_min

    def _open(self) -> None:
        self._channel_open()
        try:
            reply = self._stub.OpenSession(pb.OpenSessionRequest(
                client_name=self.client_name, lease_ttl_ms=int(self.lease_ttl_s * 1000),
                transport=make_transport(self.transport_name).proto_value), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise Away(f"OpenSession: {e.code().name}: {e.details()}") from None
        transport = make_transport(self.transport_name)
        if reply.data_host in ("0.0.0.0", "::", ""):
            # The daemon listens on every interface: reach it where we reached its gRPC port.
            reply.data_host = grpc_host(self.address)
        try:
            transport.attach(reply.session_id, reply, self.timeout_s)
        except errors.TransportError as e:
            raise Away(str(e)) from None
        if self._epoch and reply.boot_epoch != self._epoch:
            self.counters.epoch_changes += 1
        if self._epoch:
            self.counters.reconnects += 1
        self._session_id, self._epoch = reply.session_id, reply.boot_epoch
        self._max_batch = max(1, reply.max_batch_blocks)
        transport.bind_rpc(self._transfer_rpc)
        self._transport = transport
        for handle in self._namespaces:
            self._register(handle)

    def _channel_open(self) -> None:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address, options=[
                ("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 << 20)])
            self._stub = pb_grpc.KvtierStub(self._channel)

    def _register(self, handle: Registered) -> None:
        try:
            reply = self._stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(spec=namespace_spec(handle.namespace),
                                            digest=handle.namespace.digest),
                timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() in DOWN_CODES:
                self._trip(f"RegisterNamespace: {e.details()}")
                raise Away(e.details()) from None
            raise errors.from_grpc_code(e.code().name, e.details() or "") from None
        if reply.block_bytes != handle.block_bytes or reply.namespace_id != handle.namespace_id:
            raise errors.Internal("daemon and client disagree on the namespace's id or block size")
        handle.registered_epoch = reply.boot_epoch

    def _trip(self, why: str) -> None:
        """Open the breaker: forget the session, retry after the backoff."""
        with self._conn_lock:
            self.counters.last_error = why
            self._disconnect(keep_channel=True)
            self._retry_at = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)

    def _disconnect(self, keep_channel: bool = False) -> None:
        self._session_id = 0
        if self._transport is not None:
            transport, self._transport = self._transport, None
            # A transfer in flight on another thread (or this one: cuda_ipc makes RPCs inside a
            # transfer) may still use the mapping: it closes the transport when it ends.
            self._retired.append(transport)
            if self._data_lock.acquire(blocking=False):
                try:
                    self._close_retired()
                finally:
                    self._data_lock.release()
        if not keep_channel and self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def _call(self, method: str, request: Any, *, reconnect: bool = True) -> Any:
        """One RPC with the deadline; Away when the daemon is away. Retries once after a
        reconnect when the daemon forgot our session or namespace (it restarted)."""
        for attempt in (0, 1):
            self._ensure()
            if hasattr(request, "session_id"):
                request.session_id = self._session_id
            try:
                reply = getattr(self._stub, method)(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                if code in DOWN_CODES:
                    self._trip(f"{method}: {code.name}: {e.details()}")
                    raise Away(e.details()) from None
                if code == grpc.StatusCode.NOT_FOUND and attempt == 0 and reconnect and \
                        ("session" in (e.details() or "") or "namespace" in (e.details() or "")):
                    self._reset_session()
                    continue
                raise errors.from_grpc_code(code.name, e.details() or "") from None
            self._last_call = self._clock()
            if reply.boot_epoch != self._epoch:
                self._reset_session()  # daemon restarted under us: this reply is still valid
            return reply
        raise AssertionError("unreachable")

    def _reset_session(self) -> None:
        with self._conn_lock:
            self._disconnect(keep_channel=True)
            self._retry_at = 0.0

    def _transfer_rpc(self, method: str, request: Any) -> Any:
        """A control RPC made by the data transport inside a transfer (cuda_ipc): no
        reconnect (the job belongs to this session); a daemon away is a TransportError."""
        try:
            return self._call(method, request, reconnect=False)
        except Away as e:
            raise errors.TransportError(f"{method}: {e}") from None

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(max(0.05, self.lease_ttl_s / 3)):
            if self._clock() - self._last_call < self.lease_ttl_s / 3:
                continue
            try:
                self._call("Heartbeat", pb.HeartbeatRequest())
            except (Away, errors.KvtierError):
                pass

    # -- the data channel -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[None]:
        """Hold the data channel for one transfer; close what was detached meanwhile."""
        with self._data_lock:
            try:
                yield
            finally:
                self._close_retired()

    def _close_retired(self) -> None:
        """Close detached transports (the caller holds the data lock)."""
        while self._retired:
            self._retired.pop().close()

    def _data(self) -> DataTransport:
        if self._transport is None:
            raise errors.TransportError("no data transport attached")
        return self._transport

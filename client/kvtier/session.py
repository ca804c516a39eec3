"""Session: what a :class:`kvtier.Client` uses to reach its daemon (``client.session``).

Never hang the engine: every RPC has a deadline (``timeout_s``, shortened to what is left of a
caller's ``deadline``: an engine step's budget). When the daemon is down, silent or restarting, a
call raises :class:`Away` (the client's operations turn it into misses and drops) and opens the
circuit breaker (:class:`kvtier.breaker.Breaker`, which the sessions of one engine worker may
share): from then on every call fails at once, and the breaker's probe thread, never a caller,
reopens the session, re-registers its namespaces and reattaches its data transport, each RPC
with the short ``probe_timeout_s``; then the breaker closes. A reply with a new boot epoch, or a
daemon that forgot the session, reopens at once on the caller. A call that would start with less
than ``MIN_RPC_S`` of its deadline left raises :class:`OutOfTime` (an Away that trips nothing).
Caller mistakes the daemon reports still raise :mod:`kvtier_contract.errors` types. Why calls
miss or drop (the daemon away, a refused credential, a TLS mistake, a refused namespace) is
put in words naming the fix by :mod:`kvtier.diagnose`, kept in ``counters.last_error`` and
logged at WARNING once per cause (the breaker's ``causes``, shared by its sessions).

The parts: what a call raises, the RPCs' deadlines and a call started ahead in
:mod:`kvtier.calls`; the daemon session (opening, probing, tripping, the namespaces'
registrations, the data transport) in :class:`kvtier.connection.Connection`, which a Session
holds (``connection``); its gRPC channel and credentials in :mod:`kvtier.grpc_channel`; what
it is told in the one :class:`kvtier.settings.ClientSettings`; the heartbeat thread in
:mod:`kvtier.heartbeat`. Here: the calls (``call``, ``start``, ``start_completion``) and the RPC
threads. :mod:`kvtier.batches` uses only :class:`kvtier.calls.SessionPort` (``call``, ``start``,
``trip``, ``transfer``, ``data``...), which this class implements.
"""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from kvtier.calls import (
    DOWN_CODES,
    MIN_RPC_S,
    REGISTER_RETRY_S,
    Away,
    OutOfTime,
    Overloaded,
    PendingCall,
    Registered,
    RpcThreads,
    Unanswered,
    Unregistered,
)
from kvtier.connection import Connection
from kvtier.credentials import bearer_metadata
from kvtier.diagnose import Diagnosis, explain_rpc
from kvtier.heartbeat import Heartbeat, tally_request
from kvtier.results import ClientCounters
from kvtier.settings import ClientSettings
from kvtier.transports import DataTransport
from kvtier_contract import errors

__all__ = [
    "DOWN_CODES",
    "MIN_RPC_S",
    "REGISTER_RETRY_S",
    "Away",
    "ClientSettings",
    "OutOfTime",
    "Overloaded",
    "PendingCall",
    "Registered",
    "Session",
    "Unanswered",
    "Unregistered",
    "bearer_metadata",
]


class Session:
    """Owns the calls of one Client over the :class:`kvtier.connection.Connection` it is handed
    (``connection``: the daemon session, its states and its lock), the heartbeat thread, the
    RPC threads and ``pipeline_bytes``, the one setting that changes at run time: the
    pipelining threshold in effect (:mod:`kvtier.batches` reads it), from
    ``settings.pipeline_bytes``, set per client through ``Client.pipeline_bytes``. ``settings``
    is the connection's (the client's one :class:`kvtier.settings.ClientSettings`).

    States (the connection's): AWAY (no session) -> ``ensure`` while the breaker is closed ->
    CONNECTED. CONNECTED -> AWAY by ``trip`` (the daemon did not answer, or a transfer failed:
    the breaker opens, and only its probe thread reopens, via ``Connection.probe``) or by
    ``mark_stale`` (a reply with a new boot epoch, or a daemon that forgot the session or a
    namespace: reopened by the next call). ``close()`` -> CLOSED, for good.

    Thread-safety: shared by the caller's threads, the heartbeat thread and the breaker's probe
    thread. Control calls run concurrently; (re)opening holds the connection's lock, which a
    caller waits for only as long as its deadline allows; transfers hold the data channel's
    lock (``transfer``). ``pipeline_bytes`` is one int, read once per operation.
    """

    RPC_THREADS = 4  # threads that run the RPCs a put or get starts ahead (``start``)

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.settings = connection.settings
        self.pipeline_bytes = self.settings.pipeline_bytes
        self._deadlines = connection.deadlines
        self._rpc = RpcThreads(self.RPC_THREADS, self.settings.timeout_s, connection.clock)
        connection.bind_transfer_rpc(self._transfer_rpc)
        self._hb: Heartbeat | None = None
        if self.settings.heartbeat:
            lease_ttl_s = self.settings.lease_ttl_s
            self._hb = Heartbeat(
                self.call, lambda: tally_request(connection.local), lambda: max(0.05, lease_ttl_s / 3)
            )
            self._hb.start()

    # -- what the operations read of the connection (SessionPort) ---------------------------------

    @property
    def counters(self) -> ClientCounters:
        return self.connection.counters

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self.connection.max_batch

    @property
    def lookup_slices_served(self) -> bool:
        """The daemon serves LookupSlices (``Connection.lookup_slices_served``: each open sets
        it; a tool may clear it to take the one-lookup-per-slice path)."""
        return self.connection.lookup_slices_served

    @lookup_slices_served.setter
    def lookup_slices_served(self, served: bool) -> None:
        self.connection.lookup_slices_served = served

    def clock(self) -> float:
        return self.connection.clock()

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now, on this client's clock."""
        return self._deadlines.operation(timeout_s)

    def ensure(self, deadline: float | None = None) -> None:
        """Connected, or Away at once while the breaker is open (``Connection.ensure``)."""
        self.connection.ensure(deadline)

    def trip(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Open the breaker and forget the session; never waits (``Connection.trip``)."""
        self.connection.trip(why, diagnosis)

    def transfer(self) -> contextlib.AbstractContextManager[None]:
        """Hold the data channel for one transfer (``Connection.transfer``)."""
        return self.connection.transfer()

    def data(self) -> DataTransport:
        """The attached data transport; TransportError when none is."""
        return self.connection.data()

    def close(self) -> None:
        if self._hb is not None:
            self._hb.stop()
        self._rpc.close()
        self.connection.close()

    def add_namespace(self, handle: Registered, deadline: float | None = None) -> None:
        """A namespace this session registers on every (re)open: now too when the session is
        open and the breaker closed, within ``timeout_s`` and ``deadline`` (``Client.register``).
        Never raises for the daemon: a handle it could not register misses until it is."""
        # No lock: an (re)open holds the connection lock across its RPCs, and an engine thread
        # must not wait for it (``Registrations.add``).
        conn = self.connection
        conn.registrations.add(handle)
        try:
            if conn.connected and conn.breaker.allows():
                conn.register(handle, self._deadlines.rpc(deadline))
        except OutOfTime:
            pass  # not registered yet: the daemon says so on first use and the session reopens
        except Away as e:
            conn.trip(str(e), e.diagnosis)
        except (errors.ResourceExhausted, errors.Unavailable, errors.Internal, errors.NotFound) as e:
            # The daemon answered but cannot register it now (shed, namespace table full,
            # draining, a group's namespace its publishers have not made yet): the handle stays
            # unregistered, its calls miss until a later call or a reopen registers it.
            conn.registrations.refused(handle, e)

    def call(
        self,
        method: str,
        request: Any,
        *,
        reconnect: bool = True,
        deadline: float | None = None,
        floor: bool = False,
        trip: bool = True,
    ) -> Any:
        """One RPC within ``timeout_s`` and ``deadline`` (``Deadlines.rpc``); Away when the
        daemon is away (the breaker is then open; ``trip=False``: Unanswered, the breaker left
        to the caller). Retries once after a reconnect when the daemon forgot our session or
        namespace (it restarted)."""
        conn = self.connection
        for attempt in (0, 1):
            conn.ensure(deadline)
            if hasattr(request, "session_id"):
                request.session_id = conn.session_id
            handles = self._registered_for(request, deadline)
            timeout = self._deadlines.rpc(deadline, floor=floor)
            try:
                reply = self._invoke(conn.channel.stub, method, request, timeout)
            except grpc.RpcError as e:
                self._failed(method, e, trip=trip, retry=attempt == 0 and reconnect, handles=handles)
                continue
            if method == "Heartbeat":  # (over gRPC or a control channel alike)
                conn.figures.take(reply)
            if reply.boot_epoch != conn.boot_epoch:
                conn.mark_stale()  # daemon restarted under us: this reply is still valid
            return reply
        raise AssertionError("unreachable")

    def _failed(
        self, method: str, e: grpc.RpcError, *, trip: bool, retry: bool, handles: list[Registered]
    ) -> None:
        """What ``call`` makes of a failed RPC: returns when it is worth one retry (the daemon
        forgot our session or a namespace), else raises (Away, Unanswered, Overloaded, or the
        error the daemon named)."""
        code, details = e.code(), e.details() or ""
        if code in DOWN_CODES:
            why = f"{method}: {code.name}: {e.details()}"
            if not trip:
                raise Unanswered(why, details) from None
            self.trip(why, explain_rpc(self.connection.channel.peer, method, code.name, details))
            raise Away(e.details()) from None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(errors.OVERLOADED):
            self.counters.overloaded += 1
            raise Overloaded(e.details()) from None
        if code == grpc.StatusCode.NOT_FOUND and retry and "namespace" in details and handles:
            for handle in handles:  # the daemon forgot one (expired): register again
                handle.registered_epoch = 0
            return
        if code == grpc.StatusCode.NOT_FOUND and retry and ("session" in details or "namespace" in details):
            self.connection.mark_stale()
            return
        raise errors.from_grpc_code(code.name, details) from None

    def _registered_for(self, request: Any, deadline: float | None) -> list[Registered]:
        """The handles of the namespaces ``request`` names (``namespace_id``, or LookupSlices'
        ``namespace_ids``) that are ours, each registered in this session: one that is not (a
        refusal at the last open, or the daemon forgot it) is registered now, at most once per
        ``REGISTER_RETRY_S``; Unregistered when the daemon refuses (a miss, not a trip)."""
        ids = getattr(request, "namespace_ids", None)
        if ids is None:
            ns_id = getattr(request, "namespace_id", 0)
            ids = [ns_id] if ns_id else []
        handles = self.connection.registrations.handles
        out: list[Registered] = []
        for ns_id in ids:
            handle = next((h for h in handles if h.namespace_id == ns_id), None)
            if handle is not None:
                out.append(self._registered(handle, deadline))
        return out

    def _registered(self, handle: Registered, deadline: float | None) -> Registered:
        conn = self.connection
        if handle.registered_epoch == conn.boot_epoch:
            return handle
        ns_id = handle.namespace_id
        if conn.clock() < handle.register_retry_at:
            raise Unregistered(f"namespace {ns_id} is not registered ({self.counters.last_error})")
        try:
            conn.register(handle, self._deadlines.rpc(deadline))
        except Away as e:
            if not isinstance(e, OutOfTime):
                conn.trip(str(e), e.diagnosis)
            raise
        except errors.KvtierError as e:
            handle.register_retry_at = conn.clock() + REGISTER_RETRY_S
            conn.registrations.refused(handle, e)
            raise Unregistered(f"namespace {ns_id}: {e}") from None
        return handle

    def start(
        self, method: str, request: Any, *, deadline: float | None = None, inline: bool = False
    ) -> PendingCall:
        """Start ``call(method, request, deadline=deadline, trip=False)`` on one of the
        session's RPC threads and return at once (a few microseconds; starting a gRPC future
        costs the caller's thread ~0.5 ms here), or, ``inline``, make it now on the caller's
        thread (nothing to overlap it with: no thread hand-off). Away at once while the
        breaker is open or the client is closed; every other outcome comes from ``result()``."""
        self.connection.refuse_closed()
        return self._rpc.submit(
            method, deadline, lambda: self.call(method, request, deadline=deadline, trip=False), inline
        )

    def start_completion(
        self, method: str, request: Any, session_id: int, deadline: float | None, *, inline: bool = False
    ) -> PendingCall:
        """Start the completion (CompleteStore / CompleteLoad) of a job that session
        ``session_id`` prepared, as ``start`` does: Away at once unless the breaker is closed
        and that session is still ours, as ``call(reconnect=False)`` would have refused it
        (never reopening a session). Once started it goes out under that session whatever
        happens meanwhile (a later job's PrepareStore tripping the breaker must not keep it,
        and the slots it frees, waiting for the lease). It gets ``timeout_s``, cut to
        ``deadline`` but never below ``MIN_RPC_S``. ``inline``: as ``start``'s."""
        self.connection.refuse_closed()
        if not self.connection.holds(session_id):
            raise Away("the session of the job is gone")
        return self._rpc.submit(
            method, deadline, lambda: self._complete(method, request, session_id, deadline), inline
        )

    def _complete(self, method: str, request: Any, session_id: int, deadline: float | None) -> Any:
        """The RPC of ``start_completion`` (on an RPC thread)."""
        conn = self.connection
        stub = conn.channel.stub
        if stub is None or conn.closed:
            raise Away("client closed")
        request.session_id = session_id
        try:
            return self._invoke(stub, method, request, self._deadlines.rpc(deadline, floor=True))
        except grpc.RpcError as e:
            code = e.code()
            if code in DOWN_CODES:
                conn.trip(
                    f"{method}: {code.name}: {e.details()}",
                    explain_rpc(conn.channel.peer, method, code.name, e.details() or ""),
                )
                raise Away(e.details()) from None
            raise errors.from_grpc_code(code.name, e.details() or "") from None

    def _invoke(self, stub: Any, method: str, request: Any, timeout: float) -> Any:
        """``method`` on the session's control channel when it can carry it (the request's
        session is the channel's), else over gRPC; grpc.RpcError either way."""
        control = self.connection.control
        if control is not None and getattr(request, "session_id", 0) == control.session_id:
            reply = control.call(method, request, timeout)
            if reply is not None:
                return reply
        return getattr(stub, method)(request, timeout=timeout)

    def _transfer_rpc(self, method: str, request: Any) -> Any:
        """A control RPC made by the data transport inside a transfer (cuda_ipc): no
        reconnect (the job belongs to this session); a daemon away is a TransportError."""
        try:
            return self.call(method, request, reconnect=False)
        except Away as e:
            raise errors.TransportError(f"{method}: {e}") from None

    def local_lookup(self, handle: Registered, packed: bytes, n: int, *, count: bool = True) -> int | None:
        """Hit prefix from the published index, or None (ask over gRPC): only for a live,
        open session whose namespace is registered in this boot. ``count`` False: in neither
        the counters nor the daemon's Stats."""
        conn = self.connection
        local = conn.local
        if (
            local is None
            or not conn.connected
            or handle.registered_epoch != conn.boot_epoch
            or not conn.breaker.allows()
        ):
            return None
        hit = local.lookup(handle.namespace_id, packed, n, tally=count)
        if hit is not None and count:
            self.counters.lookups_local += 1
        return hit

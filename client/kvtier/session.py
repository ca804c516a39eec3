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

The parts: what a call raises and a call started ahead in :mod:`kvtier.calls`; the connection
(channel, daemon session, opening, probing, tripping) in :mod:`kvtier.connection`, this class's
base; the data transport in :mod:`kvtier.data_channel`; credentials in :mod:`kvtier.credentials`;
what it is told in :class:`kvtier.settings.ClientSettings`; the heartbeat thread in
:mod:`kvtier.heartbeat`. Here: the calls (``call``, ``start``, ``start_completion``) and the RPC
threads. :mod:`kvtier.batches` uses only :class:`kvtier.calls.SessionPort` (``call``, ``start``,
``trip``, ``transfer``, ``data``...), which this class implements; ``probe`` is the breaker's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import grpc

from kvtier.breaker import Breaker
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
from kvtier.diagnose import explain_rpc
from kvtier.heartbeat import Heartbeat, tally_request
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2 as pb

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


class Session(Connection):
    """Owns the daemon connection (:class:`kvtier.connection.Connection`, its base), the
    heartbeat thread and the RPC threads of one Client, and its membership of a breaker (its
    own, or one shared with other sessions).

    States: AWAY (no session) -> ``ensure`` while the breaker is closed -> ``_open``
    (OpenSession, attach the transport, register every namespace) -> CONNECTED. CONNECTED ->
    AWAY by ``trip`` (the daemon did not answer, or a transfer failed: the breaker opens, and
    only its probe thread reopens, via ``probe``) or by ``_reset_session`` (a reply with a new
    boot epoch, or a daemon that forgot the session or a namespace: reopened by the next call).
    ``close()`` -> CLOSED, for good.

    Thread-safety: shared by the caller's threads, the heartbeat thread and the breaker's probe
    thread. Control calls run concurrently; (re)opening holds ``_conn_lock`` (reentrant), which
    a caller waits for only as long as its deadline allows and ``trip`` never waits for (it
    marks the session stale instead); transfers hold the data channel's lock (``transfer``).
    """

    RPC_THREADS = 4  # threads that run the RPCs a put or get starts ahead (``start``)

    def __init__(
        self,
        address: str,
        settings: ClientSettings | None = None,
        *,
        breaker: Breaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``settings``: default ``ClientSettings()``; ``breaker``: one shared with other
        sessions (else its own, probing at ``settings.backoff_s``); ``clock``: the deadlines'
        (``time.monotonic``)."""
        settings = settings if settings is not None else ClientSettings()
        super().__init__(
            address, settings, breaker if breaker is not None else Breaker(settings.backoff_s), clock
        )
        self._rpc = RpcThreads(self.RPC_THREADS, self.timeout_s, clock)  # runs ``start``'s calls
        self.breaker.attach(self)
        self._hb: Heartbeat | None = None
        if settings.heartbeat:
            self._hb = Heartbeat(
                self.call, lambda: tally_request(self.local), lambda: max(0.05, self.lease_ttl_s / 3)
            )
            self._hb.start()

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now, on this client's clock."""
        return self.clock() + (self.op_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        self._closed = True
        if self._hb is not None:
            self._hb.stop()
        self._rpc.close()
        self.breaker.detach(self)
        with self._conn_lock:
            if self._session_id and self._stub is not None and self.breaker.allows():
                tallies = tally_request(self.local)  # local lookups not yet counted
                if tallies.local_lookups:
                    tallies.session_id = self._session_id
                    with contextlib.suppress(grpc.RpcError):
                        self._stub.Heartbeat(tallies, timeout=self.probe_timeout_s)
                with contextlib.suppress(grpc.RpcError):
                    self._stub.CloseSession(
                        pb.CloseSessionRequest(session_id=self._session_id), timeout=self.probe_timeout_s
                    )
            self._disconnect()

    # -- connection management --------------------------------------------------------------------

    def _rpc_timeout(self, deadline: float | None, *, floor: bool = False) -> float:
        """The deadline of the next RPC: ``timeout_s``, cut to what is left before ``deadline``.
        OutOfTime when less than MIN_RPC_S is left (``floor``: the RPC gets MIN_RPC_S anyway,
        for a completion that frees daemon state)."""
        if deadline is None:
            return self.timeout_s
        left = deadline - self.clock()
        if left < MIN_RPC_S:
            if not floor:
                self.counters.out_of_time += 1
                raise OutOfTime("deadline spent")
            left = MIN_RPC_S
        return min(self.timeout_s, left)

    def ensure(self, deadline: float | None = None) -> None:
        """Connected, or Away at once while the breaker is open (never waits for a probe)."""
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")
        if self._session_id and not self._stale:
            return
        if not self._conn_lock.acquire(timeout=self._rpc_timeout(deadline)):
            raise Away("the session is being opened by another thread")
        try:
            if self._stale:
                self._stale = False
                self._disconnect(keep_channel=True)
            if self._session_id:
                return
            if self._closed:
                raise Away("client closed")
            if not self.breaker.allows():
                raise Away(self.breaker.why or "daemon away (breaker open)")
            try:
                self._open(self._rpc_timeout(deadline))
            except OutOfTime:
                raise
            except Away as e:
                self.trip(str(e), e.diagnosis)
                raise
        finally:
            self._conn_lock.release()

    def add_namespace(self, handle: Registered, deadline: float | None = None) -> None:
        """A namespace this session registers on every (re)open: now too when the session is
        open and the breaker closed, within ``timeout_s`` and ``deadline`` (``Client.register``).
        Never raises for the daemon: a handle it could not register misses until it is."""
        # No lock: an (re)open holds the connection lock across its RPCs, and an engine thread
        # must not wait for it. list.append is atomic; an open iterating the list meanwhile
        # registers the new handle too, or the next open does (registering twice is harmless).
        self._namespaces.append(handle)
        try:
            if self.connected and self.breaker.allows():
                self._register(handle, self._rpc_timeout(deadline))
        except OutOfTime:
            pass  # not registered yet: the daemon says so on first use and the session reopens
        except Away as e:
            self.trip(str(e), e.diagnosis)
        except (errors.ResourceExhausted, errors.Unavailable, errors.Internal) as e:
            # The daemon answered but cannot register it now (shed, namespace table full,
            # draining): the handle stays unregistered, its calls miss until a reopen does.
            self._refused(handle, e)

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
        """One RPC within ``timeout_s`` and ``deadline`` (see ``_rpc_timeout``); Away when the
        daemon is away (the breaker is then open; ``trip=False``: Unanswered, the breaker left
        to the caller). Retries once after a reconnect when the daemon forgot our session or
        namespace (it restarted)."""
        for attempt in (0, 1):
            self.ensure(deadline)
            if hasattr(request, "session_id"):
                request.session_id = self._session_id
            handles = self._registered_for(request, deadline)
            timeout = self._rpc_timeout(deadline, floor=floor)
            try:
                reply = self._invoke(self._stub, method, request, timeout)
            except grpc.RpcError as e:
                self._failed(method, e, trip=trip, retry=attempt == 0 and reconnect, handles=handles)
                continue
            self._last_call = self.clock()
            if method == "Heartbeat":  # (over gRPC or a control channel alike)
                self._take_figures(reply)
            if reply.boot_epoch != self._epoch:
                self._reset_session()  # daemon restarted under us: this reply is still valid
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
            self.trip(why, explain_rpc(self._peer, method, code.name, details))
            raise Away(e.details()) from None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(errors.OVERLOADED):
            self.counters.overloaded += 1
            raise Overloaded(e.details()) from None
        if code == grpc.StatusCode.NOT_FOUND and retry and "namespace" in details and handles:
            for handle in handles:  # the daemon forgot one (expired): register again
                handle.registered_epoch = 0
            return
        if code == grpc.StatusCode.NOT_FOUND and retry and ("session" in details or "namespace" in details):
            self._reset_session()
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
        out: list[Registered] = []
        for ns_id in ids:
            handle = next((h for h in self._namespaces if h.namespace_id == ns_id), None)
            if handle is not None:
                out.append(self._registered(handle, deadline))
        return out

    def _registered(self, handle: Registered, deadline: float | None) -> Registered:
        if handle.registered_epoch == self._epoch:
            return handle
        ns_id = handle.namespace_id
        if self.clock() < handle.register_retry_at:
            raise Unregistered(f"namespace {ns_id} is not registered ({self.counters.last_error})")
        try:
            self._register(handle, self._rpc_timeout(deadline))
        except Away as e:
            if not isinstance(e, OutOfTime):
                self.trip(str(e), e.diagnosis)
            raise
        except errors.KvtierError as e:
            handle.register_retry_at = self.clock() + REGISTER_RETRY_S
            self._refused(handle, e)
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
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")
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
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")
        if self._stale or session_id != self._session_id:
            raise Away("the session of the job is gone")
        return self._rpc.submit(
            method, deadline, lambda: self._complete(method, request, session_id, deadline), inline
        )

    def _complete(self, method: str, request: Any, session_id: int, deadline: float | None) -> Any:
        """The RPC of ``start_completion`` (on an RPC thread)."""
        stub = self._stub
        if stub is None or self._closed:
            raise Away("client closed")
        request.session_id = session_id
        try:
            reply = self._invoke(stub, method, request, self._rpc_timeout(deadline, floor=True))
        except grpc.RpcError as e:
            code = e.code()
            if code in DOWN_CODES:
                self.trip(
                    f"{method}: {code.name}: {e.details()}",
                    explain_rpc(self._peer, method, code.name, e.details() or ""),
                )
                raise Away(e.details()) from None
            raise errors.from_grpc_code(code.name, e.details() or "") from None
        self._last_call = self.clock()
        return reply

    def _invoke(self, stub: Any, method: str, request: Any, timeout: float) -> Any:
        """``method`` on the session's control channel when it can carry it (the request's
        session is the channel's), else over gRPC; grpc.RpcError either way."""
        control = self._control
        if control is not None and getattr(request, "session_id", 0) == control.session_id:
            reply = control.call(method, request, timeout)
            if reply is not None:
                return reply
        return getattr(stub, method)(request, timeout=timeout)

    def _reset_session(self) -> None:
        """Reopen on the next call (the daemon answered: no breaker involved)."""
        self._stale = True

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
        local = self.local
        if (
            local is None
            or self._stale
            or not self._session_id
            or handle.registered_epoch != self._epoch
            or not self.breaker.allows()
        ):
            return None
        hit = local.lookup(handle.namespace_id, packed, n, tally=count)
        if hit is not None and count:
            self.counters.lookups_local += 1
        return hit

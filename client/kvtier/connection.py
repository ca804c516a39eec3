"""Connection: the daemon session of one :class:`kvtier.session.Session`, and how it is opened.

Owns the session the daemon knows (id, boot epoch, ``max_batch``, ``lookup_slices_served``, the
``tenant`` the credential proved: one a namespace naming none takes, and the tier ``figures``
its replies carry), the lock that (re)opening holds, the attached data transport
(:class:`kvtier.data_channel.DataChannel`), the session's control channels (``control``), the
published index it answers lookups from (``local``), the registrations of its namespaces
(:class:`kvtier.registrations.Registrations`), the RPCs' ``deadlines``
(:class:`kvtier.calls.Deadlines`), what it says of failures (``explainer``:
:class:`kvtier.explainer.Explainer`) and the client's ``counters``. Handed: its
:class:`kvtier.grpc_channel.GrpcChannel` (``channel``), the client's one
:class:`kvtier.settings.ClientSettings` (``settings``, read, never copied), the breaker (a
member of it from construction to ``close``) and the clock. States::

    AWAY (no session) --_open: [Unix login] OpenSession, attach the transport, open the control
    channels, register every namespace--> CONNECTED --_disconnect--> AWAY
    any --close--> CLOSED (for good)

``first_open`` (``Client.connect``'s, within one deadline), ``probe`` (the breaker's probe thread:
prove the session or reopen it) and ``ensure`` (a call's, while the breaker is closed) open it;
``trip`` (the daemon did not answer) opens the breaker and drops it, never waiting;
``mark_stale`` (a reply with a new boot epoch, a daemon that forgot the session) has the next
``ensure`` reopen it. Why an open failed is put in words naming the fix (:mod:`kvtier.diagnose`),
kept in ``counters.last_error`` and logged once per cause (``explainer.note``; the breaker's
``causes``).

Thread-safety: the session's callers, heartbeat and probe threads share it; (re)opening holds
the lock (reentrant), which a caller waits for only as long as its deadline allows and ``trip``
never waits for (it marks the session stale instead); transfers hold the data channel's lock
(``transfer``; :class:`kvtier.data_channel.DataChannel`, which retires a transport detached
during a transfer).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvtier.addresses import grpc_host
from kvtier.breaker import Breaker
from kvtier.calls import DOWN_CODES, Away, Deadlines, OutOfTime, Registered
from kvtier.control import ControlChannels, session_channels
from kvtier.data_channel import DataChannel
from kvtier.diagnose import HEALTH_ONLY, Diagnosis, explain_reached
from kvtier.explainer import Explainer, explain_words
from kvtier.grpc_channel import GrpcChannel
from kvtier.heartbeat import tally_request
from kvtier.local_index import LocalIndexes
from kvtier.registrations import Registrations
from kvtier.results import ClientCounters, TierFigures
from kvtier.settings import ClientSettings
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2 as pb

Rpc = Callable[[str, Any], Any]


class Connection:
    """See the module docstring. The session's state is read through ``session_id``,
    ``boot_epoch``, ``connected``, ``holds`` and the attributes the reply sets (``max_batch``,
    ``lookup_slices_served``, ``tenant``, ``events``, ``control``: written only by an open, read by any
    thread)."""

    def __init__(
        self, channel: GrpcChannel, settings: ClientSettings, breaker: Breaker, clock: Callable[[], float]
    ) -> None:
        self.channel = channel
        self.settings = settings
        self.breaker = breaker
        self.clock = clock
        self.counters = ClientCounters()
        self.deadlines = Deadlines(settings, clock, self.counters, channel.peer)
        self.explainer = Explainer(channel.peer, settings, clock, self.counters, breaker.causes)
        self.registrations = Registrations(channel, self.counters, clock, self.explainer.note)
        self.local = LocalIndexes(clock) if settings.local_lookups else None
        self.figures = TierFigures(clock)  # the daemon's per-tier load figures
        self.control: ControlChannels | None = None  # the session's control channels
        self.max_batch = 1024  # most keys the daemon takes in one RPC (1024 before a session)
        self.lookup_slices_served = False  # the daemon serves LookupSlices (OpenSessionReply)
        self.tenant: str | None = None  # the tenant the credential proved (OpenSessionReply)
        self.events = False  # the daemon publishes KV events of this session's blocks (same)
        self._client_name = settings.client_name or f"pid{os.getpid()}"
        self._lock = threading.RLock()
        self._session_id = 0
        self._epoch = 0
        self._stale = False  # tripped while another thread held the lock: reopen next time
        self._closed = False
        self._data_channel = DataChannel()  # the attached transport
        self._transfer_rpc: Rpc = _no_calls
        breaker.attach(self)

    def bind_transfer_rpc(self, rpc: Rpc) -> None:
        """The call a transport makes inside a transfer (cuda_ipc): the holding session's."""
        self._transfer_rpc = rpc

    @property
    def session_id(self) -> int:
        """The open session's id; 0 when none is."""
        return self._session_id

    @property
    def boot_epoch(self) -> int:
        return self._epoch

    @property
    def connected(self) -> bool:
        return self._session_id != 0 and not self._stale

    @property
    def closed(self) -> bool:
        return self._closed

    def holds(self, session_id: int) -> bool:
        """Whether ``session_id`` is the open session, not marked stale."""
        return not self._stale and session_id == self._session_id

    def first_open(self, *, strict: bool) -> Diagnosis | None:
        """``Client.connect``'s open, all of it within one deadline ``timeout_s`` from now: each
        step (Unix login, OpenSession, attach, register, the TLS probe) gets what is left of it.
        None when the session is open, else why not. ``strict``: tried even while a shared
        breaker is open, a failure trips nothing (the caller raises and closes), and when a TCP
        port closed the connection one TLS handshake (``Explainer.sharpen``) tells whether the port
        serves TLS. Else (lazy: an engine's thread, which must not wait) no probe: a failure
        trips the breaker, which logs it once (WARNING) and reconnects by itself later."""
        if not strict and not self.breaker.allows():
            return None  # another session of this breaker found the daemon away: it probes
        timeout = self.settings.timeout_s
        deadline = self.clock() + timeout
        with self._lock:
            try:
                self._open(timeout, deadline)
                return None
            except Away as e:
                diagnosis = (
                    e.diagnosis if e.diagnosis is not None else explain_words(self.channel.peer, str(e))
                )
                self._disconnect(keep_channel=True)
        if strict:
            return self.explainer.sharpen(diagnosis, deadline)
        self.trip(str(diagnosis.error), diagnosis)
        return diagnosis

    def probe(self) -> bool:
        """On the breaker's probe thread: prove the session (a heartbeat) or reopen it, each RPC
        within the probe deadline. True when the daemon answered (a closed client: True)."""
        timeout = self.settings.probe_s
        with self._lock:
            if self._closed:
                return True
            stub = self.channel.stub
            if self.connected and stub is not None:
                try:
                    reply = stub.Heartbeat(pb.HeartbeatRequest(session_id=self._session_id), timeout=timeout)
                    self.figures.take(reply)
                    if reply.boot_epoch == self._epoch:
                        return True
                except grpc.RpcError as e:
                    if e.code() in DOWN_CODES:
                        return False
            self._stale = False
            self._disconnect(keep_channel=True)  # forgotten, or another boot: open anew
            try:
                self._open(timeout)
            except Away as e:
                self.explainer.note(str(e), e.diagnosis)
                self._disconnect(keep_channel=True)
                return False
            except errors.KvtierError as e:  # the daemon answered; the next call will say more
                self.explainer.note(str(e))
            return True

    def refuse_closed(self) -> None:
        """Away at once when the client is closed or the breaker open."""
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")

    def ensure(self, deadline: float | None = None) -> None:
        """Connected (opened now, within ``deadline``), or Away at once while the breaker is
        open (never waits for a probe)."""
        self.refuse_closed()
        if self.connected:
            return
        if not self._lock.acquire(timeout=self.deadlines.rpc(deadline)):
            raise Away("the session is being opened by another thread")
        try:
            if self._stale:
                self._stale = False
                self._disconnect(keep_channel=True)
            if self._session_id:
                return
            self.refuse_closed()
            try:
                self._open(self.deadlines.rpc(deadline))
            except OutOfTime:
                raise
            except Away as e:
                self.trip(str(e), e.diagnosis)
                raise
        finally:
            self._lock.release()

    def trip(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Open the breaker and forget the session; never waits (DESIGN §7)."""
        self.explainer.note(why, diagnosis)
        self.breaker.trip(why)
        if self._lock.acquire(blocking=False):
            try:
                self._disconnect(keep_channel=True)
            finally:
                self._lock.release()
        else:
            self._stale = True  # whoever holds the lock is (re)opening; the next call reopens

    def mark_stale(self) -> None:
        """Reopen on the next call (the daemon answered: no breaker involved)."""
        self._stale = True

    def register(self, handle: Registered, timeout: float) -> None:
        """RegisterNamespace in the open session (``Registrations.register``, with the tenant
        the credential proved)."""
        self.registrations.register(handle, timeout, self.tenant)

    def close(self) -> None:
        """CLOSED for good: leave the breaker, then, while it is closed, send the local lookups
        not yet counted and CloseSession (each within the probe deadline), and drop it all."""
        self._closed = True
        self.breaker.detach(self)
        timeout = self.settings.probe_s
        with self._lock:
            stub = self.channel.stub
            if self._session_id and stub is not None and self.breaker.allows():
                tallies = tally_request(self.local)  # local lookups not yet counted
                if tallies.local_lookups:
                    tallies.session_id = self._session_id
                    with contextlib.suppress(grpc.RpcError):
                        stub.Heartbeat(tallies, timeout=timeout)
                with contextlib.suppress(grpc.RpcError):
                    stub.CloseSession(pb.CloseSessionRequest(session_id=self._session_id), timeout=timeout)
            self._disconnect()

    def _open(self, timeout: float, deadline: float | None = None) -> None:
        """OpenSession, attach the transport, register every namespace (caller holds the
        lock); each step within ``timeout`` and what is left before ``deadline`` (None: no bound
        on the whole). Away when the daemon does not answer."""
        ch, s = self.channel, self.settings
        ch.open()
        if ch.logs_in:  # a fresh token per session: a restarted daemon knows none
            ch.login(self.deadlines.step(timeout, deadline, "Unix login"))
        step = self.deadlines.step(timeout, deadline, "OpenSession")
        ends = self.clock() + step
        try:
            reply = ch.stub.OpenSession(
                pb.OpenSessionRequest(
                    client_name=self._client_name,
                    lease_ttl_ms=int(s.lease_ttl_s * 1000),
                    transport=make_transport(s.transport).proto_value,
                ),
                timeout=step,
            )
        except grpc.RpcError as e:  # the address asked itself, within what is left of the step
            code, details = e.code().name, e.details() or ""
            raise Away(
                f"OpenSession: {code}: {details}",
                explain_reached(ch.peer, "OpenSession", code, details, ends - self.clock()),
            ) from None
        transport = self._data_channel.attach(
            reply,
            s.transport,
            peer=ch.peer,
            tls_files=ch.tls_files,
            io_timeout_s=s.timeout_s,
            timeout=self.deadlines.step(timeout, deadline, "attach"),
            rpc=lambda method, request: self._transfer_rpc(method, request),
        )
        self._adopt(reply, transport, timeout)
        self.registrations.register_all(
            lambda: self.deadlines.step(timeout, deadline, "RegisterNamespace"), self.tenant
        )

    def _adopt(self, reply: Any, transport: DataTransport, timeout: float) -> None:
        """Take the session ``reply`` (OpenSessionReply) opened, with its attached ``transport``:
        its id, epoch and figures, then its control channels and the local index."""
        if self._epoch and reply.boot_epoch != self._epoch:
            self.counters.epoch_changes += 1
        if self._epoch:
            self.counters.reconnects += 1
        self._session_id, self._epoch = reply.session_id, reply.boot_epoch
        self.max_batch = max(1, reply.max_batch_blocks)
        self.lookup_slices_served = reply.lookup_slices
        self.tenant = reply.tenant or None
        self.events = reply.events
        self.figures.take(reply)  # figures from the start, not one heartbeat later
        self._data_channel.use(transport)
        if self.settings.control_channel:
            server_name = grpc_host(self.channel.address)
            self.control = session_channels(
                reply, transport.name, transport.tls_context, server_name, timeout
            )
        if self.local is not None:
            self.local.reset(reply.shm_socket, reply.session_id, reply.boot_epoch, bytes(reply.data_secret))

    def stats(self) -> Any:
        """The daemon's StatsReply (``Client.stats``); raises the error naming the cause and the
        fix when the daemon cannot be reached or refuses (as ``Client.connect`` does)."""
        return self.sessionless("Stats", pb.StatsRequest())

    def sessionless(self, method: str, request: Any, *, answered: bool = False) -> Any:
        """The reply of ``method``, an RPC that needs no session (Stats, PublishPrefix,
        ListPrefixes), within ``timeout_s`` (a Unix login first, when that is the credential and
        no session holds a token). Raises the error naming the cause and the fix when the daemon
        cannot be reached or refuses the credential (as ``Client.connect`` does); ``answered``:
        any other status is the daemon's answer to the request, raised in its words (which
        begin with the field at fault), and a daemon that does not know ``method`` says so."""
        ch, timeout = self.channel, self.settings.timeout_s
        with self._lock:
            ch.open()
            if ch.logs_in and not self.connected:
                try:
                    ch.login(timeout)
                except Away as e:
                    if e.diagnosis is not None:
                        raise e.diagnosis.error from None
                    raise errors.Unavailable(str(e)) from None
        try:
            return getattr(ch.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if answered and code not in DOWN_CODES and code != grpc.StatusCode.UNAUTHENTICATED:
                raise _answer(ch.peer.address, method, code.name, details) from None
            explained = explain_reached(ch.peer, method, code.name, details, timeout)
            diagnosis = self.explainer.sharpen(explained)
            raise diagnosis.error from None

    def _disconnect(self, keep_channel: bool = False) -> None:
        self._session_id = 0
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.local is not None:
            self.local.clear()
        # A transfer in flight on another thread (or this one: cuda_ipc makes RPCs inside a
        # transfer) may still use the mapping: it closes the transport when it ends.
        self._data_channel.retire()
        if not keep_channel:
            self.channel.close()

    # -- the data channel -------------------------------------------------------------------------

    def transfer(self) -> contextlib.AbstractContextManager[None]:
        """Hold the data channel for one transfer (:class:`kvtier.data_channel.DataChannel`)."""
        return self._data_channel.transfer()

    def data(self) -> DataTransport:
        """The attached data transport; TransportError when none is."""
        return self._data_channel.get()


def _answer(address: str, method: str, code: str, details: str) -> errors.KvtierError:
    """The daemon's answer ``code`` to a sessionless ``method`` as the error to raise: in its
    words (``field``: the field they begin with), or, for a method it does not serve (not its
    health-only port), that it is older."""
    if code == "UNIMPLEMENTED" and not details.startswith(HEALTH_ONLY):
        return errors.FailedPrecondition(
            f"daemon at {address} does not serve {method} ({details}): a kvtierd older than "
            "this SDK; upgrade it"
        )
    error = errors.from_grpc_code(code, details)
    named = _FIELD.match(details)  # the daemon's words begin with the field at fault
    if named is not None:
        error.field = named.group(1)
    return error


_FIELD = re.compile(r"([a-z_][a-z0-9_.\[\]]*): ")


def _no_calls(method: str, request: Any) -> Any:
    """The transfer RPC of a connection no session holds (yet): a TransportError."""
    raise errors.TransportError(f"{method}: no session makes this connection's calls")

"""Connection: the daemon session of one :class:`kvtier.session.Session`, and how it is opened.

Owns the gRPC channel (through its base :class:`kvtier.grpc_channel.GrpcChannel`, with the
credentials it presents), the session the daemon knows (id, boot epoch, the figures its replies
carry), the attached data transport, the session's control channels and the registration of its
namespaces (one naming no tenant takes the tenant the credential proved: ``tenant``, from
OpenSessionReply). States::

    AWAY (no session) --_open: [Unix login] OpenSession, attach the transport, open the control
    channels, register every namespace--> CONNECTED --_disconnect--> AWAY

``first_open`` (``Client.connect``'s, within one deadline), ``probe`` (the breaker's probe thread:
prove the session or reopen it) and the session's ``ensure`` open it; ``trip`` (the daemon did
not answer) opens the breaker and drops it, never waiting. ``_open`` and ``_disconnect`` run under
``_conn_lock`` (reentrant). Why an open failed is put in words naming the fix (:mod:`kvtier.diagnose`),
kept in ``counters.last_error`` and logged once per cause (``_note``; the breaker's ``causes``).

Thread-safety: the session's callers, heartbeat and probe threads share it; (re)opening holds
``_conn_lock``; transfers hold the data channel's lock (``transfer``;
:class:`kvtier.data_channel.DataChannel`, which retires a transport detached during a transfer).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvtier.addresses import grpc_host, tcp_endpoint
from kvtier.breaker import Breaker
from kvtier.calls import DOWN_CODES, MIN_RPC_S, REGISTER_RETRY_S, Away, Overloaded, Registered
from kvtier.control import ControlChannels, tcp_dialer, unix_dialer
from kvtier.data_channel import DataChannel
from kvtier.diagnose import Diagnosis, Peer, explain_reached, explain_rpc
from kvtier.grpc_channel import GrpcChannel
from kvtier.local_index import LocalIndexes
from kvtier.reach import speaks_tls
from kvtier.results import ClientCounters, TierFigure, TierFigures
from kvtier.settings import ClientSettings
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors
from kvtier_contract.protoutil import namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb


class Connection(GrpcChannel):
    """See the module docstring. Made by :class:`kvtier.session.Session` (its base): the
    settings are its :class:`kvtier.settings.ClientSettings`, the breaker the session's (whose
    ``causes`` log why opens fail)."""

    def __init__(
        self, address: str, settings: ClientSettings, breaker: Breaker, clock: Callable[[], float]
    ) -> None:
        """Files (token file, TLS) are read now: InvalidArgument naming the setting."""
        super().__init__(address, settings)
        s = settings
        self.settings = settings
        self.transport_name = s.transport
        self.timeout_s = s.timeout_s
        self.probe_timeout_s = s.probe_s
        self.op_timeout_s = s.op_timeout_s
        self.lease_ttl_s = s.lease_ttl_s
        self.client_name = s.client_name or f"pid{os.getpid()}"
        self.tenant_key = s.tenant_key
        self.verify_bytes = s.verify_bytes
        self.control_channel = s.control_channel
        self.pipeline_bytes = s.pipeline_bytes  # settable per client (kvtier.batches reads it)
        self.counters = ClientCounters()
        self.breaker = breaker
        self.clock = clock
        self._conn_lock = threading.RLock()
        self._session_id = 0
        self._stale = False  # tripped while another thread held _conn_lock: reopen next time
        self._epoch = 0
        self._max_batch = 1024
        self.lookup_slices_served = False  # the daemon serves LookupSlices (OpenSessionReply)
        self.tenant: str | None = None  # the tenant the credential proved (OpenSessionReply)
        self._data_channel = DataChannel()  # the attached transport
        self._namespaces: list[Registered] = []
        self._closed = False
        self._last_call = 0.0
        self._control: ControlChannels | None = None  # the session's control channels
        self.local = LocalIndexes(clock) if s.local_lookups else None
        self._figures = TierFigures(clock)  # the daemon's per-tier load figures

    @property
    def connected(self) -> bool:
        return self._session_id != 0 and not self._stale

    @property
    def boot_epoch(self) -> int:
        return self._epoch

    def _take_figures(self, reply: Any) -> None:
        self._figures.take(reply)

    def tier_figures(self) -> dict[str, TierFigure]:
        """The daemon's latest per-tier load figures (tier name -> ``TierFigure``, its age grown
        by the time since it arrived); from the OpenSession reply and every heartbeat reply, empty
        until one brought some (the daemon has read no tier below the host tier yet). Any thread."""
        return self._figures.now()

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self._max_batch

    def first_open(self, *, strict: bool) -> Diagnosis | None:
        """``Client.connect``'s open, all of it within one deadline ``timeout_s`` from now: each
        step (Unix login, OpenSession, attach, register, the TLS probe) gets what is left of it.
        None when the session is open, else why not. ``strict``: tried even while a shared
        breaker is open, a failure trips nothing (the caller raises and closes), and when a TCP
        port closed the connection one TLS handshake (``_sharpen``) tells whether the port
        serves TLS. Else (lazy: an engine's thread, which must not wait) no probe: a failure
        trips the breaker, which logs it once (WARNING) and reconnects by itself later."""
        if not strict and not self.breaker.allows():
            return None  # another session of this breaker found the daemon away: it probes
        deadline = self.clock() + self.timeout_s
        with self._conn_lock:
            try:
                self._open(self.timeout_s, deadline)
                return None
            except Away as e:
                diagnosis = e.diagnosis if e.diagnosis is not None else _away_diagnosis(self._peer, str(e))
                self._disconnect(keep_channel=True)
        if strict:
            return self._sharpen(diagnosis, deadline)
        self.trip(str(diagnosis.error), diagnosis)
        return diagnosis

    def probe(self) -> bool:
        """On the breaker's probe thread: prove the session (a heartbeat) or reopen it, each RPC
        within ``probe_timeout_s``. True when the daemon answered (a closed client: True)."""
        timeout = self.probe_timeout_s
        with self._conn_lock:
            if self._closed:
                return True
            if self._session_id and not self._stale and self._stub is not None:
                try:
                    reply = self._stub.Heartbeat(
                        pb.HeartbeatRequest(session_id=self._session_id), timeout=timeout
                    )
                    self._take_figures(reply)
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
                self._note(str(e), e.diagnosis)
                self._disconnect(keep_channel=True)
                return False
            except errors.KvtierError as e:  # the daemon answered; the next call will say more
                self._note(str(e))
            return True

    def trip(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Open the breaker and forget the session; never waits (DESIGN §7)."""
        self._note(why, diagnosis)
        self.breaker.trip(why)
        if self._conn_lock.acquire(blocking=False):
            try:
                self._disconnect(keep_channel=True)
            finally:
                self._conn_lock.release()
        else:
            self._stale = True  # whoever holds the lock is (re)opening; the next call reopens

    _PROBED = ("plaintext-on-tls", "tls-cert-required", "tls-cert-refused")  # a closed socket

    def _sharpen(self, diagnosis: Diagnosis, deadline: float | None = None) -> Diagnosis:
        """``diagnosis`` made sure where a TLS handshake can tell (a TCP port that closed the
        connection): one handshake to one address of the host, within ``probe_timeout_s`` and
        what is left before ``deadline``. Never on a Unix socket or a gRPC scheme target."""
        endpoint = tcp_endpoint(self.address)
        if diagnosis.cause not in self._PROBED or diagnosis.rpc is None or endpoint is None:
            return diagnosis
        left = self.probe_timeout_s if deadline is None else deadline - self.clock()
        if left < MIN_RPC_S:
            return diagnosis
        answers = speaks_tls(*endpoint, min(self.probe_timeout_s, left))
        return explain_rpc(self._peer, *diagnosis.rpc, tls_probe=answers)

    def _open(self, timeout: float, deadline: float | None = None) -> None:
        """OpenSession, attach the transport, register every namespace (caller holds
        ``_conn_lock``); each step within ``timeout`` and what is left before ``deadline``
        (None: no bound on the whole). Away when the daemon does not answer."""
        self._channel_open()
        if self._login_path:  # a fresh token per session: a restarted daemon knows none
            self._login(self._step_timeout(timeout, deadline, "Unix login"))
        step = self._step_timeout(timeout, deadline, "OpenSession")
        ends = self.clock() + step
        try:
            reply = self._stub.OpenSession(
                pb.OpenSessionRequest(
                    client_name=self.client_name,
                    lease_ttl_ms=int(self.lease_ttl_s * 1000),
                    transport=make_transport(self.transport_name).proto_value,
                ),
                timeout=step,
            )
        except grpc.RpcError as e:  # the address asked itself, within what is left of the step
            code, details = e.code().name, e.details() or ""
            raise Away(
                f"OpenSession: {code}: {details}",
                explain_reached(self._peer, "OpenSession", code, details, ends - self.clock()),
            ) from None
        transport = self._data_channel.attach(
            reply,
            self.transport_name,
            peer=self._peer,
            tls_files=self._tls_files,
            io_timeout_s=self.timeout_s,
            timeout=self._step_timeout(timeout, deadline, "attach"),
            rpc=self._transfer_rpc,
        )
        self._adopt(reply, transport, timeout)
        self._register_all(timeout, deadline)

    def _adopt(self, reply: Any, transport: DataTransport, timeout: float) -> None:
        """Take the session ``reply`` (OpenSessionReply) opened, with its attached ``transport``:
        its id, epoch and figures, then its control channels and the local index."""
        if self._epoch and reply.boot_epoch != self._epoch:
            self.counters.epoch_changes += 1
        if self._epoch:
            self.counters.reconnects += 1
        self._session_id, self._epoch = reply.session_id, reply.boot_epoch
        self._max_batch = max(1, reply.max_batch_blocks)
        self.lookup_slices_served = reply.lookup_slices
        self.tenant = reply.tenant or None
        self._take_figures(reply)  # figures from the start, not one heartbeat later
        self._data_channel.use(transport)
        if self.control_channel:
            self._control = self._control_channels(reply, transport, timeout)
        if self.local is not None:
            self.local.reset(reply.shm_socket, reply.session_id, reply.boot_epoch, bytes(reply.data_secret))

    def _register_all(self, timeout: float, deadline: float | None) -> None:
        """Register every namespace of the session; one the daemon refuses misses until
        ``REGISTER_RETRY_S`` has passed (then its next call registers it)."""
        for handle in self._namespaces:
            try:
                self._register(handle, self._step_timeout(timeout, deadline, "RegisterNamespace"))
            except errors.KvtierError as e:  # refused (quota, table full...): its calls miss
                handle.register_retry_at = self.clock() + REGISTER_RETRY_S
                self._refused(handle, e)

    def stats(self) -> Any:
        """The daemon's StatsReply (``Client.stats``); raises the error naming the cause and the
        fix when the daemon cannot be reached or refuses (as ``Client.connect`` does)."""
        with self._conn_lock:
            self._channel_open()
            if self._login_path and not self.connected:
                try:
                    self._login(self.timeout_s)
                except Away as e:
                    if e.diagnosis is not None:
                        raise e.diagnosis.error from None
                    raise errors.Unavailable(str(e)) from None
        try:
            return self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            explained = explain_reached(self._peer, "Stats", e.code().name, e.details() or "", self.timeout_s)
            diagnosis = self._sharpen(explained)
            raise diagnosis.error from None

    def _control_channels(
        self, reply: Any, transport: DataTransport, timeout: float
    ) -> ControlChannels | None:
        """The session's control channels: on the daemon's shm socket (same host), on its data
        port (tcp, TLS if it is), or None (gRPC only)."""
        secret, dial = bytes(reply.data_secret), None
        if transport.name != "tcp" and reply.shm_socket:  # same host: the shm socket
            dial = unix_dialer(reply.shm_socket, reply.session_id, secret)
        elif transport.name == "tcp" and reply.data_port:  # the data port (TLS if it is)
            dial = tcp_dialer(
                reply.data_host,
                reply.data_port,
                reply.session_id,
                secret,
                tls=transport.tls_context if reply.data_tls else None,
                server_name=grpc_host(self.address),
            )
        return ControlChannels(dial, reply.session_id, timeout) if dial is not None else None

    def _transfer_rpc(self, method: str, request: Any) -> Any:
        """A control RPC the transport makes inside a transfer (cuda_ipc): the session's."""
        raise NotImplementedError

    def _step_timeout(self, timeout: float, deadline: float | None, step: str) -> float:
        """``timeout``, cut to what is left before ``deadline``; Away (the daemon was too slow
        to answer, as a deadline exceeded) when less than MIN_RPC_S is left for ``step``."""
        if deadline is None:
            return timeout
        left = deadline - self.clock()
        if left < MIN_RPC_S:
            raise Away(
                f"{step}: DEADLINE_EXCEEDED: Deadline Exceeded",
                explain_rpc(self._peer, step, "DEADLINE_EXCEEDED", "Deadline Exceeded"),
            )
        return min(timeout, left)

    def _register(self, handle: Registered, timeout: float) -> None:
        """RegisterNamespace (a namespace naming no tenant takes the session's first); Away when
        the daemon does not answer (the caller trips)."""
        if self.tenant is not None:
            handle.take_tenant(self.tenant)
        try:
            reply = self._stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(
                    spec=namespace_spec(handle.namespace), digest=handle.namespace.digest
                ),
                timeout=timeout,
            )
        except grpc.RpcError as e:
            if e.code() in DOWN_CODES:
                raise Away(
                    f"RegisterNamespace: {e.code().name}: {e.details()}",
                    explain_rpc(self._peer, "RegisterNamespace", e.code().name, e.details() or ""),
                ) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (e.details() or "").startswith(
                errors.OVERLOADED
            ):
                self.counters.overloaded += 1
                raise Overloaded(e.details()) from None
            raise errors.from_grpc_code(e.code().name, e.details() or "") from None
        if reply.block_bytes != handle.block_bytes or reply.namespace_id != handle.namespace_id:
            raise errors.Internal("daemon and client disagree on the namespace's id or block size")
        handle.registered_epoch = reply.boot_epoch

    def _note(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Record why calls miss or drop: in ``counters.last_error`` (the diagnosis' words when
        there is one) and, once per cause, in a WARNING (the breaker's ``causes``)."""
        if diagnosis is None:
            diagnosis = _away_diagnosis(self._peer, why)
        message = str(diagnosis.error)
        self.counters.last_error = message
        if not diagnosis.transient:  # (the daemon answers now: the next try will say more)
            self.breaker.causes.report(
                diagnosis.cause,
                f"{message}; meanwhile lookups miss and puts are dropped (the engine recomputes)",
            )

    def _refused(self, handle: Registered, error: errors.KvtierError) -> None:
        """The daemon refused to register ``handle``'s namespace: its calls miss."""
        ns = handle.namespace
        self._note(
            f"RegisterNamespace: {error}",
            Diagnosis(
                f"register-{type(error).__name__}",
                type(error)(
                    f"daemon at {self.address} refused namespace {ns.model_id}@{ns.model_revision} "
                    f"(id {handle.namespace_id}): {error}"
                ),
            ),
        )

    def _disconnect(self, keep_channel: bool = False) -> None:
        self._session_id = 0
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.local is not None:
            self.local.clear()
        # A transfer in flight on another thread (or this one: cuda_ipc makes RPCs inside a
        # transfer) may still use the mapping: it closes the transport when it ends.
        self._data_channel.retire()
        if not keep_channel:
            self._channel_close()

    # -- the data channel -------------------------------------------------------------------------

    def transfer(self) -> contextlib.AbstractContextManager[None]:
        """Hold the data channel for one transfer (:class:`kvtier.data_channel.DataChannel`)."""
        return self._data_channel.transfer()

    def data(self) -> DataTransport:
        """The attached data transport; TransportError when none is."""
        return self._data_channel.get()


def _away_diagnosis(peer: Peer, why: str) -> Diagnosis:
    """A failure known only by its words: a failed RPC's (``Method: CODE: details``, from a
    call started on an RPC thread) explained as ``explain_rpc`` does; any other (a transfer
    that broke, no answer in time) has for cause what failed (the words before the colon)."""
    method, _, rest = why.partition(": ")
    code, _, details = rest.partition(": ")
    if code.isupper() and code.replace("_", "").isalpha() and details:
        return explain_rpc(peer, method, code, details)
    what = method.strip() or "call"
    return Diagnosis(f"away-{what}", errors.Unavailable(f"daemon at {peer.address}: {why}"))

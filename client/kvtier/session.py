"""Session: the connection half of :class:`kvtier.Client`: channel, session, breaker, transport.

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

The underscore methods are the package's internal API: :mod:`kvtier.client` and
:mod:`kvtier.batches` make their RPCs and transfers through ``_call``, ``_transfer``, ``_data``
and ``_trip``; ``probe`` is the breaker's.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any, Protocol

import grpc

from kvtier.addresses import address_target, grpc_host, tcp_endpoint
from kvtier.breaker import Breaker
from kvtier.control import ControlChannels, tcp_dialer, unix_dialer
from kvtier.diagnose import Diagnosis, Peer, explain_attach, explain_login, explain_rpc, speaks_tls
from kvtier.local_index import LocalIndexes
from kvtier.login import shm_socket_of, unix_login
from kvtier.results import ClientCounters, TierFigure
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors
from kvtier_contract.identity import Namespace
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName, namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

DOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
MIN_RPC_S = 0.02  # an RPC never starts with less of its caller's deadline left than this
_TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme", pb.TIER_CLUSTER: "cluster"}


class Away(Exception):
    """The daemon is unreachable right now (internal: callers get misses and drops).
    ``diagnosis``: why, in words naming the fix (:mod:`kvtier.diagnose`), when known."""

    def __init__(self, message: str = "", diagnosis: Diagnosis | None = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


class OutOfTime(Away):
    """The caller's deadline (an engine step's budget) is spent: a miss or a drop, no trip."""


class Overloaded(OutOfTime):
    """The daemon shed this request (RESOURCE_EXHAUSTED, ``errors.OVERLOADED``): it answers, so
    nothing trips; this call is a miss or a drop, like one out of time."""


class Unregistered(Away):
    """The daemon does not hold this call's namespace and refused to register it (a quota, a
    full namespace table): the call is a miss or a drop, nothing trips, and the namespace is
    registered again at most once per ``REGISTER_RETRY_S``."""


REGISTER_RETRY_S = 1.0


class Unanswered(Away):
    """A call made with ``trip=False`` (``Session._start``) found the daemon down or silent:
    the caller trips the breaker with ``why`` once it has closed what it started."""

    def __init__(self, why: str, details: str) -> None:
        super().__init__(details)
        self.why = why


class PendingCall:
    """A control RPC in flight, started by ``Session._start`` (the next job's PrepareStore while
    this job's bytes are copied, a CompleteStore collected before the put returns): a
    ``Session._call`` run by one of the session's RPC threads.

    ``result()`` answers as ``_call`` would have (the reply, Away, Overloaded, OutOfTime, a
    kvtier error), except that a daemon found down or silent raises Unanswered without tripping
    the breaker: the caller trips it once it has closed the jobs it started (a put aborts the
    jobs it prepared ahead, whose completions the open breaker would refuse). Every RPC it
    makes has ``_call``'s deadline (``timeout_s``, cut to the caller's ``deadline``); the wait
    is bounded besides, by what is left of that deadline plus ``timeout_s`` plus ``GRACE_S``
    (Unanswered after that). A call that is never collected still runs to its end.
    Thread-safety: collected by the thread that started it.
    """

    GRACE_S = 0.5

    def __init__(self, session: Session, method: str, future: Future[Any],
                 deadline: float | None) -> None:
        self._session = session
        self._method = method
        self._future = future
        self._deadline = deadline

    def result(self) -> Any:
        s = self._session
        wait_s = s.timeout_s + self.GRACE_S
        if self._deadline is not None:
            wait_s += max(0.0, self._deadline - s._clock())
        try:
            return self._future.result(timeout=wait_s)
        except FutureTimeout:
            raise Unanswered(f"{self._method}: no answer within {wait_s:.2f} s",
                             "no answer") from None


class Registered(Protocol):
    """A namespace the session registers on every (re)open (``kvtier.client.NamespaceHandle``)."""

    namespace: Namespace
    namespace_id: int
    block_bytes: int
    registered_epoch: int
    register_retry_at: float  # (after a refusal) when the next call may register it again


class Session:
    """Owns the gRPC channel, the daemon session, the heartbeat thread and the data transport of
    one Client, and its membership of a breaker (its own, or one shared with other sessions).

    States: AWAY (no session) -> ``_ensure`` while the breaker is closed -> ``_open``
    (OpenSession, attach the transport, register every namespace) -> CONNECTED. CONNECTED ->
    AWAY by ``_trip`` (the daemon did not answer, or a transfer failed: the breaker opens, and
    only its probe thread reopens, via ``probe``) or by ``_reset_session`` (a reply with a new
    boot epoch, or a daemon that forgot the session or a namespace: reopened by the next call).
    ``close()`` -> CLOSED, for good.

    Thread-safety: shared by the caller's threads, the heartbeat thread and the breaker's probe
    thread. Control calls run concurrently; (re)opening holds ``_conn_lock`` (reentrant), which
    a caller waits for only as long as its deadline allows and ``_trip`` never waits for (it
    marks the session stale instead); transfers on the data channel hold ``_data_lock``. A
    transport detached during a transfer is retired, and closed when the transfer ends (never
    under it).
    """

    RPC_THREADS = 4  # threads that run the RPCs a put or get starts ahead (``_start``)
    pipeline_bytes: int = 0
    """Pipelining (:mod:`kvtier.batches`): a put or get of more than this many bytes is cut
    into jobs of at most this size whose RPCs overlap the copies of the others, on the
    session's RPC threads. 0 (the default) = off: one job per batch, every RPC on the caller's
    thread, one after the other. Off by default because on the 2-vCPU development host the
    overlapped RPC work took more from the copies than it hid (docs/benchmarks.md §14);
    e.g. ``32 << 20`` on hosts with cores to spare. Settable per client."""

    def __init__(self, address: str, transport: TransportName = "shm", *, timeout_s: float = 1.0,
                 lease_ttl_s: float = 10.0, client_name: str = "", heartbeat: bool = True,
                 backoff_s: tuple[float, float] = (0.05, 1.0), tenant_key: bytes | None = None,
                 breaker: Breaker | None = None, probe_timeout_s: float | None = None,
                 op_timeout_s: float = 30.0, local_lookups: bool = True,
                 token: str | None = None, token_file: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, unix_login: bool = False,
                 verify_bytes: bool = True, control_channel: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``backoff_s``: the probe interval, doubling from the first to the second (used when
        no ``breaker`` is given); ``probe_timeout_s``: each probe RPC's deadline (default
        ``min(timeout_s, 0.5)``); ``op_timeout_s``: the bound on one operation without a
        deadline of its own (all its batches and load rounds); ``local_lookups``: answer
        ``lookup`` from the daemon's published index when it is on this host
        (:mod:`kvtier.local_index`); ``token`` / ``token_file`` (its first line): the bearer
        token of this client's tenant, sent with every RPC (a daemon with a tenants file
        refuses calls without one; docs/security.md). Never logged. ``tls_ca``: PEM CA of a
        daemon whose TCP listener (and so its TCP data channel) serves TLS (``tls_cert`` /
        ``tls_key``: this client's certificate, for mTLS); on a Unix socket address gRPC stays
        plaintext and the files only verify the data channel. ``unix_login``: no token; this
        process's Unix user logs in on the daemon's socket at every session open and gets its
        tenant's token (:mod:`kvtier.login`; a Unix socket address only). ``verify_bytes``
        (default on): hash each block an shm put copies into its slot (sent with CompleteStore)
        and check every block ``get_into`` loads against its digest, a mismatch being a miss
        (docs/security.md); off only to measure what verification costs (``kvtier bench``).
        ``control_channel`` (default on): the session makes its control calls (Prepare*/
        Complete*, Lookup, Heartbeat...) on control channels instead of gRPC, on the daemon's shm
        socket (shm, cuda_ipc) or its TCP data port (tcp) (:mod:`kvtier.control`; gRPC when the
        daemon refuses them)."""
        names = tuple(TRANSPORT_NAMES.values())
        if transport not in names:
            raise errors.InvalidArgument(f"unknown transport {transport!r} (expected one of "
                                         f"{', '.join(names)})", field="transport")
        self.address = address_target(address)
        self.transport_name = transport
        self.timeout_s = timeout_s
        self.probe_timeout_s = probe_timeout_s or min(timeout_s, 0.5)
        self.op_timeout_s = op_timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.client_name = client_name or f"pid{os.getpid()}"
        self.tenant_key = tenant_key
        self.verify_bytes = verify_bytes
        self.control_channel = control_channel
        self._metadata = bearer_metadata(token, token_file)
        self._login_path = ""
        if unix_login:
            if self._metadata:
                raise errors.InvalidArgument("give a token or log in as the Unix peer, not both",
                                             field="unix_login")
            self._login_path = shm_socket_of(self.address)
        self._tls = _tls_credentials(tls_ca, tls_cert, tls_key)
        self._tls_files = (tls_ca, tls_cert, tls_key)  # for a TLS data channel
        self._peer = Peer(self.address, transport,
                          tls=self._tls is not None and not self.address.startswith("unix:"),
                          ca=bool(tls_ca), client_cert=bool(tls_cert), token=bool(self._metadata),
                          unix_login=unix_login, timeout_s=timeout_s)
        self.counters = ClientCounters()
        self.breaker = breaker if breaker is not None else Breaker(backoff_s)
        self._clock = clock
        self._conn_lock = threading.RLock()
        self._data_lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._session_id = 0
        self._stale = False  # tripped while another thread held _conn_lock: reopen next time
        self._epoch = 0
        self._max_batch = 1024
        self._lookup_slices = False  # the daemon serves LookupSlices (OpenSessionReply)
        self._transport: DataTransport | None = None
        self._retired: list[DataTransport] = []  # detached during a transfer, closed after it
        self._namespaces: list[Registered] = []
        self._closed = False
        self._last_call = 0.0
        self._rpc_pool: ThreadPoolExecutor | None = None  # runs ``_start``'s calls
        self._rpc_pool_lock = threading.Lock()
        self._control: ControlChannels | None = None  # the session's control channels
        self.local = LocalIndexes(clock) if local_lookups else None
        # tier -> (figure, our clock when it arrived): the daemon's per-tier load figures
        self._tier_figures: dict[str, tuple[TierFigure, float]] = {}
        self.breaker.attach(self)
        self._hb_stop = threading.Event()
        self._hb: threading.Thread | None = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="kvtier-heartbeat")
            self._hb.start()

    @property
    def connected(self) -> bool:
        return self._session_id != 0 and not self._stale

    @property
    def boot_epoch(self) -> int:
        return self._epoch

    def _take_figures(self, reply: Any) -> None:
        """Keep the per-tier read figures a reply carries (HeartbeatReply, OpenSessionReply),
        stamped with our clock; a tier the reply leaves out keeps its older figure."""
        now = self._clock()
        got = {_TIER_NAMES[f.tier]: (TierFigure(f.latency_us / 1e6, float(f.bytes_per_s),
                                                f.age_ms / 1e3, int(f.reads)), now)
               for f in reply.tier_figures if f.tier in _TIER_NAMES}
        if got:  # one new dict, swapped in whole: readers on other threads see old or new
            self._tier_figures = {**self._tier_figures, **got}

    def tier_figures(self) -> dict[str, TierFigure]:
        """The daemon's latest per-tier load figures (tier name -> ``TierFigure``, its age grown
        by the time since it arrived); from the OpenSession reply and every heartbeat reply, empty
        until one brought some (the daemon has read no tier below the host tier yet). Any thread."""
        now = self._clock()
        return {tier: replace(fig, age_s=fig.age_s + max(0.0, now - at))
                for tier, (fig, at) in dict(self._tier_figures).items()}

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self._max_batch

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now, on this client's clock."""
        return self._clock() + (self.op_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        self._closed = True
        self._hb_stop.set()
        with self._rpc_pool_lock:
            if self._rpc_pool is not None:  # calls in flight end by their own deadlines
                self._rpc_pool.shutdown(wait=False)
        self.breaker.detach(self)
        with self._conn_lock:
            if self._session_id and self._stub is not None and self.breaker.allows():
                tallies = self._tally_request()  # local lookups not yet counted
                if tallies.local_lookups:
                    tallies.session_id = self._session_id
                    with contextlib.suppress(grpc.RpcError):
                        self._stub.Heartbeat(tallies, timeout=self.probe_timeout_s)
                with contextlib.suppress(grpc.RpcError):
                    self._stub.CloseSession(pb.CloseSessionRequest(session_id=self._session_id),
                                            timeout=self.probe_timeout_s)
            self._disconnect()

    # -- connection management --------------------------------------------------------------------

    def _rpc_timeout(self, deadline: float | None, *, floor: bool = False) -> float:
        """The deadline of the next RPC: ``timeout_s``, cut to what is left before ``deadline``.
        OutOfTime when less than MIN_RPC_S is left (``floor``: the RPC gets MIN_RPC_S anyway,
        for a completion that frees daemon state)."""
        if deadline is None:
            return self.timeout_s
        left = deadline - self._clock()
        if left < MIN_RPC_S:
            if not floor:
                self.counters.out_of_time += 1
                raise OutOfTime("deadline spent")
            left = MIN_RPC_S
        return min(self.timeout_s, left)

    def _ensure(self, deadline: float | None = None) -> None:
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
                self._trip(str(e), e.diagnosis)
                raise
        finally:
            self._conn_lock.release()

    def _first_open(self, *, strict: bool) -> Diagnosis | None:
        """``Client.connect``'s open, all of it within one deadline ``timeout_s`` from now: each
        step (Unix login, OpenSession, attach, register, the TLS probe) gets what is left of it.
        None when the session is open, else why not. ``strict``: tried even while a shared
        breaker is open, a failure trips nothing (the caller raises and closes), and when a TCP
        port closed the connection one TLS handshake (``_sharpen``) tells whether the port
        serves TLS. Else (lazy: an engine's thread, which must not wait) no probe: a failure
        trips the breaker, which logs it once (WARNING) and reconnects by itself later."""
        if not strict and not self.breaker.allows():
            return None  # another session of this breaker found the daemon away: it probes
        deadline = self._clock() + self.timeout_s
        with self._conn_lock:
            try:
                self._open(self.timeout_s, deadline)
                return None
            except Away as e:
                diagnosis = e.diagnosis if e.diagnosis is not None else _away_diagnosis(self._peer, str(e))
                self._disconnect(keep_channel=True)
        if strict:
            return self._sharpen(diagnosis, deadline)
        self._trip(str(diagnosis.error), diagnosis)
        return diagnosis

    _PROBED = ("plaintext-on-tls", "tls-cert-required", "tls-cert-refused")  # a closed socket

    def _sharpen(self, diagnosis: Diagnosis, deadline: float | None = None) -> Diagnosis:
        """``diagnosis`` made sure where a TLS handshake can tell (a TCP port that closed the
        connection): one handshake to one address of the host, within ``probe_timeout_s`` and
        what is left before ``deadline``. Never on a Unix socket or a gRPC scheme target."""
        endpoint = tcp_endpoint(self.address)
        if diagnosis.cause not in self._PROBED or diagnosis.rpc is None or endpoint is None:
            return diagnosis
        left = self.probe_timeout_s if deadline is None else deadline - self._clock()
        if left < MIN_RPC_S:
            return diagnosis
        answers = speaks_tls(*endpoint, min(self.probe_timeout_s, left))
        return explain_rpc(self._peer, *diagnosis.rpc, tls_probe=answers)

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
                        pb.HeartbeatRequest(session_id=self._session_id), timeout=timeout)
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

    def _open(self, timeout: float, deadline: float | None = None) -> None:
        """OpenSession, attach the transport, register every namespace (caller holds
        ``_conn_lock``); each step within ``timeout`` and what is left before ``deadline``
        (None: no bound on the whole). Away when the daemon does not answer."""
        self._channel_open()
        if self._login_path:  # a fresh token per session: a restarted daemon knows none
            self._login(self._step_timeout(timeout, deadline, "Unix login"))
        try:
            reply = self._stub.OpenSession(pb.OpenSessionRequest(
                client_name=self.client_name, lease_ttl_ms=int(self.lease_ttl_s * 1000),
                transport=make_transport(self.transport_name).proto_value),
                timeout=self._step_timeout(timeout, deadline, "OpenSession"))
        except grpc.RpcError as e:
            raise Away(f"OpenSession: {e.code().name}: {e.details()}",
                       explain_rpc(self._peer, "OpenSession", e.code().name, e.details() or "")
                       ) from None
        transport = make_transport(self.transport_name)
        transport.io_timeout_s = self.timeout_s
        if reply.data_host in ("0.0.0.0", "::", ""):
            # The daemon listens on every interface: reach it where we reached its gRPC port.
            reply.data_host = grpc_host(self.address)
        try:
            if reply.data_tls:
                transport.tls_context = _data_tls_context(*self._tls_files)
                transport.tls_server_name = grpc_host(self.address)
            transport.attach(reply.session_id, reply, self._step_timeout(timeout, deadline, "attach"))
        except errors.TransportError as e:
            raise Away(str(e), explain_attach(self._peer, e)) from None
        if self._epoch and reply.boot_epoch != self._epoch:
            self.counters.epoch_changes += 1
        if self._epoch:
            self.counters.reconnects += 1
        self._session_id, self._epoch = reply.session_id, reply.boot_epoch
        self._max_batch = max(1, reply.max_batch_blocks)
        self._lookup_slices = reply.lookup_slices
        self._take_figures(reply)  # figures from the start, not one heartbeat later
        transport.bind_rpc(self._transfer_rpc)
        self._transport = transport
        if self.control_channel:
            secret, dial = bytes(reply.data_secret), None
            if transport.name != "tcp" and reply.shm_socket:  # same host: the shm socket
                dial = unix_dialer(reply.shm_socket, reply.session_id, secret)
            elif transport.name == "tcp" and reply.data_port:  # the data port (TLS if it is)
                dial = tcp_dialer(reply.data_host, reply.data_port, reply.session_id, secret,
                                  tls=transport.tls_context if reply.data_tls else None,
                                  server_name=grpc_host(self.address))
            if dial is not None:
                self._control = ControlChannels(dial, reply.session_id, timeout)
        if self.local is not None:
            self.local.reset(reply.shm_socket, reply.session_id, reply.boot_epoch,
                             bytes(reply.data_secret))
        for handle in self._namespaces:
            try:
                self._register(handle, self._step_timeout(timeout, deadline, "RegisterNamespace"))
            except errors.KvtierError as e:  # refused (quota, table full...): its calls miss
                handle.register_retry_at = self._clock() + REGISTER_RETRY_S
                self._refused(handle, e)

    def _step_timeout(self, timeout: float, deadline: float | None, step: str) -> float:
        """``timeout``, cut to what is left before ``deadline``; Away (the daemon was too slow
        to answer, as a deadline exceeded) when less than MIN_RPC_S is left for ``step``."""
        if deadline is None:
            return timeout
        left = deadline - self._clock()
        if left < MIN_RPC_S:
            raise Away(f"{step}: DEADLINE_EXCEEDED: Deadline Exceeded", explain_rpc(
                self._peer, step, "DEADLINE_EXCEEDED", "Deadline Exceeded"))
        return min(timeout, left)

    def _login(self, timeout: float) -> None:
        """A Unix login's fresh token for every later call (caller holds ``_conn_lock``); Away
        when the daemon refuses or cannot be reached (the engine recomputes meanwhile)."""
        try:
            token = unix_login(self._login_path, timeout)
        except errors.KvtierError as e:
            raise Away(f"Unix login: {e}", explain_login(self._peer, e)) from None
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _channel_open(self) -> None:
        if self._channel is None:
            options = [("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 << 20)]
            if self._tls is not None and not self.address.startswith("unix:"):
                # (the Unix socket never serves TLS; the files still verify a TLS data channel)
                self._channel = grpc.secure_channel(self.address, self._tls, options=options)
            else:
                self._channel = grpc.insecure_channel(self.address, options=options)
            channel = self._channel
            if self._metadata or self._login_path:
                channel = grpc.intercept_channel(channel, _WithMetadata(lambda: self._metadata))
            self._stub = pb_grpc.KvtierStub(channel)

    def _register(self, handle: Registered, timeout: float) -> None:
        """RegisterNamespace; Away when the daemon does not answer (the caller trips)."""
        try:
            reply = self._stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(spec=namespace_spec(handle.namespace),
                                            digest=handle.namespace.digest),
                timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in DOWN_CODES:
                raise Away(f"RegisterNamespace: {e.code().name}: {e.details()}",
                           explain_rpc(self._peer, "RegisterNamespace", e.code().name,
                                       e.details() or "")) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                    (e.details() or "").startswith(errors.OVERLOADED):
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
        self.breaker.causes.report(diagnosis.cause, f"{message}; meanwhile lookups miss and "
                                   "puts are dropped (the engine recomputes)")

    def _refused(self, handle: Registered, error: errors.KvtierError) -> None:
        """The daemon refused to register ``handle``'s namespace: its calls miss."""
        ns = handle.namespace
        self._note(f"RegisterNamespace: {error}", Diagnosis(
            f"register-{type(error).__name__}", type(error)(
                f"daemon at {self.address} refused namespace {ns.model_id}@{ns.model_revision} "
                f"(id {handle.namespace_id}): {error}")))

    def _trip(self, why: str, diagnosis: Diagnosis | None = None) -> None:
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

    def _disconnect(self, keep_channel: bool = False) -> None:
        self._session_id = 0
        if self._control is not None:
            self._control.close()
            self._control = None
        if self.local is not None:
            self.local.clear()
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

    def _call(self, method: str, request: Any, *, reconnect: bool = True,
              deadline: float | None = None, floor: bool = False, trip: bool = True) -> Any:
        """One RPC within ``timeout_s`` and ``deadline`` (see ``_rpc_timeout``); Away when the
        daemon is away (the breaker is then open; ``trip=False``: Unanswered, the breaker left
        to the caller). Retries once after a reconnect when the daemon forgot our session or
        namespace (it restarted)."""
        for attempt in (0, 1):
            self._ensure(deadline)
            if hasattr(request, "session_id"):
                request.session_id = self._session_id
            handles = self._registered_for(request, deadline)
            timeout = self._rpc_timeout(deadline, floor=floor)
            try:
                reply = self._invoke(self._stub, method, request, timeout)
            except grpc.RpcError as e:
                code = e.code()
                if code in DOWN_CODES:
                    why = f"{method}: {code.name}: {e.details()}"
                    if not trip:
                        raise Unanswered(why, e.details() or "") from None
                    self._trip(why, explain_rpc(self._peer, method, code.name, e.details() or ""))
                    raise Away(e.details()) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and \
                        (e.details() or "").startswith(errors.OVERLOADED):
                    self.counters.overloaded += 1
                    raise Overloaded(e.details()) from None
                if code == grpc.StatusCode.NOT_FOUND and attempt == 0 and reconnect and \
                        "namespace" in (e.details() or "") and handles:
                    for handle in handles:  # the daemon forgot one (expired): register again
                        handle.registered_epoch = 0
                    continue
                if code == grpc.StatusCode.NOT_FOUND and attempt == 0 and reconnect and \
                        ("session" in (e.details() or "") or "namespace" in (e.details() or "")):
                    self._reset_session()
                    continue
                raise errors.from_grpc_code(code.name, e.details() or "") from None
            self._last_call = self._clock()
            if method == "Heartbeat":  # (over gRPC or a control channel alike)
                self._take_figures(reply)
            if reply.boot_epoch != self._epoch:
                self._reset_session()  # daemon restarted under us: this reply is still valid
            return reply
        raise AssertionError("unreachable")

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
        if self._clock() < handle.register_retry_at:
            raise Unregistered(f"namespace {ns_id} is not registered ({self.counters.last_error})")
        try:
            self._register(handle, self._rpc_timeout(deadline))
        except Away as e:
            if not isinstance(e, OutOfTime):
                self._trip(str(e), e.diagnosis)
            raise
        except errors.KvtierError as e:
            handle.register_retry_at = self._clock() + REGISTER_RETRY_S
            self._refused(handle, e)
            raise Unregistered(f"namespace {ns_id}: {e}") from None
        return handle

    def _start(self, method: str, request: Any, *, deadline: float | None = None,
               inline: bool = False) -> PendingCall:
        """Start ``_call(method, request, deadline=deadline, trip=False)`` on one of the
        session's RPC threads and return at once (a few microseconds; starting a gRPC future
        costs the caller's thread ~0.5 ms here), or, ``inline``, make it now on the caller's
        thread (nothing to overlap it with: no thread hand-off). Away at once while the
        breaker is open or the client is closed; every other outcome comes from ``result()``."""
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")
        return self._submit(method, deadline,
                            lambda: self._call(method, request, deadline=deadline, trip=False),
                            inline)

    def _start_completion(self, method: str, request: Any, session_id: int,
                          deadline: float | None, *, inline: bool = False) -> PendingCall:
        """Start the completion (CompleteStore / CompleteLoad) of a job that session
        ``session_id`` prepared, as ``_start`` does: Away at once unless the breaker is closed
        and that session is still ours, as ``_call(reconnect=False)`` would have refused it
        (never reopening a session). Once started it goes out under that session whatever
        happens meanwhile (a later job's PrepareStore tripping the breaker must not keep it,
        and the slots it frees, waiting for the lease). It gets ``timeout_s``, cut to
        ``deadline`` but never below ``MIN_RPC_S``. ``inline``: as ``_start``'s."""
        if self._closed:
            raise Away("client closed")
        if not self.breaker.allows():
            raise Away(self.breaker.why or "daemon away (breaker open)")
        if self._stale or session_id != self._session_id:
            raise Away("the session of the job is gone")
        return self._submit(method, deadline,
                            lambda: self._complete(method, request, session_id, deadline), inline)

    def _submit(self, method: str, deadline: float | None, fn: Callable[[], Any],
                inline: bool) -> PendingCall:
        """``fn()`` on an RPC thread (at most ``RPC_THREADS``, started on first use), or now
        (``inline``)."""
        if inline:
            done: Future[Any] = Future()
            try:
                done.set_result(fn())
            except Exception as e:  # noqa: BLE001  (result() raises it, as from a thread)
                done.set_exception(e)
            return PendingCall(self, method, done, deadline)
        with self._rpc_pool_lock:
            if self._rpc_pool is None:
                self._rpc_pool = ThreadPoolExecutor(self.RPC_THREADS,
                                                    thread_name_prefix="kvtier-rpc")
            pool = self._rpc_pool
        try:
            future = pool.submit(fn)
        except RuntimeError:  # shut down by close() meanwhile
            raise Away("client closed") from None
        return PendingCall(self, method, future, deadline)

    def _complete(self, method: str, request: Any, session_id: int,
                  deadline: float | None) -> Any:
        """The RPC of ``_start_completion`` (on an RPC thread)."""
        stub = self._stub
        if stub is None or self._closed:
            raise Away("client closed")
        request.session_id = session_id
        try:
            reply = self._invoke(stub, method, request,
                                 self._rpc_timeout(deadline, floor=True))
        except grpc.RpcError as e:
            code = e.code()
            if code in DOWN_CODES:
                self._trip(f"{method}: {code.name}: {e.details()}",
                           explain_rpc(self._peer, method, code.name, e.details() or ""))
                raise Away(e.details()) from None
            raise errors.from_grpc_code(code.name, e.details() or "") from None
        self._last_call = self._clock()
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
            return self._call(method, request, reconnect=False)
        except Away as e:
            raise errors.TransportError(f"{method}: {e}") from None

    def _local_lookup(self, handle: Registered, packed: bytes, n: int, *,
                      count: bool = True) -> int | None:
        """Hit prefix from the published index, or None (ask over gRPC): only for a live,
        open session whose namespace is registered in this boot. ``count`` False: in neither
        the counters nor the daemon's Stats."""
        local = self.local
        if local is None or self._stale or not self._session_id or \
                handle.registered_epoch != self._epoch or not self.breaker.allows():
            return None
        hit = local.lookup(handle.namespace_id, packed, n, tally=count)
        if hit is not None and count:
            self.counters.lookups_local += 1
        return hit

    def _tally_request(self, tallies: dict[int, Any] | None = None) -> Any:
        """A HeartbeatRequest carrying ``tallies`` (default: take the pending ones)."""
        if tallies is None:
            tallies = self.local.take_tallies() if self.local is not None else {}
        return pb.HeartbeatRequest(local_lookups=[
            pb.LookupTally(namespace_id=ns, lookups=t.lookups,
                           blocks_requested=t.blocks_requested, blocks_hit=t.blocks_hit)
            for ns, t in tallies.items()])

    def _heartbeat_loop(self) -> None:
        # Every period, even while other calls keep the lease alive: the replies bring the
        # daemon's tier figures (``tier_figures``), which a busy engine needs most.
        while not self._hb_stop.wait(max(0.05, self.lease_ttl_s / 3)):
            tallies = self.local.take_tallies() if self.local is not None else {}
            request = self._tally_request(tallies)
            try:
                self._call("Heartbeat", request)
            except (Away, errors.KvtierError):
                # Dropped, not sent again: an unanswered heartbeat may have been applied, and
                # a lookup left uncounted is better than one counted twice.
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


def _tls_credentials(ca: str | None, cert: str | None,
                     key: str | None) -> grpc.ChannelCredentials | None:
    """TLS for the gRPC channel (files read now), or None for a plaintext one."""
    if not ca and not cert:
        return None
    if bool(cert) != bool(key):
        raise errors.InvalidArgument("tls_cert and tls_key go together", field="tls_key")

    def read(name: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise errors.InvalidArgument(f"cannot read {path}: {e.strerror}", field=name) from None

    return grpc.ssl_channel_credentials(read("tls_ca", ca), read("tls_key", key),
                                        read("tls_cert", cert))


def _data_tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """TLS for the data channel: the gRPC channel's CA (the system's without one) and client
    certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert and key:
            ctx.load_cert_chain(cert, key)
    except OSError as e:
        raise errors.TransportError(f"data channel TLS: {e}") from None
    return ctx


def bearer_metadata(token: str | None, token_file: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata for a tenant's token (given, or the first line of a
    file); empty without one."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            raise errors.InvalidArgument(f"cannot read the token file: {e.strerror}",
                                         field="token_file") from None
        if not token:
            raise errors.InvalidArgument("the token file is empty", field="token_file")
    return (("authorization", f"Bearer {token}"),) if token else ()


class _WithMetadata(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the credential to every unary call of a channel."""

    def __init__(self, metadata: Callable[[], tuple[tuple[str, str], ...]]) -> None:
        self._metadata = metadata  # read per call: a Unix login renews it at each session open

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        md = tuple(details.metadata or ()) + self._metadata()
        return continuation(_Details(details.method, details.timeout, md, details.credentials,
                                     details.wait_for_ready, details.compression), request)


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, method: str, timeout: float | None, metadata: Any, credentials: Any,
                 wait_for_ready: Any, compression: Any) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready,
                                                                   compression)

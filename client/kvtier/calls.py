"""What a session's call can raise, and a call started on one of its RPC threads.

The exceptions are the session's internal vocabulary (:mod:`kvtier.client` and
:mod:`kvtier.batches` turn them into misses and drops): :class:`Away` (the daemon is unreachable;
the breaker opened), :class:`OutOfTime` (the caller's deadline is spent: nothing trips),
:class:`Overloaded` (the daemon shed the request), :class:`Unregistered` (the daemon refused a
namespace) and :class:`Unanswered` (a call made with ``trip=False`` found the daemon away: the
caller trips). :class:`Deadlines` gives each RPC its timeout from a caller's deadline.
:class:`PendingCall` is a call in flight on :class:`RpcThreads`, which owns the threads.
:class:`Registered` is what a session needs of a namespace handle.

Thread-safety: the exceptions are values; ``Deadlines`` and ``RpcThreads`` may be used from any
thread; a ``PendingCall`` is collected by the thread that started it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kvtier.diagnose import Diagnosis, Peer, explain_rpc
from kvtier.results import ClientCounters
from kvtier.settings import ClientSettings
from kvtier_contract.identity import Namespace

if TYPE_CHECKING:
    from kvtier.transports import DataTransport

DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
MIN_RPC_S = 0.02  # an RPC never starts with less of its caller's deadline left than this


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
    """A call made with ``trip=False`` (``Session.start``) found the daemon down or silent:
    the caller trips the breaker with ``why`` once it has closed what it started."""

    def __init__(self, why: str, details: str) -> None:
        super().__init__(details)
        self.why = why


class Deadlines:
    """The deadlines of one client's RPCs, on its clock: an operation's end (``operation``), the
    next RPC's timeout (``rpc``) and an open step's (``step``), each ``timeout_s`` of the
    settings cut to what is left of a caller's deadline. Handed the settings, the clock, the
    counters (``out_of_time``: the RPCs refused for want of time) and the peer (the diagnoses').
    No state of its own: any thread."""

    def __init__(
        self, settings: ClientSettings, clock: Callable[[], float], counters: ClientCounters, peer: Peer
    ) -> None:
        self._settings, self._clock, self._counters, self._peer = settings, clock, counters, peer

    def operation(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now."""
        return self._clock() + (self._settings.op_timeout_s if timeout_s is None else timeout_s)

    def rpc(self, deadline: float | None, *, floor: bool = False) -> float:
        """The deadline of the next RPC: ``timeout_s``, cut to what is left before ``deadline``.
        OutOfTime when less than MIN_RPC_S is left (``floor``: the RPC gets MIN_RPC_S anyway,
        for a completion that frees daemon state)."""
        timeout = self._settings.timeout_s
        if deadline is None:
            return timeout
        left = deadline - self._clock()
        if left < MIN_RPC_S:
            if not floor:
                self._counters.out_of_time += 1
                raise OutOfTime("deadline spent")
            left = MIN_RPC_S
        return min(timeout, left)

    def step(self, timeout: float, deadline: float | None, step: str) -> float:
        """``timeout``, cut to what is left before ``deadline``; Away (the daemon was too slow
        to answer, as a deadline exceeded) when less than MIN_RPC_S is left for ``step``."""
        if deadline is None:
            return timeout
        left = deadline - self._clock()
        if left < MIN_RPC_S:
            raise Away(
                f"{step}: DEADLINE_EXCEEDED: Deadline Exceeded",
                explain_rpc(self._peer, step, "DEADLINE_EXCEEDED", "Deadline Exceeded"),
            )
        return min(timeout, left)


class PendingCall:
    """A control RPC in flight, started by ``Session.start`` (the next job's PrepareStore while
    this job's bytes are copied, a CompleteStore collected before the put returns): a
    ``Session.call`` run by one of the session's RPC threads.

    ``result()`` answers as ``call`` would have (the reply, Away, Overloaded, OutOfTime, a
    kvtier error), except that a daemon found down or silent raises Unanswered without tripping
    the breaker: the caller trips it once it has closed the jobs it started (a put aborts the
    jobs it prepared ahead, whose completions the open breaker would refuse). Every RPC it
    makes has ``call``'s deadline (``timeout_s``, cut to the caller's ``deadline``); the wait
    is bounded besides, by what is left of that deadline plus ``timeout_s`` plus ``GRACE_S``
    (Unanswered after that). A call that is never collected still runs to its end.
    Thread-safety: collected by the thread that started it.
    """

    GRACE_S = 0.5

    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float],
        method: str,
        future: Future[Any],
        deadline: float | None,
    ) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._method = method
        self._future = future
        self._deadline = deadline

    def result(self) -> Any:
        wait_s = self._timeout_s + self.GRACE_S
        if self._deadline is not None:
            wait_s += max(0.0, self._deadline - self._clock())
        try:
            return self._future.result(timeout=wait_s)
        except FutureTimeout:
            raise Unanswered(f"{self._method}: no answer within {wait_s:.2f} s", "no answer") from None


class RpcThreads:
    """The threads that run the calls a session starts ahead (at most ``size``, started on first
    use). Owned by one session; ``close`` lets the calls in flight end by their own deadlines.
    Thread-safety: any thread."""

    def __init__(self, size: int, timeout_s: float, clock: Callable[[], float]) -> None:
        self._size = size
        self._timeout_s = timeout_s
        self._clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, method: str, deadline: float | None, fn: Callable[[], Any], inline: bool) -> PendingCall:
        """``fn()`` on one of the threads, or now on the caller's (``inline``); Away when the
        threads were closed meanwhile."""
        if inline:
            done: Future[Any] = Future()
            try:
                done.set_result(fn())
            except Exception as e:  # noqa: BLE001  (result() raises it, as from a thread)
                done.set_exception(e)
            return PendingCall(self._timeout_s, self._clock, method, done, deadline)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="kvtier-rpc")
            pool = self._pool
        try:
            future = pool.submit(fn)
        except RuntimeError:  # shut down by close() meanwhile
            raise Away("client closed") from None
        return PendingCall(self._timeout_s, self._clock, method, future, deadline)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:  # calls in flight end by their own deadlines
                self._pool.shutdown(wait=False)


class Registered(Protocol):
    """A namespace the session registers on every (re)open (``kvtier.client.NamespaceHandle``)."""

    namespace: Namespace
    namespace_id: int
    block_bytes: int
    registered_epoch: int
    register_retry_at: float  # (after a refusal) when the next call may register it again

    def take_tenant(self, tenant: str) -> None:
        """Give ``tenant`` (the one the session's credential proved) to a namespace registered
        without one, before it is registered; a namespace naming one keeps it."""


class SessionPort(Protocol):
    """What a put, a get or a lookup (:mod:`kvtier.batches`) needs of a session
    (:class:`kvtier.session.Session` implements it); nothing else of the session is used there.

    Lifecycle of one operation on it: ``deadline()`` fixes the operation's end (unless the caller
    gave one: ``settings.op_timeout_s`` from now); lookups are ``local_lookup`` (the published
    index, no round trip) or ``call``; a put or get cuts its keys in jobs of at most ``max_batch``
    keys (and ``pipeline_bytes``), starts each job's Prepare* by ``call`` or ``start`` (on the
    session's RPC threads, collected later: ``PendingCall.result``), moves the bytes inside
    ``transfer()`` on ``data()``, then completes every job it prepared by ``start_completion``
    (under the session that prepared it, even after a failure), and trips the breaker (``trip``)
    once it has closed what it started when the daemon was found away or a transfer failed. Why
    calls miss or drop is counted in ``counters``. Thread-safety: as the session's (any thread;
    transfers serialized by ``transfer``).
    """

    @property
    def counters(self) -> ClientCounters:
        """Where the operations count their misses, drops and hits."""
        ...

    @property
    def settings(self) -> ClientSettings:
        """The client's one settings value (``transport``, ``verify_bytes``: hash what a put
        copies, check what a get loads, docs/security.md; ``op_timeout_s``...)."""
        ...

    @property
    def pipeline_bytes(self) -> int:
        """Cut puts and gets above this many bytes in overlapped jobs (0: off); the session's
        run-time state, from ``settings.pipeline_bytes``."""
        ...

    @property
    def lookup_slices_served(self) -> bool:
        """The daemon serves LookupSlices (as the open session says)."""
        ...

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC."""
        ...

    def clock(self) -> float:
        """Now, on the clock the deadlines are on."""
        ...

    def deadline(self, timeout_s: float | None = None) -> float:
        """``timeout_s`` (default ``op_timeout_s``) from now."""
        ...

    def ensure(self, deadline: float | None = None) -> None:
        """Connected (opened now if needed), or Away at once while the breaker is open."""
        ...

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
        """One RPC within ``timeout_s`` and ``deadline``; Away (breaker opened), Unanswered
        (``trip=False``), Overloaded, OutOfTime, or the daemon's error."""
        ...

    def start(
        self, method: str, request: Any, *, deadline: float | None = None, inline: bool = False
    ) -> PendingCall:
        """``call(..., trip=False)`` started on an RPC thread (``inline``: now)."""
        ...

    def start_completion(
        self, method: str, request: Any, session_id: int, deadline: float | None, *, inline: bool = False
    ) -> PendingCall:
        """The completion of a job session ``session_id`` prepared, under that session."""
        ...

    def trip(self, why: str, diagnosis: Diagnosis | None = None) -> None:
        """Open the breaker and forget the session; never waits."""
        ...

    def local_lookup(self, handle: Registered, packed: bytes, n: int, *, count: bool = True) -> int | None:
        """The hit prefix from the daemon's published index, or None (ask the daemon)."""
        ...

    def transfer(self) -> AbstractContextManager[None]:
        """Hold the data channel for one transfer."""
        ...

    def data(self) -> DataTransport:
        """The attached data transport (TransportError when none is)."""
        ...

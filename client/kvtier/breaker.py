"""Breaker: the circuit breaker one engine worker's sessions share, and its probe thread.

Never hang the engine (DESIGN.md §7): after the first call that finds the daemon down or silent,
every call of every member session fails at once (the callers answer misses and drop stores)
until a probe, run on the breaker's own thread and never on a caller's, sees the daemon again::

    CLOSED --trip(why)--> OPEN --probe: every member answered--> CLOSED
                           |  probe failed: wait ``interval`` (doubling from the minimum of
                           +-- ``backoff_s`` to its maximum), probe again

A probe asks each member session to prove itself (``Member.probe``: a heartbeat on the session it
has, else OpenSession + transport + namespaces), each RPC with the members' short probe deadline.
Members join with ``attach`` and leave with ``detach``; the thread runs while the breaker is open
and members remain, and is started again by the next trip.

Thread-safety: any thread. ``_cond`` guards the state and is never held across an RPC; ``allows``
reads one boolean without it (a stale answer costs one fast failure or one more call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvtier.diagnose import CauseLog

log = logging.getLogger("kvtier.breaker")


class Member(Protocol):
    """A connection that shares a breaker (``kvtier.connection.Connection``)."""

    def probe(self) -> bool:
        """On the probe thread: True when the daemon answered and the session is usable."""
        ...


class Breaker:
    """See the module docstring. Owns the probe thread; the members own their sessions."""

    def __init__(
        self,
        backoff_s: tuple[float, float] = (0.05, 1.0),
        causes: CauseLog | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``causes``: where the members log why calls fail (one WARNING per cause and
        interval, shared by every member: an engine worker's clients say it once); ``clock``:
        the backoff's (a test's fake one: the probe thread then waits until the clock has passed
        the interval and the breaker is notified, by a trip, an attach or a detach)."""
        self.causes = causes if causes is not None else CauseLog()
        self._clock = clock
        self._min_s, self._max_s = backoff_s
        self._cond = threading.Condition()
        self._members: list[Member] = []
        self._open = False
        self._thread: threading.Thread | None = None
        self.why = ""
        self.trips = 0  # CLOSED -> OPEN transitions
        self.probes = 0  # probes run (successful or not)

    def allows(self) -> bool:
        """Whether calls may go to the daemon now (CLOSED)."""
        return not self._open

    @property
    def is_open(self) -> bool:
        return self._open

    def attach(self, member: Member) -> None:
        with self._cond:
            self._members.append(member)

    def detach(self, member: Member) -> None:
        with self._cond:
            if member in self._members:
                self._members.remove(member)
            self._cond.notify_all()

    def trip(self, why: str) -> None:
        """OPEN (again): calls fail fast until a probe sees the daemon. Never blocks."""
        with self._cond:
            self.why = why
            if not self._open:
                self._open = True
                self.trips += 1
            if self._thread is None and self._members:
                self._thread = threading.Thread(target=self._probe_loop, daemon=True, name="kvtier-probe")
                self._thread.start()
            self._cond.notify_all()

    def _probe_loop(self) -> None:
        interval = self._min_s
        try:
            while True:
                with self._cond:
                    # The first probe waits too (a trip means trouble now). A later trip does not
                    # cut the wait short: only a close or the last member leaving does.
                    end = self._clock() + interval
                    while self._open and self._members and (left := end - self._clock()) > 0:
                        self._cond.wait(left)
                    members = list(self._members)
                    if not self._open or not members:
                        self._thread = None
                        return
                ok = all([_probe(m) for m in members])  # every member, even after one failed
                with self._cond:
                    self.probes += 1
                    if ok:
                        self._open = False
                        self._thread = None
                        self._cond.notify_all()
                        log.info("kvtier: the daemon answers again (%s had opened the breaker)", self.why)
                        return
                interval = min(interval * 2, self._max_s)
        finally:  # only an unexpected error gets here with the thread still registered
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def wait_closed(self, timeout_s: float) -> bool:
        """Block until CLOSED (for tests and tools, never on an engine thread)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._open, timeout_s)


def _probe(member: Member) -> bool:
    """One member's probe; any error of its own (a short shm reply, an mmap failure, a CUDA
    error) is a failed probe, never the end of the probe thread."""
    try:
        return member.probe()
    except Exception as e:  # noqa: BLE001  (the thread must keep probing)
        log.debug("probe of %r failed: %s", member, e)
        return False

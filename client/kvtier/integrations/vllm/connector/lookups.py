"""The planner's lookups: each request's pinned lookup on the lookup thread, and its pins.

A request's lookup is submitted when vLLM admits it (again after a preemption), runs on the
``kvtier-lookup`` thread (``LookupThread``) and is taken here once answered. The scheduler thread
waits for answers at most ``wait_s`` per engine step in all (``wait``); a lookup still out after
``timeout_s`` is a miss for good (``expired``). Pins are released at once when vLLM will not load
(``release_now``), or ``pin_release_steps`` steps after the load was handed to the workers
(``release_at``, released by ``step_done``).

Ownership and concurrency: a part of ``planner.Planner``, handed the planner's counters; owns the
lookup thread, the clock, this step's wait budget and the pin releases due, and writes the lookup
fields of the request records it is given (``gen``, ``submitted_at``, ``outcome``, ``keys``,
``pins_released``). Scheduler thread only (the lookup thread is reached through
``LookupThread``'s own lock).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from kvtier.integrations.vllm.connector.lookup_thread import Backend, LookupOutcome, LookupThread, Pin
from kvtier.integrations.vllm.connector.plans import PlannerStats
from kvtier.integrations.vllm.connector.requests import RequestState


class Lookups:
    """The requests' lookups and their pins; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        stats: PlannerStats,
        timeout_s: float,
        wait_s: float,
        load_enabled: bool,
        clock: Callable[[], float],
    ) -> None:
        """``stats``: the planner's counters; the rest the planner's ``backend``,
        ``lookup_timeout_s``, ``lookup_wait_s``, ``load`` and ``clock``."""
        self.thread = LookupThread(backend)
        self.stats = stats
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.load_enabled = load_enabled
        self._clock = clock
        self._wait_left = wait_s  # of this step's budget for waiting on lookups
        self._releases: deque[tuple[int, list[Pin]]] = deque()  # (due step, pins)

    def submit(self, st: RequestState, tokens: Sequence[int]) -> None:
        """Look ``st`` up afresh over ``tokens`` (a re-lookup covers the output so far too)."""
        st.gen += 1
        st.outcome, st.timed_out, st.pins_released = None, False, False
        st.submitted_at = self._clock()
        if st.info.variant is not None:
            self.stats.lookups += 1
            self.thread.submit(st.info.req_id, st.gen, st.info.variant, tokens)

    def outcome(self, st: RequestState) -> LookupOutcome | None:
        """``st``'s answer, taken from the lookup thread once it is there (no wait)."""
        if st.outcome is None:
            got = self.thread.take(st.info.req_id, st.gen)
            if got is not None:
                self._accept(st, got)
        return st.outcome

    def wait(self, st: RequestState) -> LookupOutcome | None:
        """``st``'s answer, waited for within what is left of this step's wait budget."""
        if self._wait_left <= 0 or st.info.variant is None:
            return None
        t0 = time.perf_counter()
        got = self.thread.wait(st.info.req_id, st.gen, self._wait_left)
        self._wait_left -= time.perf_counter() - t0
        if got is None:
            return None
        self.stats.lookup_waits += 1
        return self._accept(st, got)

    def expired(self, st: RequestState) -> bool:
        """``st``'s lookup has been out for ``timeout_s``: a miss for good."""
        return self._clock() - st.submitted_at >= self.timeout_s

    def _accept(self, st: RequestState, got: LookupOutcome) -> LookupOutcome:
        st.outcome = got
        if got.keys and (not st.keys or len(got.keys[0]) > len(st.keys[0])):
            st.keys = [list(k) for k in got.keys]  # a re-lookup may cover more
        if st.timed_out or not self.load_enabled:
            self.release_now(st)  # answered too late to load; keys still serve stores
        return got

    def release_now(self, st: RequestState) -> None:
        """``st``'s lookup pins, released now (vLLM will not load them)."""
        if st.outcome is not None and not st.pins_released:
            st.pins_released = True
            if st.outcome.pins:
                self.thread.release(st.outcome.pins)

    def release_at(self, st: RequestState, step: int) -> None:
        """``st``'s lookup pins, released once ``step`` is built (its load has run by then)."""
        if st.outcome is not None and not st.pins_released and st.outcome.pins:
            st.pins_released = True
            self._releases.append((step, list(st.outcome.pins)))

    def step_done(self, step: int) -> None:
        """Step ``step`` is next: a fresh wait budget, and the pins due before it released."""
        self._wait_left = self.wait_s
        while self._releases and self._releases[0][0] < step:
            self.thread.release(self._releases.popleft()[1])

    def forget(self, req_id: str) -> None:
        self.thread.forget(req_id)

    def pending(self) -> int:
        return self.thread.pending()

    def close(self) -> None:
        """Every pin still held released, and the lookup thread stopped."""
        while self._releases:
            self.thread.release(self._releases.popleft()[1])
        self.thread.close()

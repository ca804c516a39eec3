"""The shared circuit breaker (kvtier.breaker): its probe thread survives a member whose probe
raises, and repeated trips do not cut its backoff short."""

from __future__ import annotations

import threading
import time

from kvtier.breaker import Breaker


class Member:
    def __init__(self, answers: list[object]) -> None:
        self.answers = answers  # True / False / an exception to raise, one per probe
        self.calls = 0
        self.lock = threading.Lock()

    def probe(self) -> bool:
        with self.lock:
            self.calls += 1
            answer = self.answers.pop(0) if self.answers else True
        if isinstance(answer, BaseException):
            raise answer
        return bool(answer)


def test_a_probe_that_raises_is_a_failed_probe_and_the_thread_keeps_probing() -> None:
    b = Breaker(backoff_s=(0.01, 0.02))
    m = Member([OSError("mmap failed"), ValueError("short shm reply"), True])
    b.attach(m)
    b.trip("test")
    assert b.wait_closed(5.0), (m.calls, b.probes)
    assert m.calls == 3 and b.allows()
    b.trip("again")  # a new trip starts a new probe thread
    assert b.wait_closed(5.0)


def test_trips_while_open_do_not_cut_the_backoff_short() -> None:
    b = Breaker(backoff_s=(0.2, 0.2))
    m = Member([False] * 100)
    b.attach(m)
    b.trip("down")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # callers keep tripping, as failing calls do
        b.trip("still down")
        time.sleep(0.001)
    assert m.calls <= 6, m.calls  # ~one probe per 0.2 s, not one per trip
    b.detach(m)  # the last member leaving ends the thread
    time.sleep(0.5)
    assert b._thread is None

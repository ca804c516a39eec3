"""The shared circuit breaker (kvtier.breaker): its probe thread survives a member whose probe
raises, and repeated trips do not cut its backoff short."""

from __future__ import annotations

import threading

from kvtier.breaker import Breaker


class Member:
    def __init__(self, answers: list[object]) -> None:
        self.answers = answers  # True / False / an exception to raise, one per probe
        self.calls = 0
        self.lock = threading.Lock()
        self.probed = threading.Event()  # set by each probe

    def probe(self) -> bool:
        with self.lock:
            self.calls += 1
            answer = self.answers.pop(0) if self.answers else True
            self.probed.set()
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
    now = [0.0]
    read = threading.Event()  # the probe thread read the clock: it is timing its first wait

    def clock() -> float:
        read.set()
        return now[0]

    b = Breaker(backoff_s=(0.2, 0.2), clock=clock)
    m = Member([False] * 100)
    b.attach(m)
    b.trip("down")
    assert read.wait(5.0)  # its first probe is due at 0.2 s on the clock
    for _ in range(1000):  # callers keep tripping, as failing calls do: each wakes the thread
        b.trip("still down")
    assert m.calls == 0  # no probe before the interval is over, however many trips
    now[0] = 0.2
    b.trip("still down")  # (wakes it) the interval is over: one probe
    assert m.probed.wait(5.0)
    for _ in range(1000):
        b.trip("still down")
    assert m.calls == 1, m.calls  # one probe per 0.2 s, not one per trip
    thread = b._thread
    assert thread is not None
    b.detach(m)  # the last member leaving ends the thread
    thread.join(5.0)
    assert b._thread is None

"""The vLLM planner's lookup thread: ordering and the scheduler thread's bounded wait.

The backend here records calls instead of talking to a daemon: what is under test is the
thread's queueing, not the daemon (tests/integration/vllm/test_vllm_planner.py drives a real one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvtier.integrations.vllm.connector.config import BASE, Variant
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome, LookupThread, Pin


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()

    def warmup(self) -> None:
        self.calls.append("warmup")
        self.gate.wait(5)

    def lookup(self, variant: Variant, token_ids: Sequence[int]) -> LookupOutcome:
        self.calls.append(f"lookup {token_ids[0]}")
        return LookupOutcome([], token_ids[0], [], [])

    def release(self, pins: Sequence[Pin]) -> None:
        self.calls.append(f"release {pins[0][1]}")

    def close(self) -> None:
        pass


def test_lookups_go_before_queued_releases_but_after_the_warmup() -> None:
    rec = Recorder()
    t = LookupThread(rec)
    t.release([(0, 1, 1)])
    t.submit("a", 1, BASE, [7])
    t.release([(0, 2, 1)])
    t.submit("b", 1, BASE, [8])
    rec.gate.set()  # the warmup (opening the session) ends
    assert t.wait("b", 1, 5.0) == LookupOutcome([], 8, [], [])
    t.close()
    assert rec.calls == ["warmup", "lookup 7", "lookup 8", "release 1", "release 2"]


def test_wait_answers_only_the_generation_asked_and_is_bounded() -> None:
    rec = Recorder()
    rec.gate.set()
    t = LookupThread(rec)
    t.submit("a", 1, BASE, [3])
    assert t.wait("a", 2, 0.05) is None  # an older generation's answer is not this one
    t0 = time.monotonic()
    assert t.wait("b", 1, 0.05) is None
    assert time.monotonic() - t0 < 2.0
    t.submit("a", 2, BASE, [4])
    assert t.wait("a", 2, 5.0) == LookupOutcome([], 4, [], [])
    t.close()

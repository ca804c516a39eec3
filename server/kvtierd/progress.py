"""Progress lines for long work (``kvtierd fsck``, the NVMe tier's recovery): how much is done,
of how much, the average rate and the time taken, at most once every ``interval_s``.

Usage::

    p = Progress("nvme recovery", log.info, total=n, unit="records", interval_s=5.0)
    for i, item in enumerate(items, 1):
        ...
        if p.due():               # a clock read; cheap enough to ask per item or per batch
            p.report(i, "3 quarantined")
    p.finish(n)                   # a last line, only when a progress line was printed

``emit`` receives whole lines (a logger method or a print to stderr). ``clock`` is injectable
(tests advance it by hand). Owned by the one thread doing the work; not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier_contract.units import format_bytes


class Progress:
    """Rate-limited progress of one piece of work (see the module docstring)."""

    def __init__(
        self,
        what: str,
        emit: Callable[[str], object],
        *,
        total: int | None = None,
        unit: str = "",
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit, self.interval_s = what, total, unit, interval_s
        self._emit, self._clock = emit, clock
        self.started = clock()
        self._next = self.started + interval_s
        self.lines = 0  # progress lines emitted (report and finish; not say)

    def due(self) -> bool:
        """Whether a progress line is due (``interval_s`` since the start or the last line)."""
        return self._clock() >= self._next

    def say(self, text: str) -> None:
        """One line now, prefixed with what the work is (a start or a phase)."""
        self._emit(f"{self.what}: {text}")

    def report(self, done: int, detail: str = "") -> None:
        """A progress line now: ``done`` of ``total`` units, the rate so far, ``detail``."""
        now = self._clock()
        elapsed = now - self.started
        if self.total:
            number = format_bytes(done) if self.unit == "bytes" else f"{done:,}"
            text = f"{number} of {self._amount(self.total)} ({100 * done / self.total:.0f}%)"
        else:
            text = self._amount(done)
        if elapsed > 0:
            text += f", {self._amount(int(done / elapsed))}/s"
        text += f", {elapsed:.1f}s"
        self._emit(f"{self.what}: {text}" + (f"; {detail}" if detail else ""))
        self.lines += 1
        self._next = now + self.interval_s

    def tick(self, done: int, detail: str = "") -> None:
        """``report`` when one is due."""
        if self._clock() >= self._next:
            self.report(done, detail)

    def finish(self, done: int, detail: str = "") -> None:
        """A last line with the final figures, when any progress line was printed (short work
        stays quiet)."""
        if self.lines:
            self.report(done, ("done; " + detail) if detail else "done")

    def _amount(self, n: int) -> str:
        if self.unit == "bytes":
            return format_bytes(n)
        return f"{n:,} {self.unit}" if self.unit else f"{n:,}"

"""Read figures: what reading a storage tier into the host tier costs now (issue 30).

Part of the cache (kvtierd.cache). Each link below the host tier (``TierLink`` for NVMe,
``ClusterLink`` for the cluster tier) owns one :class:`ReadFigures` (``link.read_figures``) and
feeds it once per read batch (a promotion or an import), with three times on the daemon's
monotonic clock:

* ``asked``: when the cache asked for the read (inside the RPC handler: PrepareLoad, a Lookup
  that pins, Prefetch); waits for a promotion already in flight, for room in the host tier and
  for the I/O pool count, time the RPC spent queued before its handler ran does not;
* ``started``: when the read itself was submitted;
* ``done``: when the bytes were in the host tier.

Figures (exponentially weighted over the recent batches: each batch weighs ``weight`` against
what came before, and what came before fades further with a half-life of ``half_life_s`` of
silence, so one batch after a long pause counts almost alone):

* ``latency_s``: ``done - asked``, averaged;
* ``bytes_per_s``: payload bytes over ``done - started``, as the ratio of the weighted sums
  (large batches count in proportion to their bytes);
* ``age_s``: since the latest batch; ``reads``: batches measured.

A few float operations per batch, no allocation. Concurrency: owned by the event-loop thread
(the link's owner); ``figure()`` is read on that thread too (Heartbeat, Stats, /metrics' loop
snapshot). No locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_WEIGHT = 0.3  # of a new batch against the weighted past
DEFAULT_HALF_LIFE_S = 10.0  # of the past's weight, in seconds without a batch


@dataclass(frozen=True)
class ReadFigure:
    """One tier's read figures at one moment (see the module docstring)."""

    latency_s: float
    bytes_per_s: float
    age_s: float
    reads: int


class ReadFigures:
    """Owns one tier's weighted read sums. Event-loop thread only; no locks."""

    def __init__(self, *, weight: float = DEFAULT_WEIGHT,
                 half_life_s: float = DEFAULT_HALF_LIFE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert 0.0 < weight <= 1.0 and half_life_s > 0, (weight, half_life_s)
        self.clock = clock
        self._keep = 1.0 - weight  # the past's weight at a new batch (before fading)
        self._half_life_s = half_life_s
        self._w = 0.0  # weighted count of batches
        self._latency = 0.0  # weighted sum of latencies
        self._bytes = 0.0  # weighted sum of bytes
        self._seconds = 0.0  # weighted sum of read durations
        self._at: float | None = None  # clock of the latest batch
        self.reads = 0

    def observe(self, nbytes: int, asked: float, started: float, done: float) -> None:
        """One read batch of ``nbytes`` payload bytes (times on ``clock``; see above). A batch
        that read nothing (every block failed) is not a figure of the tier's speed: ignored."""
        if nbytes <= 0:
            return
        keep = self._keep
        if self._at is not None and done > self._at:
            keep *= 0.5 ** ((done - self._at) / self._half_life_s)
        self._w = self._w * keep + 1.0
        self._latency = self._latency * keep + max(0.0, done - asked)
        self._bytes = self._bytes * keep + nbytes
        self._seconds = self._seconds * keep + max(1e-9, done - started)
        self._at = done if self._at is None else max(self._at, done)
        self.reads += 1

    def figure(self) -> ReadFigure | None:
        """The figures now; None until a batch was measured."""
        if self._at is None:
            return None
        return ReadFigure(self._latency / self._w, self._bytes / self._seconds,
                          max(0.0, self.clock() - self._at), self.reads)

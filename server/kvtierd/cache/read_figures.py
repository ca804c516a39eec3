"""Read figures: what reading a storage tier into the host tier costs now (issue 30).

Part of the cache (kvtierd.cache). Each link below the host tier (``TierLink`` for NVMe,
``ClusterLink`` for the cluster tier) owns one :class:`ReadFigures` (``link.read_figures``) and
feeds it once per read batch (a promotion or an import) with its payload bytes and three times
on the daemon's monotonic clock:

* ``asked``: when the cache asked for the read (inside the RPC handler: PrepareLoad, a Lookup
  that pins, Prefetch); waits for a promotion already in flight, for room in the host tier and
  for the I/O pool count, time the RPC spent queued before its handler ran does not;
* ``started``: when the read itself was submitted;
* ``done``: when the bytes were in the host tier.

The figures are the two terms of the cost of a batch of ``n`` bytes, ``latency_s + n /
bytes_per_s`` (how ``kvtier.adaptive`` uses them), so that the transfer is not counted twice:

* ``latency_s``: the intercept, what a batch costs whatever its size (queueing in the daemon,
  a disk's or a link's fixed cost per read);
* ``bytes_per_s``: the marginal rate, 1 / the slope of ``done - asked`` over bytes.

Both come from an exponentially weighted least-squares line through the recent batches
(``done - asked`` against bytes). When their sizes do not spread enough to tell the two apart
(every batch alike), the slope is the read's own time per byte (``done - started`` over bytes)
and the latency what is left (the waiting). The slope is kept between zero (1 TB/s at most) and
that read-time rate (a marginal rate is never below the average one), the latency at >= 0.

A batch read as parallel parts (the NVMe link's ~4 MiB jobs on the tier's I/O threads) also
gives each part's own time (``parts``). A line through whole batches reads parallelism as
bandwidth: 4 parts of 150 ms at once look like 37.5 ms per part and no latency, and a load of
one part, which takes 150 ms, would be predicted at a quarter of that. So the latency is at
least what a part takes beyond its share of the batch's transfer (``part time - part bytes x the
batch's time per byte``, averaged): a load of one part is then predicted at what one took, and
a larger one above what it takes (at most twice), which errs the safe way for a caller deciding
between loading and recomputing.
Weights: each batch weighs ``weight`` against those before it, and what came before fades
further with a half-life of ``half_life_s`` without a batch, so after a pause one batch counts
almost alone. A batch that read nothing (every block failed) is left out.

A change of regime restarts the figures, as the clients' own fits do (``kvtier.adaptive``): a
batch of a size like the recent ones (within 2x of their mean: a line through batches of one
size says little about others) ``SHIFT`` times slower or faster than predicted, and more than
``SHIFT_FLOOR_S`` from it
(a disk that slowed down or recovered, not jitter), drops what came before, so the next
heartbeat tells every client the new regime rather than a blend (a blend that is still fast
half-way is what makes a client plan a load that then fails). Until the sizes spread again, the
slope is kept from before the restart and the change is put on the latency.

A few float operations per batch, no allocation. Concurrency: owned by the event-loop thread
(the link's owner); ``figure()`` is read on that thread too (Heartbeat, Stats, /metrics' loop
snapshot). No locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_WEIGHT = 0.3  # of a new batch against the weighted past
DEFAULT_HALF_LIFE_S = 10.0  # of the past's weight, in seconds without a batch
MIN_SPREAD = 0.25  # batch sizes' weighted std / mean needed to fit a slope
MAX_BYTES_PER_S = 1e12
SHIFT = 4.0  # a batch this many times off the prediction restarts the figures
SHIFT_FLOOR_S = 0.001  # ... when it is also this far from it


@dataclass(frozen=True)
class ReadFigure:
    """One tier's read figures at one moment (see the module docstring)."""

    latency_s: float
    bytes_per_s: float
    age_s: float
    reads: int


class ReadFigures:
    """Owns one tier's weighted read sums. Event-loop thread only; no locks."""

    def __init__(
        self,
        *,
        weight: float = DEFAULT_WEIGHT,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert 0.0 < weight <= 1.0 and half_life_s > 0, (weight, half_life_s)
        self.clock = clock
        self._keep = 1.0 - weight  # the past's weight at a new batch (before fading)
        self._half_life_s = half_life_s
        # weighted sums: count, bytes x, cost y = done - asked, x*x, x*y, read time
        self._w = self._x = self._y = self._xx = self._xy = self._read = 0.0
        self._part = 0.0  # what a part takes beyond its share of its batch's transfer
        self._slope_before: float | None = None  # s/B before the latest restart
        self._at: float | None = None  # clock of the latest batch
        self.reads = 0

    def observe(
        self, nbytes: int, asked: float, started: float, done: float, parts: Sequence[tuple[int, float]] = ()
    ) -> None:
        """One read batch of ``nbytes`` payload bytes (times on ``clock``; see above);
        ``parts``: (payload bytes, seconds) of each part read in parallel, when it was."""
        if nbytes <= 0:
            return
        rate = max(1e-9, done - started) / nbytes  # the batch's read seconds per byte
        part = [s - n * rate for n, s in parts if n > 0]
        excess = max(0.0, sum(part) / len(part)) if part else 0.0
        keep = self._keep
        if self._at is not None and done > self._at:
            keep *= 0.5 ** ((done - self._at) / self._half_life_s)
        x, y = float(nbytes), max(0.0, done - asked)
        now = self.figure()
        if now is not None and self._x / 2 <= x * self._w <= 2 * self._x:  # a size like before
            pred = now.latency_s + x / now.bytes_per_s
            if abs(y - pred) > SHIFT_FLOOR_S and (y > SHIFT * pred or y * SHIFT < pred):
                keep = 0.0  # a new regime: what came before says nothing about it
                self._slope_before = 1.0 / now.bytes_per_s
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self._read = self._read * keep + max(1e-9, done - started)
        self._part = self._part * keep + excess
        self._at = done if self._at is None else max(self._at, done)
        self.reads += 1

    def figure(self) -> ReadFigure | None:
        """The figures now; None until a batch was measured."""
        if self._at is None:
            return None
        w = self._w
        mx, my = self._x / w, self._y / w
        max_slope = self._read / self._x  # s/B over the reads themselves: the average rate
        var = self._xx / w - mx * mx
        if var > (MIN_SPREAD * mx) ** 2:
            slope = (self._xy / w - mx * my) / var
        elif self._slope_before is not None:  # sizes alike since a restart: the old slope
            slope = self._slope_before
        else:  # sizes alike: the slope cannot be told from the intercept
            slope = max_slope
        slope = min(max(slope, 1.0 / MAX_BYTES_PER_S), max_slope)
        latency = max(0.0, my - slope * mx, self._part / w)
        return ReadFigure(latency, 1.0 / slope, max(0.0, self.clock() - self._at), self.reads)

"""Figures measured while serving: the cost of loading from each tier, the engine's prefill rate.

Everything here is a running estimate that forgets: an observation's weight halves every
``half_life_s`` seconds of the injected clock, so a tier that slows down (a busy disk, a slow
link, a daemon under load) shows in its figures within a few loads, and one that recovers shows
as fast. Plain arithmetic, no I/O and no locks: each object belongs to the one thread that feeds
and asks it (the vLLM scheduler thread, an SGLang storage call, a Transformers ``generate``);
a caller that shares one across threads holds its own lock.

* ``LinearFit``: weighted least squares of ``y = a + b·x`` with exponential forgetting. The
  intercept is the fixed cost (a round trip, a step's overhead), the slope the cost per unit.
* ``LoadFigures``: per tier ("host", "nvme", "cluster"), the end-to-end seconds to load ``n``
  bytes into the engine. Two sources: the engine's own loads (``observe``, the time a load took
  with its bytes by tier) and the daemon's per-tier figures (``report``: the latency and
  bandwidth of its recent reads of that tier, which other clients' loads keep fresh). The
  fresher wins, except that a recent own figure slower than the daemon's is kept (the daemon's
  misses part of what this engine pays), until the daemon's figure turns ``SHIFT`` times faster
  than it was at our own load (the tier recovered: others' reads show it first).
* ``PrefillRate``: seconds per prefilled token, from the engine's steps (tokens computed, seconds);
  ``FixedPrefillRate``: an operator's figure where no step can be measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Clock = Callable[[], float]
TIERS = ("host", "nvme", "cluster")


class LinearFit:
    """``y ≈ a + b·x`` over recent observations, each weighted ``0.5 ** (age / half_life_s)``.

    With one distinct ``x`` (or a negative intercept) the fit goes through the origin
    (``b = Σxy / Σxx``, ``a = 0``): a cost that only grows with ``x``. ``known`` is False until the
    first observation. A change of regime restarts the fit: an observation ``SHIFT`` times above
    or below the prediction, and more than ``SHIFT_FLOOR_S`` away from it (a disk that slowed
    down or recovered, not jitter), drops what came before, so one load after a recovery is
    enough to see it. Owned by one thread (see the module docstring).
    """

    SHIFT = 4.0
    SHIFT_FLOOR_S = 0.001

    def __init__(
        self, *, half_life_s: float = 30.0, clock: Clock = time.monotonic, restart_on_shift: bool = True
    ) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s: must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.restart_on_shift = restart_on_shift  # False: only forgetting ages old figures out
        self._clock = clock
        self._s = [0.0, 0.0, 0.0, 0.0, 0.0]  # Σw, Σwx, Σwy, Σwxx, Σwxy
        self.updated_at: float | None = None
        self.count = 0

    @property
    def known(self) -> bool:
        return self.count > 0

    def _decay(self, now: float) -> None:
        if self.updated_at is not None and now > self.updated_at:
            f = 0.5 ** ((now - self.updated_at) / self.half_life_s)
            self._s = [v * f for v in self._s]

    def observe(self, x: float, y: float) -> None:
        """One observation; ignored unless both are finite and ``x > 0``, ``y >= 0``."""
        if not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y < 0:
            return
        now = self._clock()
        self._decay(now)
        pred = self.predict(x)
        if (
            self.restart_on_shift
            and pred is not None
            and abs(y - pred) > self.SHIFT_FLOOR_S
            and (y > self.SHIFT * pred or y * self.SHIFT < pred)
        ):
            self._s = [0.0, 0.0, 0.0, 0.0, 0.0]
        s = self._s
        s[0] += 1.0
        s[1] += x
        s[2] += y
        s[3] += x * x
        s[4] += x * y
        self.updated_at = now
        self.count += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before the first observation."""
        w, sx, sy, sxx, sxy = self._s
        if self.count == 0 or w <= 0 or sxx <= 0:
            return None
        det = w * sxx - sx * sx
        if det > 1e-9 * w * sxx:
            b = (w * sxy - sx * sy) / det
            a = (sy - b * sx) / w
            if a >= 0 and b >= 0:
                return a, b
        return 0.0, max(0.0, sxy / sxx)

    def predict(self, x: float) -> float | None:
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * x


@dataclass(frozen=True)
class Report:
    """A tier's figures as the daemon reported them: its recent reads of that tier."""

    latency_s: float
    bytes_per_s: float
    at: float  # our clock when the daemon measured it


class LoadFigures:
    """End-to-end load cost per tier; see the module docstring. One owning thread."""

    def __init__(self, *, half_life_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._half_life_s = half_life_s
        self._own: dict[str, LinearFit] = {}
        self._reported: dict[str, Report] = {}
        self._reported_then: dict[str, Report | None] = {}  # tier -> the daemon's slowest
        #   figure since our latest own load from it (latency and bandwidth, each at its worst)

    def _fit(self, tier: str) -> LinearFit:
        fit = self._own.get(tier)
        if fit is None:
            fit = self._own[tier] = LinearFit(half_life_s=self._half_life_s, clock=self._clock)
        return fit

    def observe(self, bytes_by_tier: Mapping[str, int], seconds: float) -> None:
        """A load the engine ran: ``seconds`` end to end for these bytes. A load from one tier
        feeds that tier's fit. A mixed load charges the host tier its predicted share (host
        copies are measured by host-only loads) and splits the rest over the other tiers by
        bytes, so a slow disk is blamed and the host tier is not."""
        parts = {t: int(b) for t, b in bytes_by_tier.items() if b > 0}
        if not parts or not math.isfinite(seconds) or seconds < 0:
            return
        for tier in parts:
            self._reported_then[tier] = self._reported.get(tier)
        if len(parts) == 1:
            ((tier, nbytes),) = parts.items()
            self._fit(tier).observe(nbytes, seconds)
            return
        rest = seconds
        if "host" in parts:
            host = self._fit("host").predict(parts["host"])
            share = parts["host"] / sum(parts.values())
            rest -= min(seconds, host if host is not None else seconds * share)
        others = {t: b for t, b in parts.items() if t != "host"}
        total = sum(others.values())
        for tier, nbytes in others.items():
            self._fit(tier).observe(nbytes, max(0.0, rest) * nbytes / total)

    def report(self, tier: str, latency_s: float, bytes_per_s: float, *, age_s: float = 0.0) -> None:
        """The daemon's figures for ``tier``, measured ``age_s`` before now (ignored when not
        finite or the bandwidth is not positive)."""
        if (
            math.isfinite(latency_s)
            and latency_s >= 0
            and math.isfinite(bytes_per_s)
            and bytes_per_s > 0
            and math.isfinite(age_s)
        ):
            at = self._clock() - max(0.0, age_s)
            old = self._reported.get(tier)
            if old is None or at >= old.at:
                rep = self._reported[tier] = Report(latency_s, bytes_per_s, at)
                then = self._reported_then.get(tier)
                if tier in self._reported_then:  # (the reads of our cut load may land now)
                    self._reported_then[tier] = (
                        rep
                        if then is None
                        else Report(
                            max(then.latency_s, latency_s), min(then.bytes_per_s, bytes_per_s), then.at
                        )
                    )

    def updated_at(self, tier: str) -> float | None:
        """When the latest figure for ``tier`` (either source) arrived; None: never."""
        times = [
            self._own[tier].updated_at if tier in self._own else None,
            self._reported[tier].at if tier in self._reported else None,
        ]
        known = [t for t in times if t is not None]
        return max(known) if known else None

    def cost(self, tier: str, nbytes: int) -> float | None:
        """Seconds to load ``nbytes`` from ``tier`` into the engine; None when not known."""
        fit, rep = self._own.get(tier), self._reported.get(tier)
        own_fresher = (
            fit is not None
            and fit.known
            and (rep is None or (fit.updated_at is not None and fit.updated_at >= rep.at))
        )
        if own_fresher:
            assert fit is not None
            return fit.predict(nbytes)
        if rep is None:
            return None
        copy = 0.0
        if tier != "host":  # the daemon reads into the host tier; the engine copies from there
            host = self._own.get("host")
            ab = host.coefficients() if host is not None else None
            copy = ab[1] * nbytes if ab is not None else 0.0
        reported = rep.latency_s + nbytes / rep.bytes_per_s + copy
        if (
            fit is not None
            and fit.known
            and fit.updated_at is not None
            and self._clock() - fit.updated_at < self._half_life_s
            and not self._recovered_since(tier, rep, nbytes)
        ):
            # Our own recent loads were slower than the daemon's figure says: its figure misses
            # part of what this engine pays (reads in parallel that a line of cost over bytes
            # cannot tell from bandwidth, the transport, our own queueing). The slower one,
            # while ours is recent and the daemon has not seen the tier recover since.
            own = fit.predict(nbytes)
            return max(reported, own) if own is not None else reported
        return reported

    def _recovered_since(self, tier: str, rep: Report, nbytes: int) -> bool:
        """Whether the daemon's figure ``rep`` is ``LinearFit.SHIFT`` times faster than the
        slowest it reported since we last loaded from ``tier`` (the tier recovered meanwhile:
        the daemon's reads, others' or a read probe's, show it before our next load does)."""
        then = self._reported_then.get(tier)
        if then is None:
            return False
        return (
            rep.latency_s + nbytes / rep.bytes_per_s
        ) * LinearFit.SHIFT < then.latency_s + nbytes / then.bytes_per_s

    def predict(self, bytes_by_tier: Mapping[str, int], *, unknown: float | None = None) -> float | None:
        """Seconds to load these bytes. A tier with bytes and no figure yet makes it None, or
        costs ``unknown`` seconds when that is given (0.0: an optimistic guess, so that a load
        measures the tier)."""
        total = 0.0
        for tier, nbytes in bytes_by_tier.items():
            if nbytes <= 0:
                continue
            c = self.cost(tier, nbytes)
            if c is None:
                if unknown is None:
                    return None
                c = unknown
            total += c
        return total

    def known(self, tier: str) -> bool:
        """Whether ``tier`` has a figure (own or reported)."""
        fit = self._own.get(tier)
        return (fit is not None and fit.known) or tier in self._reported


class PrefillRate:
    """The engine's seconds per prefilled token: the slope of step time over tokens computed.

    ``observe_step(tokens, seconds)`` once per engine step that computed tokens (decode steps
    too: they pin the fixed cost, so the slope is the cost of one more token). One owning thread.
    No regime restarts (``LinearFit(restart_on_shift=False)``): decode steps (1 token, the
    fixed cost) and prefill steps (hundreds of tokens) lie far apart on one line, and each would
    otherwise look like a new regime to the other and drop it; nor would one noisy step (a host
    busy with something else for one step) leave the slope of that one point.
    """

    def __init__(self, *, half_life_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self.fit = LinearFit(half_life_s=half_life_s, clock=clock, restart_on_shift=False)

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.fit.observe(tokens, seconds)

    def seconds_per_token(self) -> float | None:
        ab = self.fit.coefficients()
        return None if ab is None or ab[1] <= 0 else ab[1]

    def seconds_for(self, tokens: int) -> float | None:
        """Seconds the engine spends to prefill ``tokens`` more tokens; None when not known."""
        spt = self.seconds_per_token()
        return None if spt is None else spt * tokens


class FixedPrefillRate(PrefillRate):
    """An operator's figure for the engine's seconds per prefilled token, for an integration
    that sees no engine step to measure (SGLang's storage backend; the vLLM secondary tier when
    ``prefill_seconds_per_token`` is set). Steps observed are ignored."""

    def __init__(self, seconds_per_token: float) -> None:
        if not (math.isfinite(seconds_per_token) and seconds_per_token > 0):
            raise ValueError(f"prefill_seconds_per_token: must be > 0, got {seconds_per_token}")
        super().__init__()
        self._spt = float(seconds_per_token)

    def observe_step(self, tokens: int, seconds: float) -> None:
        return None

    def seconds_per_token(self) -> float | None:
        return self._spt

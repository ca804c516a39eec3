"""RateLimitedLog: at most one log line per interval for a failure that may repeat without end
(undecodable requests, a failing accept, a probe that keeps failing)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    """At most one line per ``interval_s``; the next line says how many were suppressed.

    Owned by one thread (each user keeps its own instance); no locks."""

    def __init__(
        self, logger: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log, self._interval, self._clock = logger, interval_s, clock
        self._next = 0.0
        self.suppressed = 0

    def warning(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        self.log(logging.WARNING, msg, *args, exc_info=exc_info)

    def error(self, msg: str, *args: Any, exc_info: bool = False) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info)

    def log(self, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return
        self._next = now + self._interval
        if self.suppressed:
            msg += f" ({self.suppressed} more like it in the last {self._interval:.0f}s)"
            self.suppressed = 0
        self._log.log(level, msg, *args, exc_info=exc_info)

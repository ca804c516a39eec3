"""A tiny progress bar on stderr (no dependency): ``[#####.....]  12/40  tcp get 1MiB``."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts steps toward ``total``; redraws one line. Single-threaded; disabled = silent."""

    def __init__(
        self, total: int, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self._t0 = time.monotonic()
        self._last = ""

    def step(self, label: str, n: int = 1) -> None:
        """Mark ``n`` steps done; ``label`` names what runs next."""
        self.done = min(self.total, self.done + n)
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r[{bar}] {self.done:>3}/{self.total} {time.monotonic() - self._t0:5.0f}s {label[:40]:<40}"
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * len(self._last) + "\r")
            self.stream.flush()

"""A driver process: an engine (vLLM, SGLang, LMCache...) run by another environment's Python,
driven by the tests over stdin/stdout.

The driver script reads one JSON command per stdin line and answers each with one
``DRIVER {json}`` line on stdout (its first answer, unasked, says ``{"ready": true}``); every
other line it prints goes to the log file, with its stderr.

Lifecycle::

    d = DriverProcess([python, "x_driver.py", json.dumps(spec)], log_path, env=..., cwd=...)
    d.request({"op": "..."}, timeout_s)  # -> the answer dict (AssertionError naming the log when
                                       #    it does not come or the driver exited)
    d.close()                          # stdin closed (or ``quit`` sent), then wait, then kill

Owned by one test; ``request`` is not thread-safe (one command at a time).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


def require_env(python: str, engine: str, make_target: str, skip_var: str) -> str:
    """``python``, an engine's environment interpreter; fails the test without it (it is built by
    ``make test``), or skips it when ``$skip_var`` is 1."""
    if os.environ.get(skip_var) == "1":
        pytest.skip(f"{skip_var}=1")
    if not os.access(python, os.X_OK):
        pytest.fail(
            f"no {engine} environment at {python}: run `make {make_target}` (or set "
            f"{skip_var}=1 to skip these tests)",
            pytrace=False,
        )
    return python


class DriverProcess:
    """See the module docstring."""

    def __init__(
        self,
        argv: Sequence[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        ready_timeout_s: float = 300,
        what: str = "driver",
    ) -> None:
        self.what = what
        self.log = open(log, "w")  # noqa: SIM115  (closed in close)
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.answer(ready_timeout_s).get("ready"), f"{what} did not start; see {log}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("DRIVER "):
                self.lines.put(line[7:])
            else:
                self.log.write(line)
        self.lines.put(None)

    def answer(self, timeout_s: float) -> dict[str, Any]:
        """The next answer line."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"{self.what} gave no answer in {timeout_s} s; see {self.log.name}"
            ) from None
        assert line is not None, f"{self.what} exited (rc={self.proc.poll()}); see {self.log.name}"
        return dict(json.loads(line))

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def request(self, cmd: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
        """Send ``cmd`` and wait for its answer."""
        self.send(cmd)
        return self.answer(timeout_s)

    def close(self, *, quit_cmd: dict[str, Any] | None = None, wait_s: float = 20) -> None:
        """End the driver: send ``quit_cmd`` (else close its stdin), wait up to ``wait_s``, then
        kill it. Idempotent."""
        if self.proc.poll() is None:
            try:
                if quit_cmd is not None:
                    self.send(quit_cmd)
                elif self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(wait_s)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        if not self.log.closed:
            self.log.close()

"""Dynamo's standalone KV indexer as a process, and the three calls of its HTTP API kvtier uses.

The indexer (``python -m dynamo.indexer`` from the ``ai-dynamo-runtime`` wheel, in an
environment of its own: ``make dynamo-env`` builds ``.venv-dynamo``) subscribes to KV-event
streams in vLLM's wire format, one per registered instance, hashes each block's token ids with
its own block hashing, and answers ``POST /query`` with every instance's longest matched
prefix. kvtier uses it as a real router's index: ``kvtier bench trace --pods`` routes requests
by it, and tests/integration/events/test_events_dynamo_indexer.py checks it against lookups.

Lifecycle: ``DynamoIndexer(python, log)`` starts the process and waits for its HTTP port (up to
60 s; RuntimeError with the log's tail if it exits or never answers) -> ``register`` each
daemon's stream -> ``matched_blocks`` per request -> ``close()`` kills it. One thread.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["DynamoIndexer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DynamoIndexer:
    """See the module docstring. ``model`` and ``block_size`` (tokens per block) are the ones
    every instance is registered with and every query asks about."""

    def __init__(
        self, python: str, log: Path, *, model: str, block_size: int, timeout_s: float = 60.0
    ) -> None:
        self.port = _free_port()
        self.log, self.model, self.block_size = log, model, block_size
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")},
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Dynamo indexer exited ({self.proc.returncode}): {self._tail()}")
            try:
                self.call("GET", "/workers")
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the Dynamo indexer never answered: {self._tail()}") from None
                time.sleep(0.05)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP call; its JSON answer. OSError (urllib's) when it fails."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method=method,
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null")

    def register(self, instance: int, endpoint: str, replay_endpoint: str) -> None:
        """Follow one daemon's event stream (and its replay endpoint) as instance ``instance``."""
        self.call(
            "POST",
            "/register",
            {
                "instance_id": instance,
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "model_name": self.model,
                "block_size": self.block_size,
            },
        )

    def matched_blocks(self, token_ids: list[int]) -> dict[int, int]:
        """Each instance's longest matched prefix of ``token_ids``, in blocks (absent: none)."""
        got = self.call("POST", "/query", {"token_ids": token_ids, "model_name": self.model})
        instances = (got or {}).get("instances") or {}
        return {int(i): int(v["longest_matched"]) // self.block_size for i, v in instances.items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

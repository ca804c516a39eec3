"""docs/hashing.md from scratch, for the contract's tests: hashlib, hmac and int.to_bytes only,
never kvtier_contract (so a test holds the contract to the page, not to itself)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def ref_block_key(
    ns_digest: bytes,
    prev: bytes,
    tokens: Sequence[int],
    extra: bytes = b"",
    key: bytes | None = None,
    record: bytes = b"",
) -> bytes:
    """§2's key of one block (``record``: §7's boundary record, empty without one)."""
    msg = b"kvtier/block/v1" + ns_digest + prev + b"".join(t.to_bytes(4, "little") for t in tokens)
    msg += len(extra).to_bytes(4, "little") + extra + record
    return hmac.new(key, msg, hashlib.sha256).digest() if key else hashlib.sha256(msg).digest()


def run_fresh(code: str, golden: Path, seed: str) -> Any:
    """The JSON ``code`` prints, run by a fresh interpreter with ``PYTHONHASHSEED=seed`` and the
    client on its path, given the golden file's path as ``sys.argv[1]``."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo / "client"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(golden)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(proc.stdout)

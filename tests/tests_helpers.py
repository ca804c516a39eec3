"""Helpers shared by test modules (importable: tests/ is on sys.path through conftest)."""

from __future__ import annotations

from typing import Any

import numpy as np


def worker_keys(ns: Any, seed: int, n_blocks: int) -> list[bytes]:
    """The keys tests/integration/worker.py computes for ``seed``."""
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 150_000, 16 * n_blocks)]
    return list(ns.block_keys(tokens))

"""The secondary tier of vLLM's native offloading: ``KvtierSecondaryTier`` (a ``secondary_tiers``
entry's ``module_path``: ``kvtier.integrations.vllm``, or this package).

Importing this package has no side effects and does not import vLLM: ``KvtierSecondaryTier``
loads the vLLM adapter (``adapter``, the only module here that imports vLLM) on first access.
The rest is plain Python, tested without vLLM: ``config`` (the tier's settings, namespace and
keys), ``jobs`` (``TierJobs``: the work off the scheduler thread) and ``decisions``
(``TierDecisions``: load or recompute, per chunk).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KvtierSecondaryTier"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvtier.integrations.vllm.tier.adapter"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

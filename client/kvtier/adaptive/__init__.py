"""Load or recompute: the engine integrations' shared decision (issue 30, docs/adaptive.md).

A hit is worth loading only when its bytes arrive before the engine would have recomputed them.
This package holds the pieces every integration (vLLM connector and secondary tier, SGLang,
Transformers) uses to decide, all plain Python with no engine import and no I/O:

* ``figures``: what is measured while serving. ``LinearFit`` (exponentially forgetting least
  squares of ``y = a + b·x``), ``LoadFigures`` (each tier's end-to-end load cost, from the
  engine's own loads and the daemon's per-tier reports) and ``PrefillRate`` (the engine's
  seconds per prefilled token, from its steps).
* ``decision``: ``Decider.decide(tiers, ...)`` -> ``Decision``: how many blocks of a hit prefix to
  load under the ``always`` / ``never`` / ``adaptive`` policy, with probes that let a tier that was
  cut back show it recovered; ``DecisionStats`` counts every decision; ``worth_waiting_s``: how
  long a decided load is waited for (as long as recomputing it would take); ``cut_load_s``: the
  figure of a load given up on at that deadline.
* ``budget``: ``InterferenceBudget``: the transfer time kvtier may add to each engine step
  (a fraction of the step), loads charged before stores, stores refused (counted) when spent.
"""

from __future__ import annotations

from kvtier.adaptive.budget import BudgetStats, InterferenceBudget
from kvtier.adaptive.decision import (
    LOAD_POLICIES,
    WORTH_FLOOR_S,
    Decider,
    Decision,
    DecisionStats,
    LoadPolicy,
    cut_load_s,
    worth_waiting_s,
)
from kvtier.adaptive.figures import FixedPrefillRate, LinearFit, LoadFigures, PrefillRate

__all__ = [
    "LOAD_POLICIES",
    "BudgetStats",
    "Decider",
    "Decision",
    "DecisionStats",
    "FixedPrefillRate",
    "InterferenceBudget",
    "LinearFit",
    "LoadFigures",
    "LoadPolicy",
    "PrefillRate",
    "WORTH_FLOOR_S",
    "cut_load_s",
    "worth_waiting_s",
]

"""The interference budget: how much transfer time kvtier may add to the engine's steps.

Loads and stores share the engine's host: on a GPU the copy engines, PCIe and the CPU threads
that feed them; on a CPU build the cores the forward pass runs on. Unbounded, they stretch every
decoding request's step (measured on an H100 with vLLM's CPU offloading: decode p50 15 -> 42 ms).
The budget bounds that stretch to ``fraction`` of a step: a token bucket in seconds of transfer.

State: ``balance`` (seconds of transfer allowed now; None before the first step is measured,
when every transfer is admitted: there is no step to bound it against yet)::

    step(s):            balance = min(balance + fraction·s, burst_steps·fraction·s)
    charge_load(t):     balance -= t    (loads go first and always run: the engine was promised
                                         them; a large one leaves a debt that later steps repay)
    admit_store(t):     balance > 0 -> balance -= t, True;  else False (dropped, counted)
    settle(pred, act):  balance -= act - pred (a transfer took longer or shorter than predicted)

So over any run of steps, transfer time ≤ ``fraction`` × step time + the last admitted job, and
stores, not loads, give way. ``fraction`` None means no budget: every store is admitted (and
still counted). One owning thread, or the caller's lock (the vLLM worker's job lock).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BudgetStats:
    steps: int = 0
    step_s: float = 0.0
    load_s: float = 0.0  # transfer seconds charged to loads
    store_s: float = 0.0  # ... to admitted stores
    stores_admitted: int = 0
    stores_dropped: int = 0  # refused because the budget was spent
    bytes_dropped: int = 0


class InterferenceBudget:
    """See the module docstring."""

    def __init__(self, fraction: float | None, *, burst_steps: float = 2.0) -> None:
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"interference_budget: must be in (0, 1] or None, got {fraction}")
        if burst_steps < 1:
            raise ValueError(f"burst_steps: must be >= 1, got {burst_steps}")
        self.fraction = fraction
        self.burst_steps = burst_steps
        self.balance: float | None = None
        self.stats = BudgetStats()

    def step(self, seconds: float) -> None:
        """An engine step of ``seconds`` ran: its share of transfer time becomes available."""
        if seconds <= 0:
            return
        self.stats.steps += 1
        self.stats.step_s += seconds
        if self.fraction is not None:
            grant = self.fraction * seconds
            cap = self.burst_steps * grant
            self.balance = cap if self.balance is None else min(self.balance + grant, cap)

    def charge_load(self, seconds: float) -> None:
        self.stats.load_s += seconds
        if self.fraction is not None and self.balance is not None:
            self.balance -= seconds

    def admit_store(self, seconds: float, nbytes: int = 0) -> bool:
        """Admit a store predicted to take ``seconds``, or refuse it (counted) when spent."""
        if self.balance is not None and self.balance <= 0:
            self.stats.stores_dropped += 1
            self.stats.bytes_dropped += nbytes
            return False
        self.stats.stores_admitted += 1
        self.stats.store_s += seconds
        if self.balance is not None:
            self.balance -= seconds
        return True

    def settle(self, predicted_s: float, actual_s: float) -> None:
        """Correct a charge once the transfer's real time is known."""
        if self.balance is not None:
            self.balance -= actual_s - predicted_s

    def used_fraction(self) -> float:
        """Transfer seconds charged over step seconds, so far (0 before the first step)."""
        s = self.stats
        return (s.load_s + s.store_s) / s.step_s if s.step_s else 0.0

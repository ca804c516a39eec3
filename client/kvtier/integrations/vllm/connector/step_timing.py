"""Step timing of the vLLM worker: each step's forward seconds, for the scheduler and the budget.

``forward_start`` (when the plan is bound, again after sync loads) and ``forward_end`` (in
``wait_for_save``) bracket the step's forward; its seconds, less kvtier's own engine-thread time
in between, become a ``StepReport`` for the scheduler's load-or-recompute decision (with the
loads' ``LoadReport``s, handed over by ``take_reports``). On CUDA two events on the engine's
stream time it, read once the GPU has passed them.

The interference budget (``cfg.interference_budget``, ``kvtier.adaptive.InterferenceBudget``: the
state's ``budget``, under its ``cond``), over the steps in which a request decodes:
``forward_end`` refills it with the step's forward seconds; the step's loads were charged before
(``loads``) and the step's store jobs are admitted against it (``stores``).

Ownership and concurrency: a part of ``KvtierWorker`` (``worker``), handed the worker's
``WorkerState``; owns the open step's mark, the CUDA events still to read and the step reports.
Engine thread only; its tables, the budget and the counters under the state's ``cond``.
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.integrations.vllm.connector.plans import StepReport
from kvtier.integrations.vllm.connector.worker_state import WorkerState


class StepTiming:
    """The worker's step timing and step reports; see the module docstring."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        # the figures the scheduler's decision needs (under state.cond): each step's forward seconds
        self._forward: tuple[float, float, Any] | None = None  # (wall start, engine_s, event)
        self._pending_steps: list[tuple[int, int, bool, Any, Any]] = []  # CUDA: events to read
        self._step_reports: list[StepReport] = []

    def forward_start(self) -> None:
        """The step's forward starts now (engine thread; again after sync loads: the later
        mark wins). On CUDA an event on the engine's stream marks it too."""
        state = self.state
        event = None
        if state.layouts is not None and state.layouts[0].device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(state.layouts[0].device))
        with state.cond:
            self._forward = (time.perf_counter(), state.engine_s_total, event)

    def forward_end(self, step: int, tokens: int, decoding: bool) -> None:
        """The step's forward is over (engine thread, in ``wait_for_save`` before the stores
        are submitted): its seconds, less kvtier's own engine-thread time in between, are the
        step's figure and, when a request decodes in it, refill the interference budget. On
        CUDA the time between the two events is read once the GPU has passed them."""
        state = self.state
        with state.cond:
            mark, self._forward = self._forward, None
            if mark is None:
                return
            t0, engine0, start_event = mark
            if start_event is None:
                seconds = time.perf_counter() - t0 - (state.engine_s_total - engine0)
                self._stepped(step, tokens, decoding, seconds)
                return
        import torch

        end_event = torch.cuda.Event(enable_timing=True)
        assert state.layouts is not None
        end_event.record(torch.cuda.current_stream(state.layouts[0].device))
        with state.cond:
            self._pending_steps.append((step, tokens, decoding, start_event, end_event))
            self._read_events()

    def _read_events(self) -> None:
        """CUDA step timings whose events the GPU has passed (caller holds the state's cond)."""
        while self._pending_steps and self._pending_steps[0][4].query():
            step, tokens, decoding, start, end = self._pending_steps.pop(0)
            self._stepped(step, tokens, decoding, start.elapsed_time(end) / 1000)

    def _stepped(self, step: int, tokens: int, decoding: bool, seconds: float) -> None:
        if seconds <= 0:
            return
        self._step_reports.append(StepReport(step, tokens, seconds))
        if decoding:
            self.state.budget.step(seconds)
            self.state.stats.budget_steps += 1
            self.state.stats.budget_step_seconds += seconds

    def take_reports(self) -> list[StepReport]:
        """The steps measured since the last call (caller holds the state's cond)."""
        if self._pending_steps:
            self._read_events()
        steps, self._step_reports = self._step_reports, []
        return steps

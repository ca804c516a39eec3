"""Step timing of the vLLM worker: each step's forward seconds, for the scheduler and the budget.

``forward_start`` (when the plan is bound, again after sync loads) and ``forward_end`` (in
``wait_for_save``) bracket the step's forward; its seconds, less kvtier's own engine-thread time
in between, become a ``StepReport`` for the scheduler's load-or-recompute decision (with the
loads' ``LoadReport``s, handed over by ``take_reports``). On CUDA two events on the engine's
stream time it, read once the GPU has passed them.

The interference budget (``cfg.interference_budget``, ``kvtier.adaptive.InterferenceBudget``,
under ``_cond``), over the steps in which a request decodes: ``forward_end`` refills it with the
step's forward seconds; the step's loads were charged before (``worker_load``) and the step's
store jobs are admitted against it (``worker_store``).

Ownership and concurrency: a mixin of ``KvtierWorker`` (``worker.py``) over its shared state
(``worker_state``); engine thread only, the reports and counters under ``_cond``.
"""

from __future__ import annotations

import time

from kvtier.adaptive import InterferenceBudget
from kvtier.integrations.vllm.plans import LoadReport, StepReport
from kvtier.integrations.vllm.worker_state import WorkerState


class StepTiming(WorkerState):
    """The worker's step timing and reports; see the module docstring."""

    def _init_step_timing(self, interference_budget: float | None) -> None:
        """The budget and the step figures, empty (``KvtierWorker.__init__``)."""
        # The interference budget and the figures the scheduler's decision needs (under _cond):
        # each step's forward seconds, each load's bytes by tier and seconds.
        self.budget = InterferenceBudget(interference_budget)
        self._store_s_per_byte = None  # measured stores (moving average)
        self._engine_s_total = 0.0  # engine-thread seconds in kvtier, never reset
        self._forward = None  # (wall start, engine_s, event)
        self._pending_steps = []  # CUDA: events to read
        self._step_reports = []
        self._load_reports = []
        self._warm_loads = set()  # load paths (engine thread or not) used once

    def forward_start(self) -> None:
        """The step's forward starts now (engine thread; again after sync loads: the later
        mark wins). On CUDA an event on the engine's stream marks it too."""
        event = None
        if self._layouts is not None and self._layouts[0].device.type == "cuda":
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self._layouts[0].device))
        with self._cond:
            self._forward = (time.perf_counter(), self._engine_s_total, event)

    def forward_end(self, step: int, tokens: int, decoding: bool) -> None:
        """The step's forward is over (engine thread, in ``wait_for_save`` before the stores
        are submitted): its seconds, less kvtier's own engine-thread time in between, are the
        step's figure and, when a request decodes in it, refill the interference budget. On
        CUDA the time between the two events is read once the GPU has passed them."""
        with self._cond:
            mark, self._forward = self._forward, None
            if mark is None:
                return
            t0, engine0, start_event = mark
            if start_event is None:
                seconds = time.perf_counter() - t0 - (self._engine_s_total - engine0)
                self._stepped(step, tokens, decoding, seconds)
                return
        import torch

        end_event = torch.cuda.Event(enable_timing=True)
        assert self._layouts is not None
        end_event.record(torch.cuda.current_stream(self._layouts[0].device))
        with self._cond:
            self._pending_steps.append((step, tokens, decoding, start_event, end_event))
            self._read_events()

    def _read_events(self) -> None:
        """CUDA step timings whose events the GPU has passed (caller holds _cond)."""
        while self._pending_steps and self._pending_steps[0][4].query():
            step, tokens, decoding, start, end = self._pending_steps.pop(0)
            self._stepped(step, tokens, decoding, start.elapsed_time(end) / 1000)

    def _stepped(self, step: int, tokens: int, decoding: bool, seconds: float) -> None:
        if seconds <= 0:
            return
        self._step_reports.append(StepReport(step, tokens, seconds))
        if decoding:
            self.budget.step(seconds)
            self._stats.budget_steps += 1
            self._stats.budget_step_seconds += seconds

    def take_reports(self) -> tuple[list[StepReport], list[LoadReport]]:
        """The steps and loads measured since the last call, for the scheduler's decision."""
        with self._cond:
            if self._pending_steps:
                self._read_events()
            steps, self._step_reports = self._step_reports, []
            loads, self._load_reports = self._load_reports, []
        return steps, loads

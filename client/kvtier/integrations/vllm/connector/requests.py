"""``RequestState``: one request's record on the scheduler side of the connector.

The planner (``planner.Planner``) creates one per request vLLM admits and keeps it until the
request finishes; its parts read and write the fields they own: ``Lookups`` (``lookups``) the
lookup, its answer and its pins, the planner the answer to vLLM and the load plan,
``LoadDecisions`` (``load_decisions``) the decision, ``StorePlanning`` (``store_planning``) the
key chain beyond the lookup's and the store progress.

Concurrency: scheduler thread only, no locks (the lookup thread never sees a record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.adaptive import Decision
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome
from kvtier.integrations.vllm.connector.plans import RequestInfo

__all__ = ["RequestState"]


@dataclass
class RequestState:
    """One request as the planner knows it: its lookup (generation, answer, pins), the answer
    given to vLLM, its blocks, its planned load, its store progress and its decision."""

    info: RequestInfo
    gen: int = 0  # the lookup's generation (a re-lookup after preemption starts the next one)
    submitted_at: float = 0.0  # when the lookup was submitted (the planner's clock)
    outcome: LookupOutcome | None = None  # the lookup's answer, once taken
    timed_out: bool = False  # answered a miss for good (``lookup_timeout_s``)
    matched: tuple[int, int] | None = None  # (num_local_tokens, answer) once answered
    block_ids: list[int] = field(default_factory=list)  # the engine blocks vLLM gave it
    pending_load: tuple[int, int] | None = None  # (first block, count)
    stored_upto: int = 0  # blocks stored (or planned to be) from the start
    keys: list[list[bytes]] | None = None  # the key chain so far, per slice (prompt, then output)
    jobs: list[int] = field(default_factory=list)  # its store jobs (fenced on preemption)
    pins_released: bool = False
    relookup: bool = False  # look up afresh when vLLM asks again (after preemption)
    loading: bool = False  # an async load is in flight (handed to the workers, not finished)
    load_done: bool = False  # its async load finished: vLLM asks again only after a failure
    decision: Decision | None = None  # the load-or-recompute decision behind ``matched``
    decided_at: tuple[int, int] = (0, 0)  # (first hit block, hit blocks) it was made for

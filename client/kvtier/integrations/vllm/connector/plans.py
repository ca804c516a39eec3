"""The plain data the vLLM connector's scheduler side and workers exchange.

What the adapter (``adapter``) hands the planner (``RequestInfo``, ``StepInput`` of
``ScheduledRequest``s), what the planner hands the workers each step (``StepPlan`` of
``LoadJob``s and ``StoreJob``s), what the workers report back (``StepReport``, ``LoadReport``),
the stores told to vLLM's KV-event publisher (``StoredBlocks``) and the planner's counters
(``PlannerStats``). ``planner`` re-exports every name.

Ownership and concurrency: values only (frozen where they cross threads or processes); a plan
is built on the scheduler thread and read by the workers after vLLM serialises it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.connector.config import Variant


@dataclass(frozen=True)
class RequestInfo:
    """What the planner needs of a request. ``variant`` None = not cacheable (never looked up
    nor stored, e.g. an adapter without a known revision or a prompt given as embeddings).
    ``token_ids``: the request's live token ids (prompt, then every output token as vLLM appends
    it; read at each step, never written), or None to store prompt blocks only."""

    req_id: str
    prompt_token_ids: Sequence[int]
    variant: Variant | None
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[Any] | None = None
    """vLLM's own block hashes of the request (its live ``Request.block_hashes``, one per full
    block as vLLM computes them; read, never written), for the KV events vLLM publishes of what
    kvtier stores (``StorePlanning.take_stored``). None: no such events."""
    lora_name: str | None = None


@dataclass(frozen=True)
class StoredBlocks:
    """Blocks of one store job in vLLM's own terms, for a ``BlockStored`` of vLLM's publisher:
    their vLLM block hashes (a chain, the first one's parent ``parent``), tokens and adapter."""

    block_hashes: list[Any]
    parent: Any | None
    token_ids: list[int]
    lora_name: str | None


@dataclass(frozen=True)
class LoadJob:
    """Load ``keys[slice][i]`` into engine block ``block_ids[i]`` before this step's forward.
    ``tiers[i]``: where the lookup found block ``i`` ("host", "nvme", ...; empty when unknown),
    ``predicted_s``: the decision's predicted load time (None: no figures yet); ``recompute_s``:
    its predicted recompute time of the same tokens (None: unknown; a sync load waits for its
    blocks no longer than that, ``kvtier.adaptive.worth_waiting_s``). ``shared``: the first
    ``shared`` blocks load from ``shared_variant``'s namespace (a group's published prefix),
    the rest from ``variant``'s."""

    req_id: str
    variant: Variant
    keys: list[list[bytes]]
    block_ids: list[int]
    tiers: list[str] = field(default_factory=list)
    predicted_s: float | None = None
    recompute_s: float | None = None
    shared: int = 0
    shared_variant: Variant | None = None

    def parts(self, rank: int) -> list[tuple[Variant, list[bytes], list[int]]]:
        """Slice ``rank``'s keys and engine blocks per namespace variant, in order."""
        keys, ids, cut = self.keys[rank], self.block_ids, self.shared
        if not cut or self.shared_variant is None:
            return [(self.variant, keys, ids)]
        return [(self.shared_variant, keys[:cut], ids[:cut]), (self.variant, keys[cut:], ids[cut:])]


@dataclass(frozen=True)
class StoreJob:
    """Store engine block ``block_ids[i]`` under ``keys[slice][i]`` after this step's forward.
    With ``event_token_ids``: the blocks' token ids, and per slice the key before ``keys[s][0]``
    (None at a chain's start), which the daemon publishes in its KV events (docs/events.md)."""

    job_id: int
    req_id: str
    variant: Variant
    keys: list[list[bytes]]
    block_ids: list[int]
    token_ids: list[int] | None = None
    parents: list[bytes | None] | None = None


@dataclass
class StepPlan:
    """What the workers do in one step: fences first, then loads, forward, stores. ``step``:
    the plan's number; ``tokens``: tokens the step computes (the workers report the step's
    forward seconds with both: the engine's prefill rate); ``decoding``: a request in the step
    is decoding (its stores are held to the interference budget)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    step: int = 0
    tokens: int = 0
    decoding: bool = False

    def empty(self) -> bool:
        return not (self.loads or self.stores or self.flush)


@dataclass(frozen=True)
class ScheduledRequest:
    """One scheduled request of a step. ``block_ids`` is the whole table when ``replace`` (new or
    resumed requests), else the blocks added this step (or None)."""

    req_id: str
    block_ids: Sequence[int] | None
    replace: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class StepInput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass
class PlannerStats:
    lookups: int = 0
    lookup_timeouts: int = 0
    lookup_waits: int = 0  # lookups answered while the scheduler thread waited (same step)
    hit_blocks: int = 0
    host_hit_blocks: int = 0
    nvme_hit_blocks: int = 0
    load_blocks: int = 0
    store_blocks: int = 0
    store_generated_blocks: int = 0
    store_shared_skipped_blocks: int = 0  # a group's blocks not stored: this tenant only reads it
    shared_hit_blocks: int = 0  # of hit_blocks, those of a group's published prefix
    flushes: int = 0
    # the load-or-recompute decision (the Decider's counters, exported unprefixed)
    decision_tokens_loaded: int = 0
    decision_tokens_recomputed_slower: int = 0
    decision_tokens_recomputed_budget: int = 0
    decision_tokens_recomputed_policy: int = 0
    decision_probes: int = 0
    load_seconds_predicted: float = 0.0
    load_seconds_actual: float = 0.0


@dataclass(frozen=True)
class StepReport:
    """One engine step as the workers measured it: the plan's ``step``, its ``tokens`` and the
    forward's seconds (kvtier's own engine-thread time taken out)."""

    step: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class LoadReport:
    """One load the workers ran: the requests it served, its bytes by tier (one tp slice) and
    its seconds end to end."""

    req_ids: tuple[str, ...]
    bytes_by_tier: dict[str, int]
    seconds: float

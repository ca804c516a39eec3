"""The vLLM planner's store planning: which computed blocks each step stores, under which keys.

Stores: every full block once it is computed and its token ids are known, except blocks the
lookup found in the daemon: the prompt's, and (``store_generated``) the generated tokens' as
decode completes them, so the next turn of a conversation, which resends them as prompt, loads
them. A generated block's keys chain on from the prompt's over the request's token ids
(``LookupOutcome.chain``, hashed on the scheduler thread: one SHA-256 per block and slice),
exactly as the next turn's prompt hashes them. The last sampled token's KV is never computed, so
a block it completes is not stored. Each store job reads engine blocks on a worker thread
after the step; when vLLM hands one of those block ids to a request again (re-allocation,
also after preemption or finish), the next plan lists the job in ``flush`` and the worker
waits for it before the forward pass that could overwrite the block (the fence).

With ``engine_events`` (vLLM's own KV events on), each store job is also kept in vLLM's terms
(its block hashes, tokens, adapter: ``StoredBlocks``) until the scheduler takes them for its
publisher (``take_stored``; the adapter's ``take_events``), so a router that follows the engine
pods sees what kvtier holds for them.

Ownership and concurrency: a part of ``planner.Planner``, handed the planner's counters; owns the
store settings, the job numbers, the fence map (engine block id -> the last store job reading
it) and the records for vLLM's events, and writes the key chains and store progress of the
request records it is given. Scheduler thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvtier.integrations.vllm.connector.config import Variant
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome
from kvtier.integrations.vllm.connector.plans import PlannerStats, StepPlan, StoredBlocks, StoreJob
from kvtier.integrations.vllm.connector.requests import RequestState

MAX_STORED_RECORDS = 4096
"""Store jobs kept for vLLM's KV-event publisher between two scheduler steps, at most."""


class StorePlanning:
    """The planner's store jobs and fence map; see the module docstring."""

    def __init__(
        self,
        stats: PlannerStats,
        block_size: int,
        enabled: bool,
        store_generated: bool,
        event_token_ids: Callable[[], bool],
    ) -> None:
        """``stats``: the planner's counters; the rest the planner's parameters (``enabled``:
        its ``store``; ``event_token_ids``: asked at each store job, whether it carries its
        token ids)."""
        self.stats = stats
        self.block_size = block_size
        self.enabled = enabled
        self.store_generated = store_generated
        self.event_token_ids = event_token_ids
        self._fence: dict[int, int] = {}  # engine block id -> last store job reading it
        self._next_job = 1
        self.engine_events = False
        """vLLM's KV events are on: keep each store job in vLLM's terms (set by the adapter)."""
        self._stored: deque[StoredBlocks] = deque(maxlen=MAX_STORED_RECORDS)

    def fence_blocks(self, block_ids: Sequence[int], flush: set[int]) -> None:
        """Store jobs still reading ``block_ids`` (handed to a request again) into ``flush``."""
        for bid in block_ids:
            job = self._fence.pop(bid, None)
            if job is not None:
                flush.add(job)

    def tokens(self, st: RequestState) -> Sequence[int]:
        """The token ids whose full blocks are stored: prompt and output, or the prompt alone."""
        if self.store_generated and st.info.token_ids is not None:
            return st.info.token_ids
        return st.info.prompt_token_ids

    def _chain(self, st: RequestState, outcome: LookupOutcome, tokens: Sequence[int], upto: int) -> int:
        """Extend ``st.keys`` to ``upto`` blocks of ``tokens`` (each slice's chain goes on from
        its last key); the number of blocks that have keys."""
        keys = st.keys
        if not keys:
            return 0
        have = len(keys[0])
        if upto > have and outcome.chain is not None:
            block = tokens[have * self.block_size : upto * self.block_size]
            for r, chain in enumerate(keys):
                chain.extend(outcome.chain(r, chain[-1] if chain else None, block, have * self.block_size))
            have = len(keys[0])
        return have

    def plan(
        self, st: RequestState, outcome: LookupOutcome | None, computed_tokens: int, plan: StepPlan
    ) -> None:
        """The store job of ``st``'s blocks that ``computed_tokens`` completes, if any, into
        ``plan`` (``outcome``: its lookup's answer, None while out)."""
        if not self.enabled or st.info.variant is None:
            return
        if outcome is None or not st.keys:
            return  # keys not hashed yet: planned on a later step
        tokens = self.tokens(st)
        # Full blocks whose KV this step computes and whose token ids are known (with async
        # scheduling or spec decode the ids of a computed slot may come a step later).
        full = min(len(tokens), computed_tokens) // self.block_size
        full = min(full, len(st.block_ids))
        start = max(st.stored_upto, outcome.hits)
        if full <= start:
            return
        full = min(full, self._chain(st, outcome, tokens, full))
        if full <= start:
            return
        scope = outcome.shared
        if scope is not None and start < scope.blocks:  # a group's published prefix first
            cut = min(full, scope.blocks)
            if scope.publisher:
                plan.stores.append(self._job(st, tokens, start, cut, scope.variant))
            else:  # a member only reads the group's blocks: a publisher stores them
                self.stats.store_shared_skipped_blocks += cut - start
                st.stored_upto = cut
            start = cut
            if full <= start:
                return
        plan.stores.append(self._job(st, tokens, start, full, st.info.variant))

    def _job(
        self, st: RequestState, tokens: Sequence[int], start: int, full: int, variant: Variant
    ) -> StoreJob:
        """Blocks ``start:full`` of ``st`` as the next store job into ``variant``'s namespace:
        numbered, in the fence map, counted, and ``st``'s store progress moved on to ``full``."""
        assert st.keys is not None
        events = self.event_token_ids()
        job = StoreJob(
            self._next_job,
            st.info.req_id,
            variant,
            [k[start:full] for k in st.keys],
            st.block_ids[start:full],
            list(tokens[start * self.block_size : full * self.block_size]) if events else None,
            [k[start - 1] if start else None for k in st.keys] if events else None,
        )
        self._next_job += 1
        for bid in job.block_ids:
            self._fence[bid] = job.job_id
        st.jobs.append(job.job_id)
        st.stored_upto = full
        self.stats.store_blocks += full - start
        self._tell(st, tokens, start, full)
        if full > len(st.info.prompt_token_ids) // self.block_size:
            self.stats.store_generated_blocks += full - max(
                start, len(st.info.prompt_token_ids) // self.block_size
            )
        return job

    def _tell(self, st: RequestState, tokens: Sequence[int], start: int, full: int) -> None:
        """With ``engine_events``: blocks ``start:full`` as vLLM names them, for its publisher."""
        hashes = st.info.block_hashes
        if not self.engine_events or hashes is None:
            return
        full = min(full, len(hashes))  # (vLLM hashes a block once its tokens are in: not behind
        if full <= start:  # but for a token sampled and not appended yet; those go untold)
            return
        bs = self.block_size
        self._stored.append(
            StoredBlocks(
                list(hashes[start:full]),
                hashes[start - 1] if start else None,
                list(tokens[start * bs : full * bs]),
                st.info.lora_name,
            )
        )

    def take_stored(self) -> list[StoredBlocks]:
        """The store jobs planned since the last call, in vLLM's terms (``engine_events``; at
        most ``MAX_STORED_RECORDS`` kept: a scheduler that never asks loses the oldest)."""
        out = list(self._stored)
        self._stored.clear()
        return out

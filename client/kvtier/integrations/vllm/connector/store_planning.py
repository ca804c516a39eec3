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

Ownership and concurrency: a part of ``planner.Planner``, handed the planner's counters; owns the
store settings, the job numbers and the fence map (engine block id -> the last store job reading
it), and writes the key chains and store progress of the request records it is given. Scheduler
thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome
from kvtier.integrations.vllm.connector.plans import PlannerStats, StepPlan, StoreJob
from kvtier.integrations.vllm.connector.requests import RequestState


class StorePlanning:
    """The planner's store jobs and fence map; see the module docstring."""

    def __init__(
        self,
        stats: PlannerStats,
        block_size: int,
        enabled: bool,
        store_generated: bool,
        event_token_ids: bool,
    ) -> None:
        """``stats``: the planner's counters; the rest the planner's parameters (``enabled``:
        its ``store``)."""
        self.stats = stats
        self.block_size = block_size
        self.enabled = enabled
        self.store_generated = store_generated
        self.event_token_ids = event_token_ids
        self._fence: dict[int, int] = {}  # engine block id -> last store job reading it
        self._next_job = 1

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
                chain.extend(outcome.chain(r, chain[-1] if chain else None, block))
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
        plan.stores.append(self._job(st, tokens, start, full))

    def _job(self, st: RequestState, tokens: Sequence[int], start: int, full: int) -> StoreJob:
        """Blocks ``start:full`` of ``st`` as the next store job: numbered, in the fence map,
        counted, and ``st``'s store progress moved on to ``full``."""
        assert st.keys is not None and st.info.variant is not None
        events = self.event_token_ids
        job = StoreJob(
            self._next_job,
            st.info.req_id,
            st.info.variant,
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
        if full > len(st.info.prompt_token_ids) // self.block_size:
            self.stats.store_generated_blocks += full - max(
                start, len(st.info.prompt_token_ids) // self.block_size
            )
        return job

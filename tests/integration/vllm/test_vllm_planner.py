"""The vLLM connector's planner and worker without vLLM, against a real daemon process.

The planner is driven the way vLLM's scheduler drives the connector (on_new_request ->
num_new_matched -> after_alloc -> build per step -> request_finished); the worker moves real CPU
paged-KV tensors (vLLM's LBHNC layout) through the daemon.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from conftest import DaemonProcess
from tests_helpers import ManualClock, worker_identity

import kvtier
from kvtier.integrations.vllm.connector.backend import DaemonBackend
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, Variant
from kvtier.integrations.vllm.connector.lookup_thread import LookupOutcome, Pin
from kvtier.integrations.vllm.connector.planner import (
    Planner,
    RequestInfo,
    ScheduledRequest,
    StepInput,
    StepPlan,
    StoreJob,
)
from kvtier.integrations.vllm.connector.worker import KvtierWorker

BS = 16  # tokens per block
L, H, D = 2, 2, 64
NUM_BLOCKS = 16
IDENTITY = worker_identity("test/vllm")  # BS, L, H, D as above


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 3 for i in range(n_tokens)]


def cfg_for(d: DaemonProcess, **kw: Any) -> ConnectorConfig:
    return ConnectorConfig(address=d.unix, **kw)


class SlowBackend:
    """The real daemon backend, held back until ``go`` is set (a slow daemon)."""

    def __init__(self, inner: DaemonBackend) -> None:
        self.inner = inner
        self.go = threading.Event()

    def lookup(self, variant: Variant, token_ids: Sequence[int]) -> LookupOutcome:
        self.go.wait(10)
        return self.inner.lookup(variant, token_ids)

    def release(self, pins: Sequence[Pin]) -> None:
        self.inner.release(pins)

    def close(self) -> None:
        self.go.set()
        self.inner.close()


def make_planner(
    d: DaemonProcess, *, timeout_s: float = 5.0, slow: bool = False, **kw: Any
) -> tuple[Planner, Any]:
    backend: Any = DaemonBackend(IDENTITY, cfg_for(d))
    if slow:
        backend = SlowBackend(backend)
    return Planner(block_size=BS, backend=backend, lookup_timeout_s=timeout_s, **kw), backend


def matched(
    p: Planner, req_id: str, local: int, n_tokens: int, wait_s: float = 5.0
) -> tuple[int | None, bool]:
    deadline = time.monotonic() + wait_s
    while True:
        got = p.num_new_matched(req_id, local, n_tokens)
        if got[0] is not None or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def seed_blocks(
    d: DaemonProcess, tokens: list[int], n_blocks: int, variant: Variant = BASE, fill: int = 7
) -> list[bytes]:
    """Store the first n_blocks of ``tokens`` as the engine would (same namespace and keys)."""
    with kvtier.Client.connect(d.unix) as c:
        h = c.register(IDENTITY.namespace(variant))
        keys = h.block_keys(tokens)[:n_blocks]
        r = h.put(keys, [bytes([fill + i]) * h.block_bytes for i in range(n_blocks)])
        assert r.stored == n_blocks
        return keys


def pinned(d: DaemonProcess) -> int:
    with kvtier.Client.connect(d.unix) as c:
        return int(c.stats()["pinned_blocks"])


def wait_pinned(d: DaemonProcess, want: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        got = pinned(d)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def schedule(
    req_id: str, block_ids: Sequence[int] | None, computed: int, scheduled: int, *, replace: bool = True
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id, list(block_ids) if block_ids is not None else None, replace, computed, scheduled
    )


@pytest.fixture
def planner_daemon(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    yield daemon


def test_miss_stores_every_full_prompt_block(daemon: DaemonProcess) -> None:
    p, _ = make_planner(daemon)
    toks = prompt(3 * BS + 5)
    p.on_new_request(RequestInfo("a", toks, BASE))
    assert matched(p, "a", 0, len(toks)) == (0, False)
    p.after_alloc("a", [4, 5, 6, 7], 0)
    plan = p.build(StepInput([schedule("a", [4, 5, 6, 7], 0, len(toks))]))
    assert not plan.loads and not plan.flush
    assert len(plan.stores) == 1 and plan.stores[0].block_ids == [4, 5, 6]
    assert plan.stores[0].keys[0] == IDENTITY.namespace().block_keys(toks)
    # the next step (decode) plans nothing more: only prompt blocks are stored, each once
    plan = p.build(StepInput([schedule("a", None, len(toks), 1, replace=False)]))
    assert plan.empty()
    p.close()


def test_chunked_prefill_stores_blocks_as_they_complete(daemon: DaemonProcess) -> None:
    p, _ = make_planner(daemon)
    toks = prompt(4 * BS)
    p.on_new_request(RequestInfo("a", toks, BASE))
    assert matched(p, "a", 0, len(toks)) == (0, False)
    p.after_alloc("a", [1, 2], 0)
    plan = p.build(StepInput([schedule("a", [1, 2], 0, BS + 3)]))  # 1 full block computed
    assert [s.block_ids for s in plan.stores] == [[1]]
    plan = p.build(StepInput([schedule("a", [3, 4], BS + 3, 3 * BS - 3, replace=False)]))
    assert [s.block_ids for s in plan.stores] == [[2, 3, 4]]
    p.close()


def test_partial_hit_loads_the_prefix_and_stores_only_the_rest(daemon: DaemonProcess) -> None:
    toks = prompt(4 * BS + 3)
    keys = seed_blocks(daemon, toks, 2)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("b", toks, BASE))
    assert matched(p, "b", 0, len(toks)) == (2 * BS, False)
    assert matched(p, "b", 0, len(toks)) == (2 * BS, False)  # idempotent
    assert p.stats.hit_blocks == 2 and p.stats.host_hit_blocks == 2
    assert p.hit_sources("b", 2 * BS) == {"host": 2 * BS}
    p.after_alloc("b", [9, 8, 7, 6, 5], 2 * BS)
    plan = p.build(StepInput([schedule("b", [9, 8, 7, 6, 5], 2 * BS, len(toks) - 2 * BS)]))
    assert len(plan.loads) == 1
    assert plan.loads[0].block_ids == [9, 8] and plan.loads[0].keys[0] == keys
    assert [s.block_ids for s in plan.stores] == [[7, 6]]  # blocks 2, 3; not the loaded ones
    p.close()


def test_local_prefix_hit_loads_only_beyond_it(daemon: DaemonProcess) -> None:
    toks = prompt(5 * BS)
    seed_blocks(daemon, toks, 4)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("c", toks, BASE))
    assert matched(p, "c", BS, len(toks)) == (3 * BS, False)
    p.after_alloc("c", [3, 4, 5, 6, 7], 3 * BS)
    plan = p.build(StepInput([schedule("c", [3, 4, 5, 6, 7], 4 * BS, BS)]))
    assert plan.loads[0].block_ids == [4, 5, 6]
    assert plan.loads[0].keys[0] == IDENTITY.namespace().block_keys(toks)[1:4]
    p.close()


def test_full_prompt_hit_leaves_the_last_block_to_compute(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS)
    seed_blocks(daemon, toks, 3)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("d", toks, BASE))
    # (48 - 1) // 16 = 2 blocks: a synchronous load never claims the whole prompt
    assert matched(p, "d", 0, len(toks)) == (2 * BS, False)
    p.close()


def test_deferred_lookup_answers_none_then_the_hit(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 2)
    p, backend = make_planner(daemon, slow=True)
    p.on_new_request(RequestInfo("e", toks, BASE))
    for _ in range(3):
        assert p.num_new_matched("e", 0, len(toks)) == (None, False)
    backend.go.set()
    assert matched(p, "e", 0, len(toks)) == (2 * BS, False)
    p.close()


def warmed(p: Planner) -> Planner:
    """The lookup thread has opened its session (a fresh engine's first task)."""
    deadline = time.monotonic() + 5
    while p.pending_lookups() and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def test_a_lookup_is_answered_in_the_step_it_is_asked(daemon: DaemonProcess) -> None:
    """The scheduler thread waits (bounded) for the lookup thread: a new request's miss or hit
    is known at its first ``num_new_matched``, so vLLM admits it in this step, not the next."""
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 2)
    p, _ = make_planner(daemon, lookup_wait_s=1.0)  # generous: a loaded CI machine
    warmed(p)
    p.on_new_request(RequestInfo("hit", toks, BASE))
    assert p.num_new_matched("hit", 0, len(toks)) == (2 * BS, False)
    assert wait_pinned(daemon, 2) == 2  # a pinned lookup, as without the wait
    p.on_new_request(RequestInfo("miss", prompt(2 * BS, seed=5), BASE))
    assert p.num_new_matched("miss", 0, 2 * BS) == (0, False)
    assert p.stats.lookup_waits == 2
    # its keys came with the answer: the prompt's blocks are stored in this very step
    p.after_alloc("miss", [3, 4], 0)
    plan = p.build(StepInput([schedule("miss", [3, 4], 0, 2 * BS)]))
    assert [s.block_ids for s in plan.stores] == [[3, 4]]
    p.close()


def test_a_tensor_parallel_engine_looks_every_slice_up_at_once(daemon: DaemonProcess) -> None:
    """TP 2: rank 0 holds 3 blocks of the prompt, rank 1 holds 2: the hit is 2 blocks (what
    every slice holds), from one LookupSlices; the load names both slices' keys."""
    ident = dataclasses.replace(IDENTITY, tp_size=2)
    toks = prompt(4 * BS + 1)
    with kvtier.Client.connect(daemon.unix) as c:
        for rank, n in ((0, 3), (1, 2)):
            h = c.register(ident.namespace(BASE, rank))
            keys = h.block_keys(toks)[:n]
            assert h.put(keys, [bytes([rank + 1]) * h.block_bytes] * n).stored == n
    backend = DaemonBackend(ident, cfg_for(daemon))
    p = warmed(Planner(block_size=BS, backend=backend, lookup_timeout_s=5.0, lookup_wait_s=1.0))
    p.on_new_request(RequestInfo("tp", toks, BASE))
    assert p.num_new_matched("tp", 0, len(toks)) == (2 * BS, False)
    assert wait_pinned(daemon, 3 + 2) == 5  # rank 0's 3 blocks, rank 1's 2 (keys cut at 3)
    p.after_alloc("tp", [5, 6, 7, 8, 9], 2 * BS)
    plan = p.build(StepInput([schedule("tp", [5, 6, 7, 8, 9], 2 * BS, 2 * BS + 1)]))
    assert plan.loads[0].block_ids == [5, 6]
    assert plan.loads[0].keys == [ident.namespace(BASE, r).block_keys(toks)[:2] for r in (0, 1)]
    p.close()
    assert wait_pinned(daemon, 0) == 0


def test_the_lookup_wait_is_a_budget_per_step(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    p, backend = make_planner(daemon, slow=True, lookup_wait_s=0.2)
    warmed(p)
    p.on_new_request(RequestInfo("a", toks, BASE))
    p.on_new_request(RequestInfo("b", prompt(3 * BS + 1, seed=3), BASE))
    t0 = time.perf_counter()
    assert p.num_new_matched("a", 0, len(toks)) == (None, False)
    waited_a = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert p.num_new_matched("b", 0, len(toks)) == (None, False)
    waited_b = time.perf_counter() - t0
    assert waited_a >= 0.19 and waited_b < waited_a / 2  # a's wait spent the step's budget
    p.build(StepInput())  # the next step: a budget again, and the answer comes within it
    threading.Timer(0.05, backend.go.set).start()
    assert p.num_new_matched("a", 0, len(toks)) == (0, False)
    assert p.stats.lookup_waits == 1
    p.close()


def test_no_lookup_wait_answers_on_a_later_step(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    p, _ = make_planner(daemon, lookup_wait_s=0.0)
    warmed(p)
    p.on_new_request(RequestInfo("a", toks, BASE))
    assert p.num_new_matched("a", 0, len(toks)) == (None, False)
    assert matched(p, "a", 0, len(toks)) == (0, False)
    assert p.stats.lookup_waits == 0
    p.close()


def test_lookup_timeout_is_a_miss_for_good_and_late_pins_are_released(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 3)
    clock = ManualClock()
    p, backend = make_planner(daemon, timeout_s=0.05, slow=True, clock=clock)
    p.on_new_request(RequestInfo("f", toks, BASE))
    assert p.num_new_matched("f", 0, len(toks)) == (None, False)
    clock.advance(0.1)  # past the 50 ms lookup timeout, the lookup still held by the backend
    assert p.num_new_matched("f", 0, len(toks)) == (0, False)
    assert p.stats.lookup_timeouts == 1
    backend.go.set()
    deadline = time.monotonic() + 5
    while p.pending_lookups() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.num_new_matched("f", 0, len(toks)) == (0, False)  # still the same answer
    p.after_alloc("f", [1, 2, 3, 4], 0)
    p.build(StepInput([schedule("f", [1, 2, 3, 4], 0, len(toks))]))
    assert wait_pinned(daemon, 0) == 0
    p.close()


def test_hits_stay_pinned_until_the_load_has_run(daemon: DaemonProcess) -> None:
    toks = prompt(4 * BS + 1)
    seed_blocks(daemon, toks, 3)
    p, _ = make_planner(daemon, pin_release_steps=2)
    p.on_new_request(RequestInfo("g", toks, BASE))
    assert matched(p, "g", 0, len(toks)) == (3 * BS, False)
    assert wait_pinned(daemon, 3) == 3
    p.after_alloc("g", [0, 1, 2, 3, 4], 3 * BS)
    p.build(StepInput([schedule("g", [0, 1, 2, 3, 4], 3 * BS, BS + 1)]))
    assert wait_pinned(daemon, 3, timeout_s=0.2) == 3  # the workers load during this step
    p.build(StepInput([schedule("g", None, 4 * BS + 1, 1, replace=False)]))
    assert wait_pinned(daemon, 3, timeout_s=0.2) == 3  # still within pin_release_steps
    p.build(StepInput([schedule("g", None, 4 * BS + 2, 1, replace=False)]))
    assert wait_pinned(daemon, 0) == 0
    p.close()


def test_pins_released_when_vllm_does_not_load(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 2)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("h", toks, BASE))
    assert matched(p, "h", 0, len(toks)) == (2 * BS, False)
    assert wait_pinned(daemon, 2) == 2
    p.after_alloc("h", [0, 1, 2, 3], 0)  # vLLM chose not to load (e.g. a longer local hit)
    assert wait_pinned(daemon, 0) == 0
    with kvtier.Client.connect(daemon.unix) as c:
        total = c.stats()["total"]
    assert total["loads"] == 0 and total["bytes_out_shm"] == 0  # a released pin moved nothing
    p.close()


def test_reallocated_block_fences_the_store_reading_it(daemon: DaemonProcess) -> None:
    p, _ = make_planner(daemon)
    a, b = prompt(2 * BS + 1, 1), prompt(2 * BS + 1, 2)
    for rid, toks in (("a", a), ("b", b)):
        p.on_new_request(RequestInfo(rid, toks, BASE))
        assert matched(p, rid, 0, len(toks)) == (0, False)
    p.after_alloc("a", [10, 11, 12], 0)
    plan = p.build(StepInput([schedule("a", [10, 11, 12], 0, len(a))]))
    job = plan.stores[0].job_id
    p.request_finished("a")  # finished while its store is still in flight
    p.after_alloc("b", [11, 3, 4], 0)
    plan = p.build(StepInput([schedule("b", [11, 3, 4], 0, len(b))]))
    assert plan.flush == [job]  # the worker waits for it before the forward writes block 11
    plan = p.build(StepInput([schedule("b", [13], len(b), 1, replace=False)]))
    assert plan.flush == []  # a fence is paid once
    p.close()


def test_preemption_flushes_its_stores_and_looks_up_again(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 2)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("p", toks, BASE))
    assert matched(p, "p", 0, len(toks)) == (0, False)
    p.after_alloc("p", [1, 2, 3, 4], 0)
    job = p.build(StepInput([schedule("p", [1, 2, 3, 4], 0, len(toks))])).stores[0].job_id
    plan = p.build(StepInput(preempted={"p"}))
    assert plan.flush == [job]
    # re-admitted later: a fresh lookup (its blocks are in the daemon by now)
    seed_blocks(daemon, toks, 3)
    assert matched(p, "p", 0, len(toks) + 3) == (3 * BS, False)
    p.close()


def test_load_disabled_never_leaves_pins(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 3)
    p, _ = make_planner(daemon, load=False)
    p.on_new_request(RequestInfo("nl", toks, BASE))
    assert p.num_new_matched("nl", 0, len(toks)) == (0, False)
    p.after_alloc("nl", [1, 2, 3, 4], 0)
    deadline = time.monotonic() + 5
    while p.pending_lookups() and time.monotonic() < deadline:
        time.sleep(0.01)
    plan = p.build(StepInput([schedule("nl", [1, 2, 3, 4], 0, len(toks))]))
    assert not plan.loads and not plan.stores  # all 3 blocks are already in the daemon
    assert wait_pinned(daemon, 0) == 0
    p.close()


def test_salt_and_adapter_separate_blocks(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    seed_blocks(daemon, toks, 3)
    p, _ = make_planner(daemon)
    variants = {
        "salt": Variant(cache_salt="tenant-b"),
        "lora": Variant(adapter_id="sql", adapter_revision="v1"),
        "base": BASE,
    }
    for rid, v in variants.items():
        p.on_new_request(RequestInfo(rid, toks, v))
    assert matched(p, "salt", 0, len(toks)) == (0, False)
    assert matched(p, "lora", 0, len(toks)) == (0, False)
    assert matched(p, "base", 0, len(toks)) == (3 * BS, False)
    p.on_new_request(RequestInfo("nocache", toks, None))  # e.g. an adapter of unknown revision
    assert p.num_new_matched("nocache", 0, len(toks)) == (0, False)
    assert p.build(StepInput([schedule("nocache", [1, 2, 3, 4], 0, len(toks))])).empty()
    p.close()


def decode(p: Planner, req_id: str, toks: list[int], out: list[int], n: int) -> list[Any]:
    """``n`` decode steps as vLLM runs them: each feeds the last sampled token (its KV is
    computed this step), then samples the next one (appended after the step). The stores
    planned, step by step."""
    stores = []
    for _ in range(n):
        computed = len(toks) - 1  # every token but the last sampled one has its KV
        new_block = [100 + len(toks) // BS] if len(toks) % BS == 0 else None  # vLLM allocates
        stores.append(p.build(StepInput([schedule(req_id, new_block, computed, 1, replace=False)])).stores)
        toks.append(out.pop(0))
    return stores


def test_decode_stores_generated_blocks_chained_from_the_prompt(daemon: DaemonProcess) -> None:
    """Generated tokens' full blocks are stored as decode completes them, under the keys the
    next turn's prompt (prompt + answer + new message) hashes to; the block completed by the
    last sampled token is not (its KV is never computed)."""
    p, _ = make_planner(daemon)
    prompt_toks = prompt(2 * BS + 5)
    answer = prompt(2 * BS, seed=9)
    toks = list(prompt_toks)  # vLLM's live all_token_ids: prompt, then each output token
    p.on_new_request(RequestInfo("t1", prompt_toks, BASE, toks))
    assert matched(p, "t1", 0, len(toks)) == (0, False)
    p.after_alloc("t1", [0, 1, 2], 0)
    plan = p.build(StepInput([schedule("t1", [0, 1, 2], 0, len(toks))]))  # prefill, samples o1
    assert [s.block_ids for s in plan.stores] == [[0, 1]]
    toks.append(answer[0])
    out = list(answer[1:])
    stores = decode(p, "t1", toks, out, 2 * BS - 1)  # samples o2 .. o_{2BS}
    planned = [(i, s.block_ids) for i, step in enumerate(stores) for s in step]
    # block 2 (5 prompt tokens + 11 generated) has its KV once o_11 is fed: decode step 10
    assert planned == [(BS - 5 - 1, [2]), (2 * BS - 5 - 1, [100 + 4 - 1])]
    job = stores[BS - 6][0]
    assert job.keys[0] == IDENTITY.namespace().block_keys(toks)[2:3]
    turn2 = toks + prompt(BS + 3, seed=11)  # history + answer + a new message
    keys2 = IDENTITY.namespace().block_keys(turn2)
    assert stores[2 * BS - 6][0].keys[0] == keys2[3:4]
    # 2 * BS + 5 + 2 * BS tokens: 4 full blocks stored (2 of the prompt, 2 with generated
    # tokens); block 4 is partial (and holds o_{2BS}, whose KV is never computed)
    assert p.stats.store_blocks == 4 and p.stats.store_generated_blocks == 2
    p.request_finished("t1")
    with kvtier.Client.connect(daemon.unix) as c:
        h = c.register(IDENTITY.namespace())
        stored = [k for s in [plan.stores[0]] + [s for st in stores for s in st] for k in s.keys[0]]
        assert h.put(stored, [bytes([7]) * h.block_bytes] * len(stored)).stored == 4
    # turn 2 in another planner (another engine): the prompt and the answer's full blocks hit
    p2, _ = make_planner(daemon)
    p2.on_new_request(RequestInfo("t2", turn2, BASE, list(turn2)))
    assert matched(p2, "t2", 0, len(turn2)) == (4 * BS, False)
    p2.close()
    p.close()


def test_a_finished_request_no_longer_counts_as_decoding(daemon: DaemonProcess) -> None:
    """The interference budget cuts a load only while another request decodes: a request
    vLLM finished (after the decode step async scheduling planned for it) is not one, or the
    next request's load, with nothing decoding, would be cut (seen in docs/benchmarks.md §26)."""
    p, _ = make_planner(daemon)
    toks = prompt(2 * BS + 1)
    p.on_new_request(RequestInfo("d", toks, BASE, list(toks)))
    assert matched(p, "d", 0, len(toks)) == (0, False)
    p.after_alloc("d", [0, 1, 2], 0)
    p.build(StepInput([schedule("d", [0, 1, 2], 0, len(toks))]))  # prefill
    p.build(StepInput([schedule("d", None, len(toks), 1, replace=False)]))  # a decode step
    assert p.decisions.decoding == {"d"}
    p.request_finished("d")
    assert p.decisions.decoding == set()
    p.close()


def test_store_generated_off_stores_prompt_blocks_only(daemon: DaemonProcess) -> None:
    p, _ = make_planner(daemon, store_generated=False)
    prompt_toks = prompt(BS + 5)
    toks = list(prompt_toks)
    p.on_new_request(RequestInfo("g", prompt_toks, BASE, toks))
    assert matched(p, "g", 0, len(toks)) == (0, False)
    p.after_alloc("g", [0, 1], 0)
    assert [s.block_ids for s in p.build(StepInput([schedule("g", [0, 1], 0, len(toks))])).stores] == [[0]]
    toks.append(1)
    stores = decode(p, "g", toks, prompt(2 * BS), 2 * BS)
    assert not any(stores) and p.stats.store_generated_blocks == 0
    p.close()


def test_preempted_request_looks_up_its_output_too(daemon: DaemonProcess) -> None:
    """Re-admitted after preemption, a request is recomputed from prompt + output so far: the
    re-lookup covers the generated blocks too, and nothing already stored is stored again."""
    p, _ = make_planner(daemon)
    prompt_toks = prompt(BS + 3)
    toks = list(prompt_toks)
    p.on_new_request(RequestInfo("q", prompt_toks, BASE, toks))
    assert matched(p, "q", 0, len(toks)) == (0, False)
    p.after_alloc("q", [5, 6], 0)
    p.build(StepInput([schedule("q", [5, 6], 0, len(toks))]))
    toks.append(7)
    stores = decode(p, "q", toks, prompt(2 * BS, seed=3), 2 * BS)
    assert sum(len(s.block_ids) for st in stores for s in st) == 2
    plan = p.build(StepInput(preempted={"q"}))
    assert len(plan.flush) == 3  # the prompt's store job and both generated ones
    seed_blocks(daemon, toks, 3)  # what the worker stored by now
    assert matched(p, "q", 0, len(toks)) == (3 * BS, False)  # 3 of the 4 full blocks
    p.after_alloc("q", [1, 2, 3, 4], 3 * BS)
    plan = p.build(StepInput([schedule("q", [1, 2, 3, 4], 3 * BS, len(toks) - 3 * BS)]))
    assert len(plan.loads) == 1 and not plan.stores  # 0-2 were hits, block 3 is partial
    p.close()


def test_daemon_away_is_a_fast_miss(tmp_path: Any) -> None:
    backend = DaemonBackend(IDENTITY, ConnectorConfig(address=f"unix:{tmp_path}/none.sock"))
    p = Planner(block_size=BS, backend=backend, lookup_timeout_s=2.0)
    toks = prompt(3 * BS)
    t0 = time.monotonic()
    p.on_new_request(RequestInfo("z", toks, BASE))
    assert matched(p, "z", 0, len(toks)) == (0, False)
    assert time.monotonic() - t0 < 1.5  # answered by the breaker, not by the timeout
    p.close()


# -- worker ------------------------------------------------------------------------------------


def lbhnc_cache(fill: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One shared buffer, vLLM LBHNC: per layer [B, H, N, K‖V] bf16."""
    buf = torch.zeros(L, NUM_BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16)
    if fill:
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(3)))
    return buf, [buf[i] for i in range(L)]


def test_worker_stores_then_loads_blocks_at_other_ids(daemon: DaemonProcess) -> None:
    toks = prompt(5 * BS)
    p, _ = make_planner(daemon)
    p.on_new_request(RequestInfo("w", toks, BASE))
    assert matched(p, "w", 0, len(toks)) == (0, False)
    src, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, cfg_for(daemon))
    w.register(layers)
    p.after_alloc("w", [3, 9, 1, 14, 6], 0)
    plan = p.build(StepInput([schedule("w", [3, 9, 1, 14, 6], 0, len(toks))]))
    w.submit_stores(plan.stores)
    assert w.drain() and w.idle()
    w.wait([plan.stores[0].job_id])  # a finished job never blocks the fence
    assert w.take_stats()["stored_blocks"] == 5
    p.request_finished("w")
    # a second engine: new lookup, load into different block ids
    dst, layers2 = lbhnc_cache(False)
    w2 = KvtierWorker(IDENTITY, cfg_for(daemon))
    w2.register(layers2)
    p.on_new_request(RequestInfo("w2", toks + [1], BASE))
    assert matched(p, "w2", 0, len(toks) + 1) == (5 * BS, False)
    p.after_alloc("w2", [0, 2, 4, 5, 7, 8], 5 * BS)
    plan = p.build(StepInput([schedule("w2", [0, 2, 4, 5, 7, 8], 5 * BS, 1)]))
    assert w2.load(plan.loads) == set()
    for s, t in zip([3, 9, 1, 14, 6], [0, 2, 4, 5, 7], strict=True):
        assert torch.equal(src[:, s], dst[:, t])
    assert torch.count_nonzero(dst[:, 8]) == 0
    stats = w2.take_stats()
    assert stats["loaded_blocks"] == 5 and stats["loaded_bytes"] == 5 * w2.block_bytes
    for x in (w, w2):
        x.close()
    p.close()


def test_worker_reports_failed_loads_and_never_raises(daemon: DaemonProcess) -> None:
    toks = prompt(3 * BS + 1)
    keys = seed_blocks(daemon, toks, 2)
    _, layers = lbhnc_cache(False)
    w = KvtierWorker(IDENTITY, cfg_for(daemon))
    w.register(layers)
    from kvtier.integrations.vllm.connector.planner import LoadJob

    missing = IDENTITY.namespace().block_keys(toks)[2]
    assert w.load([LoadJob("r", BASE, [[keys[0], missing]], [5, 6])]) == {6}
    daemon.kill()
    t0 = time.monotonic()
    assert w.load([LoadJob("r", BASE, [keys], [1, 2])]) == {1, 2}
    assert time.monotonic() - t0 < 3
    w.close()


def test_worker_drops_stores_when_the_daemon_is_away(tmp_path: Any) -> None:
    _, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, ConnectorConfig(address=f"unix:{tmp_path}/none.sock"))
    w.register(layers)
    from kvtier.integrations.vllm.connector.planner import StoreJob

    keys = IDENTITY.namespace().block_keys(prompt(2 * BS))
    w.submit_stores([StoreJob(1, "r", BASE, [keys], [0, 1])])
    w.wait([1])
    assert w.drain()
    assert w.take_stats()["store_dropped_blocks"] == 2
    w.close()


def test_worker_refuses_a_cache_of_another_geometry(daemon: DaemonProcess) -> None:
    bad = [torch.zeros(NUM_BLOCKS, H, BS, D, dtype=torch.bfloat16) for _ in range(L)]
    w = KvtierWorker(IDENTITY, cfg_for(daemon))
    with pytest.raises(ValueError, match="kv_cache"):
        w.register(bad)


def test_the_session_opens_before_the_first_request(daemon: DaemonProcess) -> None:
    p, backend = make_planner(daemon)
    deadline = time.monotonic() + 5
    while p.pending_lookups() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend._client is not None and backend.client.connected  # warmed up, no request yet
    p.close()


def test_disk_hits_are_reported_as_disk_hits(daemon_factory: Any, tmp_path: Any) -> None:
    """A daemon whose host tier holds 4 blocks over an NVMe tier: of 8 stored blocks, the 4
    oldest live on NVMe only, and the pinned lookup says so (it used to promote inside the RPC
    and call every hit a host hit, so the connector's disk-hit figures were always 0)."""
    d = daemon_factory(
        "--host-bytes",
        "64KiB",
        "--slab-bytes",
        "16KiB",
        "--disk-dir",
        str(tmp_path / "nvme"),
        "--disk-bytes",
        "16MiB",
        "--write-policy",
        "write-through",
    )
    toks = prompt(8 * BS + 3)
    seed_blocks(d, toks[: 4 * BS], 4)
    with kvtier.Client.connect(d.unix) as c:
        h = c.register(IDENTITY.namespace(BASE))
        keys = h.block_keys(toks)[:8]
        deadline = time.monotonic() + 10
        while not all(h.lookup_detail(keys[:4]).durable) and time.monotonic() < deadline:
            time.sleep(0.02)  # write-through: wait until NVMe holds the first four
        assert h.put(keys[4:], [bytes([7 + i]) * h.block_bytes for i in range(4)]).stored == 4
        assert h.lookup_detail(keys).tiers == ["nvme"] * 4 + ["host"] * 4
    p, _ = make_planner(d)
    p.on_new_request(RequestInfo("disk", toks, BASE))
    assert matched(p, "disk", 0, len(toks)) == (8 * BS, False)
    assert (p.stats.nvme_hit_blocks, p.stats.host_hit_blocks) == (4, 4)
    assert p.hit_sources("disk", 8 * BS) == {"nvme": 4 * BS, "host": 4 * BS}
    p.close()


def test_async_load_is_planned_unscheduled_and_pinned_until_reported(daemon: DaemonProcess) -> None:
    """load_async: the hit is an async load; vLLM does not schedule the request while it loads
    (WAITING_FOR_REMOTE_KVS), so the load is planned without it being scheduled, the store job
    still reading one of its new blocks is fenced first, and the pins are held until the
    workers report the load finished, however many steps that takes."""
    toks = prompt(4 * BS + 1)
    seed_blocks(daemon, toks, 3)
    p, _ = make_planner(daemon, pin_release_steps=1, load_async=True)
    other = prompt(2 * BS, seed=5)
    p.on_new_request(RequestInfo("o", other, BASE))
    assert matched(p, "o", 0, len(other)) == (0, False)
    p.after_alloc("o", [7, 8], 0)
    store = p.build(StepInput([schedule("o", [7, 8], 0, len(other))])).stores[0]
    p.request_finished("o")  # block 8 goes back to vLLM while its store may still read it
    p.on_new_request(RequestInfo("a", toks, BASE))
    assert matched(p, "a", 0, len(toks)) == (3 * BS, True)
    assert matched(p, "a", 0, len(toks)) == (3 * BS, True)  # idempotent
    assert wait_pinned(daemon, 3) == 3
    p.after_alloc("a", [8, 1, 2, 3, 4], 3 * BS)
    plan = p.build(StepInput())  # "a" is not scheduled while its load runs
    assert [j.block_ids for j in plan.loads] == [[8, 1, 2]]
    assert plan.flush == [store.job_id]  # the load must not write block 8 under that store
    for _ in range(4):
        assert p.build(StepInput()).empty()
    assert wait_pinned(daemon, 3, timeout_s=0.2) == 3  # held while the load is in flight
    assert p.loads_in_flight() == 1
    p.load_finished("a")
    assert wait_pinned(daemon, 0) == 0
    # vLLM asks again only when the whole load failed: then it is recomputed, never retried
    assert p.num_new_matched("a", 0, len(toks)) == (0, False)
    p.after_alloc("a", [8, 1, 2, 3, 4], 0)
    plan = p.build(StepInput([schedule("a", [8, 1, 2, 3, 4], 0, len(toks))]))
    assert not plan.loads and [s.block_ids for s in plan.stores] == [[3]]  # block 3 only
    p.close()


def test_worker_async_load_runs_off_the_engine_thread(daemon: DaemonProcess) -> None:
    """load_async returns at once; finished_loads reports each request once, with the block
    ids that failed (a missing key; then the daemon killed: every block); the bytes land in the
    engine blocks; a store job never reads a block a load is still writing."""
    toks = prompt(3 * BS + 1)
    keys = seed_blocks(daemon, toks, 2)
    missing = IDENTITY.namespace().block_keys(toks)[2]
    _, layers = lbhnc_cache(False)
    w = KvtierWorker(IDENTITY, cfg_for(daemon, load_mode="async"))
    w.register(layers)
    from kvtier.integrations.vllm.connector.planner import LoadJob, StoreJob

    def finished(timeout_s: float = 5.0) -> tuple[set[str], set[int]]:
        deadline = time.monotonic() + timeout_s
        reqs: set[str] = set()
        failed: set[int] = set()
        while time.monotonic() < deadline:
            r, f = w.finished_loads()
            reqs |= r
            failed |= f
            if r:
                return reqs, failed
            time.sleep(0.005)
        return reqs, failed

    w.load_async([LoadJob("r1", BASE, [[keys[0], keys[1], missing]], [5, 6, 9])])
    assert finished() == ({"r1"}, {9})
    for b, fill in ((5, 7), (6, 8)):  # seed_blocks: block i holds bytes 7 + i
        assert bool((layers[0][b].view(torch.uint8) == fill).all())
    assert torch.count_nonzero(layers[0][9]) == 0
    stats = w.take_stats()
    assert stats["loaded_blocks"] == 2 and stats["load_failed_blocks"] == 1
    assert stats["engine_seconds"] < 0.05  # the engine thread only queued it
    with w.state.cond:  # a block a load is writing: a store reading it is dropped, never run
        w.loads._loading_blocks[11] = 1
    w.submit_stores([StoreJob(1, "s", BASE, [keys[:1]], [11])])
    assert w.take_stats()["store_dropped_blocks"] == 1
    with w.state.cond:
        w.loads._loading_blocks.clear()
    daemon.kill()
    w.load_async([LoadJob("r2", BASE, [keys], [1, 2])])
    assert finished() == ({"r2"}, {1, 2})
    w.close()


def test_a_miss_in_the_published_index_costs_no_lookup_rpc(daemon: DaemonProcess) -> None:
    """A new prompt (all misses) is answered from the published index; a revisit still makes
    the pinned lookup RPC (its pins are what keeps the blocks until the load)."""
    backend = DaemonBackend(IDENTITY, cfg_for(daemon))
    try:
        backend.warmup()
        deadline = time.monotonic() + 10  # (the client fetches the index in the background)
        while backend.local_misses == 0 and time.monotonic() < deadline:
            new = backend.lookup(BASE, prompt(BS * 4, seed=11))
            assert new.hits == 0 and not new.pins
            time.sleep(0.005)
        assert backend.local_misses == 1
        lookups = backend.client.counters.lookups
        backend.lookup(BASE, prompt(BS * 4, seed=11))
        assert backend.local_misses == 2
        assert backend.client.counters.lookups == lookups + 1  # counted once
        seed_blocks(daemon, prompt(BS * 4, seed=12), 4)
        lookups = backend.client.counters.lookups
        old = backend.lookup(BASE, prompt(BS * 4, seed=12))
        assert old.hits == 4 and old.pins  # pinned over gRPC
        assert backend.local_misses == 2
        assert backend.client.counters.lookups == lookups + 1  # the probe is not counted
        backend.release(old.pins)
    finally:
        backend.close()


def test_event_token_ids_carry_each_store_jobs_tokens_and_parent(daemon_factory: Any, tmp_path: Any) -> None:
    """``event_token_ids``: the connector's stores (chunked prefill: two jobs, the second
    chaining on from the first) reach the daemon's KV events with their token ids and parent
    key, so a router hashing tokens matches them; off, none are sent; left out (None, the
    default), they are sent because the daemon said at the session's open that it publishes
    events (``Client.events``), and not to a daemon that publishes none."""
    pytest.importorskip("zmq")
    from events_follower import Follower

    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--events-endpoint",
        f"ipc://{tmp_path}/ev.sock",
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-replay-endpoint",
        f"ipc://{tmp_path}/replay.sock",
    )
    follow = Follower(f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock")
    w = KvtierWorker(IDENTITY, cfg_for(d))
    w.register(lbhnc_cache(True)[1])
    try:
        for told, seed in ((True, 1), (False, 2), (None, 3)):
            p, _ = make_planner(d, event_token_ids=told)
            on = told is not False
            toks = prompt(4 * BS, seed=seed)
            keys = IDENTITY.namespace().block_keys(toks)
            p.on_new_request(RequestInfo("e", toks, BASE))
            assert matched(p, "e", 0, len(toks)) == (0, False)
            assert p.lookups.thread.events()  # the session's open said so
            p.after_alloc("e", [1, 2], 0)
            jobs = p.build(StepInput([schedule("e", [1, 2], 0, BS + 3)])).stores
            jobs += p.build(StepInput([schedule("e", [3, 4], BS + 3, 3 * BS - 3, replace=False)])).stores
            assert [j.block_ids for j in jobs] == [[1], [2, 3, 4]]
            w.submit_stores(jobs)
            assert w.drain()
            want = set(keys)
            follow.settle(lambda: set(follow.stored) >= want)  # noqa: B023 (settled here)
            for i, k in enumerate(keys):
                assert follow.stored[k]["tokens"] == (toks[i * BS : (i + 1) * BS] if on else []), i
                # without: only a job's own chain is known (its first block has no parent)
                linked = i and (on or i not in (0, 1))
                assert follow.stored[k]["parent"] == (keys[i - 1] if linked else None), i
            p.request_finished("e")
            p.close()
        quiet = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")  # no events
        p, _ = make_planner(quiet, event_token_ids=None)
        toks = prompt(2 * BS, seed=4)
        p.on_new_request(RequestInfo("q", toks, BASE))
        assert matched(p, "q", 0, len(toks)) == (0, False)
        assert not p.lookups.thread.events()
        p.after_alloc("q", [1, 2], 0)
        (job,) = p.build(StepInput([schedule("q", [1, 2], 0, 2 * BS)])).stores
        assert job.token_ids is None and job.parents is None
        p.close()
    finally:
        w.close()
        follow.close()


def test_with_vllms_events_on_each_store_job_is_told_in_vllms_block_hashes(daemon: DaemonProcess) -> None:
    """``engine_events`` (vLLM's KV events on): each planned store job is kept with vLLM's own
    hashes of its blocks (the request's live ``block_hashes``), its parent hash, tokens and
    adapter, for the adapter's ``take_events``; taken once; none without."""
    for on in (True, False):
        p, _ = make_planner(daemon)
        p.stores.engine_events = on  # (the adapter sets it when vLLM's KV events are on)
        toks = prompt(4 * BS, seed=5)
        hashes: list[bytes] = []  # vLLM appends a block's hash once the block is full
        p.on_new_request(RequestInfo("v", toks, BASE, None, hashes, "lora-x"))
        assert matched(p, "v", 0, len(toks)) == (0, False)
        p.after_alloc("v", [1, 2], 0)
        hashes += [b"h0"]  # the first step computes BS + 3 tokens: one full block
        p.build(StepInput([schedule("v", [1, 2], 0, BS + 3)]))
        hashes += [b"h1", b"h2"]  # (no h3 yet: that block goes untold)
        p.build(StepInput([schedule("v", [3, 4], BS + 3, 3 * BS - 3, replace=False)]))
        told = p.stores.take_stored()
        if not on:
            assert told == []
            continue
        assert [(t.block_hashes, t.parent) for t in told] == [([b"h0"], None), ([b"h1", b"h2"], b"h0")]
        assert [t.token_ids for t in told] == [toks[:BS], toks[BS : 3 * BS]]
        assert {t.lora_name for t in told} == {"lora-x"}
        assert p.stores.take_stored() == []  # taken once
        p.request_finished("v")
        p.close()


def warm_worker_and_plan(daemon: DaemonProcess, p: Planner, w: KvtierWorker, req_id: str) -> StepPlan:
    """A worker past its first load (which pays one-time setup and is no tier figure), and the
    plan of a second request's load of 4 host blocks, ``req_id``, decoding one token."""
    for rid, seed in (("warm", 1), (req_id, 2)):
        toks = prompt(4 * BS + 1, seed)
        seed_blocks(daemon, toks, 4)
        p.on_new_request(RequestInfo(rid, toks, BASE))
        assert matched(p, rid, 0, len(toks)) == (4 * BS, False)
        p.after_alloc(rid, [0, 1, 2, 3, 4], 4 * BS)
        plan = p.build(StepInput([schedule(rid, [0, 1, 2, 3, 4], 4 * BS, 1)]))
        assert plan.loads[0].tiers == ["host"] * 4 and plan.tokens == 1
        if rid == "warm":
            assert w.load(plan.loads) == set()
            assert w.take_reports() == ([], [])
            w.take_stats()
            p.request_finished(rid)
    return plan


def test_worker_reports_steps_and_loads_and_keeps_the_interference_budget(daemon: DaemonProcess) -> None:
    """The figures the scheduler's decision needs (step seconds, loads by tier) and the budget:
    a decoding step's load is charged first, its stores admitted while the balance lasts and
    dropped (counted) once it is spent; a step where nobody decodes is not budgeted."""
    p, _ = make_planner(daemon)
    _, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, cfg_for(daemon, interference_budget=0.5))
    w.register(layers)
    plan = warm_worker_and_plan(daemon, p, w, "l")
    w.forward_start()
    assert w.load(plan.loads, decoding=True) == set()
    w.forward_start()
    w.forward_end(plan.step, plan.tokens, True)
    steps, loads = w.take_reports()
    assert [(s.step, s.tokens) for s in steps] == [(plan.step, 1)] and steps[0].seconds > 0
    assert [(r.req_ids, r.bytes_by_tier) for r in loads] == [(("l",), {"host": 4 * w.block_bytes})]
    st = w.take_stats()
    assert st["budget_steps"] == 1 and st["budget_load_seconds"] == loads[0].seconds
    assert w.budget.stats.load_s == loads[0].seconds  # charged, before any store

    def store_job(job_id: int, ids: list[int]) -> StoreJob:
        return StoreJob(job_id, "s", BASE, [[bytes([job_id, i]) * 16 for i in ids]], ids)

    w.budget.balance = -0.001  # spent (the load's debt)
    w.submit_stores([store_job(1, [5, 6])], decoding=True)
    w.submit_stores([store_job(2, [7])], decoding=False)  # nobody decodes: not budgeted
    w.budget.balance = 1.0
    w.submit_stores([store_job(3, [8])], decoding=True)
    assert w.drain()
    st = w.take_stats()
    assert st["store_dropped_budget_blocks"] == 2
    assert st["store_dropped_budget_bytes"] == 2 * w.block_bytes
    assert st["stored_blocks"] == 2 and st["budget_store_jobs"] == 1
    assert 0 < st["budget_store_seconds"] <= st["store_seconds"]
    assert w.budget.balance == pytest.approx(1.0 - st["budget_store_seconds"])  # settled
    w.close()
    p.close()


def test_a_load_cut_at_its_deadline_still_reports_a_figure(daemon: DaemonProcess) -> None:
    """A sync load that runs out of its step's time fails (vLLM recomputes); the time it took
    is still news about the tier, a lower bound: without it a tier slower than the step's
    budget would never show in the figures, and every revisit would pay the deadline again
    (issue 30; seen in the seed experiment's slow tier before this report existed)."""
    p, _ = make_planner(daemon)
    _, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, cfg_for(daemon))
    w.register(layers)
    plan = warm_worker_and_plan(daemon, p, w, "late")
    failed = w.load(plan.loads, deadline=time.monotonic() - 0.001)  # out of time at once
    assert failed == {0, 1, 2, 3}
    _, loads = w.take_reports()
    assert [(r.req_ids, r.bytes_by_tier) for r in loads] == [(("late",), {"host": w.block_bytes})]
    assert loads[0].seconds >= 0
    w.close()
    p.close()

"""kvtier's vLLM secondary tier inside vLLM's own tiering manager, in the vLLM environment.

Run as ``.venv-vllm/bin/python vllm_tier_jobs_driver.py '{"address": ..., "engine_id": ...}'``:
builds vLLM's real ``TieringOffloadingSpec`` (its shared CPU pool, CPU primary tier and
``TieringOffloadingManager``) with ``KvtierSecondaryTier`` as its one secondary tier, then answers
one JSON command per stdin line with one ``DRIVER {json}`` line:

* ``{"op": "roundtrip"}``: rows 0..3 of the pool get a byte pattern, a store job cascades them to
  the daemon, the tier's lookups (flushed once per "step") find them, a load job brings them into
  rows 8..11 -> ``{"stored": bool, "lookup": [..], "loaded": bool, "same_bytes": bool,
  "steps_to_hit": n}``
* ``{"op": "timed", "keys": seed}``: with the daemon in whatever state the test put it (e.g.
  SIGSTOP), times every scheduler-side call -> ``{"submit_store_s", "submit_load_s",
  "lookup_s": max of the per-call times, "finished_s": until both jobs reported,
  "store_ok", "load_ok", "lookup_results": the final answers, "resolved_s"}``
* load or recompute (issue 30), on tiers built by ``{"op": "build", "name", "extra"}`` (more
  tier settings): ``{"op": "store", "name", "seed", "n"}`` stores ``n`` chunks of a byte pattern;
  ``{"op": "play", "name", "seed", "steps", "step_s"}`` plays engine steps through the tier's
  hooks as vLLM's manager calls them (``on_new_request``, a one-chunk cascaded store per step,
  ``on_schedule_end``, ``on_request_finished``) -> ``{"spt"}``; ``{"op": "fetch", "name",
  "seed", "n"}`` looks the chunks up step by step until resolved, loads the HIT prefix into rows
  16.. -> ``{"hits", "same", "seconds"}``; ``{"op": "stats", "name"}`` -> the tier's counters.
* a tier's contract beside vLLM's own file tier (``"tier": "fs"``, its ``root``, or kvtier's):
  ``{"op": "no_groups", "tier", "root"}`` builds vLLM's manager over a spec with no KV cache
  group -> ``{"ok"}`` or ``{"error", "field"}``; ``{"op": "events", "tier", "root",
  "kv_events", "extra"}`` stores 4 rows and takes the manager's events -> ``{"stored",
  "events", "again", "keys"}``
* ``{"op": "quit"}``
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TOKENS = 16
ROW_BYTES = TOKENS * 2 * 2 * 64 * 2  # 16 tokens x K,V x 2 layers x 64 x bf16 = 8 KiB


def build(address: str, engine_id: str, **extra: object) -> tuple[object, object]:
    tier = {
        "type": "KvtierSecondaryTier",
        "module_path": "kvtier.integrations.vllm",
        "address": address,
        "model_revision": "rev-a",
        "tokenizer_digest": "none",
        "request_timeout_ms": 500,
        "lookup_timeout_ms": 300,
        "job_timeout_ms": 2000,
        **extra,
    }
    spec = make_spec(engine_id, tier)
    manager = spec.get_manager()
    return spec, manager.secondary_tiers[0]  # type: ignore[attr-defined]


def make_spec(
    engine_id: str, tier: dict[str, object], *, groups: bool = True, kv_events: bool = False
) -> TieringOffloadingSpec:
    """vLLM's tiering spec with ``tier`` as its one secondary tier. ``groups`` False: no KV
    cache group (as vLLM's own offloading test helper can build); ``kv_events``: vLLM
    publishes KV cache events."""
    par = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    group = OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=("l0", "l1"), group_id=0)
    config = OffloadingConfig(
        groups=(group,) if groups else (),
        worker_kv_bytes_per_block=ROW_BYTES,
        enable_kv_cache_events=kv_events,
        extra_config={"cpu_bytes_to_use": 32 * ROW_BYTES, "secondary_tiers": [tier]},
        engine_id=engine_id,
        model=OffloadingModelConfig(name="/models/tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=par,
        kv_cache_layout="LBHNC",
    )
    return TieringOffloadingSpec(config)


def tier_entry(c: dict[str, object], address: str) -> dict[str, object]:
    """The ``secondary_tiers`` entry of command ``c``: kvtier's, or vLLM's own file tier
    (``"tier": "fs"``, under ``c["root"]``); ``c["extra"]``: more keys."""
    extra = dict(c.get("extra") or {})  # type: ignore[call-overload]
    if c.get("tier") == "fs":
        return {"type": "fs", "root_dir": str(c["root"]), **extra}
    return {
        "type": "KvtierSecondaryTier",
        "module_path": "kvtier.integrations.vllm",
        "address": address,
        "model_revision": "rev-a",
        "tokenizer_digest": "none",
        "job_timeout_ms": 2000,
        **extra,
    }


def spec_built(c: dict[str, object], address: str) -> dict[str, object]:
    """``{"op": "no_groups", "tier", "root"}``: vLLM's tiering manager over a spec with no KV
    cache group -> ``{"ok": true}`` or ``{"error": "<type>: <message>", "field"}``."""
    spec = make_spec(f"nogroups-{c.get('tier')}-{time.monotonic_ns()}", tier_entry(c, address), groups=False)
    try:
        manager = spec.get_manager()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "field": getattr(e, "field", None)}
    manager.shutdown()  # type: ignore[attr-defined]
    return {"ok": True}


def stored_events(c: dict[str, object], address: str) -> dict[str, object]:
    """``{"op": "events", "tier", "root", "kv_events", "extra"}``: a store job of 4 rows
    through the tier inside vLLM's manager, then the manager's ``take_events()`` ->
    ``{"stored", "events": [{"keys": [hex], "removed", "medium"}], "again": [...]}``."""
    spec = make_spec(
        f"events-{c.get('tier')}-{time.monotonic_ns()}",
        tier_entry(c, address),
        kv_events=bool(c["kv_events"]),
    )
    manager = spec.get_manager()
    tier = manager.secondary_tiers[0]  # type: ignore[attr-defined]
    view = np.frombuffer(tier._primary_kv_view, dtype=np.uint8).reshape(-1, tier.block_size_bytes)
    for i in range(4):
        view[i, :] = pattern(70, i)
    tier.submit_store(job(1, keys(70, 4), [0, 1, 2, 3], False, "ev"))
    stored = wait_jobs(tier, {1}, 10).get(1, False)

    def events() -> list[dict[str, object]]:
        return [
            {"keys": [bytes(k).hex() for k in e.keys], "removed": e.removed, "medium": e.medium.name}
            for e in manager.take_events()  # type: ignore[attr-defined]
        ]

    got = events()
    again = events()  # taken once
    manager.shutdown()  # type: ignore[attr-defined]
    return {"stored": stored, "events": got, "again": again, "keys": [k.hex() for k in keys(70, 4)]}


def keys(seed: int, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).digest() + (0).to_bytes(4, "big") for i in range(n)]


def job(job_id: int, ks: list[bytes], rows: list[int], load: bool, req: str) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=ks,
        chunk_ids=np.array(rows, dtype=np.int64),
        is_promotion=load,
        req_context=ReqContext(req_id=req),
    )


def wait_jobs(tier: object, ids: set[int], timeout_s: float) -> dict[int, bool]:
    got: dict[int, bool] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) != ids and time.monotonic() < deadline:
        for r in tier.get_finished_jobs():  # type: ignore[attr-defined]
            got[r.job_id] = r.success
        time.sleep(0.01)
    return got


def lookup_until_resolved(
    tier: object, ks: list[bytes], req: str, timeout_s: float
) -> tuple[list[str], int, float, float]:
    """Look ``ks`` up step after step (on_schedule_end between steps) until none is RETRY:
    (answers, steps, the longest single call, seconds)."""
    ctx = ReqContext(req_id=req)
    t0 = time.monotonic()
    worst = 0.0
    steps = 0
    while True:
        steps += 1
        answers = []
        for k in ks:
            t = time.perf_counter()
            answers.append(tier.lookup(k, ctx))  # type: ignore[attr-defined]
            worst = max(worst, time.perf_counter() - t)
        tier.on_schedule_end(ScheduleEndContext((), ()))  # type: ignore[attr-defined]
        if LookupResult.RETRY not in answers or time.monotonic() - t0 > timeout_s:
            tier.on_request_finished(ctx)  # type: ignore[attr-defined]
            return [a.name for a in answers], steps, worst, time.monotonic() - t0
        time.sleep(0.02)


def roundtrip(tier: object, view: np.ndarray) -> dict[str, object]:
    ks = keys(1, 4)
    for i in range(4):
        view[i, :] = np.frombuffer(hashlib.sha256(bytes([i])).digest() * (ROW_BYTES // 32), dtype=view.dtype)
    tier.submit_store(job(1, ks, [0, 1, 2, 3], False, "r1"))  # type: ignore[attr-defined]
    stored = wait_jobs(tier, {1}, 10).get(1, False)
    answers, steps, _, _ = lookup_until_resolved(tier, ks, "r2", 10)
    tier.submit_load(job(2, ks, [8, 9, 10, 11], True, "r2"))  # type: ignore[attr-defined]
    loaded = wait_jobs(tier, {2}, 10).get(2, False)
    same = bool((view[8:12] == view[0:4]).all())
    return {"stored": stored, "lookup": answers, "loaded": loaded, "same_bytes": same, "steps_to_hit": steps}


def timed(tier: object, seed: int) -> dict[str, object]:
    ks = keys(seed, 4)
    t = time.perf_counter()
    tier.submit_store(job(10 + seed, ks, [4, 5, 6, 7], False, "t1"))  # type: ignore[attr-defined]
    store_s = time.perf_counter() - t
    t = time.perf_counter()
    tier.submit_load(job(20 + seed, keys(1, 4), [12, 13, 14, 15], True, "t2"))  # type: ignore
    load_s = time.perf_counter() - t
    t0 = time.monotonic()
    done = wait_jobs(tier, {10 + seed, 20 + seed}, 30)
    finished_s = time.monotonic() - t0
    answers, steps, worst, resolved_s = lookup_until_resolved(tier, keys(1, 4), "t3", 30)
    return {
        "submit_store_s": store_s,
        "submit_load_s": load_s,
        "lookup_s": worst,
        "finished_s": finished_s,
        "store_ok": done.get(10 + seed),
        "load_ok": done.get(20 + seed),
        "lookup_results": answers,
        "lookup_steps": steps,
        "resolved_s": resolved_s,
    }


def pattern(seed: int, i: int) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(f"p{seed}:{i}".encode()).digest() * (ROW_BYTES // 32), dtype=np.uint8)


class Tiers:
    """Named tiers for the load-or-recompute ops (see the module docstring)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.tiers: dict[str, tuple[object, np.ndarray]] = {}
        self.job_id = 10_000

    def next_id(self) -> int:
        self.job_id += 1
        return self.job_id

    def build(self, c: dict[str, object]) -> dict[str, object]:
        _, tier = build(self.address, f"engine-{c['name']}", **c.get("extra", {}))  # type: ignore
        view = np.frombuffer(tier._primary_kv_view, dtype=np.uint8).reshape(  # type: ignore
            -1, tier.block_size_bytes
        )  # type: ignore[attr-defined]
        self.tiers[str(c["name"])] = (tier, view)
        return {"ok": True}

    def store(self, c: dict[str, object]) -> dict[str, object]:
        tier, view = self.tiers[str(c["name"])]
        seed, n = int(c["seed"]), int(c["n"])  # type: ignore[arg-type]
        for i in range(n):
            view[i, :] = pattern(seed, i)
        jid = self.next_id()
        tier.submit_store(job(jid, keys(seed, n), list(range(n)), False, "w"))  # type: ignore
        return {"ok": wait_jobs(tier, {jid}, 10).get(jid, False)}

    def play(self, c: dict[str, object]) -> dict[str, object]:
        tier, _ = self.tiers[str(c["name"])]
        seed, step_s = int(c["seed"]), float(c["step_s"])  # type: ignore[arg-type]
        ctx = ReqContext(req_id=f"play{seed}")
        tier.on_new_request(ctx)  # type: ignore[attr-defined]
        tier.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))  # type: ignore
        ids = set()
        for i in range(int(c["steps"])):  # type: ignore[arg-type]
            time.sleep(step_s)  # sleep: the engine's forward, whose seconds per token the tier measures
            jid = self.next_id()
            ids.add(jid)
            tier.submit_store(job(jid, keys(seed, i + 1)[i:], [30], False, ctx.req_id))  # type: ignore
            tier.on_schedule_end(ScheduleEndContext((), ()))  # type: ignore[attr-defined]
        tier.on_request_finished(ctx)  # type: ignore[attr-defined]
        wait_jobs(tier, ids, 10)
        return {"spt": tier.jobs.decisions.decider.prefill.seconds_per_token()}  # type: ignore

    def fetch(self, c: dict[str, object]) -> dict[str, object]:
        tier, view = self.tiers[str(c["name"])]
        seed, n = int(c["seed"]), int(c["n"])  # type: ignore[arg-type]
        t0 = time.monotonic()
        ks = keys(seed, n)
        answers, _, _, _ = lookup_until_resolved(tier, ks, f"fetch{seed}", 10)
        hits = answers.index("MISS") if "MISS" in answers else len(answers)
        same = True
        if hits:
            jid = self.next_id()
            tier.submit_load(
                job(
                    jid,
                    ks[:hits],
                    list(range(16, 16 + hits)),
                    True,  # type: ignore
                    f"fetch{seed}",
                )
            )
            ok = wait_jobs(tier, {jid}, 10).get(jid, False)
            same = ok and all((view[16 + i] == pattern(seed, i)).all() for i in range(hits))
        return {"answers": answers, "hits": hits, "same": bool(same), "seconds": time.monotonic() - t0}

    def stats(self, c: dict[str, object]) -> dict[str, object]:
        tier, _ = self.tiers[str(c["name"])]
        return {"stats": tier.jobs.take_stats()}  # type: ignore[attr-defined]


def main() -> None:
    args = json.loads(sys.argv[1])
    spec, tier = build(args["address"], args["engine_id"])
    view = np.frombuffer(tier._primary_kv_view, dtype=np.uint8).reshape(  # type: ignore
        -1, tier.block_size_bytes
    )  # type: ignore[attr-defined]
    print(
        "DRIVER " + json.dumps({"ready": True, "row_bytes": tier.block_size_bytes}),  # type: ignore
        flush=True,
    )
    named = Tiers(args["address"])
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "roundtrip":
            print("DRIVER " + json.dumps(roundtrip(tier, view)), flush=True)
        if cmd["op"] == "timed":
            print("DRIVER " + json.dumps(timed(tier, int(cmd["keys"]))), flush=True)
        if cmd["op"] in ("no_groups", "events"):
            answer = (spec_built if cmd["op"] == "no_groups" else stored_events)(cmd, args["address"])
            print("DRIVER " + json.dumps(answer), flush=True)
        if cmd["op"] in ("build", "store", "play", "fetch", "stats"):
            print("DRIVER " + json.dumps(getattr(named, cmd["op"])(cmd)), flush=True)
    tier.shutdown()  # type: ignore[attr-defined]
    print("DRIVER " + json.dumps({"bye": True}), flush=True)


if __name__ == "__main__":
    main()

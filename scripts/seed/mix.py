"""Concurrent clients, revisits and new documents (``--mix``): one engine serves
``--mix-clients`` closed-loop clients at once (each sends its next request as soon as its last one
finished, so that many requests are in flight and vLLM batches them; see ``seed/engine.py``,
op ``clients``). Each request is, with probability ``--mix-revisit``, a revisit of one of
``--mix-pool`` documents, else a new document; ``max_tokens=--mix-answer``.

Three engines, all running: ``alone`` (no connector), ``sync`` (kvtier, ``load_mode="sync"``) and
``async`` (kvtier, ``load_mode="async"``; its own namespace, so that neither kvtier engine finds
the other's new documents). Each first visits the pool once (not measured: the kvtier engines store
it, the engine alone keeps what its cache holds). Then ``--mix-phases`` phases, each a different
workload (which documents, which new ones), each run on every engine, in rotated order, so that
the three see the same requests at nearby times.

Per request: TTFT (``add_request`` to the step that returned its first token) and the
inter-token latencies (the time between the steps that returned its successive tokens); the
prompt tokens by source are summed per phase (vLLM's counters cannot tell concurrent requests
apart).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from seed.common import CHECK2_HINT, SOURCES, EngineSet, log, make_docs, percentile, random_ids

CONFIGS = ("alone", "sync", "async")


def workloads(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[tuple[str, list[int]]]]]]:
    """The pool, and per phase per client its requests as (kind, ids)."""
    pool = make_docs(args.mix_pool, *args.mix_doc_tokens, args.vocab, args.seed + 4000)
    rng = random.Random(args.seed + 4001)
    phases = []
    for _ in range(args.mix_phases):
        clients = []
        for _ in range(args.mix_clients):
            reqs: list[tuple[str, list[int]]] = []
            for _ in range(args.mix_requests):
                if rng.random() < args.mix_revisit:
                    reqs.append(("revisit", pool[rng.randrange(len(pool))]))
                else:
                    reqs.append(("new", random_ids(rng, rng.randint(*args.mix_doc_tokens), args.vocab)))
            clients.append(reqs)
        phases.append(clients)
    return pool, phases


def run(args: argparse.Namespace, es: EngineSet) -> tuple[str, dict[str, Any], bool]:
    engines = es.start(list(CONFIGS))
    pool, phases = workloads(args)
    for name in CONFIGS:  # first visits of the pool, one at a time, not measured
        for ids in pool:
            engines[name].call({"op": "generate", "ids": ids})
    records: list[dict[str, Any]] = []
    sums = {c: dict.fromkeys((*SOURCES, "bytes_out", "wall_s"), 0.0) for c in CONFIGS}
    for p, clients in enumerate(phases):
        for j in range(len(CONFIGS)):
            name = CONFIGS[(p + j) % len(CONFIGS)]
            d0 = es.counters(name) if name != "alone" else None
            res = engines[name].call(
                {
                    "op": "clients",
                    "clients": [[ids for _, ids in c] for c in clients],
                    "max_tokens": args.mix_answer,
                }
            )
            if d0 is not None:
                sums[name]["bytes_out"] += es.counters(name)["bytes_out_shm"] - d0["bytes_out_shm"]
            for s in SOURCES:
                sums[name][s] += res["sources"][s]
            sums[name]["wall_s"] += res["wall_s"]
            for r in res["requests"]:
                r.update(config=name, phase=p + 1, kind=clients[r["client"]][r["index"]][0])
                records.append(r)
            ttfts = sorted(r["ttft_s"] for r in res["requests"])
            log(
                f"  mix phase {p + 1} {name}: {len(res['requests'])} requests in {res['wall_s']:.1f}s, "
                f"TTFT p50 {percentile(ttfts, 0.5):.2f}s, sources {res['sources']}"
            )
    check2 = all(
        sums[c]["bytes_out"] % es.bpt == 0
        and sums[c]["bytes_out"] // es.bpt == sums[c]["external_kv_transfer"]
        for c in ("sync", "async")
    )
    prompt = {c: sum(r["prompt_tokens"] for r in records if r["config"] == c) for c in CONFIGS}
    check1 = all(sum(sums[c][s] for s in SOURCES) == prompt[c] for c in CONFIGS)
    lines = [
        "| engine | requests | TTFT p50 s | TTFT p90 s | TTFT p50 revisits | TTFT p50 new "
        "| inter-token p50 ms | inter-token p90 ms | TTFT p50 vs alone | prompt tokens | computed "
        "| engine cache hit | loaded from kvtier | wall s (all phases) |",
        "|" + " --- |" * 14,
    ]
    base = percentile([r["ttft_s"] for r in records if r["config"] == "alone"], 0.5)
    for c in CONFIGS:
        rs = [r for r in records if r["config"] == c]
        tt = [r["ttft_s"] for r in rs]
        itl = [x for r in rs for x in r["itl_s"]]
        rev = [r["ttft_s"] for r in rs if r["kind"] == "revisit"]
        new = [r["ttft_s"] for r in rs if r["kind"] == "new"]
        lines.append(
            f"| {c} | {len(rs)} | {percentile(tt, 0.5):.3f} | {percentile(tt, 0.9):.3f} "
            f"| {percentile(rev, 0.5):.3f} | {percentile(new, 0.5):.3f} | {percentile(itl, 0.5) * 1e3:.0f} "
            f"| {percentile(itl, 0.9) * 1e3:.0f} | {percentile(tt, 0.5) / base:.2f}× | {prompt[c]:,} "
            f"| {int(sums[c]['local_compute']):,} | {int(sums[c]['local_cache_hit']):,} "
            f"| {int(sums[c]['external_kv_transfer']):,} | {sums[c]['wall_s']:.1f} |"
        )
    kinds = [k for clients in phases for c in clients for k, _ in c]
    report = (
        f"{args.mix_clients} clients × {args.mix_requests} requests × {args.mix_phases} phases per "
        f"engine ({kinds.count('revisit')} revisits of {args.mix_pool} pool documents, "
        f"{kinds.count('new')} new documents; {'-'.join(map(str, args.mix_doc_tokens))} tokens each; "
        f"pool {', '.join(str(len(d)) for d in pool)}), {args.mix_answer} tokens per answer; "
        f"engines 'alone', 'sync', 'async' of the small set.\n\n"
        + "\n".join(lines)
        + f"\n\nCheck 1 (computed + cache hit + loaded = prompt tokens, per engine): "
        f"{'ok' if check1 else 'FAIL'}; check 2 (daemon bytes out ÷ {es.bpt:,} = loaded tokens, "
        f"sync and async): {'ok' if check2 else 'FAIL' + CHECK2_HINT}."
    )
    return report, {"records": records, "sums": sums}, check1 and check2

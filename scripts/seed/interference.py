"""Decode interference (``--interference``): what loads and stores running at full rate cost a
request that is decoding beside them, with kvtier's interference budget and without.

Four engines of the small set: ``alone`` (no connector), ``budget`` (kvtier with the default
``interference_budget`` 0.25: kvtier's transfers may add at most a quarter of a step; stores
past it are dropped, counted), ``tight`` (0.02: the budget binding on this host, where
transfers take a few percent of a step) and ``nobudget`` (``interference_budget`` null). Each first visits
``--mix-pool`` documents (the kvtier engines store them). Then, per engine, two runs:

* ``quiet``: one request decodes ``--interference-decode`` tokens alone;
* ``busy``: the same request, and beside it ``--mix-clients`` closed-loop clients that each send
  ``--mix-requests`` requests (``max_tokens=1``), alternating a revisit of a pool document (a
  load, for kvtier) and a new document (a store).

Per run: the decoding request's inter-token latency p50 and p99 (the steps that returned its
tokens), and for kvtier the connector's counters over the run (transfer seconds charged, stores
dropped by the budget). The engine alone's ``busy`` row is the cost of the other requests' own
prefills, which no cache removes; kvtier's rows beside it show what its transfers add or save.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from seed.common import EngineSet, log, make_docs, percentile, random_ids

ENGINES = ("alone", "budget", "tight", "nobudget")


def run(args: argparse.Namespace, es: EngineSet) -> tuple[str, dict[str, Any], bool]:
    engines = es.start(list(ENGINES))
    pool = make_docs(args.mix_pool, *args.mix_doc_tokens, args.vocab, args.seed + 6000)
    rng = random.Random(args.seed + 6001)
    decoder = random_ids(rng, 200, args.vocab)
    traffic: list[list[list[int]]] = []
    for c in range(args.mix_clients):
        reqs = []
        for i in range(args.mix_requests):
            if (i + c) % 2 == 0:
                reqs.append(pool[rng.randrange(len(pool))])
            else:
                reqs.append(random_ids(rng, rng.randint(*args.mix_doc_tokens), args.vocab))
        traffic.append(reqs)
    for name in ENGINES:
        for ids in pool:
            engines[name].call({"op": "generate", "ids": ids})
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for name in ENGINES:
        eng = engines[name]
        for mode in ("quiet", "busy"):
            clients = [[decoder]] + (traffic if mode == "busy" else [])
            each = [args.interference_decode] + [1] * (len(clients) - 1)
            m0 = eng.call({"op": "metrics"})["kvtier"]
            res = eng.call({"op": "clients", "clients": clients, "max_tokens": 1, "max_tokens_each": each})
            m1 = eng.call({"op": "metrics"})["kvtier"]
            itl = next(r["itl_s"] for r in res["requests"] if r["client"] == 0)
            rows[(name, mode)] = {
                "itl_p50": percentile(itl, 0.5),
                "itl_p99": percentile(itl, 0.99),
                "wall_s": res["wall_s"],
                "sources": res["sources"],
                "kvtier": {k: m1[k] - m0.get(k, 0.0) for k in m1},
            }
            log(
                f"  interference {name} {mode}: ITL p50 {percentile(itl, 0.5) * 1e3:.1f} ms, "
                f"p99 {percentile(itl, 0.99) * 1e3:.1f} ms, sources {res['sources']}"
            )
    return report(args, rows), {"rows": {f"{k[0]}/{k[1]}": v for k, v in rows.items()}}, True


def report(args: argparse.Namespace, rows: dict[tuple[str, str], dict[str, Any]]) -> str:
    lines = [
        "| engine | run | decode ITL p50 ms | p99 ms | p50 vs quiet | p99 vs quiet "
        "| loaded from kvtier | kvtier transfers / decoding steps' time | stores dropped (budget) "
        "| wall s |",
        "|" + " --- |" * 10,
    ]
    for name in ENGINES:
        q = rows[(name, "quiet")]
        for mode in ("quiet", "busy"):
            r = rows[(name, mode)]
            k = r["kvtier"]
            dropped = [v for n, v in k.items() if "dropped_budget_blocks" in n]
            step_s = k.get("vllm:kvtier_budget_step_seconds", 0.0)
            moved = k.get("vllm:kvtier_budget_load_seconds", 0.0) + k.get(
                "vllm:kvtier_budget_store_seconds", 0.0
            )
            share = f"{moved / step_s:.1%}" if step_s else "-"
            lines.append(
                f"| {name} | {mode} | {r['itl_p50'] * 1e3:.1f} | {r['itl_p99'] * 1e3:.1f} "
                f"| {r['itl_p50'] / q['itl_p50']:.2f}× | {r['itl_p99'] / q['itl_p99']:.2f}× "
                f"| {r['sources']['external_kv_transfer']:,} | {share} "
                f"| {int(sum(dropped)) if dropped else '-'} | {r['wall_s']:.1f} |"
            )
    return (
        f"One request decodes {args.interference_decode} tokens; busy: {args.mix_clients} clients × "
        f"{args.mix_requests} requests beside it (revisits of {args.mix_pool} pool documents and "
        f"new documents, {'-'.join(map(str, args.mix_doc_tokens))} tokens).\n\n" + "\n".join(lines)
    )

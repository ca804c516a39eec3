"""Two engines sharing one daemon (``--fleet``): two vLLM engines (``LLM`` instances, each in its
own processes, both running at once) with kvtier connectors in the same namespace, one
``kvtierd``. ``--fleet-docs`` documents; round 1 sends document i to engine A if i is even, else
to B; round 2 sends every document to the other engine; later rounds alternate again. One
request at a time, ``max_tokens=1``; each engine's KV cache (``--small-blocks``) is too small to
keep the documents from one round to the next.

Cross-replica hits: the script keeps, per (document, block), the engine that computed the block
first (the one whose store put it in the daemon; the other engine's store of the same block finds
it present). Each request's loaded blocks are the prompt positions after vLLM's own cache hit,
so every loaded token is counted as loaded from its own store or from the other engine's.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from seed.common import BLOCK_TOKENS, CHECK2_HINT, EngineSet, log, make_docs

NAMES = {"sync": "A", "sync-b": "B"}


def run(args: argparse.Namespace, es: EngineSet) -> tuple[str, dict[str, Any], bool]:
    engines = es.start(["sync", "sync-b"])
    docs = make_docs(args.fleet_docs, *args.fleet_doc_tokens, args.vocab, args.seed + 3000)
    owner: dict[tuple[int, int], str] = {}
    records: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    order = ["sync", "sync-b"]
    for rnd in range(1, args.fleet_rounds + 1):
        d0 = es.counters("sync")
        for i, ids in enumerate(docs):
            name = order[(i + rnd - 1) % 2]
            rec = engines[name].call({"op": "generate", "ids": ids})
            src = rec["sources"]
            h, n = src["local_cache_hit"], src["external_kv_transfer"]
            loaded = [owner.get((i, b)) for b in range(h // BLOCK_TOKENS, (h + n) // BLOCK_TOKENS)]
            rec.update(
                round=rnd,
                doc=i,
                engine=NAMES[name],
                loaded_self=BLOCK_TOKENS * sum(1 for o in loaded if o == name),
                loaded_other=BLOCK_TOKENS * sum(1 for o in loaded if o is not None and o != name),
                loaded_unknown=BLOCK_TOKENS * sum(1 for o in loaded if o is None),
            )
            for b in range((h + n) // BLOCK_TOKENS, len(ids) // BLOCK_TOKENS):  # computed full blocks
                owner.setdefault((i, b), name)
            records.append(rec)
            log(
                f"  fleet round {rnd} doc {i} on {NAMES[name]}: {len(ids)} tokens, TTFT "
                f"{rec['ttft_s']:.2f}s, computed {src['local_compute']}, cache {h}, kvtier {n} "
                f"(other engine's {rec['loaded_other']})"
            )
        d1 = es.counters("sync")
        rounds.append(
            {"round": rnd, **{k: d1[k] - d0[k] for k in ("bytes_out_shm", "loads", "stores_accepted")}}
        )
    check1 = all(sum(r["sources"].values()) == r["prompt_tokens"] for r in records)
    check2 = True
    lines = [
        "| round | engine | requests | prompt tokens | computed | engine cache hit | loaded from kvtier "
        "| of which stored by the other engine | stored by itself | median TTFT s | daemon blocks "
        "stored in the round | daemon bytes out ÷ B/token |",
        "|" + " --- |" * 12,
    ]
    for rinfo in rounds:
        rnd = rinfo["round"]
        rs_round = [r for r in records if r["round"] == rnd]
        loaded_round = sum(r["sources"]["external_kv_transfer"] for r in rs_round)
        ok = rinfo["bytes_out_shm"] % es.bpt == 0 and rinfo["bytes_out_shm"] // es.bpt == loaded_round
        check2 &= ok
        for eng in ("A", "B"):
            rs = [r for r in rs_round if r["engine"] == eng]
            if not rs:
                continue

            def tot(key: str, rs: list[dict[str, Any]] = rs) -> int:
                return sum(r[key] if key in r else r["sources"][key] for r in rs)

            lines.append(
                f"| {rnd} | {eng} | {len(rs)} | {tot('prompt_tokens'):,} | {tot('local_compute'):,} "
                f"| {tot('local_cache_hit'):,} | {tot('external_kv_transfer'):,} | {tot('loaded_other'):,} "
                f"| {tot('loaded_self'):,} | {statistics.median(r['ttft_s'] for r in rs):.3f} "
                f"| {rinfo['stores_accepted']:,} (both) "
                f"| {rinfo['bytes_out_shm'] / es.bpt:,.0f} (both; {'ok' if ok else 'FAIL'}) |"
            )
    cross = sum(r["loaded_other"] for r in records)
    report = (
        f"{args.fleet_docs} documents of {'-'.join(map(str, args.fleet_doc_tokens))} tokens "
        f"({', '.join(str(len(d)) for d in docs)}), {args.fleet_rounds} rounds; engines 'sync' (A) "
        f"and 'sync-b' (B) of the small set, both running, one daemon.\n\n"
        + "\n".join(lines)
        + f"\n\nCross-replica: {cross:,} tokens ({cross // BLOCK_TOKENS} blocks) loaded by one "
        f"engine from blocks the other stored. Unattributed loaded tokens: "
        f"{sum(r['loaded_unknown'] for r in records):,}. Check 1 (computed + cache hit + loaded "
        f"= prompt, every request): {'ok' if check1 else 'FAIL'}; check 2 (daemon bytes out ÷ "
        f"{es.bpt:,} = loaded tokens, every round): {'ok' if check2 else 'FAIL' + CHECK2_HINT}."
    )
    return report, {"records": records, "rounds": rounds}, check1 and check2

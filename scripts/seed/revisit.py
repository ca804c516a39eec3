"""The original seed experiment (``--revisit``): documents revisited by one client, one request
at a time, engine alone vs engine + kvtier, each arm in fresh processes (see the docstring of
``scripts/seed_experiment.py`` and docs/benchmarks.md §9)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from seed.common import (
    COUNTERS,
    SOURCES,
    Engine,
    code_state,
    connector_config,
    daemon,
    daemon_counters,
    engine_spec,
    log,
    make_docs,
    write_model,
)


def run_arm(
    arm: str, rep: int, docs: list[list[int]], args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """One arm in fresh processes: every round over every document; returns the records."""
    spec = engine_spec(workdir / "model", args.dtype, args.max_model_len, args.num_blocks)
    result: dict[str, Any] = {"arm": arm, "rep": rep, "requests": [], "rounds": []}
    with ExitStack() as stack:
        address = None
        if arm == "kvtier":
            ddir = Path(tempfile.mkdtemp(prefix=f"daemon-{rep}-", dir=workdir))
            address = stack.enter_context(daemon(ddir, args.host_bytes))["address"]
            spec["connector"] = connector_config(address, args.revision)
        t_start = time.perf_counter()
        engine = Engine(spec, workdir / f"engine-{arm}-{rep}.log", args.kv_cache_gib, args.cpus)
        stack.callback(engine.close)
        result["startup_s"] = engine.wait_ready()
        result["kv_capacity_tokens"] = engine.kv_capacity_tokens()
        warm = make_docs(1, args.warmup_tokens, args.warmup_tokens, args.vocab, args.seed + 1000)[0]
        engine.call({"op": "generate", "ids": warm})  # first-step costs, not a document
        for rnd in range(1, args.rounds + 1):
            d0 = daemon_counters(address, args.revision) if address else None
            for i, ids in enumerate(docs):
                rec = engine.call({"op": "generate", "ids": ids})
                rec.update(round=rnd, doc=i)
                result["requests"].append(rec)
                src = rec["sources"]
                log(
                    f"  {arm}#{rep} round {rnd} doc {i}: {len(ids)} tokens, TTFT {rec['ttft_s']:.2f}s, "
                    f"computed {src['local_compute']}, cache {src['local_cache_hit']}, "
                    f"kvtier {src['external_kv_transfer']}"
                )
            rinfo: dict[str, Any] = {"round": rnd}
            if address and d0 is not None:
                d1 = daemon_counters(address, args.revision)
                rinfo.update({k: d1[k] - d0[k] for k in COUNTERS}, block_bytes=d1["block_bytes"])
            result["rounds"].append(rinfo)
    result["arm_s"] = time.perf_counter() - t_start
    return result


def summarize(results: list[dict[str, Any]], bpt: int) -> list[dict[str, Any]]:
    """One row per (arm, round): medians and token sums over every repetition, and both checks
    (which must hold in every repetition)."""
    rows = []
    for arm in ("alone", "kvtier"):
        arm_results = [r for r in results if r["arm"] == arm]
        if not arm_results:
            continue
        rounds = sorted({q["round"] for r in arm_results for q in r["requests"]})
        for rnd in rounds:
            row: dict[str, Any] = {
                "arm": arm,
                "round": rnd,
                "check1": True,
                "check2": None,
                "per_rep_median": [],
                "ttfts": [],
            }
            tot = dict.fromkeys(("prompt", *SOURCES, "bytes_out"), 0)
            for r in arm_results:
                reqs = [q for q in r["requests"] if q["round"] == rnd]
                row["ttfts"] += [q["ttft_s"] for q in reqs]
                row["per_rep_median"].append(statistics.median(q["ttft_s"] for q in reqs))
                prompt = sum(q["prompt_tokens"] for q in reqs)
                src = {s: sum(q["sources"][s] for q in reqs) for s in SOURCES}
                tot["prompt"] += prompt
                for s in SOURCES:
                    tot[s] += src[s]
                row["check1"] &= sum(src.values()) == prompt
                rinfo = next(x for x in r["rounds"] if x["round"] == rnd)
                if "bytes_out_shm" in rinfo:
                    b = rinfo["bytes_out_shm"]
                    tot["bytes_out"] += b
                    ok = b % bpt == 0 and b // bpt == src["external_kv_transfer"]
                    row["check2"] = ok if row["check2"] is None else (row["check2"] and ok)
            row.update(tot, median_ttft=statistics.median(row["ttfts"]), requests=len(row["ttfts"]))
            rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], bpt: int) -> str:
    def mark(ok: bool | None) -> str:
        return "n/a" if ok is None else ("ok" if ok else "FAIL")

    alone = {r["round"]: r["median_ttft"] for r in rows if r["arm"] == "alone"}
    head = (
        "| arm | round | requests | median TTFT s (run 1 / run 2) | vs alone | prompt tokens "
        "| computed | engine cache hit | loaded from kvtier | check 1 | kvtier bytes out "
        f"| ÷ {bpt:,} B/token | check 2 |"
    )
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        per_rep = " / ".join(f"{m:.2f}" for m in r["per_rep_median"])
        ratio = (
            f"{r['median_ttft'] / alone[r['round']]:.2f}×"
            if r["arm"] == "kvtier" and alone.get(r["round"])
            else ""
        )
        tokens_out = f"{r['bytes_out'] / bpt:,.2f}" if r["arm"] == "kvtier" else ""
        bytes_out = f"{r['bytes_out']:,}" if r["arm"] == "kvtier" else ""
        lines.append(
            f"| {r['arm']} | {r['round']} | {r['requests']} | {r['median_ttft']:.2f} ({per_rep}) "
            f"| {ratio} | {r['prompt']:,} | {r['local_compute']:,} | {r['local_cache_hit']:,} "
            f"| {r['external_kv_transfer']:,} | {mark(r['check1'])} | {bytes_out} | {tokens_out} "
            f"| {mark(r['check2'])} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT per round: every request as a dot, each repetition's median as a line."""
    import matplotlib  # the caller checks that it is installed
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"alone": "tab:red", "kvtier": "tab:blue"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, r in enumerate(results):
        rounds = sorted({q["round"] for q in r["requests"]})
        meds = [statistics.median(q["ttft_s"] for q in r["requests"] if q["round"] == n) for n in rounds]
        dx = (k - (len(results) - 1) / 2) * 0.06
        style = "-" if r["rep"] == 1 else "--"
        ax.plot(
            [n + dx for n in rounds],
            meds,
            style,
            marker="o",
            color=colors[r["arm"]],
            label=f"{'engine alone' if r['arm'] == 'alone' else 'engine + kvtier'}, run {r['rep']} (median)",
        )
        ax.scatter(
            [q["round"] + dx for q in r["requests"]],
            [q["ttft_s"] for q in r["requests"]],
            s=10,
            color=colors[r["arm"]],
            alpha=0.35,
        )
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(sorted({q["round"] for r in results for q in r["requests"]}))
    ax.set_xlabel("round (1 = first visits, then revisits)")
    ax.set_ylabel("time to first token, s (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace, workdir: Path, bpt: int, plots: bool) -> tuple[str, dict[str, Any], bool]:
    """The whole scenario: every arm of ``--order``; returns (report, records, checks passed)."""
    t0 = time.perf_counter()
    code = code_state()
    docs = make_docs(args.docs, args.doc_lo, args.doc_hi, args.vocab, args.seed)
    working_set = sum(map(len, docs))
    write_model(workdir / "model", args.layers, args.vocab, args.dtype)
    log(
        f"revisit: {args.docs} docs ({', '.join(str(len(d)) for d in docs)} tokens; "
        f"{working_set:,} in all), {args.rounds} rounds, order {','.join(args.order)}, "
        f"{args.dtype}, {bpt:,} KV bytes/token; code: {code}"
    )
    results: list[dict[str, Any]] = []
    for arm in args.order:
        rep = sum(1 for r in results if r["arm"] == arm) + 1
        log(f"arm {arm} run {rep}")
        res = run_arm(arm, rep, docs, args, workdir)
        log(
            f"  engine KV cache {res['kv_capacity_tokens']} tokens; start {res['startup_s']:.0f}s, "
            f"arm {res['arm_s']:.0f}s"
        )
        results.append(res)
    rows = summarize(results, bpt)
    wall = time.perf_counter() - t0
    capacity = sorted({r["kv_capacity_tokens"] for r in results if r["kv_capacity_tokens"]})
    if plots:
        title = (
            f"Qwen3-0.6B shape ({args.dtype}), {args.docs} docs / {working_set:,} tokens, "
            f"engine KV cache {', '.join(f'{c:,}' for c in capacity)} tokens"
        )
        plot(results, args.png, title)
    size = f"{args.num_blocks} blocks" if args.num_blocks else f"{args.kv_cache_gib} GiB"
    report = (
        f"Working set {working_set:,} tokens in {args.docs} documents "
        f"({', '.join(f'{len(d):,}' for d in docs)}); engine KV cache "
        f"{', '.join(f'{c:,}' for c in capacity)} tokens ({size}); "
        f"{bpt:,} KV bytes per token; engine start "
        f"{', '.join(str(round(r['startup_s'])) for r in results)} s; wall time {wall:.0f} s.\n\n"
        + markdown_table(rows, bpt)
    )
    ok = all(r["check1"] and r["check2"] is not False for r in rows)
    return report, {"docs": list(map(len, docs)), "wall_s": wall, "results": results, "rows": rows}, ok

"""Never slower than recompute (``--slow``): the engine alone against kvtier with the ``always``,
``adaptive`` and ``never`` load policies (docs/vllm.md, docs/adaptive.md), on a daemon whose tier
is slow on purpose and then fast again.

The daemon is ``python -m kvtierd.testing.serve --read-latency-file F serve ...`` (test-only: the
real daemon, whose NVMe reads sleep the milliseconds written in ``F``) with a host tier of
``--slow-host-bytes`` and write-through NVMe, so a revisit's blocks are read from the NVMe tier.
Three phases, each with documents of its own (``--slow-docs`` of ``--fleet-doc-tokens``):

* ``fast``: the file says 0: the tier at its own speed (page cache), far faster than recompute:
  adaptive must keep the speed-up of always;
* ``slow``: every NVMe read sleeps ``--slow-read-ms``: loading a block takes longer than the
  engine takes to recompute it (and longer than a sync load's step budget): adaptive must not
  be slower than the engine alone;
* ``recovered``: 0 again. The adaptive engine starts it with figures that say the tier is slow
  and must see it recover (its probes, and the daemon's figures from the other engine's loads).

In each phase, each engine (``alone``, ``always``, ``adaptive``, ``never``, then ``alone`` again;
one request at a time, ``max_tokens=1``) first visits every document (stores; not measured), then
revisits them for ``--slow-rounds`` rounds; the engine cache (``--small-blocks``) cannot keep them
between rounds. One engine after the other, not interleaved request by request: three vLLM
processes on two cores disturb each other's next request for a while after each one (tried: the
ratios of one phase moved by up to 2x with the order of the engines). The baseline is the mean of
the engine alone's two runs, request by request, so the machine's drift over a phase falls on
both sides; ``never`` (the connector, nothing loaded by policy) shows the connector's own cost.
Per engine and phase: the revisits' wall clock and TTFT p50, the ratios to the baseline (of the
sums, and the median of the per-request ratios), the tokens computed, loaded and failed (the
connector's own counters: vLLM counts a hit's tokens as transferred also when the load failed),
and the adaptive engine's decision counters. Every engine's outputs must equal the engine
alone's (check).
"""

from __future__ import annotations

import argparse
from typing import Any

from seed.common import SOURCES, EngineSet, connector_config, daemon, log, make_docs, percentile

ENGINES = ("alone", "always", "adaptive", "never", "alone again")
PHASES = ("fast", "slow", "recovered")


def run(args: argparse.Namespace, es: EngineSet) -> tuple[str, dict[str, Any], bool]:
    latency = es.workdir / "read-latency-ms"
    latency.write_text(str(args.slow_read_ms))
    ready = es.stack.enter_context(
        daemon(
            es.workdir / "slow-daemon",
            args.slow_host_bytes,
            "--slab-bytes",
            args.slow_slab_bytes,
            "--disk-dir",
            str(es.workdir / "slow-nvme"),
            "--disk-bytes",
            "4GiB",
            "--write-policy",
            "write-through",
            launcher=("kvtierd.testing.serve", "--read-latency-file", str(latency)),
        )
    )
    rev = f"{args.revision}-slow"
    engines = es.start_with(
        ["alone", "slow-always", "slow-adaptive", "slow-never"],
        {
            "alone": None,
            "slow-always": connector_config(ready["address"], rev + "-always", load_policy="always"),
            "slow-adaptive": connector_config(ready["address"], rev + "-adaptive", load_policy="adaptive"),
            "slow-never": connector_config(ready["address"], rev + "-never", load_policy="never"),
        },
    )
    by = {
        "alone": engines["alone"],
        "always": engines["slow-always"],
        "adaptive": engines["slow-adaptive"],
        "never": engines["slow-never"],
        "alone again": engines["alone"],
    }
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    outputs_equal = True
    records: list[dict[str, Any]] = []
    for p, phase in enumerate(PHASES):
        latency.write_text(str(args.slow_read_ms if phase == "slow" else 0))
        docs = make_docs(args.slow_docs, *args.fleet_doc_tokens, args.vocab, args.seed + 5000 + p)
        outs: dict[str, list[list[int]]] = {}
        for name in ENGINES:
            eng = by[name]
            for ids in docs:  # first visits: the kvtier engines store them
                eng.call({"op": "generate", "ids": ids})
            m0 = eng.call({"op": "metrics"})["kvtier"]
            recs = []
            for rnd in range(args.slow_rounds):
                for i, ids in enumerate(docs):
                    rec = eng.call({"op": "generate", "ids": ids})
                    recs.append({**rec, "phase": phase, "engine": name, "round": rnd + 2, "doc": i})
            m1 = eng.call({"op": "metrics"})["kvtier"]
            outs[name] = [r["output"] for r in recs]
            records += recs
            rows[(phase, name)] = row(recs, {k: m1[k] - m0.get(k, 0.0) for k in m1})
            log(
                f"  slow-tier {phase} {name}: revisits {rows[(phase, name)]['wall_s']:.2f}s, TTFT p50 "
                f"{rows[(phase, name)]['ttft_p50']:.3f}s, sources {rows[(phase, name)]['sources']}"
            )
        outputs_equal &= all(outs[n] == outs["alone"] for n in ENGINES)
        paired(rows, phase)
    return (
        report(args, rows, outputs_equal),
        {"rows": {f"{k[0]}/{k[1]}": v for k, v in rows.items()}, "records": records},
        outputs_equal,
    )


def row(recs: list[dict[str, Any]], decisions: dict[str, float]) -> dict[str, Any]:
    """One engine's revisits in one phase: sums, TTFT p50, per-request walls, counters."""
    return {
        "wall_s": sum(r["wall_s"] for r in recs),
        "ttft_p50": percentile([r["ttft_s"] for r in recs], 0.5),
        "walls": [r["wall_s"] for r in recs],
        "sources": {s: sum(r["sources"][s] for r in recs) for s in SOURCES},
        "decisions": decisions,
    }


def paired(rows: dict[tuple[str, str], dict[str, Any]], phase: str) -> None:
    """The baseline of a phase is the engine alone measured first and again last (the mean of
    the two, request by request): the machine's drift over the phase falls on both sides. Each
    engine gets ``vs_alone`` (its wall sum over the baseline's) and ``median_ratio`` (the median
    over requests of its wall over the baseline's for the same document and round: one stalled
    request does not move it); ``noise`` is the engine alone's second run over its first."""
    first, again = rows[(phase, "alone")], rows[(phase, "alone again")]
    base = [(a + b) / 2 for a, b in zip(first["walls"], again["walls"], strict=True)]
    for name in ENGINES:
        r = rows[(phase, name)]
        r["vs_alone"] = r["wall_s"] / sum(base)
        r["ttft_vs_alone"] = r["ttft_p50"] / ((first["ttft_p50"] + again["ttft_p50"]) / 2)
        r["median_ratio"] = percentile([w / b for w, b in zip(r["walls"], base, strict=True)], 0.5)
    first["noise"] = again["wall_s"] / first["wall_s"]


def report(args: argparse.Namespace, rows: dict[tuple[str, str], dict[str, Any]], equal: bool) -> str:
    lines = [
        "| phase | engine | revisits wall s | vs alone | per request, median | TTFT p50 s | vs alone "
        "| computed | loaded from kvtier | load failed (blocks) | recomputed: slower, budget | probes |",
        "|" + " --- |" * 12,
    ]
    for phase in PHASES:
        for name in ENGINES:
            r = rows[(phase, name)]
            d = r["decisions"]

            def pick(word: str, d: dict[str, float] = d) -> str:
                vals = [v for k, v in d.items() if word in k]
                return f"{int(sum(vals)):,}" if vals else "-"

            lines.append(
                f"| {phase} | {name} | {r['wall_s']:.2f} | {r['vs_alone']:.3f}× | {r['median_ratio']:.3f}× "
                f"| {r['ttft_p50']:.3f} | {r['ttft_vs_alone']:.2f}× "
                f"| {r['sources']['local_compute']:,} | {pick('_loaded_tokens')} "
                f"| {pick('load_failed_blocks')} "
                f"| {pick('recomputed_slower')}, {pick('recomputed_budget')} | {pick('probe')} |"
            )
    noise = ", ".join(f"{p} {rows[(p, 'alone')]['noise']:.3f}×" for p in PHASES)
    return (
        f"{args.slow_docs} documents per phase, {args.slow_rounds} revisit rounds, one request at a "
        f"time; NVMe reads sleep {args.slow_read_ms} ms in the slow phase, 0 in the others; host "
        f'tier {args.slow_host_bytes}. "alone" is the mean of the engine alone\'s runs first and '
        f"last in the phase (drift: the second over the first, {noise}).\n\n"
        + "\n".join(lines)
        + f"\n\nCheck (every engine's outputs equal the engine alone's): {'ok' if equal else 'FAIL'}."
    )

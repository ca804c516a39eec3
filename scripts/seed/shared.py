"""Tenants sharing one system prompt (``--shared``, issue 43): flat salting against a published
prefix (docs/vllm.md "Shared prefixes"), each arm on a fresh ``kvtierd`` and a fresh engine.

``--shared-tenants`` tenants (N) are N ``cache_salt`` values ("tenant-1"...) on one vLLM engine.
Tenant i sends ``SYSTEM + SUFFIX_i``: one ``--shared-prompt-tokens`` system prompt that every
tenant sends and a private ``--shared-suffix-tokens`` suffix (random token ids, fixed seed), in
tenant order, one request at a time, ``max_tokens=1``. Two arms, in this order, each with its own
single-tenant daemon (Unix socket, shm; a host tier that holds every block of the arm, so that
nothing is evicted) and engine with the kvtier connector (``prefix_refresh_ms`` 200, the rest at
its defaults: sync loads, ``load_policy`` adaptive):

* ``flat``: nothing published. Every salt is a namespace of its own: each tenant computes the
  system prompt and stores its own copy of its blocks.
* ``shared``: ``Client.publish_prefix("fleet", "system", SYSTEM)`` before the engine starts (its
  connector fetches the list at start). The prompt's whole blocks are keyed in the group's scope:
  tenant 1 computes and stores them, tenants 2..N load them and compute their suffix.

The engine's KV cache holds one request's blocks (``max_model_len``: the prompt and one token
rounded up to a block; plus vLLM's null block), and vLLM salts its own prefix cache per request,
so a tenant never hits another's blocks there and little of its own earlier ones.

Then, in the shared arm only, the probe: ``--shared-probes`` rounds of three requests each, all
shuffled, each from a tenant none of the last ``RECENT`` requests came from (a request's first
block can survive two more requests in the engine cache):

* ``other``: tenant j sends tenant i's exact prompt (i != j, a pair not probed before): it must
  load the shared whole blocks and nothing more (cross-tenant suffix hits: 0);
* ``fresh``: tenant j sends the system prompt and a suffix that nobody sent;
* ``own`` (the control): tenant i sends its own prompt again; its suffix is in kvtier.

From TTFTs: ROC AUC of ``other`` against ``fresh`` (a shorter TTFT read as "stored by someone",
Mann-Whitney U / (n1 n2), ties half): 0.5 is chance; its permutation p-value. The same for
``own`` against ``fresh`` shows what the probe detects when there is a hit.

Figures per request: vLLM's TTFT, prompt tokens by source, the connector's counter deltas; per
arm: the daemon's Stats once the stores have landed (resident blocks and bytes, the group's
namespaces apart) and the connector's counters. Checks: computed + engine cache hit + loaded =
prompt tokens (every request); the daemon's bytes out ÷ KV bytes per token = loaded tokens (per
arm and phase); in the shared arm the lookups of tenants 2..N and of the probes hit every shared
whole block (``sched_shared_hit_blocks``; what is loaded is the load policy's choice), and no
``other`` probe hits or loads past them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from seed.common import (
    BLOCK_TOKENS,
    CHECK2_HINT,
    Engine,
    connector_config,
    daemon,
    engine_spec,
    fmt_s,
    kv_bytes_per_token,
    log,
    percentile,
    random_ids,
    write_model,
)

ARMS = ("flat", "shared")
KINDS = ("other", "fresh", "own")
GROUP, NAME = "fleet", "system"
RECENT = 3  # a probe's tenant is none of the last RECENT requests' (see plan_probes)
MiB = 2**20


def make_prompts(args: argparse.Namespace) -> dict[str, Any]:
    """The system prompt, one suffix per tenant and one fresh suffix per probe; distinct first
    tokens, so no suffix begins like another."""
    rng = random.Random(args.seed + 4300)
    n, k = args.shared_tenants, args.shared_probes
    firsts = rng.sample(range(3, args.vocab), n + k)
    suffix = [random_ids(rng, args.shared_suffix_tokens, args.vocab, f) for f in firsts]
    system = random_ids(rng, args.shared_prompt_tokens, args.vocab)
    return {"system": system, "suffixes": suffix[:n], "fresh": suffix[n:]}


def daemon_figures(address: str) -> dict[str, int]:
    """Resident blocks and bytes (all, and the group's namespaces'), bytes out, stores."""
    from kvtier.client import Client

    with Client(address, "tcp", timeout_s=10.0, heartbeat=False) as client:
        stats = client.stats()
    total = stats["total"]
    groups = [ns for ns in stats["namespaces"] if ns.get("spec", {}).get("group")]
    keys = ("resident_blocks", "resident_bytes", "bytes_out_shm", "stores_accepted", "stores_already_present")
    return {
        "namespaces": len(stats["namespaces"]),
        "host_used_bytes": int(stats["host_used_bytes"]),
        **{k: int(total[k]) for k in keys},
        **{f"group_{k}": sum(int(ns["counters"][k]) for ns in groups) for k in keys[:2]},
    }


def settled(address: str, quiet_s: float = 1.0, limit_s: float = 30.0) -> dict[str, int]:
    """``daemon_figures`` once the engine's last stores have landed: ``stores_accepted`` unchanged
    for ``quiet_s`` (the connector stores on its own thread after a request returns)."""
    last, deadline = daemon_figures(address), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = daemon_figures(address)
        if now["stores_accepted"] == last["stores_accepted"]:
            return now
        last = now
    return last


def host_bytes(args: argparse.Namespace, bpt: int) -> str:
    """Room for the larger arm's whole blocks (flat: N prompts; shared: the system prompt once,
    the N tenants' and the probes' own blocks), +12.5 % and 256 MiB: nothing is evicted."""
    blocks = (args.shared_prompt_tokens + args.shared_suffix_tokens) // BLOCK_TOKENS
    system = args.shared_prompt_tokens // BLOCK_TOKENS
    n = args.shared_tenants
    need = max(n * blocks, system + (n + 3 * args.shared_probes) * (blocks - system))
    return f"{need * bpt * BLOCK_TOKENS * 9 // 8 // MiB + 256}MiB"


def start_engine(args: argparse.Namespace, workdir: Path, model: Path, address: str) -> Engine:
    span = args.shared_prompt_tokens + args.shared_suffix_tokens + 1
    max_len = -(-span // BLOCK_TOKENS) * BLOCK_TOKENS
    spec = engine_spec(
        model,
        args.dtype,
        max_len,
        max_len // BLOCK_TOKENS + 1,  # vLLM keeps one block back (its null block)
        connector_config(address, f"{args.revision}-shared", prefix_refresh_ms=200),
    )
    spec["max_num_batched_tokens"] = max_len  # every prompt in one prefill step
    engine = Engine(spec, workdir / "engine.log", args.kv_cache_gib, args.cpus)
    try:
        engine.wait_ready()
        # less than a block, so that it stores nothing (the daemon's blocks are the tenants')
        warm = random_ids(random.Random(args.seed + 1000), BLOCK_TOKENS - 1, args.vocab)
        engine.call({"op": "generate", "ids": warm, "cache_salt": "warm-up"})
    except BaseException:
        engine.close()
        raise
    return engine


def ask(engine: Engine, ids: list[int], tenant: int, **tags: Any) -> dict[str, Any]:
    rec = engine.call({"op": "generate", "ids": ids, "cache_salt": f"tenant-{tenant + 1}"})
    rec.update(tenant=tenant + 1, **tags)
    src = rec["sources"]
    log(
        f"  {tags.get('arm')} {tags.get('kind', 'tenant')} {tenant + 1}: TTFT {rec['ttft_s']:.2f} s, "
        f"computed {src['local_compute']}, cache {src['local_cache_hit']}, "
        f"kvtier {src['external_kv_transfer']}"
    )
    return rec


def run_arm(args: argparse.Namespace, arm: str, workdir: Path, model: Path, prompts: dict[str, Any]) -> Any:
    """One arm in fresh processes: the N tenants' requests, then (shared) the probe."""
    bpt = kv_bytes_per_token(args.small_layers, args.dtype)
    with ExitStack() as stack:
        ready = stack.enter_context(daemon(workdir / "daemon", host_bytes(args, bpt)))
        address = ready["address"]
        if arm == "shared":
            from kvtier.client import Client

            with Client.connect(address, "tcp", timeout_s=10.0) as client:
                client.publish_prefix(GROUP, NAME, prompts["system"])
        engine = start_engine(args, workdir, model, address)
        stack.callback(engine.close)
        d0 = settled(address)
        system = prompts["system"]
        reqs = [ask(engine, system + sfx, i, arm=arm) for i, sfx in enumerate(prompts["suffixes"])]
        out: dict[str, Any] = {
            "requests": reqs,
            "daemon_before": d0,
            "daemon": settled(address),
            "connector": engine.call({"op": "metrics"})["kvtier"],
            "startup_s": engine.startup_s,
        }
        if arm == "shared":
            out["probes"] = probe(args, engine, prompts)
            out["daemon_after_probes"] = settled(address)
            out["connector_after_probes"] = engine.call({"op": "metrics"})["kvtier"]
        return out


def plan_probes(n: int, k: int, rng: random.Random) -> list[dict[str, Any]]:
    """``k`` rounds of the three kinds, shuffled. Each request's tenant is none of the last
    ``RECENT`` requests' (the N requests' last tenants first): the engine cache can keep the
    first block of a request two back (seen: 128 tokens hit). An ``other`` probe's pair is new."""
    kinds = [(kind, r) for r in range(k) for kind in KINDS]
    rng.shuffle(kinds)
    recent, pairs, plan = list(range(n))[-RECENT:], set(), []
    for kind, r in kinds:
        tenant = rng.choice([t for t in range(n) if t not in recent[-min(RECENT, n - 1) :]])
        victim = tenant
        if kind == "other":
            fresh_victims = [v for v in range(n) if v != tenant and (tenant, v) not in pairs]
            victim = rng.choice(fresh_victims or [v for v in range(n) if v != tenant])
            pairs.add((tenant, victim))
        plan.append({"kind": kind, "round": r, "tenant": tenant, "victim": victim})
        recent.append(tenant)
    return plan


def probe(args: argparse.Namespace, engine: Engine, prompts: dict[str, Any]) -> list[dict[str, Any]]:
    plan = plan_probes(args.shared_tenants, args.shared_probes, random.Random(args.seed + 4301))
    out = []
    for p in plan:
        suffix = prompts["fresh"][p["round"]] if p["kind"] == "fresh" else prompts["suffixes"][p["victim"]]
        rec = ask(engine, prompts["system"] + suffix, p["tenant"], arm="probe", kind=p["kind"])
        rec.update(victim=p["victim"] + 1, round=p["round"])
        out.append(rec)
    return out


def auc(pos: list[float], neg: list[float]) -> float:
    """P(a ``pos`` TTFT < a ``neg`` TTFT), ties half: Mann-Whitney U / (n1 n2)."""
    if not pos or not neg:
        return float("nan")
    wins = sum((p < q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def perm_p(pos: list[float], neg: list[float], rng: random.Random, n: int = 4000) -> float:
    """Two-sided permutation p-value of ``|auc - 0.5|`` (labels shuffled ``n`` times)."""
    observed = abs(auc(pos, neg) - 0.5)
    pooled, hits = pos + neg, 0
    for _ in range(n):
        rng.shuffle(pooled)
        hits += abs(auc(pooled[: len(pos)], pooled[len(pos) :]) - 0.5) >= observed - 1e-12
    return (hits + 1) / (n + 1)


def tot(reqs: list[dict[str, Any]], source: str) -> int:
    return sum(int(r["sources"][source]) for r in reqs)


def checks(args: argparse.Namespace, arms: dict[str, Any], bpt: int) -> dict[str, Any]:
    """The checks of the module docstring; each a bool, plus the figures they compare."""
    shared_tokens = args.shared_prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    every = [r for a in arms.values() for r in a["requests"] + a.get("probes", [])]
    out: dict[str, Any] = {"check1": all(sum(r["sources"].values()) == r["prompt_tokens"] for r in every)}
    check2 = True
    for a in arms.values():
        phases = [(a["daemon_before"], a["daemon"], a["requests"])]
        if "probes" in a:
            phases.append((a["daemon"], a["daemon_after_probes"], a["probes"]))
        for d0, d1, reqs in phases:
            sent = d1["bytes_out_shm"] - d0["bytes_out_shm"]
            check2 &= sent % bpt == 0 and sent // bpt == tot(reqs, "external_kv_transfer")
    out["check2"] = check2
    sh, shared_blocks = arms["shared"], shared_tokens // BLOCK_TOKENS
    rest = sh["requests"][1:]
    out["tenants_shared_hit"] = sum(kv(r, "sched_shared_hit_blocks") == shared_blocks for r in rest)
    out["tenants_shared_loaded"] = sum(r["sources"]["external_kv_transfer"] == shared_tokens for r in rest)
    out["shared_hits"] = out["tenants_shared_hit"] == len(rest)
    # an ``other`` probe's hit: what the connector offered, or what vLLM did not compute
    hit = [
        max(kv(r, "sched_hit_blocks") * BLOCK_TOKENS, r["prompt_tokens"] - r["sources"]["local_compute"])
        for r in sh["probes"]
        if r["kind"] == "other"
    ]
    out["cross_tenant_suffix_tokens"] = sum(max(0, x - shared_tokens) for x in hit)
    out["probes_shared_hit"] = all(kv(r, "sched_shared_hit_blocks") == shared_blocks for r in sh["probes"])
    answers = zip(arms["flat"]["requests"], sh["requests"], strict=True)
    out["same_answers"] = sum(a["output"] == b["output"] for a, b in answers)  # informative
    out["ok"] = out["cross_tenant_suffix_tokens"] == 0 and all(
        out[k] for k in ("check1", "check2", "shared_hits", "probes_shared_hit")
    )
    return out


def kv(rec: dict[str, Any], name: str) -> int:
    """The request's delta of the connector's counter ``vllm:kvtier_<name>``."""
    return int(rec["kvtier"].get(f"vllm:kvtier_{name}", 0))


def run(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, Any], bool]:
    if args.shared_tenants < 2:
        raise SystemExit("--shared-tenants must be at least 2")
    model = write_model(workdir / "model", args.small_layers, args.vocab, args.dtype)
    prompts = make_prompts(args)
    arms = {}
    for arm in ARMS:
        log(f"shared: arm {arm}, {args.shared_tenants} tenants")
        arms[arm] = run_arm(args, arm, workdir / arm, model, prompts)
    bpt = kv_bytes_per_token(args.small_layers, args.dtype)
    result = checks(args, arms, bpt)
    return report(args, arms, result, bpt), {**arms, "checks": result}, bool(result["ok"])


def arm_row(arm: str, a: dict[str, Any], n: int) -> str:
    reqs, d = a["requests"], a["daemon"]
    rest = [r["ttft_s"] for r in reqs[1:]]
    return (
        f"| {arm} | {n} | {sum(r['prompt_tokens'] for r in reqs):,} | {tot(reqs, 'local_compute'):,} "
        f"| {tot(reqs, 'external_kv_transfer'):,} | {tot(reqs, 'local_cache_hit'):,} "
        f"| {d['resident_blocks']:,} / {d['resident_bytes'] / MiB:,.0f} | {reqs[0]['ttft_s']:.2f} "
        f"| {statistics.median(rest):.2f} | {percentile(rest, 0.9):.2f} |"
    )


def probe_rows(probes: list[dict[str, Any]], seed: int) -> tuple[list[str], dict[str, float]]:
    ttft = {k: [r["ttft_s"] for r in probes if r["kind"] == k] for k in KINDS}
    rows: list[str] = []
    figures: dict[str, float] = {}
    for kind in KINDS:
        rs = [r for r in probes if r["kind"] == kind]

        def span(src: str, rs: list[dict[str, Any]] = rs) -> str:
            xs = [r["sources"][src] for r in rs]
            return f"{min(xs):,}" if min(xs) == max(xs) else f"{min(xs):,}-{max(xs):,}"

        a = p = float("nan")
        if kind != "fresh":
            a, p = auc(ttft[kind], ttft["fresh"]), perm_p(ttft[kind], ttft["fresh"], random.Random(seed))
            figures |= {f"auc_{kind}": a, f"p_{kind}": p}
        rows.append(
            f"| {kind} | {len(rs)} | {span('external_kv_transfer')} | {span('local_compute')} "
            f"| {span('local_cache_hit')} | {statistics.median(ttft[kind]):.3f} "
            f"| {percentile(ttft[kind], 0.9):.3f} | {'' if kind == 'fresh' else f'{a:.2f} (p {p:.2g})'} |"
        )
    return rows, figures


def connector_line(arms: dict[str, Any]) -> str:
    keys = ("sched_hit_blocks", "sched_shared_hit_blocks", "loaded_tokens", "load_failed_blocks")
    more = ("decision_tokens_recomputed_budget", "decision_tokens_recomputed_slower", "sched_lookup_timeouts")
    parts = []
    for arm, a in arms.items():
        c = {k.removeprefix("vllm:kvtier_").removesuffix("_total"): v for k, v in a["connector"].items()}
        parts.append(
            f"{arm}: " + ", ".join(f"{k} {c.get(k, 0):,.0f}" for k in (*keys, "stored_tokens", *more))
        )
    return "; ".join(parts)


def summary(args: argparse.Namespace, arms: dict[str, Any], result: dict[str, Any], bpt: int) -> str:
    """The ratios shared / flat and the bytes' formula, predicted against measured."""
    n, p, s = args.shared_tenants, args.shared_prompt_tokens, args.shared_suffix_tokens
    blocks, own = (p + s) // BLOCK_TOKENS, (p + s) // BLOCK_TOKENS - p // BLOCK_TOKENS
    flat, sh = arms["flat"]["daemon"], arms["shared"]["daemon"]
    part = {k: tot(a["requests"], "local_compute") - n * s for k, a in arms.items()}
    result.update(
        bytes_ratio=sh["resident_bytes"] / flat["resident_bytes"],
        computed_ratio=part["shared"] / max(1, part["flat"]),
        system_computed=part,
    )
    return (
        f"Shared / flat: daemon host bytes {result['bytes_ratio']:.4f}x (the group's namespace holds "
        f"{sh['group_resident_blocks']} blocks); system-prompt tokens computed {part['shared']:,} vs "
        f"{part['flat']:,} ({part['shared'] / p:.2f}x vs {part['flat'] / p:.2f}x the prompt; ratio "
        f"{result['computed_ratio']:.4f}). Tenants 2..N whose lookup hit every shared block: "
        f"{result['tenants_shared_hit']} of {n - 1}; that loaded them all: "
        f"{result['tenants_shared_loaded']}. Blocks, flat = N x {blocks}, shared = "
        f"{p // BLOCK_TOKENS} + N x {own} (of {bpt * BLOCK_TOKENS:,} B): predicted {n * blocks:,} "
        f"and {p // BLOCK_TOKENS + n * own:,}, measured {flat['resident_blocks']:,} and "
        f"{sh['resident_blocks']:,}."
    )


def report(args: argparse.Namespace, arms: dict[str, Any], result: dict[str, Any], bpt: int) -> str:
    n, p, s = args.shared_tenants, args.shared_prompt_tokens, args.shared_suffix_tokens
    flat, sh = arms["flat"], arms["shared"]
    rows, figures = probe_rows(sh["probes"], args.seed + 4302)
    result.update(figures)
    check2 = "ok" if result["check2"] else "FAIL" + CHECK2_HINT
    return "\n".join(
        [
            f"{n} tenants (cache salts) on one engine, each sending one {p:,}-token system prompt and "
            f"a private {s:,}-token suffix; engine start {fmt_s(flat['startup_s'])} (flat), "
            f"{fmt_s(sh['startup_s'])} (shared).",
            "",
            "| arm | tenants | prompt tokens | computed | loaded from kvtier | engine cache hit "
            "| daemon resident blocks / MiB | TTFT of tenant 1 s | median TTFT of tenants 2..N s | p90 s |",
            "|" + " --- |" * 10,
            arm_row("flat", flat, n),
            arm_row("shared", sh, n),
            "",
            summary(args, arms, result, bpt),
            f"Connector counters: {connector_line(arms)}.",
            "",
            "| probe | requests | loaded from kvtier per request | computed per request | engine cache hit "
            "| TTFT p50 s | TTFT p90 s | ROC AUC vs fresh |",
            "|" + " --- |" * 8,
            *rows,
            "",
            f"Cross-tenant suffix hits: {result['cross_tenant_suffix_tokens']:,} tokens. Check 1 "
            f"(computed + cache hit + loaded = prompt): {'ok' if result['check1'] else 'FAIL'}; "
            f"check 2 (daemon bytes out / {bpt:,} = loaded tokens, per arm and phase): {check2}. "
            f"Tenants whose generated token is the same in both arms: {result['same_answers']} of {n}.",
        ]
    )

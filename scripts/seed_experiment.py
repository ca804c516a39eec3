"""The seed experiment: a real vLLM engine whose own KV cache is smaller than the working set it
revisits, alone and with kvtier (docs/benchmarks.md §9). Run: ``make seed``, or
``.venv-vllm/bin/python scripts/seed_experiment.py`` (the defaults are the documented run).

Seven scenarios, each chosen by a flag; with none of the flags, the first six run, in this order
(``--shared`` runs only when named: ~9 min of its own at its defaults):

* ``--revisit``: the original experiment, described below (scripts/seed/revisit.py);
* ``--chats``: multi-turn conversations, tokens by source per turn (scripts/seed/chats.py);
* ``--fleet``: two engines sharing one daemon, cross-replica hits (scripts/seed/fleet.py);
* ``--mix``: concurrent clients, revisits and new documents, sync vs async loads vs the engine
  alone, TTFT and inter-token latency (scripts/seed/mix.py);
* ``--slow``: a tier slowed on purpose, then fast again: the engine alone (before and after)
  against the ``always``, ``adaptive`` and ``never`` load policies (scripts/seed/slow.py);
* ``--interference``: a decoding request's inter-token latency with loads and stores running
  beside it, with the interference budget and without (scripts/seed/interference.py);
* ``--shared``: many tenants (cache salts) sending one system prompt with private suffixes, flat
  salting against a published prefix, and a timing probe across tenants (scripts/seed/shared.py).

The last six use the same model shape with ``--small-layers`` layers (default 4, so that they
fit the runtime) and engine KV caches of a fixed number of blocks; their module docstrings say
what they measure. The rest of this docstring is the ``--revisit`` scenario.

What it measures. ``--docs`` documents of random token ids (fixed seed, distinct per document,
lengths drawn from ``--doc-tokens``) are sent by one client, one request at a time
(``max_tokens=1``), for ``--rounds`` rounds: round 1 visits every document once, the later rounds
revisit them in the same order. The engine's KV cache (``--kv-cache-gib``) holds clearly fewer
tokens than the documents together, so with prefix caching alone a revisit finds its blocks
evicted. Two arms, each in fresh processes (a fresh engine process; for kvtier also a fresh
daemon), run in the order ``--order`` (default alone, kvtier, kvtier, alone):

* ``alone``: the engine with prefix caching and no ``kv_transfer_config``;
* ``kvtier``: the same engine with ``KvtierConnector`` (``kv_load_failure_policy`` "recompute")
  and a ``kvtierd`` whose host tier holds the whole working set.

Per request it records vLLM's own figures: the time to first token (``RequestOutput.metrics``,
arrival to first token; the wall time of ``llm.generate`` is kept beside it), the prompt tokens
by source (deltas of ``vllm:prompt_tokens_by_source`` from ``llm.get_metrics()``:
``local_compute``, ``local_cache_hit``, ``external_kv_transfer``) and ``num_cached_tokens``. Per
round of the kvtier arm it reads the daemon's Stats (the namespace's ``bytes_out_shm`` delta).
Two reconciliation checks per round: computed + engine cache hit + loaded from kvtier = prompt
tokens, and kvtier bytes out / KV bytes per token is a whole number equal to the loaded tokens.

Defaults (sized for the 2-core development machine, ~12 min): a Qwen3-0.6B-shaped model (28
layers, 8 KV heads, head dim 128; vocabulary cut to 32,000; dummy weights) in float32, because
bf16 on a CPU without AVX-512 is ~60x slower; 4 documents of 1,500-1,900 tokens (6,598 in all)
against a 1 GiB engine cache (4,608 tokens; 224 KiB of KV per token); the same OpenMP cores for
both arms (vLLM's automatic binding gives an engine without a connector one core fewer).

Output: a markdown report per scenario on stdout, the plot ``--png`` (TTFT per round, both
arms, every repetition; skipped when matplotlib is not installed), and with ``--json`` every
record. Each engine is this script re-invoked as
``--engine SPEC`` under the vLLM environment's interpreter, spoken to in JSON lines over
stdin/stdout; processes and temporary directories are removed on exit, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ``seed`` package beside this file

from seed.common import (
    DTYPE_BYTES,
    QWEN3_06B,
    ROOT,
    EngineSet,
    code_state,
    kv_bytes_per_token,
    log,
    parse_range,
)

SCENARIOS = ("revisit", "chats", "fleet", "mix", "slow", "interference", "shared")
OPT_IN = ("shared",)  # not in the default run (make seed)
NEEDS = {
    "chats": ("alone", "sync"),
    "fleet": ("sync", "sync-b"),
    "mix": ("alone", "sync", "async"),
    "slow": ("alone",),
    "interference": ("alone", "budget", "tight", "nobudget"),
}


def parse_order(text: str) -> list[str]:
    order = [a.strip() for a in text.split(",") if a.strip()]
    if not order or any(a not in ("alone", "kvtier") for a in order):
        raise argparse.ArgumentTypeError("a comma-separated list of 'alone' and 'kvtier'")
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name in SCENARIOS:
        p.add_argument(
            f"--{name}", action="store_true", help=f"run the {name} scenario (none: all but shared)"
        )
    g = p.add_argument_group("revisit")
    g.add_argument("--docs", type=int, default=4, help="documents in the working set")
    g.add_argument("--doc-tokens", default="1500-1900", help="document length range LO-HI")
    g.add_argument("--rounds", type=int, default=3, help="round 1 visits, later rounds revisit")
    g.add_argument(
        "--order",
        type=parse_order,
        default="alone,kvtier,kvtier,alone",
        help="arms in run order, each in fresh processes",
    )
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="override the engine's KV blocks (num_gpu_blocks_override), for quick checks",
    )
    g.add_argument("--layers", type=int, default=QWEN3_06B["num_hidden_layers"])
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "seed_ttft.png")
    g = p.add_argument_group("chats, fleet and mix (a smaller model; engine caches in blocks of 128)")
    g.add_argument("--small-layers", type=int, default=4, help="layers of their model")
    g.add_argument(
        "--small-blocks",
        type=int,
        default=20,
        help="each small engine's KV cache in blocks (max_model_len: one block less)",
    )
    g.add_argument("--chat-count", type=int, default=3, help="conversations, interleaved")
    g.add_argument("--chat-turns", type=int, default=3)
    g.add_argument("--chat-first", type=parse_range, default="800-1000", help="first message tokens")
    g.add_argument("--chat-message", type=parse_range, default="60-160", help="later messages' tokens")
    g.add_argument("--chat-answer", type=int, default=96, help="tokens per answer")
    g.add_argument("--fleet-docs", type=int, default=6)
    g.add_argument("--fleet-doc-tokens", type=parse_range, default="600-1000")
    g.add_argument(
        "--fleet-rounds",
        type=int,
        default=3,
        help="round 1 on engine i%%2, round 2 on the other engine, then alternating",
    )
    g.add_argument("--mix-clients", type=int, default=3, help="closed-loop clients in one engine")
    g.add_argument("--mix-requests", type=int, default=4, help="requests per client per phase")
    g.add_argument(
        "--mix-phases", type=int, default=3, help="phases; each runs on every configuration, in rotated order"
    )
    g.add_argument("--mix-pool", type=int, default=4, help="documents that requests revisit")
    g.add_argument("--mix-doc-tokens", type=parse_range, default="600-1000")
    g.add_argument("--mix-revisit", type=float, default=0.5, help="share of requests that revisit")
    g.add_argument("--mix-answer", type=int, default=24, help="tokens per answer")
    g.add_argument("--slow-docs", type=int, default=4, help="documents per phase of --slow")
    g.add_argument("--slow-rounds", type=int, default=4, help="revisit rounds per phase of --slow")
    g.add_argument(
        "--slow-read-ms", type=int, default=150, help="each NVMe read's sleep in the slow phase of --slow"
    )
    g.add_argument("--slow-host-bytes", default="16MiB", help="the --slow daemon's host tier")
    g.add_argument("--slow-slab-bytes", default="4MiB", help="the --slow daemon's slab size")
    g.add_argument(
        "--interference-decode",
        type=int,
        default=160,
        help="tokens the decoding request of --interference generates",
    )
    g = p.add_argument_group("shared (the small model; an engine and a daemon per arm)")
    g.add_argument("--shared-tenants", type=int, default=64, help="tenants (cache salts), at least 2")
    g.add_argument("--shared-prompt-tokens", type=int, default=4096, help="the system prompt's tokens")
    g.add_argument("--shared-suffix-tokens", type=int, default=256, help="each tenant's private suffix")
    g.add_argument("--shared-probes", type=int, default=32, help="probe rounds (other, fresh, own)")
    g = p.add_argument_group("all scenarios")
    g.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="VLLM_CPU_KVCACHE_SPACE (the revisit engine's cache when --num-blocks is unset)",
    )
    g.add_argument("--host-bytes", default="4GiB", help="kvtierd host tier")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_BYTES),
        help="model and KV dtype (bfloat16 is ~60x slower than float32 on AVX2 CPUs)",
    )
    g.add_argument("--vocab", type=int, default=32000, help="vocabulary (Qwen3-0.6B has 151,936)")
    g.add_argument("--warmup-tokens", type=int, default=200, help="one warm-up prompt per engine")
    g.add_argument(
        "--cpus",
        default=",".join(map(str, sorted(os.sched_getaffinity(0)))),
        help="the engine worker's cores (VLLM_CPU_OMP_THREADS_BIND), same for every arm",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--revision", default="seed-r1", help="model_revision for the connector")
    g.add_argument("--json", type=Path, default=None, help="write every record here")
    g.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if isinstance(args.order, str):
        args.order = parse_order(args.order)
    for key in ("chat_first", "chat_message", "fleet_doc_tokens", "mix_doc_tokens"):
        if isinstance(getattr(args, key), str):
            setattr(args, key, parse_range(getattr(args, key)))
    args.doc_lo, args.doc_hi = parse_range(args.doc_tokens)
    args.scenarios = [s for s in SCENARIOS if getattr(args, s)] or [s for s in SCENARIOS if s not in OPT_IN]
    return args


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cleanup below runs
    if args.engine is not None:
        from seed.engine import engine_main

        engine_main(json.loads(args.engine))
        return 0
    from seed import chats, fleet, interference, mix, revisit, shared, slow

    t0 = time.perf_counter()
    code = code_state()
    plots = have_matplotlib()
    if not plots:
        log("matplotlib is not installed in this interpreter: no plots")
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-seed-"))
    log(f"seed experiment: {', '.join(args.scenarios)}; work dir {workdir}; code: {code}")
    records: dict[str, object] = {}
    ok = True
    try:
        with ExitStack() as stack:
            small = EngineSet(args, workdir / "small", stack)
            for name in args.scenarios:
                t1 = time.perf_counter()
                if name == "revisit":
                    sub = workdir / name
                    sub.mkdir()
                    report, rec, good = revisit.run(
                        args, sub, kv_bytes_per_token(args.layers, args.dtype), plots
                    )
                elif name == "shared":  # an engine and a daemon of its own per arm
                    report, rec, good = shared.run(args, workdir / name)
                else:
                    # every small engine the remaining scenarios need, started side by side
                    small.start(sorted({e for s in args.scenarios for e in NEEDS.get(s, ())}))
                    module = {
                        "chats": chats,
                        "fleet": fleet,
                        "mix": mix,
                        "slow": slow,
                        "interference": interference,
                    }[name]
                    report, rec, good = module.run(args, small)
                took = time.perf_counter() - t1
                ok &= good
                records[name] = {**rec, "scenario_s": took}
                print(f"## {name} ({took:.0f} s)\n\n{report}\n", flush=True)
            if small.engines:
                print(
                    f"Small engines: {small.model_desc()}; start "
                    f"{', '.join(f'{n} {s:.0f}' for n, s in small.startup_s.items())} s (side by side)."
                )
        wall = time.perf_counter() - t0
        if code_state() != code:
            print(f"WARNING: client/ or server/ changed during the run (was {code})")
            log("WARNING: client/ or server/ changed during the run; the arms may differ in code")
        print(f"Wall time {wall:.0f} s; code: {code}; checks {'ok' if ok else 'FAILED'}.")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "args": {k: str(v) for k, v in vars(args).items()},
                        "wall_s": wall,
                        "code": code,
                        **records,
                    },
                    indent=1,
                )
            )
        return 0 if ok else 1
    finally:
        if args.keep:
            log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

"""The seed experiment: a real vLLM engine whose own KV cache is smaller than the working set it
revisits, alone and with kvtier (docs/benchmarks.md §9). Run: ``make seed``, or
``.venv-vllm/bin/python scripts/seed_experiment.py`` (the defaults are the documented run).

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

Output: a markdown table on stdout, the plot ``--png`` (TTFT per round, both arms, every
repetition), and with ``--json`` every record. Each engine is this script re-invoked as
``--engine SPEC`` under the vLLM environment's interpreter, spoken to in JSON lines over
stdin/stdout; processes and temporary directories are removed on exit, also on error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROTO = "SEED "  # prefix of the engine's protocol lines on stdout (vLLM logs there too)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The Qwen3-0.6B shape (Qwen/Qwen3-0.6B config.json) except the vocabulary (see --vocab).
QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}


# -- setup -------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """config.json of a Qwen3-0.6B-shaped model (weights are dummy)."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_06B,
            "num_hidden_layers": args.layers, "vocab_size": args.vocab,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.layers,
            "torch_dtype": args.dtype, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": True, "hidden_act": "silu"}


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """K and V of every layer for one token."""
    return int(args.layers * 2 * QWEN3_06B["num_key_value_heads"] * QWEN3_06B["head_dim"]
               * DTYPE_BYTES[args.dtype])


def make_docs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` documents of random token ids, lengths uniform in [lo, hi]; distinct first tokens
    make every document's block hashes distinct from the first block on."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, vocab), n)
    return [[first] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1)]
            for first in firsts]


def cr_ids(text: str) -> list[int]:
    """CPU ids of a list like '0-1,4'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def code_state() -> str:
    """The commit, and a digest of the Python files under client/ and server/ as they are now
    (kvtier is installed editable: a change during the run would mix two versions)."""
    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("client/kvtier/**/*.py"), *ROOT.glob("server/**/*.py")]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "client", "server"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head, dirty = "unknown", ""
    return f"commit {head}{' + local changes' if dirty else ''}, client+server digest {h.hexdigest()[:12]}"


def parse_order(text: str) -> list[str]:
    order = [a.strip() for a in text.split(",") if a.strip()]
    if not order or any(a not in ("alone", "kvtier") for a in order):
        raise argparse.ArgumentTypeError("a comma-separated list of 'alone' and 'kvtier'")
    return order


# -- processes ---------------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """End ``proc`` and its process group (started with start_new_session): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # the group may still hold children (vLLM's EngineCore) after the leader exits
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def daemon(workdir: Path, host_bytes: str) -> Iterator[dict[str, Any]]:
    """A fresh ``kvtierd`` on a Unix socket in ``workdir``; yields its KVTIERD_READY record."""
    sock = workdir / "kv.sock"
    log_path = workdir / "kvtierd.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "kvtier.cli", "serve", "--socket", str(sock), "--listen", "",
             "--metrics-port", "-1", "--host-bytes", host_bytes],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            for line in log_path.read_text().splitlines():
                if line.startswith("KVTIERD_READY "):
                    ready = json.loads(line.split(" ", 1)[1])
                    ready["address"] = f"unix:{sock}"
                    yield ready
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtierd did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
    finally:
        stop_process(proc)


def daemon_counters(address: str, revision: str) -> dict[str, Any]:
    """The counters and block size of the namespaces of ``revision`` (summed), from Stats."""
    from kvtier.client import Client

    client = Client(address, "tcp", timeout_s=10.0, heartbeat=False)
    try:
        stats = client.stats()
    finally:
        client.close()
    out: dict[str, Any] = {"bytes_out_shm": 0, "loads": 0, "stores_accepted": 0, "block_bytes": 0}
    for ns in stats.get("namespaces", []):
        if ns.get("model_revision") != revision:
            continue
        counters = ns.get("counters", {})
        for key in ("bytes_out_shm", "loads", "stores_accepted"):
            out[key] += int(counters.get(key, 0))
        out["block_bytes"] = int(ns.get("block_bytes", 0))
    return out


class Engine:
    """One engine process (this script with ``--engine``), spoken to in JSON lines."""

    def __init__(self, spec: dict[str, Any], log_path: Path, kv_cache_gib: int, cpus: str) -> None:
        # The same OpenMP binding for both arms: vLLM's automatic one reserves one core fewer for
        # the worker when a kv_transfer_config is set, which on 2 cores means 2 cores vs 1.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=cpus,
                   OMP_NUM_THREADS=str(len(cr_ids(cpus))), PYTHONUNBUFFERED="1")
        self.log_path = log_path
        self.log: TextIO = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(Path(__file__).resolve()), "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=env, start_new_session=True)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTO):
                reply: dict[str, Any] = json.loads(line[len(PROTO):])
                return reply
            self.log.write(line)
            self.log.flush()
        self.log.flush()
        tail = self.log_path.read_text()[-4000:]
        raise RuntimeError(f"engine exited (rc={self.proc.poll()}); log tail:\n{tail}")

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kv_capacity_tokens(self) -> int | None:
        """From the engine log line 'CPU KV cache size: N tokens'."""
        self.log.flush()
        for line in self.log_path.read_text().splitlines():
            if "KV cache size:" in line:
                return int(line.split("KV cache size:")[1].split("tokens")[0].replace(",", ""))
        return None

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call({"op": "quit"})
                self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a dead or stuck engine is ended below either way
            pass
        stop_process(self.proc)
        self.log.close()


# -- the engine role ---------------------------------------------------------------------------


def engine_main(spec: dict[str, Any]) -> None:
    """Runs inside the engine process: build the engine, then answer one JSON line per command:
    ``{"op": "generate", "ids": [...]}`` -> TTFT, token sources, num_cached_tokens; ``quit``."""
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Counter

    kwargs: dict[str, Any] = dict(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"],
        enable_prefix_caching=True, disable_log_stats=False)
    if spec.get("num_blocks"):  # a smaller cache than 1 GiB, for quick checks of this script
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"]}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=1, detokenize=False, ignore_eos=True)

    def by_source() -> dict[str, int]:
        out = dict.fromkeys(SOURCES, 0)
        for m in llm.get_metrics():
            if m.name == "vllm:prompt_tokens_by_source" and isinstance(m, Counter):
                out[m.labels["source"]] += int(m.value)
        return out

    def answer(obj: dict[str, Any]) -> None:
        print(PROTO + json.dumps(obj), flush=True)

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        before = by_source()
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": cmd["ids"]}], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = by_source()
        ttft = getattr(out.metrics, "first_token_latency", 0.0) or wall
        answer({"ttft_s": ttft, "wall_s": wall, "num_cached_tokens": out.num_cached_tokens or 0,
                "prompt_tokens": len(cmd["ids"]),
                "sources": {s: after[s] - before[s] for s in SOURCES}})
    answer({"bye": True})


# -- the experiment ----------------------------------------------------------------------------


def run_arm(arm: str, rep: int, docs: list[list[int]], args: argparse.Namespace,
            workdir: Path) -> dict[str, Any]:
    """One arm in fresh processes: every round over every document; returns the records."""
    spec = {"model": str(workdir / "model"), "dtype": args.dtype,
            "max_model_len": args.max_model_len, "connector": None, "num_blocks": args.num_blocks}
    result: dict[str, Any] = {"arm": arm, "rep": rep, "requests": [], "rounds": []}
    with ExitStack() as stack:
        address = None
        if arm == "kvtier":
            ddir = Path(tempfile.mkdtemp(prefix=f"daemon-{rep}-", dir=workdir))
            address = stack.enter_context(daemon(ddir, args.host_bytes))["address"]
            spec["connector"] = {"address": address, "model_revision": args.revision}
        t_start = time.perf_counter()
        engine = Engine(spec, workdir / f"engine-{arm}-{rep}.log", args.kv_cache_gib, args.cpus)
        stack.callback(engine.close)
        engine.read()  # ready
        result["startup_s"] = time.perf_counter() - t_start
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
                log(f"  {arm}#{rep} round {rnd} doc {i}: {len(ids)} tokens, TTFT {rec['ttft_s']:.2f}s, "
                    f"computed {src['local_compute']}, cache {src['local_cache_hit']}, "
                    f"kvtier {src['external_kv_transfer']}")
            rinfo: dict[str, Any] = {"round": rnd}
            if address and d0 is not None:
                d1 = daemon_counters(address, args.revision)
                rinfo.update({k: d1[k] - d0[k] for k in ("bytes_out_shm", "loads", "stores_accepted")},
                             block_bytes=d1["block_bytes"])
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
            row: dict[str, Any] = {"arm": arm, "round": rnd, "check1": True, "check2": None,
                                   "per_rep_median": [], "ttfts": []}
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
    head = ("| arm | round | requests | median TTFT s (run 1 / run 2) | vs alone | prompt tokens "
            "| computed | engine cache hit | loaded from kvtier | check 1 | kvtier bytes out "
            f"| ÷ {bpt:,} B/token | check 2 |")
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        per_rep = " / ".join(f"{m:.2f}" for m in r["per_rep_median"])
        ratio = (f"{r['median_ttft'] / alone[r['round']]:.2f}×"
                 if r["arm"] == "kvtier" and alone.get(r["round"]) else "")
        tokens_out = f"{r['bytes_out'] / bpt:,.2f}" if r["arm"] == "kvtier" else ""
        bytes_out = f"{r['bytes_out']:,}" if r["arm"] == "kvtier" else ""
        lines.append(
            f"| {r['arm']} | {r['round']} | {r['requests']} | {r['median_ttft']:.2f} ({per_rep}) "
            f"| {ratio} | {r['prompt']:,} | {r['local_compute']:,} | {r['local_cache_hit']:,} "
            f"| {r['external_kv_transfer']:,} | {mark(r['check1'])} | {bytes_out} | {tokens_out} "
            f"| {mark(r['check2'])} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT per round: every request as a dot, each repetition's median as a line."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"alone": "tab:red", "kvtier": "tab:blue"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, r in enumerate(results):
        rounds = sorted({q["round"] for q in r["requests"]})
        meds = [statistics.median(q["ttft_s"] for q in r["requests"] if q["round"] == n)
                for n in rounds]
        dx = (k - (len(results) - 1) / 2) * 0.06
        style = "-" if r["rep"] == 1 else "--"
        ax.plot([n + dx for n in rounds], meds, style, marker="o", color=colors[r["arm"]],
                label=f"{'engine alone' if r['arm'] == 'alone' else 'engine + kvtier'}, "
                      f"run {r['rep']} (median)")
        ax.scatter([q["round"] + dx for q in r["requests"]], [q["ttft_s"] for q in r["requests"]],
                   s=10, color=colors[r["arm"]], alpha=0.35)
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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--docs", type=int, default=4, help="documents in the working set")
    p.add_argument("--doc-tokens", default="1500-1900", help="document length range LO-HI")
    p.add_argument("--rounds", type=int, default=3, help="round 1 visits, later rounds revisit")
    p.add_argument("--order", type=parse_order, default="alone,kvtier,kvtier,alone",
                   help="arms in run order, each in fresh processes")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="engine KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="override the engine's KV blocks (num_gpu_blocks_override), for quick checks")
    p.add_argument("--host-bytes", default="4GiB", help="kvtierd host tier")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                   help="model and KV dtype (bfloat16 is ~60x slower than float32 on AVX2 CPUs)")
    p.add_argument("--layers", type=int, default=QWEN3_06B["num_hidden_layers"])
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (Qwen3-0.6B has 151,936)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--warmup-tokens", type=int, default=200, help="one warm-up prompt per engine")
    p.add_argument("--cpus", default=",".join(map(str, sorted(os.sched_getaffinity(0)))),
                   help="the engine worker's cores (VLLM_CPU_OMP_THREADS_BIND), same for both arms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--revision", default="seed-r1", help="model_revision for the connector")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "seed_ttft.png")
    p.add_argument("--json", type=Path, default=None, help="write every record here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if isinstance(args.order, str):
        args.order = parse_order(args.order)
    lo, _, hi = args.doc_tokens.partition("-")
    args.doc_lo, args.doc_hi = int(lo), int(hi or lo)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the cleanup below runs
    if args.engine is not None:
        engine_main(json.loads(args.engine))
        return 0
    t0 = time.perf_counter()
    code = code_state()
    bpt = kv_bytes_per_token(args)
    docs = make_docs(args.docs, args.doc_lo, args.doc_hi, args.vocab, args.seed)
    working_set = sum(map(len, docs))
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-seed-"))
    try:
        (workdir / "model").mkdir()
        (workdir / "model" / "config.json").write_text(json.dumps(model_config(args)))
        log(f"seed experiment: {args.docs} docs ({', '.join(str(len(d)) for d in docs)} tokens; "
            f"{working_set:,} in all), {args.rounds} rounds, order {','.join(args.order)}, "
            f"{args.dtype}, {bpt:,} KV bytes/token, work dir {workdir}; code: {code}")
        results: list[dict[str, Any]] = []
        for arm in args.order:
            rep = sum(1 for r in results if r["arm"] == arm) + 1
            log(f"arm {arm} run {rep}")
            res = run_arm(arm, rep, docs, args, workdir)
            log(f"  engine KV cache {res['kv_capacity_tokens']} tokens; start {res['startup_s']:.0f}s, "
                f"arm {res['arm_s']:.0f}s")
            results.append(res)
        rows = summarize(results, bpt)
        wall = time.perf_counter() - t0
        if code_state() != code:
            print(f"WARNING: client/ or server/ changed during the run (was {code})")
            log("WARNING: client/ or server/ changed during the run; the arms may differ in code")
        capacity = sorted({r["kv_capacity_tokens"] for r in results if r["kv_capacity_tokens"]})
        title = (f"Qwen3-0.6B shape ({args.dtype}), {args.docs} docs / {working_set:,} tokens, "
                 f"engine KV cache {', '.join(f'{c:,}' for c in capacity)} tokens")
        plot(results, args.png, title)
        size = f"{args.num_blocks} blocks" if args.num_blocks else f"{args.kv_cache_gib} GiB"
        print(f"Working set {working_set:,} tokens in {args.docs} documents "
              f"({', '.join(f'{len(d):,}' for d in docs)}); engine KV cache "
              f"{', '.join(f'{c:,}' for c in capacity)} tokens ({size}); "
              f"{bpt:,} KV bytes per token; engine start "
              f"{', '.join(str(round(r['startup_s'])) for r in results)} s; wall time {wall:.0f} s; "
              f"code: {code}.\n")
        print(markdown_table(rows, bpt))
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "bytes_per_token": bpt, "docs": list(map(len, docs)),
                                             "wall_s": wall, "results": results,
                                             "rows": rows}, indent=1))
        ok = all(r["check1"] and r["check2"] is not False for r in rows)
        return 0 if ok else 1
    finally:
        if args.keep:
            log(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

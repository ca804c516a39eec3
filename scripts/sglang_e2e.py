"""End-to-end check of SGLang with the kvtier HiCache backend. Needs a CUDA GPU; not in CPU CI.

Prerequisites, in one environment: a CUDA build of SGLang (``pip install sglang==0.5.23``, the
version the backend is tested against) and kvtier (``pip install -e .`` from this repository).
The model must be a local directory (or a hub id the machine can download).

    python scripts/sglang_e2e.py --model /models/Qwen3-0.6B --revision <commit> [--out DIR]

What it does, each engine a fresh process (``--phase``) so that no GPU or host cache survives:

1. starts ``kvtierd serve`` on a private socket;
2. **reference**: SGLang without HiCache storage answers the prompts (greedy, token ids in);
3. **store**: SGLang with ``--hicache-storage-backend dynamic`` (kvtier, write-through) answers
   them; the script waits until the daemon holds every full page of every prompt;
4. **load**: a new SGLang process with the same backend answers them again: its pages come from
   kvtier (``wait_complete`` prefetch), which the daemon's load bytes and SGLang's
   ``cached_tokens`` show;
5. checks that all three produced the same tokens and that the load phase hit, and prints one JSON
   summary (also ``DIR/summary.json``). Exit status 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS, PROMPT_TOKENS, MAX_NEW_TOKENS = 4, 2048, 16


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab - 100) for _ in range(PROMPT_TOKENS // 2)]
    return [
        shared + [rng.randrange(100, vocab - 100) for _ in range(PROMPT_TOKENS // 2)] for _ in range(PROMPTS)
    ]


def extra_config(args: argparse.Namespace, socket: str) -> dict[str, Any]:
    return {
        "backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "address": f"unix:{socket}",
        "model_revision": args.revision,
        "tokenizer_digest": "none",
    }  # the prompts are token ids: no tokenizer in the identity


def run_phase(args: argparse.Namespace) -> None:
    """One engine: answer the prompts, print ``PHASE {json}``."""
    import sglang  # noqa: PLC0415 - only the phase processes import SGLang

    kw: dict[str, Any] = dict(
        model_path=args.model,
        page_size=args.page_size,
        tp_size=args.tp,
        mem_fraction_static=0.6,
        skip_tokenizer_init=True,
    )
    if args.phase != "reference":
        kw.update(
            enable_hierarchical_cache=True,
            hicache_ratio=2.0,
            hicache_mem_layout=args.layout,
            hicache_write_policy="write_through",
            hicache_storage_backend="dynamic",
            hicache_storage_prefetch_policy="wait_complete",
            hicache_storage_backend_extra_config=json.dumps(extra_config(args, args.socket)),
        )
    engine = sglang.Engine(**kw)
    try:
        outs = engine.generate(
            input_ids=prompts(args.vocab),
            sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS},
        )
        result = {
            "outputs": [o["output_ids"] for o in outs],
            "cached_tokens": [o["meta_info"].get("cached_tokens", 0) for o in outs],
        }
    finally:
        engine.shutdown()
    print("PHASE " + json.dumps(result), flush=True)


def phase(args: argparse.Namespace, name: str, socket: str, log: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        name,
        "--socket",
        socket,
        "--model",
        args.model,
        "--revision",
        args.revision,
        "--page-size",
        str(args.page_size),
        "--layout",
        args.layout,
        "--tp",
        str(args.tp),
        "--vocab",
        str(args.vocab),
    ]
    with open(log, "w") as f:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=1200)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PHASE ")]
    if out.returncode or not lines:
        raise SystemExit(f"phase {name} failed (rc={out.returncode}); see {log}")
    return dict(json.loads(lines[-1][6:]))


def daemon_counters(socket: str) -> dict[str, int]:
    import kvtier  # noqa: PLC0415

    with kvtier.Client.connect(f"unix:{socket}") as c:
        total: dict[str, int] = {}
        for ns in c.stats()["namespaces"]:
            for k, v in ns["counters"].items():
                total[k] = total.get(k, 0) + int(v)
        return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--revision", required=True, help="the model's immutable revision (commit)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument(
        "--layout", default="page_first", choices=["page_first", "page_first_direct", "layer_first"]
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--vocab", type=int, default=1000, help="prompt token ids are below this")
    p.add_argument("--out", default="")
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--socket", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        run_phase(args)
        return 0

    out = Path(args.out or tempfile.mkdtemp(prefix="sglang-e2e-"))
    out.mkdir(parents=True, exist_ok=True)
    socket = str(out / "kvtier.sock")
    daemon_log = open(out / "kvtierd.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtierd",
            "serve",
            "--socket",
            socket,
            "--listen",
            "",
            "--metrics-port",
            "-1",
            "--host-bytes",
            "8GiB",
        ],
        stdout=daemon_log,
        stderr=subprocess.STDOUT,
        cwd=out,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(socket):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvtierd did not start; see {out / 'kvtierd.log'}")
            time.sleep(0.2)
        ref = phase(args, "reference", socket, out / "reference.log")
        stored = phase(args, "store", socket, out / "store.log")
        # Write-through stores as it computes; the shutdown may leave the last writes in flight
        # on the daemon: wait until what it holds stops growing (at most 120 s).
        held, still, deadline = -1, 0, time.monotonic() + 120
        while still < 3 and time.monotonic() < deadline:
            now = daemon_counters(socket).get("resident_blocks", 0)
            still, held = (still + 1, held) if now == held and now > 0 else (0, now)
            time.sleep(1)
        before = daemon_counters(socket)
        loaded = phase(args, "load", socket, out / "load.log")
        after = daemon_counters(socket)
    finally:
        daemon.terminate()
        daemon.wait(30)
    load_bytes = sum(
        after.get(k, 0) - before.get(k, 0) for k in ("bytes_out_shm", "bytes_out_tcp", "bytes_out_cuda_ipc")
    )
    summary = {
        "same_outputs_store": stored["outputs"] == ref["outputs"],
        "same_outputs_load": loaded["outputs"] == ref["outputs"],
        "resident_blocks": before.get("resident_blocks", 0),
        "loaded_bytes": load_bytes,
        "cached_tokens_load": loaded["cached_tokens"],
    }
    ok = (
        summary["same_outputs_store"]
        and summary["same_outputs_load"]
        and load_bytes > 0
        and all(t > 0 for t in loaded["cached_tokens"])
    )
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The vLLM connector's lookup for a tensor-parallel engine: ``DaemonBackend.lookup`` (hash every
slice's keys, pinned lookup of the hit prefix in every slice's namespace) timed against a
``kvtier serve`` daemon that holds the prompt's blocks in every slice (docs/benchmarks.md §20).

Per TP size: ``--calls`` lookups of a ``--blocks``-block prompt (16 tokens per block), each
followed by the release of its pins (not timed); p50 and p90 of the lookup call. Two backends
take turns call by call: **LookupSlices** (one pinned lookup for every slice) and **per slice**
(one pinned lookup per slice, as the SDK does against a daemon without LookupSlices, and as
the connector did before docs/benchmarks.md §20).

Run: ``.venv/bin/python scripts/tp_lookup_bench.py [--tp 1,2,4,8] [--blocks 64]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import kvtier
from kvtier.bench.procs import DaemonProc
from kvtier.integrations.vllm.connector.backend import DaemonBackend
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, EngineIdentity

BS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", default="1,2,4,8")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args()
    tokens = [(i * 31) % 30000 + 3 for i in range(args.blocks * BS + 1)]
    print("| TP | LookupSlices p50 | p90 | per slice p50 | p90 | hit blocks |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp, DaemonProc(Path(tmp) / "d", 256 << 20, 4 << 20) as d:
        for tp in [int(t) for t in args.tp.split(",")]:
            ident = EngineIdentity(
                model_id="bench/tp",
                model_revision="r1",
                tokenizer_digest="none",
                kv_dtype="bfloat16",
                layout="vllm.LBHNC",
                tokens_per_block=BS,
                num_layers=2,
                num_kv_heads=2,
                head_dim=64,
                tp_size=tp,
            )
            with kvtier.Client.connect(d.unix) as c:
                for r in range(tp):
                    h = c.register(ident.namespace(BASE, r))
                    keys = h.block_keys(tokens)
                    assert h.put(keys, [b"x" * h.block_bytes] * len(keys)).stored == len(keys)
            backends = [DaemonBackend(ident, ConnectorConfig(address=d.unix)) for _ in "ab"]
            for b in backends:
                b.warmup()
            backends[1].client.session.lookup_slices_served = False  # one pinned lookup per slice
            times: list[list[float]] = [[], []]
            hits = set()
            for i in range(args.calls + 20):
                for b, out_times in zip(backends, times, strict=True):
                    t0 = time.perf_counter()
                    out = b.lookup(BASE, tokens)
                    dt = time.perf_counter() - t0
                    b.release(out.pins)
                    hits.add(out.hits)
                    if i >= 20:
                        out_times.append(dt)
            for b in backends:
                b.close()
            cells = []
            for t in times:
                t.sort()
                cells += [f"{t[len(t) // 2] * 1e6:.0f} µs", f"{t[int(len(t) * 0.9)] * 1e6:.0f} µs"]
            print(f"| {tp} | {' | '.join(cells)} | {'/'.join(map(str, sorted(hits)))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

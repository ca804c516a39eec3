"""How long one big LookupSlices keeps other clients waiting (docs/benchmarks.md §21, issue 26).

One client pins the longest lookup the daemon takes (``--slices`` namespaces x ``--blocks`` keys,
every key a hit; the request must fit gRPC's 4 MiB, so 30 x 4096 is about the most) again and
again; another process, meanwhile, sends Heartbeats over gRPC in a loop (a tenant's lease
renewals). Reported: the heartbeats' p50 / p99 / max while the big lookups run,
and without them (same daemon, same run).

Run: ``.venv/bin/python scripts/lookup_slices_stall.py [--slices 30] [--blocks 4096]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.bench.procs import DaemonProc
from kvtier_contract.v1 import kvtier_pb2 as pb


def beats(address: str, seconds: float, out: Any) -> None:
    """Heartbeats for ``seconds`` in a process of its own (the big client's GIL is not ours)."""
    times = []
    with kvtier.Client.connect(address, "tcp", control_channel=False) as c:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            c.session.call("Heartbeat", pb.HeartbeatRequest())
            times.append(time.perf_counter() - t0)
    out.put(times)


def figures(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return (
        f"n={len(xs)} p50 {statistics.median(xs) * 1e3:.2f} ms, p99 {p99 * 1e3:.1f} ms, "
        f"max {xs[-1] * 1e3:.1f} ms"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "kvtierd.toml"
        cfg.write_text("slot_align_bytes = 64\n")  # tiny blocks: 64 x 4096 hits in 16 MiB
        with (
            DaemonProc(Path(tmp) / "d", 256 << 20, 1 << 20, ["--config", str(cfg)]) as d,
            kvtier.Client.connect(d.grpc, "tcp", control_channel=False) as big,
        ):
            handles, chains = [], []
            for r in range(args.slices):
                h = big.register(
                    kvtier.Namespace(
                        model_id="bench/stall",
                        model_revision="r1",
                        tokenizer_digest="none",
                        kv_dtype="bfloat16",
                        layout="contiguous",
                        tokens_per_block=1,
                        num_layers=1,
                        num_kv_heads=1,
                        head_dim=16,
                        tp_size=args.slices,
                        tp_rank=r,
                    )
                )
                keys = h.block_keys(list(range(args.blocks)))
                for i in range(0, len(keys), 1024):
                    assert h.put(keys[i : i + 1024], [b"x" * h.block_bytes] * 1024).stored == 1024
                handles.append(h)
                chains.append(keys)
            for label, load in (("idle", False), ("during LookupSlices", True)):
                queue: Any = multiprocessing.Queue()
                calls: list[float] = []
                proc = multiprocessing.Process(target=beats, args=(d.grpc, args.seconds, queue))
                proc.start()
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    if not load:
                        time.sleep(0.05)
                        continue
                    t0 = time.perf_counter()
                    found = big.lookup_slices(handles, chains)
                    calls.append(time.perf_counter() - t0)
                    assert found.hits == args.blocks, found.hits
                    for sl in found.slices:
                        big.release(sl.pin)
                out = queue.get(timeout=60)
                proc.join()
                extra = f"; LookupSlices {figures(calls)}" if calls else ""
                print(f"heartbeats {label}: {figures(out)}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

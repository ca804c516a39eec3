"""A/B: what publishing a namespace's index costs the daemon's put path (docs/benchmarks.md §15).

Two namespaces of the same block size on one daemon; a looking-up client maps the published
index of one of them. 64 MiB shm puts of fresh keys alternate between the two (the arena fills
and evicts on the way, so removals are published too); the ratio of median put times and the daemon's CPU
time per put (from /proc, less noisy than wall time here) are printed per block size.
Run: ``.venv/bin/python scripts/published_index_ab.py``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import DaemonProcess, make_namespace  # noqa: E402

import kvtier  # noqa: E402
from kvtier.bench.lookups import cpu_seconds  # noqa: E402

BATCH = 64 << 20
ROUNDS = 22  # the first two are warm-up


def main() -> None:
    d = DaemonProcess(
        Path(tempfile.mkdtemp()) / "d", "--host-bytes", "512MiB", "--slab-bytes", "64MiB"
    ).start()
    try:
        putter = kvtier.Client.connect(d.unix, "shm", local_lookups=False)
        looker = kvtier.Client.connect(d.unix, "tcp")
        seq = 0
        for label, shape in (("16 KiB", {}), ("256 KiB", {"head_dim": 1024})):
            pub = putter.register(make_namespace(model_revision="pub", **shape))
            plain = putter.register(make_namespace(model_revision="plain", **shape))
            looker.register(make_namespace(model_revision="pub", **shape)).lookup(
                pub.block_keys(list(range(16)))
            )
            if looker.counters.lookups_local != looker.counters.lookups:
                raise SystemExit("the looking-up client did not map the published index")
            n = BATCH // pub.block_bytes
            block = np.random.default_rng(0).integers(0, 255, pub.block_bytes, dtype=np.uint8)
            times: dict[str, list[float]] = {"pub": [], "plain": []}
            cpu: dict[str, list[float]] = {"pub": [], "plain": []}
            assert d.proc is not None
            for r in range(ROUNDS):
                order = [("pub", pub), ("plain", plain)]
                for name, ns in order if r % 2 else order[::-1]:
                    seq += 1
                    keys = ns.block_keys(list(range(seq * 10**7, seq * 10**7 + 16 * n)))
                    c0, t0 = cpu_seconds(d.proc.pid), time.perf_counter()
                    res = ns.put(keys, [block] * n)
                    dt, dc = time.perf_counter() - t0, cpu_seconds(d.proc.pid) - c0
                    if res.stored != n:
                        raise SystemExit(f"put stored {res.stored} of {n}")
                    if r >= 2:
                        times[name].append(dt)
                        cpu[name].append(dc)
            a, b = statistics.median(times["pub"]), statistics.median(times["plain"])
            ca, cb = sum(cpu["pub"]), sum(cpu["plain"])
            print(
                f"{label}: {n} blocks per put; put time published / unpublished = {a / b:.3f} "
                f"({BATCH / a / 1e9:.2f} vs {BATCH / b / 1e9:.2f} GB/s); daemon CPU per put "
                f"{ca / len(cpu['pub']) * 1e3:.1f} vs {cb / len(cpu['plain']) * 1e3:.1f} ms"
            )
        stats = looker.stats()
        print(
            f"evictions: {stats['total']['evictions']:,}; published index figures: "
            f"{ {k: v for k, v in stats.items() if k.startswith('published')} }"
        )
        log = (d.run_dir / "kvtierd.log").read_text()
        if "published index" in log:
            print([line for line in log.splitlines() if "published index" in line][:3])
    finally:
        d.kill()


if __name__ == "__main__":
    main()

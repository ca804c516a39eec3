"""Where one 64 MiB put and get_into go (docs/benchmarks.md §19.1): the SDK's time in each
control call and in the transport's copy, per batch, against a bench daemon (2 GiB host tier,
64 MiB slabs) that fills and then evicts as it stores fresh keys.

Run: ``.venv/bin/python scripts/batch_breakdown.py [BLOCK_BYTES] [shm|tcp] [--grpc]``
(``--grpc``: control calls over gRPC instead of the control channel). Prints the median and
the minimum of batches 5-24.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.procs import DaemonProc
from kvtier.bench.transfers import KeySource, bench_namespace, connect
from kvtier.session import Session

BATCH = 64 << 20
BATCHES = 24


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    block = int(args[0]) if args else 256 << 10
    transport = args[1] if len(args) > 1 else "shm"
    n = BATCH // block
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(name, []).append(time.perf_counter() - t0)

        return call

    invoke = Session._invoke
    Session._invoke = lambda self, stub, method, request, timeout: timed(  # type: ignore[method-assign]
        method, invoke
    )(self, stub, method, request, timeout)
    with tempfile.TemporaryDirectory() as d, DaemonProc(Path(d), 2 << 30, 64 << 20) as daemon:
        c = connect(daemon.address(transport), transport, control_channel="--grpc" not in sys.argv)
        ns = c.register(bench_namespace(block))
        src = np.random.default_rng(0).integers(0, 255, BATCH, dtype=np.uint8)
        views = [memoryview(src[i * block : (i + 1) * block]) for i in range(n)]
        dst = np.zeros_like(src)
        into = [memoryview(dst[i * block : (i + 1) * block]) for i in range(n)]
        source = KeySource()
        batches = [source.take(n) for _ in range(BATCHES)]
        data = c.session.data()
        data.write = timed("write", data.write)  # type: ignore[method-assign]
        data.read = timed("read", data.read)  # type: ignore[method-assign]
        for keys in batches:
            res = timed("put", ns.put)(keys, views)
            if res.stored != n:
                raise SystemExit(f"put stored {res.stored} of {n}: {res}")
            if not all(timed("get_into", ns.get_into)(keys, into)):
                raise SystemExit("get_into missed")
        c.close()
    for name, v in times.items():
        v = v[4:]
        print(f"{name:14s} median {statistics.median(v) * 1e3:7.2f} ms  min {min(v) * 1e3:7.2f}")


if __name__ == "__main__":
    main()

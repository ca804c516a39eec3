"""Group arenas over shm (issue 43): what a member's load from its group's read-only arena and a
publisher's staged store into it cost, against the same client's own arena, in one run.

A daemon with a tenants file (``pub`` publishes group ``g``, ``member`` reads it; both shm),
started here. Per block size (256 KiB, 1 MiB, 4 MiB), interleaved rounds of 64 MiB batches,
the best of ``--repeat`` kept (the machine may be shared: a figure and its twin see the same
conditions):

* ``put own``: pub stores into its own namespace (the client writes the slots);
* ``put group``: pub stores into the group's namespace (the client writes staging slots of its
  own arena, the daemon copies them into the group's at the commit: one copy more);
* ``get_into own``: pub loads its own blocks into an engine buffer;
* ``get_into group``: member loads the group's blocks through its read-only mapping.

Every round trip is checked byte for byte once. Run: ``.venv/bin/python
scripts/group_arenas_bench.py [--repeat 5]``; docs/benchmarks.md §26.1 has the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import kvtier
from kvtier.bench.memory import engine_buffer
from kvtier.bench.plan import timed
from kvtier.bench.procs import DaemonProc
from kvtier.bench.transfers import bench_namespace

BATCH = 64 << 20
TOKENS = {"pub": "bench-pub-token-1", "member": "bench-member-token-2"}


def tenants_file(path: Path) -> Path:
    body = ""
    for name, token in TOKENS.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{digest}"]\ntransports = ["shm"]\n'
        body += 'arena_bytes = "320MiB"\n\n'
    body += '[[group]]\nname = "g"\npublishers = ["pub"]\nmembers = ["member"]\narena_bytes = "192MiB"\n'
    path.write_text(body)
    return path


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=32).digest() for i in range(n)]


def views(buf: np.ndarray, block: int) -> list[memoryview]:
    mv = memoryview(buf.data).cast("B")
    return [mv[i : i + block] for i in range(0, len(mv), block)]


def measure(d: DaemonProc, block: int, repeat: int) -> dict[str, float]:
    n = BATCH // block
    src, dst = engine_buffer(BATCH, fill=7), engine_buffer(BATCH)
    src[:] = np.random.default_rng(block).integers(0, 256, BATCH, dtype=np.uint8)
    with (
        kvtier.Client.connect(d.unix, transport="shm", token=TOKENS["pub"]) as pub,
        kvtier.Client.connect(d.unix, transport="shm", token=TOKENS["member"]) as member,
    ):
        spec = bench_namespace(block, name=f"bench-{block}").to_dict()
        own = pub.register(kvtier.Namespace(**{**spec, "tenant": "pub"}))
        group_spec = kvtier.Namespace(**{**spec, "group": "g"})
        g_pub, g_member = pub.register(group_spec), member.register(group_spec)
        best: dict[str, float] = {}
        round_no = [0]

        def put(handle: Any, tag: str) -> None:
            round_no[0] += 1
            keys = keys_for(f"{tag}-{block}-{round_no[0]}", n)
            assert handle.put(keys, views(src, block)).stored == n
            last[tag] = keys

        last: dict[str, list[bytes]] = {}
        ops = {
            "put own": lambda: put(own, "own"),
            "put group": lambda: put(g_pub, "group"),
            "get_into own": lambda: own.get_into(last["own"], views(dst, block)),
            "get_into group": lambda: g_member.get_into(last["group"], views(dst, block)),
        }
        for name, op in ops.items():  # warm-up, and the byte checks
            op()
            if name.startswith("get_into"):
                assert np.array_equal(dst, src), name
        for _ in range(repeat):
            for name, op in ops.items():
                gbps = BATCH / timed(op) / 1e9
                best[name] = max(best.get(name, 0.0), gbps)
        return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-garena-") as tmp:
        cfg = Path(tmp) / "kvtierd.toml"
        cfg.write_text(f'tenants_file = "{tenants_file(Path(tmp) / "tenants.toml")}"\n')
        for block in (256 << 10, 1 << 20, 4 << 20):
            with DaemonProc(Path(tmp) / f"d{block}", 64 << 20, 64 << 20, ["--config", str(cfg)]) as d:
                rows.append((block, measure(d, block, args.repeat)))
    print("block    put own  put group (ratio)   get_into own  get_into group (ratio)   GB/s")
    for block, f in rows:
        put, get = f["put group"] / f["put own"], f["get_into group"] / f["get_into own"]
        print(
            f"{block >> 10:>5} KiB  {f['put own']:6.2f}  {f['put group']:6.2f} ({put:.2f})"
            f"      {f['get_into own']:6.2f}        {f['get_into group']:6.2f} ({get:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

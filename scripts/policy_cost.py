"""What an eviction policy costs the daemon: memory and CPU per block (docs/benchmarks.md §25.3).

For each policy (``lru``, ``prefix``; ``--policies``) a fresh daemon with a host tier of
``--host-mib`` (default: room for every block, each 1 KiB block in a 4 KiB slot) and small
blocks (1 KiB: 16 tokens x 1 layer x 1 head x 16 dim x bf16, so the index and the policy, not
the bytes, dominate) takes the same work from one shm client:

* **fill**: chains of ``--chain`` blocks (keys chained as an engine's are, each put's first
  block naming its parent), stored in puts of 256 until the tier holds ``--blocks``; reported:
  the daemon's resident memory per block held (RSS after less RSS before, the arena prefaulted
  at start, so the growth is the index, the policy and their links) and its CPU time per block;
* **lookups**: every chain looked up whole (``lookup``: a pinless hit that touches each block);
  CPU per block looked up;
* **churn**: as many blocks again, fresh chains, each put evicting as much as it stores; CPU per
  block stored (the evictions included).

CPU is the daemon's user + system time from /proc (all threads), less noisy than wall time on
a shared box; run the policies back to back, twice, and compare within a run.
Run: ``.venv/bin/python scripts/policy_cost.py [--blocks 200000]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import DaemonProcess, make_namespace  # noqa: E402

import kvtier  # noqa: E402
from kvtier.bench.lookups import cpu_seconds  # noqa: E402
from kvtier.bench.soak import proc_figures  # noqa: E402

PUT = 256


def rss_bytes(pid: int) -> float:
    return proc_figures(pid)["rss_mib"] * (1 << 20)  # (to 0.1 MiB: ~0.1 % of a 200k-block fill)


def chains(h: kvtier.NamespaceHandle, first: int, blocks: int, chain: int) -> list[list[bytes]]:
    """Keys of ``blocks`` blocks in chains of ``chain``, numbered from ``first`` (distinct)."""
    out = []
    for c in range(first, first + blocks // chain):
        out.append(h.block_keys([c, *range(1, chain * 16)]))  # a distinct head: a distinct chain
    return out


def store(h: kvtier.NamespaceHandle, all_keys: list[list[bytes]]) -> int:
    block = bytes(h.block_bytes)
    stored = 0
    for keys in all_keys:
        for i in range(0, len(keys), PUT):
            part = keys[i : i + PUT]
            r = h.put(part, [block] * len(part), parent=keys[i - 1] if i else None)
            stored += r.stored
    return stored


def measure(policy: str, blocks: int, chain: int, host_mib: int) -> dict[str, float]:
    d = DaemonProcess(
        Path(tempfile.mkdtemp()) / "d",
        "--host-bytes",
        f"{host_mib}MiB",
        "--slab-bytes",
        "16MiB",
        "--eviction-policy",
        policy,
    ).start()
    try:
        pid = d.proc.pid
        ns = make_namespace(num_layers=1, num_kv_heads=1, head_dim=16)
        with kvtier.Client.connect(d.unix, "shm", local_lookups=False) as c:
            h = c.register(ns)
            fill = chains(h, 0, blocks, chain)
            rss0, cpu0 = rss_bytes(pid), cpu_seconds(pid)
            stored = store(h, fill)
            rss1, cpu1 = rss_bytes(pid), cpu_seconds(pid)
            held = c.stats()["total"]["resident_blocks"]
            for keys in fill:
                for i in range(0, len(keys), 1000):
                    h.lookup(keys[i : i + 1000])
            cpu2 = cpu_seconds(pid)
            churned = store(h, chains(h, blocks, blocks, chain))
            cpu3 = cpu_seconds(pid)
            return {
                "stored": stored,
                "held": held,
                "rss_bytes_per_block": (rss1 - rss0) / max(1, held),
                "fill_cpu_us_per_block": (cpu1 - cpu0) * 1e6 / max(1, stored),
                "lookup_cpu_us_per_block": (cpu2 - cpu1) * 1e6 / max(1, blocks),
                "churn_cpu_us_per_block": (cpu3 - cpu2) * 1e6 / max(1, churned),
            }
    finally:
        d.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="lru,prefix")
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--chain", type=int, default=512, help="blocks per chain (a prompt)")
    ap.add_argument("--host-mib", type=int, default=0, help="host tier (default: room for --blocks)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    host_mib = a.host_mib or max(64, (a.blocks * 4096 * 11 // 10) >> 20)  # 4 KiB slots
    out: dict[str, list[dict[str, float]]] = {}
    for _ in range(a.rounds):
        for policy in a.policies.split(","):
            got = measure(policy, a.blocks, a.chain, host_mib)
            out.setdefault(policy, []).append(got)
            print(policy, json.dumps({k: round(v, 2) for k, v in got.items()}), flush=True)


if __name__ == "__main__":
    main()

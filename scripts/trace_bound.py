"""How much recompute any eviction order could save on a trace: the offline optimum (issue 42).

``kvtier bench trace`` replays a trace against real daemons and reports each policy's
eviction-induced recomputed tokens. This script answers the question that figure leaves open:
how low could it go at that budget? For a cache of ``--blocks`` blocks it replays the same
requests (lookup of the longest held prefix, then every block of the prompt stored, as
``kvtier.bench.replay.Replayer`` does) under Belady's rule, the offline optimum for equal-size
blocks: when full, drop the block whose next use is farthest away (never used again first).
A head's next use is never after its tail's, so this order keeps chains whole by itself.

It also replays plain LRU as the daemon keeps it (a lookup touches its hit chain head to tail,
new blocks enter after, deepest coldest) for a same-run reference, so the printed ratios
compare like with like. Figures are blocks x ``--tokens-per-block`` (16, the bench's).

Run: ``.venv/bin/python scripts/trace_bound.py --trace-file mooncake_conversation_trace.jsonl
--blocks 6970,30000`` (a Mooncake-format JSONL, ``kvtier.bench.traces.load_jsonl``; without
``--trace-file``, the bench's synthesized traces of ``--requests`` each).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "client")]

from kvtier.bench.traces import TRACE_KINDS, load_jsonl, synthesize  # noqa: E402

Trace = list[tuple[int, ...]]
NEVER = 1 << 62


def replay_lru(trace: Trace, capacity: int) -> int:
    """Eviction-induced recomputed blocks under the daemon's LRU order."""
    held: OrderedDict[int, None] = OrderedDict()
    stored: set[int] = set()
    lost = 0
    for ids in trace:
        n = _hit(ids, held)
        lost += sum(1 for h in ids[n:] if h in stored)
        for h in ids[:n]:
            held.move_to_end(h)
        for h in reversed(ids[n:]):  # deepest coldest
            held[h] = None
            held.move_to_end(h)
            stored.add(h)
        while len(held) > capacity:
            held.popitem(last=False)
    return lost


def replay_optimal(trace: Trace, capacity: int) -> int:
    """Eviction-induced recomputed blocks under Belady's rule (next use farthest goes first)."""
    next_use: list[list[int]] = [[] for _ in trace]
    seen: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = [seen.get(h, NEVER) for h in trace[i]]
        for h in trace[i]:
            seen[h] = i
    held: dict[int, int] = {}
    heap: list[tuple[int, int]] = []  # (-next use, id), stale entries skipped
    stored: set[int] = set()
    lost = 0
    for i, ids in enumerate(trace):
        n = _hit(ids, held)
        lost += sum(1 for h in ids[n:] if h in stored)
        for h, nu in zip(ids, next_use[i], strict=True):
            held[h] = nu
            heapq.heappush(heap, (-nu, h))
            stored.add(h)
        while len(held) > capacity:
            nu, h = heapq.heappop(heap)
            if held.get(h) == -nu:
                del held[h]
    return lost


def _hit(ids: tuple[int, ...], held: dict[int, int] | OrderedDict[int, None]) -> int:
    n = 0
    while n < len(ids) and ids[n] in held:
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace-file", type=Path)
    p.add_argument("--requests", type=int, default=600, help="per synthesized trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", default="330", help="cache sizes in blocks, comma-separated")
    p.add_argument("--tokens-per-block", type=int, default=16)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.blocks.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        p.error("--blocks: positive block counts, e.g. 330,6970")
    if a.trace_file:
        traces = {a.trace_file.stem: load_jsonl(a.trace_file, None)}
    else:
        traces = {k: synthesize(k, a.requests, a.seed) for k in TRACE_KINDS}
    t = a.tokens_per_block
    print(f"{'trace':<30}{'blocks':>8}{'lru':>12}{'optimal':>12}{'optimal/lru':>13}")
    for name, reqs in traces.items():
        trace = [tuple(r.hash_ids) for r in reqs]
        for size in sizes:
            lru, best = replay_lru(trace, size) * t, replay_optimal(trace, size) * t
            ratio = f"{best / lru:.3f}" if lru else "-"
            print(f"{name:<30}{size:>8,}{lru:>12,}{best:>12,}{ratio:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

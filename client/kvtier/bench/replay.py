"""What ``kvtier bench trace`` replays and how (issue 42): its settings, one engine's replay of a
trace through one namespace handle, and the figures it counts.

:class:`Replayer` does, per request, what an engine does (``kvtier.bench.trace`` describes it:
lookup, checked ``get_into`` of the hit, ``put`` of the rest with the parent key); the single-
daemon runs (``kvtier.bench.trace``) and the routed runs over several daemons
(``kvtier.bench.routing``) both drive it.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.bench.traces import TRACE_KINDS, TraceRequest, load_jsonl, synthesize
from kvtier_contract.units import parse_bytes

if TYPE_CHECKING:
    from kvtier.client import NamespaceHandle

__all__ = ["ReplayReport", "Replayer", "TraceSettings"]
KiB, MiB = 1 << 10, 1 << 20
_POLICY_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


@dataclass(frozen=True)
class TraceSettings:
    """What one ``kvtier bench trace`` run replays, and against which daemon; validated once."""

    traces: tuple[str, ...] = TRACE_KINDS
    """Synthesized trace kinds (``traces.TRACE_KINDS``); ignored with ``trace_file``."""
    policies: tuple[str, ...] = ("lru", "arc")
    """``eviction_policy`` values, one daemon each; any name (the daemon may refuse it)."""
    requests: int | None = None
    """Requests per synthesized trace (default 600); a file's first so many (default all)."""
    seed: int = 0
    trace_file: Path | None = None
    host_bytes: int = 2 * MiB
    """The daemon's host tier: 128 blocks of ``block_bytes``."""
    disk_bytes: int = 4 * MiB
    """The daemon's NVMe tier below it (about 200 blocks: each slot has a 4 KiB header)."""
    block_bytes: int = 16 * KiB
    slab_bytes: int = 256 * KiB
    write_policy: str = "write-back"
    pods: int = 0
    """With 2 or more: each trace is replayed again over this many daemons, routed at random and
    (with ``router_indexer``) by Dynamo's KV indexer (``kvtier.bench.routing``)."""
    router_indexer: str | None = None
    """The Python of an environment with ``ai-dynamo-runtime`` (``make dynamo-env``)."""
    route_gap_ms: int = 50
    """Time between two routed requests (events reach the router meanwhile)."""
    progress: bool = True
    json_out: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TraceSettings:
        """ValueError naming the flag at fault."""
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        bad = [p for p in policies if not _POLICY_NAME.match(p)]
        if not policies or bad:
            raise ValueError(f"--policies: need names like lru,arc (got {args.policies!r})")
        traces = tuple(t.strip() for t in args.traces.split(",") if t.strip())
        if not traces or any(t not in TRACE_KINDS for t in traces):
            raise ValueError(f"--traces: one or more of {','.join(TRACE_KINDS)} (got {args.traces!r})")
        if args.requests is not None and args.requests <= 0:
            raise ValueError("--requests must be positive")
        if args.pods and not 2 <= args.pods <= 16:
            raise ValueError(f"--pods: 2..16 daemons (got {args.pods})")
        if args.router_indexer and not args.pods:
            raise ValueError("--router-indexer needs --pods")
        if not 0 <= args.route_gap_ms <= 10_000:
            raise ValueError(f"--route-gap-ms: 0..10000 (got {args.route_gap_ms})")
        return cls(
            traces=traces,
            policies=policies,
            requests=args.requests,
            seed=args.seed,
            trace_file=Path(args.trace_file) if args.trace_file else None,
            host_bytes=parse_bytes(args.trace_host_bytes, field="--trace-host-bytes"),
            disk_bytes=parse_bytes(args.trace_disk_bytes, field="--trace-disk-bytes"),
            pods=args.pods or 0,
            router_indexer=args.router_indexer,
            route_gap_ms=args.route_gap_ms,
            progress=not args.no_progress,
            json_out=args.json_out,
        )

    def load(self) -> dict[str, list[TraceRequest]]:
        """Trace name -> requests: the file's, or every synthesized kind's."""
        if self.trace_file is not None:
            return {self.trace_file.stem: load_jsonl(self.trace_file, self.requests)}
        n = self.requests or 600
        return {kind: synthesize(kind, n, self.seed) for kind in self.traces}  # type: ignore[arg-type]

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["trace_file"] = str(self.trace_file) if self.trace_file else None
        return d


@dataclass
class ReplayReport:
    """The figures of one trace replayed with one policy (tokens: blocks x tokens per block)."""

    trace: str
    policy: str
    status: str = "ok"
    """``ok``, or ``unavailable``: the daemon refused the policy at start (``reason``)."""
    reason: str = ""
    requests: int = 0
    total_tokens: int = 0
    """Prompt tokens of every request: ``hit_tokens + recomputed_tokens``."""
    hit_tokens: int = 0
    """Tokens of the blocks loaded: the hit prefix of each request, every block byte-checked."""
    recomputed_tokens: int = 0
    eviction_recomputed_tokens: int = 0
    """Recomputed tokens of blocks stored earlier in the run (evicted, or cut off from the head)."""
    stored_blocks: int = 0
    """Distinct blocks the daemon took in the run."""
    rejected_blocks: int = 0
    """Blocks of puts the daemon refused (no room) or dropped."""
    held_blocks: int = 0
    """Of the stored blocks, those the daemon still holds at the end (any tier)."""
    orphaned_blocks: int = 0
    """Held blocks at the end whose parent chain is broken: no prefix lookup reaches them."""
    seconds: float = 0.0


class Replayer:
    """Replays requests through one namespace handle and counts into ``report``; owns the keys
    of every hash id seen and the set of those stored. ``token_ids``: stores carry their
    blocks' tokens (a router that hashes tokens reads them in the KV events). One thread; the
    handle's client stays open for the replayer's whole life."""

    def __init__(
        self,
        ns: NamespaceHandle,
        parent_of: dict[int, int | None],
        report: ReplayReport,
        *,
        token_ids: bool = False,
    ) -> None:
        self.ns, self.parent_of, self.report, self.token_ids = ns, parent_of, report, token_ids
        self.tpb = ns.namespace.tokens_per_block
        self.keys: dict[int, bytes] = {}
        self.stored: set[int] = set()
        words = ns.block_bytes // 8
        self._pattern = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)

    def tokens(self, ids: tuple[int, ...]) -> list[int]:
        """The tokens of blocks ``ids`` (each block's derived from its hash id), in order."""
        tpb = self.tpb
        return [(h * tpb + j) % (1 << 32) for h in ids for j in range(tpb)]

    def key(self, h: int) -> bytes:
        """Block ``h``'s key: chained from its parent's over tokens derived from ``h``."""
        if h not in self.keys:
            p = self.parent_of[h]
            self.keys[h] = self.ns.block_keys(self.tokens((h,)), parent=None if p is None else self.key(p))[0]
        return self.keys[h]

    def block(self, h: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes stored for block ``h`` (distinct for every id)."""
        return (self._pattern + np.uint64(h)).view(np.uint8)

    def request(self, req: TraceRequest) -> int:
        """Look up, load and check the hit prefix, store the rest (module docstring); the
        blocks the lookup hit."""
        ids = req.hash_ids
        keys = [self.key(h) for h in ids]
        seen = self.ns.lookup(keys)
        hit = self._load(ids, keys, seen)
        missed = ids[hit:]
        r = self.report
        r.requests += 1
        r.total_tokens += len(ids) * self.tpb
        r.hit_tokens += hit * self.tpb
        r.recomputed_tokens += len(missed) * self.tpb
        r.eviction_recomputed_tokens += sum(h in self.stored for h in missed) * self.tpb
        if missed:
            self._store(missed, keys[hit:], keys[hit - 1] if hit else None)
        return seen

    def _load(self, ids: tuple[int, ...], keys: list[bytes], n: int) -> int:
        """Load the first ``n`` blocks; how many of them, from the head, arrived (checked)."""
        if n == 0:
            return 0
        bufs = np.empty((n, self.ns.block_bytes), dtype=np.uint8)
        found = self.ns.get_into(keys[:n], list(bufs))
        hit = found.index(False) if False in found else n
        for i in range(hit):
            if not np.array_equal(bufs[i], self.block(ids[i])):
                raise AssertionError(f"block {ids[i]} came back with other bytes than it was stored with")
        return hit

    def _store(self, ids: tuple[int, ...], keys: list[bytes], parent: bytes | None) -> None:
        tokens = self.tokens(ids) if self.token_ids else None
        res = self.ns.put(keys, [self.block(h) for h in ids], parent=parent, token_ids=tokens)
        taken = res.stored + res.already_present  # a refusal ends the batch: the rest is refused too
        for h in ids[:taken]:
            if h not in self.stored:
                self.stored.add(h)
                self.report.stored_blocks += 1
        self.report.rejected_blocks += res.rejected + res.dropped

    def probe_orphans(self) -> None:
        """Probe every stored block alone; count the held ones and those cut off from their head."""
        reachable: dict[int, bool] = {}
        for h, p in self.parent_of.items():  # a parent comes before its children
            held = h in self.stored and self.ns.lookup([self.key(h)]) == 1
            reachable[h] = held and (p is None or reachable[p])
            self.report.held_blocks += held
            self.report.orphaned_blocks += held and not reachable[h]

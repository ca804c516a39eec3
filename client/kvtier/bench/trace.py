"""``kvtier bench trace``: request traces replayed against a daemon, once per eviction policy (issue 42).

One run, one process tree: for every trace (``bench.traces``: a multi-turn conversation trace and
an agentic trace, synthesized from ``--seed``, or a Mooncake-format ``--trace-file``) and every
policy of ``--policies``, this process starts a fresh kvtierd (``procs.DaemonProc``) with a small
fixed host tier, an NVMe tier of a small fixed size below it (so blocks leave the cache) and
``eviction_policy`` set in a config file, and replays the trace through the SDK as one engine
would, request by request, in arrival order (as fast as it can: timestamps give only the order).
A policy the daemon refuses at start is reported ``unavailable`` and the run goes on.

Per request (:class:`Replayer`): the prompt's block keys (``handle.block_keys`` over tokens
derived from each hash id, chained from the head as an engine's are), a lookup (the longest
prefix held, on any tier), ``get_into`` of that prefix with every block checked against the
bytes stored for it (derived from its hash id), and a ``put`` of the missed blocks with the
parent key of the first of them. At the end every block ever stored is probed alone (a 1-key
lookup): held blocks whose parent chain is broken are *orphaned* (no prefix lookup can reach
them).

Figures per (trace, policy), :class:`ReplayReport`: hit tokens (blocks × tokens per block),
recomputed tokens (every prompt token not hit), eviction-induced recomputed tokens (misses of
blocks stored before), orphaned blocks; and, when both ran, prefix / lru of the
eviction-induced recomputed tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.bench.routing import RoutedReport, run_routed
from kvtier.bench.traces import TRACE_KINDS, TraceRequest, load_jsonl, parents, synthesize
from kvtier_contract.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from kvtier.client import NamespaceHandle

__all__ = ["TraceSettings", "bench_trace", "format_reports", "run_replay"]
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


def run_replay(
    settings: TraceSettings, name: str, trace: list[TraceRequest], policy: str, root: Path
) -> ReplayReport:
    """Replay ``trace`` against a fresh daemon with ``policy`` under ``root``; the figures, or
    a report ``unavailable`` when the daemon refuses the policy at start. RuntimeError when the
    daemon fails otherwise."""
    from kvtier.bench.procs import DaemonProc
    from kvtier.bench.transfers import bench_namespace, connect

    run_dir = root / f"{name}-{policy}"
    run_dir.mkdir(parents=True)
    config = run_dir / "kvtierd.toml"
    config.write_text(f"eviction_policy = {json.dumps(policy)}\n")
    extra = ["--config", str(config), "--disk-dir", str(run_dir / "disk")]
    extra += ["--disk-bytes", str(settings.disk_bytes), "--write-policy", settings.write_policy]
    report = ReplayReport(trace=name, policy=policy)
    try:
        daemon = DaemonProc(run_dir, settings.host_bytes, settings.slab_bytes, extra).__enter__()
    except RuntimeError as e:
        if "eviction_policy" not in str(e):
            raise
        report.status, report.reason = "unavailable", _refusal(str(e))
        return report
    try:
        with contextlib.closing(connect(daemon.unix, "shm", local_lookups=False)) as client:
            ns = client.register(bench_namespace(settings.block_bytes, name=f"kvtier-bench-trace-{name}"))
            replayer = Replayer(ns, parents(trace), report)
            t0 = time.perf_counter()
            for req in trace:
                replayer.request(req)
            replayer.probe_orphans()
            report.seconds = round(time.perf_counter() - t0, 3)
    finally:
        daemon.__exit__(None, None, None)
    return report


def _refusal(message: str) -> str:
    """The daemon's line about ``eviction_policy`` out of its log tail."""
    lines = [ln.strip() for ln in message.splitlines() if "eviction_policy" in ln]
    return lines[-1] if lines else message.strip().splitlines()[-1]


_COLUMNS = (
    ("trace", "trace", 14),
    ("policy", "policy", 8),
    ("requests", "requests", 9),
    ("tokens", "total_tokens", 10),
    ("hit", "hit_tokens", 10),
    ("recomputed", "recomputed_tokens", 11),
    ("evict-recomp", "eviction_recomputed_tokens", 13),
    ("orphaned", "orphaned_blocks", 9),
    ("held", "held_blocks", 6),
    ("s", "seconds", 7),
)


def format_reports(
    settings: TraceSettings, traces: dict[str, list[TraceRequest]], reports: list[ReplayReport]
) -> str:
    """The table of every (trace, policy), then the prefix / lru ratios where both ran."""
    tokens = 16  # bench_namespace's tokens per block
    lines = [
        f"trace replay: {format_bytes(settings.block_bytes)} blocks of {tokens} tokens; host tier "
        f"{format_bytes(settings.host_bytes)}, NVMe tier {format_bytes(settings.disk_bytes)} "
        f"({settings.write_policy}); seed {settings.seed}"
    ]
    for name, trace in traces.items():
        blocks = len(parents(trace))
        lines.append(
            f"  {name}: {len(trace)} requests, {blocks} distinct blocks "
            f"({format_bytes(blocks * settings.block_bytes)})"
        )
    lines.append(
        "".join(f"{head:>{w}}" if i > 1 else f"{head:<{w}}" for i, (head, _f, w) in enumerate(_COLUMNS))
    )
    for r in reports:
        if r.status != "ok":
            lines.append(f"{r.trace:<14}{r.policy:<8}  unavailable: {r.reason}")
            continue
        row = {**asdict(r), "seconds": f"{r.seconds:.2f}"}
        lines.append(
            "".join(
                f"{row[f]:<{w}}" if i <= 1 else f"{row[f]:>{w}}" if f == "seconds" else f"{row[f]:>{w},}"
                for i, (_h, f, w) in enumerate(_COLUMNS)
            )
        )
    for name, ratio in ratios(reports).items():
        lines.append(f"prefix/lru eviction-induced recomputed tokens, {name}: {ratio}")
    return "\n".join(lines)


def ratios(reports: list[ReplayReport]) -> dict[str, float | str]:
    """Trace -> prefix / lru of eviction-induced recomputed tokens, where both policies ran."""
    out: dict[str, float | str] = {}
    ok = {(r.trace, r.policy): r for r in reports if r.status == "ok"}
    for (trace, policy), lru in ok.items():
        prefix = ok.get((trace, "prefix"))
        if policy != "lru" or prefix is None:
            continue
        lru_n, prefix_n = lru.eviction_recomputed_tokens, prefix.eviction_recomputed_tokens
        out[trace] = round(prefix_n / lru_n, 3) if lru_n else ("n/a (lru: 0)" if prefix_n else 1.0)
    return out


def format_routed(routed: list[RoutedReport]) -> str:
    """One line per (trace, arm): hits over the pods, and how often the router's index was right."""
    lines = []
    for r in routed:
        share = r.hit_tokens / r.total_tokens if r.total_tokens else 0.0
        line = (
            f"routed {r.trace} over {r.pods} pods ({r.policy}), {r.arm}: {r.requests} requests, "
            f"hit {r.hit_tokens:,} of {r.total_tokens:,} tokens ({share:.1%})"
        )
        if r.arm == "indexer":
            line += (
                f"; the index predicted the lookup's hit for {r.predicted} "
                f"({r.predicted / max(r.requests, 1):.1%}), off by {r.mispredicted_blocks} blocks in all"
            )
        lines.append(line)
    return "\n".join(lines)


def bench_trace(args: argparse.Namespace) -> int:
    """``kvtier bench trace``: 0 when every available policy replayed every trace, 1 when a run
    failed, 2 for bad arguments."""
    try:
        settings = TraceSettings.from_args(args)
        traces = settings.load()
        for trace in traces.values():
            parents(trace)
    except (ValueError, OSError) as e:
        print(f"kvtier bench trace: {e}", file=sys.stderr)
        return 2
    reports: list[ReplayReport] = []
    routed: list[RoutedReport] = []
    arms = (["indexer"] if settings.router_indexer else []) + ["random"] if settings.pods else []
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-bench-trace-") as tmp:
            for name, trace in traces.items():
                for policy in settings.policies:
                    if settings.progress:
                        print(f"replaying {name} ({len(trace)} requests) with {policy}", file=sys.stderr)
                    reports.append(run_replay(settings, name, trace, policy, Path(tmp)))
                for arm in arms:
                    if settings.progress:
                        print(f"routing {name} over {settings.pods} pods: {arm}", file=sys.stderr)
                    routed.append(run_routed(settings, name, trace, arm, Path(tmp)))
    except (RuntimeError, AssertionError, OSError) as e:
        print(f"kvtier bench trace: failed: {e}", file=sys.stderr)
        return 1
    print(format_reports(settings, traces, reports))
    if routed:
        print(format_routed(routed))
    if settings.json_out:
        doc = {
            "settings": settings.describe(),
            "runs": [asdict(r) for r in reports],
            "ratios": ratios(reports),
            "routed": [asdict(r) for r in routed],
        }
        Path(settings.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0

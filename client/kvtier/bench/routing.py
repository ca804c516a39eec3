"""``kvtier bench trace --pods N``: one trace over N nodes, routed by a real router's index or at random.

Each of N pods is a fresh kvtierd (the trace settings' host and NVMe budget, the first policy of
``--policies``) with KV events on (ipc://, a replay endpoint, token ids sent with every store).
Two arms, each on fresh daemons:

* ``indexer``: Dynamo's standalone KV indexer (``kvtier.bench.dynamo``; ``--router-indexer``
  names its environment's Python) follows every pod's event stream; each request goes to the
  pod it scores highest (ties, and no match at all: the pod with the fewest requests so far,
  then the lowest number). The figure a router lives by, **predicted**, counts the requests for
  which the indexer's longest match on the chosen pod equals the hit that pod's ``lookup`` then
  observes.
* ``random``: each request goes to a pod drawn from ``random.Random(seed)``.

Per request, on the chosen pod, exactly :class:`kvtier.bench.replay.Replayer`'s work (lookup,
checked ``get_into`` of the hit, ``put`` of the rest with its tokens); then ``route_gap_ms``
pass before the next request (requests arrive spaced in a real trace; the events of one store
reach the router within the publisher's 20 ms turn and the indexer's apply).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.dynamo import DynamoIndexer
from kvtier.bench.procs import DaemonProc
from kvtier.bench.replay import Replayer, ReplayReport, TraceSettings
from kvtier.bench.traces import TraceRequest, parents
from kvtier.bench.transfers import bench_namespace, connect

__all__ = ["RoutedReport", "run_routed"]


@dataclass
class RoutedReport:
    """One trace over ``pods`` pods with one routing arm."""

    trace: str
    arm: str
    """``indexer`` or ``random``."""
    pods: int
    policy: str
    requests: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    predicted: int = 0
    """Requests whose indexer match on the chosen pod equalled its lookup's hit (``indexer``)."""
    mispredicted_blocks: int = 0
    """Sum over requests of |indexer match - lookup hit| on the chosen pod, in blocks."""
    seconds: float = 0.0


def run_routed(
    settings: TraceSettings, name: str, trace: list[TraceRequest], arm: str, root: Path
) -> RoutedReport:
    """Replay ``trace`` over ``settings.pods`` fresh daemons routed by ``arm`` (module
    docstring). RuntimeError when a daemon or the indexer fails to start."""
    report = RoutedReport(trace=name, arm=arm, pods=settings.pods, policy=settings.policies[0])
    with contextlib.ExitStack() as stack:
        pods = _start_pods(stack, settings, name, arm, root, parents(trace))
        indexer = None
        if arm == "indexer":
            assert settings.router_indexer is not None
            log, model = root / f"{name}-indexer.log", f"kvtier-bench-{name}"
            indexer = DynamoIndexer(settings.router_indexer, log, model=model, block_size=pods[0][0].tpb)
            stack.callback(indexer.close)
            for n, (_replayer, ev, replay) in enumerate(pods):
                indexer.register(n + 1, ev, replay)
        t0 = time.perf_counter()
        _route(settings, trace, [p[0] for p in pods], indexer, report)
        report.seconds = round(time.perf_counter() - t0, 3)
        for r, _ev, _replay in pods:
            report.requests += r.report.requests
            report.total_tokens += r.report.total_tokens
            report.hit_tokens += r.report.hit_tokens
    return report


def _start_pods(
    stack: contextlib.ExitStack,
    settings: TraceSettings,
    name: str,
    arm: str,
    root: Path,
    parent_of: dict[int, int | None],
) -> list[tuple[Replayer, str, str]]:
    """``settings.pods`` daemons with events on, each with a replayer (token ids on): with their
    event and replay endpoints. Closed by ``stack``."""
    policy = settings.policies[0]
    out = []
    for pod in range(settings.pods):
        run_dir = root / f"{name}-{arm}-pod{pod}"
        run_dir.mkdir(parents=True)
        (run_dir / "kvtierd.toml").write_text(f'eviction_policy = "{policy}"\n')
        ev, replay = f"ipc://{run_dir}/ev.sock", f"ipc://{run_dir}/replay.sock"
        extra = ["--config", str(run_dir / "kvtierd.toml"), "--disk-dir", str(run_dir / "disk")]
        extra += ["--disk-bytes", str(settings.disk_bytes), "--write-policy", settings.write_policy]
        extra += ["--events-endpoint", ev, "--events-replay-endpoint", replay]
        daemon = stack.enter_context(DaemonProc(run_dir, settings.host_bytes, settings.slab_bytes, extra))
        client = stack.enter_context(contextlib.closing(connect(daemon.unix, "shm", local_lookups=False)))
        ns = client.register(bench_namespace(settings.block_bytes, name=f"kvtier-bench-route-{name}"))
        out.append(
            (Replayer(ns, parent_of, ReplayReport(trace=name, policy=policy), token_ids=True), ev, replay)
        )
    return out


def _route(
    settings: TraceSettings,
    trace: list[TraceRequest],
    pods: list[Replayer],
    indexer: DynamoIndexer | None,
    report: RoutedReport,
) -> None:
    """Each request to the pod the indexer scores highest (or a random one), then the gap."""
    rng = random.Random(settings.seed)
    load = [0] * len(pods)
    for req in trace:
        if indexer is not None:
            scores = indexer.matched_blocks(pods[0].tokens(req.hash_ids))
            pod = min(range(len(pods)), key=lambda p: (-scores.get(p + 1, 0), load[p], p))
            predicted = scores.get(pod + 1, 0)
        else:
            pod, predicted = rng.randrange(len(pods)), 0
        load[pod] += 1
        seen = pods[pod].request(req)
        report.predicted += predicted == seen
        report.mispredicted_blocks += abs(predicted - seen)
        time.sleep(settings.route_gap_ms / 1000)

"""``kvtier bench trace`` (issue 42): the traces are deterministic chains, and a tiny replay's
figures add up.

The replay runs against a real kvtierd with a 512 KiB host tier (32 blocks of 16 KiB) and a
1 MiB NVMe tier below it, so a 60-request conversation trace (several hundred distinct blocks)
pushes blocks out of both tiers within a few seconds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.bench.replay import ReplayReport
from kvtier.bench.routing import run_routed
from kvtier.bench.trace import TraceSettings, bench_trace, format_reports, format_routed, ratios, run_replay
from kvtier.bench.traces import TRACE_KINDS, dump_jsonl, load_jsonl, parents, synthesize
from kvtier.cli import build_parser

TINY = TraceSettings(policies=("lru",), requests=60, host_bytes=512 << 10, disk_bytes=1 << 20, progress=False)


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_a_seed_gives_one_trace_of_chains(kind: str, tmp_path: Path) -> None:
    trace = synthesize(kind, 80, seed=7)  # type: ignore[arg-type]
    assert trace == synthesize(kind, 80, seed=7)  # type: ignore[arg-type]
    assert trace != synthesize(kind, 80, seed=8)  # type: ignore[arg-type]
    assert len(trace) == 80
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    parent_of = parents(trace)  # every id follows one parent: chains from the heads
    heads = [r.hash_ids[0] for r in trace]
    assert len(set(heads)) < len(heads)  # prefixes are shared
    assert all(p is None or p in parent_of for p in parent_of.values())
    path = tmp_path / "trace.jsonl"
    dump_jsonl(trace, path)
    assert load_jsonl(path) == trace
    assert load_jsonl(path, limit=5) == trace[:5]


def test_a_conversation_turn_extends_the_previous_turn_of_its_session() -> None:
    trace = synthesize("conversation", 40, seed=1)
    by_head: dict[int, tuple[int, ...]] = {}
    for r in trace:  # sessions share the system prompt: a session is its first own block
        head = r.hash_ids[4]
        prev = by_head.get(head, ())
        assert r.hash_ids[: len(prev)] == prev and len(r.hash_ids) > len(prev)
        by_head[head] = r.hash_ids


def test_an_id_under_two_parents_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}\n')
    path.write_text(
        path.read_text() + '{"timestamp": 1, "input_length": 32, "output_length": 1, "hash_ids": [3, 2]}\n'
    )
    with pytest.raises(ValueError, match="hash id 2 follows 3"):
        parents(load_jsonl(path))


def test_a_tiny_replay_adds_up(tmp_path: Path) -> None:
    trace = synthesize("conversation", TINY.requests or 0, TINY.seed)
    report = run_replay(TINY, "conversation", trace, "lru", tmp_path)
    assert report.status == "ok" and report.requests == len(trace)
    assert report.total_tokens == sum(len(r.hash_ids) for r in trace) * 16
    assert report.hit_tokens + report.recomputed_tokens == report.total_tokens
    assert report.hit_tokens > 0  # later turns find their session's earlier turns
    assert 0 < report.eviction_recomputed_tokens <= report.recomputed_tokens  # the budget evicts
    assert report.stored_blocks <= len(parents(trace))
    assert 0 <= report.orphaned_blocks <= report.held_blocks < report.stored_blocks
    table = format_reports(TINY, {"conversation": trace}, [report])
    assert "conversation  lru" in table and "prefix/lru" not in table


def test_a_long_trace_name_keeps_its_columns() -> None:
    """A file's stem names the trace (mooncake_conversation_trace: 27 characters): the table
    widens its first column instead of running the name into the policy."""
    name = "mooncake_conversation_trace"
    trace = synthesize("conversation", 3, 0)
    reports = [ReplayReport(trace=name, policy=p, requests=3) for p in ("lru", "prefix")]
    reports.append(ReplayReport(trace=name, policy="nope", status="unavailable", reason="no"))
    table = format_reports(TINY, {name: trace}, reports)
    for policy in ("lru ", "prefix ", "nope      unavailable"):
        assert f"\n{name}  {policy}" in table


def test_a_policy_the_daemon_refuses_is_unavailable(tmp_path: Path) -> None:
    report = run_replay(TINY, "agentic", synthesize("agentic", 5, 0), "no-such-policy", tmp_path)
    assert report.status == "unavailable" and "eviction_policy" in report.reason
    assert ratios([report]) == {}


def test_the_command_refuses_bad_flags() -> None:
    def run(*argv: str) -> int:
        return bench_trace(build_parser().parse_args(["bench", "trace", "--no-progress", *argv]))

    assert run("--policies", "") == 2
    assert run("--traces", "chat") == 2
    assert run("--requests", "0") == 2
    assert run("--trace-file", "/nonexistent/trace.jsonl") == 2
    assert run("--pods", "1") == 2
    assert run("--router-indexer", "/usr/bin/python3") == 2  # (needs --pods)
    assert run("--pods", "2", "--route-gap-ms", "-1") == 2


def test_a_routed_replay_over_random_pods_adds_up(tmp_path: Path) -> None:
    """The random arm needs no router: two daemons with events on, stores with token ids. (The
    indexer arm needs Dynamo's environment: tests/integration/events/test_events_dynamo_indexer.py
    covers the index it routes by.)"""
    settings = replace(TINY, pods=2, route_gap_ms=0)
    trace = synthesize("agentic", 30, 0)
    r = run_routed(settings, "agentic", trace, "random", tmp_path)
    assert (r.arm, r.pods, r.requests) == ("random", 2, 30)
    assert r.total_tokens == sum(len(q.hash_ids) for q in trace) * 16
    assert 0 < r.hit_tokens < r.total_tokens and r.predicted <= r.requests
    assert "routed agentic over 2 pods (lru), random: 30 requests" in format_routed([r])

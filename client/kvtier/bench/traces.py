"""Request traces for ``kvtier bench trace``, in the public Mooncake traces' shape, as plain data.

A trace is a list of :class:`TraceRequest` in arrival order. Each request's ``hash_ids`` name its
prompt's blocks from the head: a hash id stands for a block *and everything before it* (a chained
hash, as an engine's block keys are), so a request that shares a prefix with an earlier one
repeats that prefix's ids, and an id always follows the same parent id (:func:`parents` checks).

Two generators, both deterministic functions of their arguments (one ``random.Random(seed)``,
ids handed out in order):

* :func:`conversation_trace`: multi-turn chats. Every session starts with a system prompt shared
  by all sessions and a first message; each next turn's prompt is the previous prompt, the
  previous answer and a new message, so its ids extend the previous turn's. Sessions interleave
  by arrival time; the gap before a session's next turn is Pareto-distributed (a Zipf-like tail),
  so a few sessions come back only after long idle stretches, when their blocks have gone cold.
* :func:`agentic_trace`: agents over a few long shared system/tool prefixes (chosen with Zipf
  weights). A request either starts a new task on a prefix, or takes a recent trajectory and
  extends it by a step (tool output, next call), sometimes branching off an earlier point of
  it (a retry, a sub-agent), so trajectories form deep trees under the prefixes.

:func:`load_jsonl` reads a real Mooncake-format file (one JSON object a line: ``timestamp``,
``input_length``, ``output_length``, ``hash_ids``); :func:`dump_jsonl` writes one.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TraceKind = Literal["conversation", "agentic"]
TRACE_KINDS: tuple[TraceKind, ...] = ("conversation", "agentic")
SYSTEM_BLOCKS = 4
"""Blocks of the system prompt every conversation starts with."""
MEAN_GAP_MS = 2_000.0
"""Scale of the idle gap between two turns of one session (Pareto, shape ``GAP_SHAPE``)."""
GAP_SHAPE = 1.2
MAX_CONTEXT_BLOCKS = 256
"""An agent trajectory longer than this ends; the next request starts a new task."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival time, prompt and answer lengths, and its prompt's blocks."""

    timestamp_ms: int
    input_length: int
    """Prompt tokens (``len(hash_ids) * tokens_per_block`` in the synthesized traces)."""
    output_length: int
    """Answer tokens (the answer's blocks open the session's next prompt)."""
    hash_ids: tuple[int, ...]


def conversation_trace(requests: int, seed: int, tokens_per_block: int = 16) -> list[TraceRequest]:
    """``requests`` turns of multi-turn chats (module docstring), sorted by arrival time."""
    rng = random.Random(seed)
    ids = itertools.count()
    system = tuple(next(ids) for _ in range(SYSTEM_BLOCKS))
    turns: list[tuple[float, int, TraceRequest]] = []
    session = 0
    while len(turns) < requests:
        t = rng.uniform(0.0, MEAN_GAP_MS * requests / 8)
        prompt = system
        for _turn in range(rng.randint(2, 10)):
            prompt = prompt + tuple(next(ids) for _ in range(rng.randint(1, 4)))  # the new message
            answer = rng.randint(1, 4)
            turns.append((t, session, _request(t, prompt, answer, tokens_per_block)))
            prompt = prompt + tuple(next(ids) for _ in range(answer))
            t += 200.0 + MEAN_GAP_MS * (rng.paretovariate(GAP_SHAPE) - 1.0)
        session += 1
    turns = sorted(turns[:requests], key=lambda x: (x[0], x[1]))  # (the last session cut short)
    return [r for _t, _s, r in turns]


def agentic_trace(requests: int, seed: int, tokens_per_block: int = 16) -> list[TraceRequest]:
    """``requests`` agent steps over a few shared prefixes (module docstring), in arrival order."""
    rng = random.Random(seed)
    ids = itertools.count()
    prefixes = [tuple(next(ids) for _ in range(rng.randint(16, 48))) for _ in range(4)]
    weights = [1.0 / (i + 1) for i in range(len(prefixes))]
    trajectories: list[tuple[int, ...]] = []
    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(1.0 / 100.0)
        if not trajectories or rng.random() < 0.25:
            context = rng.choices(prefixes, weights)[0]  # a new task on a shared prefix
        else:
            back = min(len(trajectories), int(rng.paretovariate(1.0)))  # recent ones mostly
            context = trajectories[-back]
            if rng.random() < 0.25:  # a branch off an earlier point (a retry, a sub-agent)
                context = context[: rng.randint(len(context) // 2, len(context))]
        prompt = context + tuple(next(ids) for _ in range(rng.randint(1, 6)))
        answer = rng.randint(1, 3)
        out.append(_request(t, prompt, answer, tokens_per_block))
        full = prompt + tuple(next(ids) for _ in range(answer))
        if len(full) <= MAX_CONTEXT_BLOCKS:
            trajectories.append(full)
    return out


def synthesize(kind: TraceKind, requests: int, seed: int, tokens_per_block: int = 16) -> list[TraceRequest]:
    """The trace of ``kind`` (``TRACE_KINDS``)."""
    make = conversation_trace if kind == "conversation" else agentic_trace
    return make(requests, seed, tokens_per_block)


def _request(t_ms: float, prompt: tuple[int, ...], answer_blocks: int, tpb: int) -> TraceRequest:
    return TraceRequest(round(t_ms), len(prompt) * tpb, answer_blocks * tpb, prompt)


def parents(trace: list[TraceRequest]) -> dict[int, int | None]:
    """Each hash id's parent id (None: a chain head). ValueError when an id follows two
    different parents (not a chained trace)."""
    out: dict[int, int | None] = {}
    for n, req in enumerate(trace):
        parent: int | None = None
        for h in req.hash_ids:
            if out.setdefault(h, parent) != parent:
                raise ValueError(f"request {n}: hash id {h} follows {parent}, earlier {out[h]}")
            parent = h
    return out


def load_jsonl(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSONL file (at most ``limit``); ValueError naming the
    line when one is not such an object."""
    out: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(_parse(line, f"{path}:{lineno}"))
    return out


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
        ids = tuple(int(h) for h in obj["hash_ids"])
        if any(h < 0 for h in ids):
            raise ValueError("negative hash id")
        return TraceRequest(
            round(float(obj.get("timestamp", 0))),
            int(obj.get("input_length", 0)),
            int(obj.get("output_length", 0)),
            ids,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a Mooncake trace line ({e})") from None


def dump_jsonl(trace: list[TraceRequest], path: Path) -> None:
    """Write ``trace`` in the Mooncake format (``load_jsonl`` reads it back equal)."""
    with path.open("w") as f:
        for line in _lines(trace):
            f.write(line + "\n")


def _lines(trace: list[TraceRequest]) -> Iterator[str]:
    for r in trace:
        yield json.dumps(
            {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
        )

"""A real router's indexer, fed only by kvtier's KV events, scores the node that holds a prefix.

Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from the ``ai-dynamo-runtime``
wheel, its own environment: ``make dynamo-env``; driven by ``kvtier.bench.dynamo``), written by
no one here, subscribes to each
daemon's event stream (ipc://, with its replay endpoint) as it would to a vLLM engine's, hashes
token ids with its own block hashing, and answers ``POST /query`` with each instance's longest
matched prefix. Two daemons stand for two nodes. After stores, evictions and a daemon restart,
the indexer's score for each node equals, block for block, the hits a ``lookup`` on that node
then observes: a router fed by kvtier's events sends the request where its prefix is. An engine
pod registered as an instance on its node daemon's stream is credited with that node's blocks,
until it is unregistered (docs/events.md, "A router's indexer").

The events go with vLLM's default int64 block hashes (``events_block_hashes``): this indexer
refuses the 32-byte ``bin`` form ("data did not match any variant of untagged enum
BlockHashValue").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, make_namespace
from driver_process import require_env
from tests_helpers import wait_for

import kvtier
from kvtier.bench.dynamo import DynamoIndexer

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

DYNAMO_PYTHON = os.environ.get("KVTIER_DYNAMO_PYTHON") or str(ROOT / ".venv-dynamo" / "bin" / "python")
TPB = 16  # make_namespace's tokens per block
HOST = ("--host-bytes", "1MiB", "--slab-bytes", "1MiB")  # 64 blocks of 16 KiB
MODEL = "test/model"


def tokens(seed: int, n_blocks: int) -> list[int]:
    h = hashlib.shake_256(b"tokens %d" % seed).digest(4 * TPB * n_blocks)
    return [int.from_bytes(h[i : i + 4], "little") % 150_000 for i in range(0, len(h), 4)]


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[DynamoIndexer]:
    python = require_env(DYNAMO_PYTHON, "Dynamo", "dynamo-env", "KVTIER_SKIP_DYNAMO")
    idx = DynamoIndexer(python, tmp_path / "indexer.log", model=MODEL, block_size=TPB)
    yield idx
    idx.close()


def serve(run: Path) -> tuple[str, ...]:
    run.mkdir(parents=True, exist_ok=True)
    return (
        *HOST,
        "--events-endpoint",
        f"ipc://{run}/ev.sock",
        "--events-replay-endpoint",
        f"ipc://{run}/replay.sock",
    )


def test_dynamos_indexer_scores_the_node_holding_the_longest_prefix(
    daemon_factory: Any, indexer: DynamoIndexer, tmp_path: Path
) -> None:
    runs = {1: tmp_path / "node1", 2: tmp_path / "node2"}
    nodes = {n: daemon_factory(*serve(run), run_dir=run) for n, run in runs.items()}
    for n, run in runs.items():
        indexer.register(n, f"ipc://{run}/ev.sock", f"ipc://{run}/replay.sock")
    clients = {n: kvtier.Client.connect(d.unix, transport="shm") for n, d in nodes.items()}
    try:
        ns = {n: c.register(make_namespace()) for n, c in clients.items()}
        prompts = {seed: tokens(seed, 40) for seed in (1, 2)}

        def put(n: int, toks: list[int]) -> None:
            h = ns[n]
            keys = h.block_keys(toks)
            assert h.put(keys, [bytes(h.block_bytes)] * len(keys), token_ids=toks).stored == len(keys)

        def observed(toks: list[int]) -> dict[int, int]:
            """What a lookup on each node hits of ``toks`` (the truth the router predicts)."""
            return {n: h.lookup(h.block_keys(toks)) for n, h in ns.items()}

        def agrees(toks: list[int]) -> bool:
            want = {n: hits for n, hits in observed(toks).items() if hits}
            return indexer.matched_blocks(toks) == want

        def settle(toks: list[int]) -> dict[int, int]:
            wait_for(f"the indexer to agree with lookups ({observed(toks)})", lambda: agrees(toks), 30.0)
            return indexer.matched_blocks(toks)

        # stores: node 1 holds 30 blocks of prompt 1, node 2 its first 10 and all of prompt 2
        put(1, prompts[1][: 30 * TPB])
        put(2, prompts[1][: 10 * TPB])
        put(2, prompts[2])
        assert settle(prompts[1]) == {1: 30, 2: 10}  # the router sends prompt 1 to node 1
        assert settle(prompts[2]) == {2: 40}
        best = max((s, n) for n, s in indexer.matched_blocks(prompts[1]).items())[1]
        assert best == 1

        # evictions: node 1's host tier (64 blocks) takes 64 blocks of other prompts
        for seed in (10, 11):
            put(1, tokens(seed, 32))
        assert observed(prompts[1])[1] < 30  # evicted (LRU: prompt 1 was the coldest)
        after = settle(prompts[1])
        assert after.get(1, 0) == observed(prompts[1])[1] and after[2] == 10

        # a restart: node 1 comes back empty (no NVMe), a new stream; then holds prompt 1 again
        clients[1].close()
        nodes[1].stop()
        nodes[1] = daemon_factory(*serve(runs[1]), run_dir=runs[1])
        clients[1] = kvtier.Client.connect(nodes[1].unix, transport="shm")
        ns[1] = clients[1].register(make_namespace())
        assert settle(tokens(10, 32)) == {}  # what it held before is no longer credited to it
        put(1, prompts[1])
        assert settle(prompts[1]) == {1: 40, 2: 10}

        # engines as instances: a second engine pod on node 1, registered on node 1's stream,
        # is credited with what node 1 holds (it loads from the same daemon); leaving, it is not
        indexer.register(3, f"ipc://{runs[1]}/ev.sock", f"ipc://{runs[1]}/replay.sock")
        wait_for("the second engine's credit", lambda: indexer.matched_blocks(prompts[1]).get(3) == 40, 30.0)
        indexer.call("POST", "/unregister", {"instance_id": 3, "model_name": MODEL})
        assert indexer.matched_blocks(prompts[1]) == {1: 40, 2: 10}
    finally:
        for c in clients.values():
            c.close()

"""KV events with the cluster tier (a real Redis Cluster on loopback: tests/redis_cluster.py).

Node A publishes ``BlockStored(REMOTE)`` for every block it wrote into the cluster (never a
removal: the cluster evicts on its own, unseen); node B, which imports them on a get, publishes
``BlockStored(CPU)`` for each import.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace

import kvtier

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("redis")
from events_follower import Follower  # noqa: E402
from redis_cluster import RedisCluster  # noqa: E402
from test_cluster_tier import node, store  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("redis")) as rc:
        yield rc


def test_blocks_written_to_the_cluster_are_remote_and_imports_are_cpu(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    ev = {n: (f"ipc://{tmp_path}/ev-{n}.sock", f"ipc://{tmp_path}/r-{n}.sock") for n in "ab"}
    a, b = (
        node(
            daemon_factory,
            tmp_path,
            n,
            cluster.url,
            f'events_endpoint = "{ev[n][0]}"',
            f'events_replay_endpoint = "{ev[n][1]}"',
            'events_block_hashes = "bytes"',
        )
        for n in "ab"
    )
    fa, fb = Follower(*ev["a"]), Follower(*ev["b"])
    try:
        keys, _ = store(a, "events-remote", 24)
        fa.settle(lambda: all(fa.held.get(k) == {"CPU", "REMOTE"} for k in keys))
        with kvtier.Client.connect(b.unix, transport="shm") as c:
            ns = c.register(make_namespace())
            assert all(g is not None for g in ns.get(keys))
        fb.settle(lambda: all(fb.held.get(k) == {"CPU"} for k in keys))
    finally:
        fa.close()
        fb.close()

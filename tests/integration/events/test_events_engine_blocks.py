"""Engine blocks stored straight from a paged cache (``put_blocks``: the path the vLLM connector
takes) carry their token ids and parent key into the daemon's KV events, as ``put`` does, over
every transport: a router that hashes tokens can then match what the engine stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_namespace

import kvtier
from kvtier import errors
from kvtier.layouts import PagedKvLayout

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
from events_follower import Follower  # noqa: E402  (needs pyzmq and msgpack)

NUM_BLOCKS, TPB = 8, 16


def paged(ns: Any) -> PagedKvLayout:
    buf = torch.randint(0, 256, (NUM_BLOCKS, ns.block_bytes), dtype=torch.uint8)
    return PagedKvLayout.contiguous(buf, num_layers=2)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_put_blocks_publishes_the_engines_tokens_and_parent(
    daemon_factory: Any, tmp_path: Path, transport: str
) -> None:
    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--events-endpoint",
        f"ipc://{tmp_path}/ev.sock",
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-replay-endpoint",
        f"ipc://{tmp_path}/replay.sock",
    )
    follow = Follower(f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock")
    try:
        with kvtier.Client.connect(d.address(transport), transport=transport) as c:
            ns = c.register(make_namespace(cache_salt="s1"))
            tokens = list(range(1000, 1000 + TPB * 6))
            keys = ns.block_keys(tokens)
            layout = paged(ns)
            # the first two blocks, then the next four chained on from them (parent = keys[1])
            assert ns.put_blocks(keys[:2], layout, [0, 1], token_ids=tokens[: 2 * TPB]).stored == 2
            assert (
                ns.put_blocks(
                    keys[2:], layout, [2, 3, 4, 5], token_ids=tokens[2 * TPB :], parent=keys[1]
                ).stored
                == 4
            )
            with pytest.raises(errors.InvalidArgument) as bad:  # checked before any copy
                ns.put_blocks(ns.block_keys(list(range(TPB * 2))), layout, [6, 7], token_ids=list(range(TPB)))
            assert bad.value.field == "token_ids"
            follow.settle(lambda: set(follow.stored) >= set(keys))
            for i, k in enumerate(keys):
                got = follow.stored[k]
                assert got["tokens"] == tokens[i * TPB : (i + 1) * TPB], i
                assert got["parent"] == (keys[i - 1] if i else None), i
            assert ns.lookup(ns.block_keys(list(range(TPB * 2)))) == 0  # the refused put: nothing
    finally:
        follow.close()

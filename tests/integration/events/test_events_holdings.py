"""A router rebuilt from kvtier's KV events agrees with the daemon on every key.

A real daemon (host tier of 128 blocks, NVMe tier below, write-back) publishes events on ipc://
with a replay endpoint. A subscriber (tests/events_follower.py) joins late and loses messages
on purpose, filling both gaps by replay; after stores (plain, salted and adapter namespaces),
evictions, demotions, promotions and a restart that recovers the NVMe tier, its holdings
(key -> media) match ``lookup`` on every key: a hit iff held, the tier "host" iff the media
hold "CPU", else "nvme" and "STORAGE".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from conftest import make_namespace

import kvtier

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
from events_follower import Follower  # noqa: E402  (needs pyzmq and msgpack)

TPB = 16
HOST = ("--host-bytes", "2MiB", "--slab-bytes", "1MiB")  # 128 blocks of 16 KiB


def tokens(seed: int, n_blocks: int) -> list[int]:
    h = hashlib.shake_256(b"tokens %d" % seed).digest(4 * TPB * n_blocks)
    return [int.from_bytes(h[i : i + 4], "little") % 150_000 for i in range(0, len(h), 4)]


def serve(tmp: Path) -> tuple[str, ...]:
    return (
        *HOST,
        "--disk-dir",
        str(tmp / "nvme"),
        "--disk-bytes",
        "16MiB",
        "--events-endpoint",
        f"ipc://{tmp}/ev.sock",
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-replay-endpoint",
        f"ipc://{tmp}/replay.sock",
    )


def agrees(f: Follower, handles: list[tuple[Any, list[bytes]]], why: list[str]) -> bool:
    why.clear()
    for ns, keys in handles:
        for k in keys:
            seen = ns.lookup_detail([k])
            media = f.held.get(k, set())
            want = "host" if "CPU" in media else "nvme" if "STORAGE" in media else None
            got = seen.tiers[0] if seen.hits else None
            if got != want:
                why.append(f"{k[:4].hex()}: lookup {got}, events {sorted(media)}")
    return not why


def test_holdings_rebuilt_from_events_agree_with_lookup(daemon_factory: Any, tmp_path: Path) -> None:
    d1 = daemon_factory(*serve(tmp_path), run_dir=tmp_path / "run")
    lost = {3, 7, 8}  # messages the subscriber loses on arrival (gaps to fill by replay)
    f = Follower(f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock", lose=lambda n: n in lost)
    why: list[str] = []
    try:
        with kvtier.Client.connect(d1.unix, transport="shm") as client:
            plain = client.register(make_namespace())
            salted = client.register(make_namespace(cache_salt="s3cret"))
            adapted = client.register(make_namespace(adapter_id="lora-a", adapter_revision="1"))
            # before the subscriber has seen anything: it joins late (replay from 0)
            early = tokens(0, 40)
            early_keys = plain.block_keys(early)
            assert plain.put(early_keys, [bytes(plain.block_bytes)] * 40, token_ids=early).stored == 40
            handles: list[tuple[Any, list[bytes]]] = [(plain, list(early_keys))]
            for seed, ns, n in ((1, plain, 160), (2, salted, 48), (3, adapted, 48), (4, plain, 64)):
                toks = tokens(seed, n)
                keys = ns.block_keys(toks)
                for i in range(0, n, 16):  # twice the host tier in all: evictions, demotions
                    put = ns.put(
                        keys[i : i + 16],
                        [bytes(ns.block_bytes)] * 16,
                        token_ids=toks[i * TPB : (i + 16) * TPB],
                        parent=keys[i - 1] if i else None,
                    )
                    assert put.stored == 16
                    f.pump(0.0)
                handles.append((ns, list(keys)))
            assert set(plain.lookup_detail(early_keys[:20]).tiers) == {"nvme"}
            got = plain.get(early_keys[:20])  # promotions from NVMe
            assert all(g is not None for g in got)
            f.settle(lambda: agrees(f, handles, why))
            assert f.lost == len(lost) and f.replays >= 2, (f.lost, f.replays)
            held_in = {m for media in f.held.values() for m in media}
            assert held_in == {"CPU", "STORAGE"}, held_in  # both tiers really seen
            # what a router needs to place a block: its tokens, parent, adapter and salt
            k = handles[2][1][5]  # salted, 6th block
            ev = f.stored[k]
            assert ev["tokens"] == tokens(2, 48)[5 * TPB : 6 * TPB]
            assert ev["parent"] == handles[2][1][4]
            # vLLM's rule: the salt on a chain's first block only, the parent carries it on
            extra = ev.get("extra_keys")
            assert extra is None or extra[ev["index"]] is None, extra
            head = f.stored[handles[2][1][0]]
            assert head["parent"] is None and head["extra_keys"][head["index"]] == ["s3cret"]
            a = f.stored[handles[3][1][0]]
            assert a["lora_name"] == "lora-a" and a["extra_keys"][a["index"]] == ["lora-a"]
            assert a["block_size"] == TPB and f.tenants == {None}
        assert d1.stop() == 0  # the drain flushes the host tier to NVMe
        d2 = daemon_factory(*serve(tmp_path), run_dir=tmp_path / "run")
        with kvtier.Client.connect(d2.unix, transport="shm") as client:
            handles = [(client.register(ns.namespace), keys) for ns, keys in handles]
            replays = f.replays
            f.settle(lambda: f.next_seq is not None and f.replays > replays and agrees(f, handles, why))
            assert all(f.held.get(k) == {"STORAGE"} for _, keys in handles for k in keys)
    finally:
        f.close()
    assert not why, why[:5]

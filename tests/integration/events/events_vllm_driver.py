"""Runs in the vLLM environment (.venv-vllm): vLLM's own KV-event classes judge kvtier's wire.

argv[1]: a msgpack file of [topic, seq, payload] messages captured from a daemon's PUB socket;
argv[2]: the daemon's replay endpoint. Prints one JSON line:

* ``decoded``: each payload decoded by ``msgspec.msgpack.Decoder(KVEventBatch)`` (vLLM's types;
  a payload it rejects raises), as [seq, [[type, medium, n hashes, lora_name, extra_keys,
  token count, parent is bytes]...]];
* ``ours`` / ``vllms``: the replay answer of the daemon and of vLLM's own ZmqEventPublisher (two
  batches published, replay asked from its first seq) to the same DEALER request, as frame
  counts per message and whether the last message is vLLM's END_SEQ marker.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while sock.poll(5000):
        frames = sock.recv_multipart()
        out.append(frames)
        if frames[2] == ZmqEventPublisher.END_SEQ:
            break
    sock.close(0)
    return out


def shape(answer: list[list[bytes]]) -> dict[str, object]:
    return {
        "frames": sorted({len(f) for f in answer}),
        "empty_delimiter": all(f[0] == b"" for f in answer),
        "ends_with_marker": bool(answer)
        and answer[-1][2:] == [ZmqEventPublisher.END_SEQ, b""]
        and answer[-1][1] == b"",
        "messages": len(answer) - 1,
    }


def main() -> None:
    messages = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    decoded = []
    for _topic, seq, payload in messages:
        batch = dec.decode(payload)
        evs = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                evs.append(
                    [
                        "BlockStored",
                        ev.medium,
                        len(ev.block_hashes),
                        ev.lora_name,
                        ev.extra_keys,
                        len(ev.token_ids),
                        isinstance(ev.parent_block_hash, bytes),
                        ev.block_size,
                        all(isinstance(h, bytes) and len(h) == 32 for h in ev.block_hashes),
                    ]
                )
            elif isinstance(ev, BlockRemoved):
                evs.append(["BlockRemoved", ev.medium, len(ev.block_hashes)])
            else:
                assert isinstance(ev, AllBlocksCleared)
                evs.append(["AllBlocksCleared"])
        decoded.append([int.from_bytes(seq, "big"), evs, batch.data_parallel_rank])
    ctx = zmq.Context()
    ours = replay(ctx, sys.argv[2], 0)
    with tempfile.TemporaryDirectory() as tmp:
        pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp}/pub", replay_endpoint=f"ipc://{tmp}/r")
        for _ in range(2):
            pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        deadline = time.monotonic() + 10
        while len(pub._buffer) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        vllms = replay(ctx, f"ipc://{tmp}/r", 0)
        pub.shutdown()
    ours_payloads_ok = all(len(dec.decode(f[3]).events) >= 0 for f in ours[:-1])
    print(
        json.dumps(
            {"decoded": decoded, "ours": shape(ours), "vllms": shape(vllms), "ours_decoded": ours_payloads_ok}
        )
    )


if __name__ == "__main__":
    main()

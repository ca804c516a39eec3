"""On-disk format of the NVMe tier, stated once (the grammar and rationale: docs/block_format.md).

A data directory holds ``kvtier.meta`` (JSON, :class:`StoreMeta`) and preallocated data files
``blocks-00000.kvt``, ``blocks-00001.kvt``, ... each ``file_bytes`` long. A data file is a sequence
of slots, each starting at a multiple of ``io_align``:

    slot = header region (io_align bytes: HEADER, then zeros) ‖ payload region
    payload region = payload (payload_len bytes) ‖ padding up to a multiple of io_align

so the payload starts aligned and O_DIRECT moves it straight from / to page-aligned memory.

Primitives: ``slot_bytes(payload_len, io_align)``; ``new_header(...)`` builds a :class:`SlotHeader`
for a payload; ``encode_header`` / ``encode_header_into`` write the header region;
``decode_header(region, expect_...)`` validates a header region completely or raises
:class:`CorruptSlot`; ``verify_payload(header, payload)`` checks the payload checksum.
What is validated when: every read of a slot decodes its header with the expected namespace, key
and payload length, then verifies the payload; recovery and fsck decode headers without
expectations (and fsck verifies payloads too). Pure functions, no I/O, thread-safe.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import time
from dataclasses import asdict, dataclass
from typing import Literal

import xxhash

from kvtier_contract.errors import KvtierError
from kvtierd.tiers.base import CorruptCopy

MAGIC = b"KVTBLK01"
FORMAT_VERSION = 1
DEFAULT_IO_ALIGN = 4096
MIN_IO_ALIGN, MAX_IO_ALIGN = 512, 1 << 20

# Slot header, little endian, 128 bytes, inside the first 512-byte sector of the header region:
#   magic 8s | format_version u16 | flags u16 | header_len u32 | io_align u32 | reserved u32 |
#   namespace_digest 32s | key 32s | payload_len u64 | payload_checksum u64 | sequence u64 |
#   written_at_ns u64 | header_checksum u64 (xxh3_64 of the 120 bytes before it)
HEADER = struct.Struct("<8sHHIII32s32sQQQQQ")
_CHECKED = HEADER.size - 8  # bytes covered by header_checksum
assert HEADER.size == 128

CorruptReason = Literal[
    "zero",  # an all-zero header region: an empty (never written) slot
    "bad_magic",  # not a slot header (stale payload bytes, or a destroyed magic)
    "bad_version",  # a format version this code does not read
    "bad_header_checksum",  # a header torn inside its first 128 bytes, or flipped bits
    "bad_layout",  # header_len / flags / reserved / io_align differ from what version 1 writes
    "bad_padding",  # non-zero bytes after the header in its region: a torn header over old data
    "bad_length",  # payload_len 0, unexpected, or the slot runs past the end of the file
    "wrong_namespace",  # a valid slot of another namespace
    "wrong_key",  # a valid slot of another key
    "bad_payload_checksum",  # the payload is torn or corrupt
]


class CorruptSlot(CorruptCopy):
    """A slot that must not be served; ``reason`` is a :data:`CorruptReason`. On the read path
    this is a miss (the slot is quarantined and counted), never an error returned to a client."""

    code_name = "INTERNAL"

    def __init__(self, reason: CorruptReason, detail: str = "") -> None:
        self.reason: CorruptReason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


@functools.cache
def _zeros(n: int) -> bytes:
    return bytes(n)


def _is_zero(view: memoryview) -> bool:
    return view.tobytes() == _zeros(len(view))  # a copy and a memcmp: ~1 us for 16 KiB


def valid_io_align(io_align: int) -> bool:
    return MIN_IO_ALIGN <= io_align <= MAX_IO_ALIGN and io_align & (io_align - 1) == 0


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def slot_bytes(payload_len: int, io_align: int = DEFAULT_IO_ALIGN) -> int:
    """Bytes a slot occupies: the header region plus the payload rounded up to ``io_align``."""
    assert payload_len > 0 and valid_io_align(io_align), (payload_len, io_align)
    return io_align + round_up(payload_len, io_align)


def payload_checksum(payload: memoryview | bytes | bytearray) -> int:
    """xxh3_64 (seed 0) of the payload bytes; releases the GIL."""
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True)
class SlotHeader:
    """A validated (decoded) or about-to-be-written slot header."""

    namespace_digest: bytes
    key: bytes
    payload_len: int
    payload_checksum: int
    sequence: int
    written_at_ns: int
    io_align: int = DEFAULT_IO_ALIGN
    flags: int = 0

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.payload_len, self.io_align)


def new_header(
    namespace_digest: bytes,
    key: bytes,
    payload: memoryview | bytes | bytearray,
    *,
    sequence: int,
    io_align: int = DEFAULT_IO_ALIGN,
    written_at_ns: int | None = None,
    checksum: int | None = None,
) -> SlotHeader:
    """The header for writing ``payload`` (its length computed here; its checksum too unless
    given: a block's digest from its commit, never recomputed from the bytes being written, so
    bytes altered in the host tier after the commit fail verification when read back)."""
    return SlotHeader(
        namespace_digest,
        key,
        memoryview(payload).nbytes,
        payload_checksum(payload) if checksum is None else checksum,
        sequence,
        time.time_ns() if written_at_ns is None else written_at_ns,
        io_align,
    )


def encode_header_into(h: SlotHeader, region: memoryview | bytearray) -> None:
    """Write the whole header region (``h.io_align`` bytes: header, then zeros) into ``region``."""
    assert len(h.namespace_digest) == 32 and len(h.key) == 32, "digest and key are 32 bytes"
    assert h.payload_len > 0 and valid_io_align(h.io_align) and h.flags == 0, h
    assert len(region) == h.io_align, (len(region), h.io_align)
    HEADER.pack_into(
        region,
        0,
        MAGIC,
        FORMAT_VERSION,
        h.flags,
        HEADER.size,
        h.io_align,
        0,
        h.namespace_digest,
        h.key,
        h.payload_len,
        h.payload_checksum,
        h.sequence,
        h.written_at_ns,
        0,
    )
    checksum = xxhash.xxh3_64_intdigest(memoryview(region)[:_CHECKED])
    struct.pack_into("<Q", region, _CHECKED, checksum)
    region[HEADER.size :] = bytes(h.io_align - HEADER.size)


def encode_header(h: SlotHeader) -> bytes:
    """The header region of ``h`` as ``h.io_align`` bytes."""
    region = bytearray(h.io_align)
    encode_header_into(h, region)
    return bytes(region)


def decode_header(
    region: memoryview | bytes | bytearray,
    *,
    expect_digest: bytes | None = None,
    expect_key: bytes | None = None,
    expect_payload_len: int | None = None,
    available_bytes: int | None = None,
) -> SlotHeader:
    """Validate a whole header region (exactly ``io_align`` bytes) and return its header.

    ``available_bytes``: bytes from the slot's start to the end of its file (the slot must fit).
    Raises :class:`CorruptSlot` unless every check passes; never returns unvalidated data.
    """
    h = _decode_region(memoryview(region).cast("B"))
    payload_len = h.payload_len
    if payload_len == 0 or (expect_payload_len is not None and payload_len != expect_payload_len):
        raise CorruptSlot("bad_length", f"payload_len {payload_len}")
    if available_bytes is not None and h.slot_bytes > available_bytes:
        raise CorruptSlot("bad_length", f"a {payload_len}-byte payload runs past the end of file")
    if expect_digest is not None and h.namespace_digest != expect_digest:
        raise CorruptSlot("wrong_namespace")
    if expect_key is not None and h.key != expect_key:
        raise CorruptSlot("wrong_key")
    return h


def _decode_region(region: memoryview) -> SlotHeader:
    """The first half of :func:`decode_header`: the region's own integrity, checked in this order
    (magic, version, header checksum, layout, zero padding); the payload length and what the
    caller expects are checked by ``decode_header`` after it."""
    io_align = len(region)
    assert valid_io_align(io_align), io_align
    (
        magic,
        version,
        flags,
        header_len,
        disk_align,
        reserved,
        digest,
        key,
        payload_len,
        p_sum,
        sequence,
        written_at_ns,
        h_sum,
    ) = HEADER.unpack_from(region)
    if magic != MAGIC:
        raise CorruptSlot("zero" if _is_zero(region) else "bad_magic")
    if version != FORMAT_VERSION:
        raise CorruptSlot("bad_version", f"version {version}")
    if xxhash.xxh3_64_intdigest(region[:_CHECKED]) != h_sum:
        raise CorruptSlot("bad_header_checksum")
    if (header_len, flags, reserved, disk_align) != (HEADER.size, 0, 0, io_align):
        raise CorruptSlot(
            "bad_layout",
            f"header_len {header_len} flags {flags} reserved "
            f"{reserved} io_align {disk_align} (region {io_align})",
        )
    if not _is_zero(region[HEADER.size :]):
        raise CorruptSlot("bad_padding", "non-zero bytes after the header")
    return SlotHeader(digest, key, payload_len, p_sum, sequence, written_at_ns, io_align, flags)


def verify_payload(h: SlotHeader, payload: memoryview | bytes | bytearray) -> None:
    """Raise CorruptSlot("bad_payload_checksum") unless the first ``h.payload_len`` bytes of
    ``payload`` (the payload region, or the payload itself) match the header's checksum."""
    view = memoryview(payload).cast("B")
    if len(view) < h.payload_len:
        raise CorruptSlot("bad_length", f"{len(view)} payload bytes, header says {h.payload_len}")
    if payload_checksum(view[: h.payload_len]) != h.payload_checksum:
        raise CorruptSlot("bad_payload_checksum")


# -- directory layout -----------------------------------------------------------------------------

META_NAME = "kvtier.meta"
LOCK_NAME = "kvtier.lock"  # flock'ed by the daemon that uses the directory (its pid inside)
PREFIXES_NAME = "published-prefixes.json"  # the daemon's published prefixes (kvtierd.tenancy.prefix_file)
DATA_FILE_FORMAT = "blocks-%05d.kvt"
MAX_FILES = 100_000
_DATA_FILE_RE = re.compile(r"blocks-(\d{5})\.kvt")


def data_file_name(index: int) -> str:
    assert 0 <= index < MAX_FILES, index
    return DATA_FILE_FORMAT % index


def parse_data_file_name(name: str) -> int | None:
    """The index of a data file name (``blocks-00042.kvt`` -> 42), or None for any other name."""
    m = _DATA_FILE_RE.fullmatch(name)
    return int(m.group(1)) if m else None


class CorruptMeta(KvtierError):
    """``kvtier.meta`` is not a valid meta file of a format this code reads."""

    code_name = "INTERNAL"


@dataclass(frozen=True)
class StoreMeta:
    """The content of ``kvtier.meta``: what every data file of the directory looks like."""

    io_align: int
    """Slot alignment and header region size of every data file."""
    file_bytes: int
    """Size of every data file (a multiple of io_align)."""
    files: int
    """Data files blocks-00000.kvt .. blocks-{files-1:05d}.kvt."""
    created_ns: int
    """When the directory was formatted (time.time_ns())."""
    format_version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        _check_meta(self)
        return (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> StoreMeta:
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptMeta(f"{META_NAME}: not JSON ({e})") from e
        fields = ("created_ns", "file_bytes", "files", "format_version", "io_align")
        if not isinstance(obj, dict) or sorted(obj) != list(fields):
            raise CorruptMeta(f"{META_NAME}: expected exactly the keys {', '.join(fields)}")
        if not all(type(obj[f]) is int for f in fields):
            raise CorruptMeta(f"{META_NAME}: every value must be an integer")
        meta = cls(**obj)
        _check_meta(meta)
        return meta


def _check_meta(m: StoreMeta) -> None:
    if m.format_version != FORMAT_VERSION:
        raise CorruptMeta(f"{META_NAME}: format_version {m.format_version} (this code reads 1)")
    if not valid_io_align(m.io_align):
        raise CorruptMeta(
            f"{META_NAME}: io_align {m.io_align} is not a power of two in [{MIN_IO_ALIGN}, {MAX_IO_ALIGN}]"
        )
    if m.file_bytes < 2 * m.io_align or m.file_bytes % m.io_align:
        raise CorruptMeta(
            f"{META_NAME}: file_bytes {m.file_bytes} is not a multiple of io_align holding at least one slot"
        )
    if not 0 <= m.files <= MAX_FILES or m.created_ns < 0:
        raise CorruptMeta(f"{META_NAME}: files {m.files} / created_ns {m.created_ns} out of range")

"""The NVMe tier's index log: a journal of index changes plus checkpoints (docs/journal_format.md).

* :class:`JournalWriter`: appends NS / ADD / DEL records to ``journal-%08d.kvj`` (generation
  ``gen``), buffered in memory until ``flush_and_sync`` writes them in one ``pwrite`` and syncs.
* :func:`write_checkpoint`: atomically replaces ``checkpoint.kvc`` by the whole index (NS, ADD,
  then END naming the journal generation that continues after it); :func:`remove_journals_before`
  then drops the journals it supersedes.
* :func:`recover`: the checkpoint (if valid) + replay of the later journals -> :class:`Recovery`.

Lifecycle: at startup ``recover(fs)``, then ``JournalWriter.open(fs, recovery.next_gen)``. Rotation
(commit thread): flush and close generation g; snapshot the index; open g + 1;
``write_checkpoint(fs, snapshot, journal_gen=g + 1)``; ``remove_journals_before(fs, g + 1)``.
A crash between any two steps leaves a log that recovers. All I/O goes through the device seam
and raises its typed DiskErrors; nothing here knows the index, the allocator or the slots' bytes.
Size: about 480 lines, over the 400 guideline: codec, writer, checkpoint and replay share the
frame grammar and one replay fast path, and read best together.
"""

from __future__ import annotations

import errno
import json
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvtier_contract.errors import InvalidArgument
from kvtierd.progress import Progress
from kvtierd.tiers.nvme.device import Device, DiskIOError, FileSystem, SyncFailed
from kvtierd.tiers.nvme.format import round_up

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
_MAX_BODY = {T_NS: NS_DIGEST.size + MAX_SPEC_BYTES, T_ADD: ADD_BODY.size, T_DEL: DEL_BODY.size,
             T_END: END_BODY.size}
_OVERHEAD = FRAME_HEAD.size + FRAME_CRC.size
ADD_FRAME_BYTES = _ADD_FRAME.size  # 136

CHECKPOINT_NAME = "checkpoint.kvc"
CHECKPOINT_TMP = CHECKPOINT_NAME + ".tmp"
JOURNAL_FORMAT = "journal-%08d.kvj"
_JOURNAL_RE = re.compile(r"journal-(\d{8,})\.kvj")
DEFAULT_JOURNAL_BYTES = 8 << 20  # ~61k ADD records per journal file before it rolls over
_MAX_FILE_BYTES = 1 << 40  # what recovery reads whole into memory
_CHUNK_BYTES = 1 << 20


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


def _frame(rtype: int, body: bytes, seq: int) -> bytes:
    head = FRAME_HEAD.pack(MAGIC, rtype, len(body), seq) + body
    return head + FRAME_CRC.pack(xxhash.xxh3_64_intdigest(head))


def encode_record(rec: Record, seq: int) -> bytes:
    """One frame. Raises InvalidArgument for a spec that is not JSON or over MAX_SPEC_BYTES."""
    assert len(rec.digest) == 32 and (isinstance(rec, NsRecord) or len(rec.key) == 32), rec
    if isinstance(rec, AddRecord):
        return _frame(T_ADD, ADD_BODY.pack(rec.digest, rec.key, rec.file, rec.offset,
                                           rec.payload_len, rec.slot_bytes, rec.payload_checksum,
                                           rec.slot_seq), seq)
    if isinstance(rec, DelRecord):
        return _frame(T_DEL, DEL_BODY.pack(rec.digest, rec.key, rec.file, rec.offset), seq)
    try:
        spec = json.dumps(rec.spec, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"namespace spec is not JSON: {e}") from e
    if len(spec) > MAX_SPEC_BYTES:
        raise InvalidArgument(f"namespace spec is {len(spec)} bytes as JSON, over {MAX_SPEC_BYTES}")
    return _frame(T_NS, rec.digest + spec, seq)


def _decode_body(rtype: int, body: bytes) -> Record | tuple[int, int] | None:
    """The record of a frame whose crc matched; END gives (count, gen); None if malformed."""
    if rtype != T_NS:
        return (AddRecord(*ADD_BODY.unpack(body)) if rtype == T_ADD else
                DelRecord(*DEL_BODY.unpack(body)) if rtype == T_DEL else END_BODY.unpack(body))
    try:
        spec = json.loads(body[NS_DIGEST.size :])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return NsRecord(body[: NS_DIGEST.size], spec) if isinstance(spec, dict) else None


@dataclass
class _Scan:
    """What a file holds: its valid records, where they end, and what follows them."""

    records: list[Record] = field(default_factory=list)
    end: int = 0  # offset after the last valid frame
    last_seq: int = 0
    torn_bytes: int = 0  # ignored bytes after ``end``, up to the last non-zero byte
    problem: str | None = None  # why the scan stopped before a clean (all-zero) end
    end_record: tuple[int, int] | None = None  # checkpoints: (record_count, journal_gen)


def _frame_problem(data: bytes, pos: int, allowed: tuple[int, ...]) -> str | None:
    """Why the frame at ``pos`` is not a valid frame of an allowed type, or None."""
    if len(data) - pos < _OVERHEAD:
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


def _scan(data: bytes, *, checkpoint: bool, tick: Callable[[int], None] | None = None,
          tick_every: int = 1 << 16) -> _Scan:
    """Parse frames from offset 0 until the first invalid one (or a checkpoint's END);
    ``tick(records so far)`` every ``tick_every`` ADD records (progress)."""
    allowed = (T_NS, T_ADD, T_END) if checkpoint else (T_NS, T_ADD, T_DEL)
    out, pos, view = _Scan(), 0, memoryview(data)
    records: list[Record] = []
    next_tick = tick_every if tick is not None else 1 << 62
    xxh3, unpack_add, size, checked = xxhash.xxh3_64_intdigest, _ADD_FRAME.unpack_from, \
        ADD_FRAME_BYTES, ADD_FRAME_BYTES - FRAME_CRC.size
    while pos < len(data):
        if data[pos + 4 : pos + 5] == b"\x02" and len(data) - pos >= size:  # fast path: ADD
            magic, _, body_len, seq, *fields, crc = unpack_add(data, pos)
            if (magic == MAGIC and body_len == ADD_BODY.size and seq == out.last_seq + 1
                    and xxh3(view[pos : pos + checked]) == crc):
                records.append(AddRecord(*fields))
                pos, out.last_seq = pos + size, seq
                if len(records) >= next_tick and tick is not None:
                    tick(len(records))
                    next_tick = len(records) + tick_every
                continue
        problem, rec = _frame_problem(data, pos, allowed), None
        if problem is None:
            _, rtype, body_len, seq = FRAME_HEAD.unpack_from(data, pos)
            body_at = pos + FRAME_HEAD.size
            if out.last_seq and seq != out.last_seq + 1:
                problem = f"seq {seq} after {out.last_seq}"
            elif (rec := _decode_body(rtype, data[body_at : body_at + body_len])) is None:
                problem = "malformed NS body"
        if problem is not None or rec is None:
            out.problem = f"{problem} at offset {pos}"
            break
        pos, out.last_seq = body_at + body_len + FRAME_CRC.size, seq
        if isinstance(rec, tuple):
            out.end_record = rec
            break
        records.append(rec)
    out.records, out.end = records, pos
    out.torn_bytes = len(data[pos:].rstrip(b"\0"))
    if not out.torn_bytes:
        out.problem = None  # all zeros after the last record: the clean end of a preallocated file
    return out


# -- writing --------------------------------------------------------------------------------------


class JournalWriter:
    """Appends records to the journal files of generation ``gen`` onwards; owns their Device.

    States: OPEN --flush_and_sync ok--> OPEN; OPEN --SyncFailed--> FAILED; any --close--> CLOSED.
    ``append`` only encodes into the in-memory tail (no I/O) and assigns the next ``seq``.
    ``flush_and_sync`` writes the whole tail in one pwrite and syncs; on return every appended
    record is durable. When the tail does not fit the current file, the writer rolls over to a new
    file of generation ``gen + 1`` (the earlier file synced first), so ``gen`` may grow.
    A failed write (DiskFull, DiskIOError) changes nothing: the tail is kept and the next
    ``flush_and_sync`` rewrites it at the same offset. A failed sync (SyncFailed) is final: the
    records appended since the last successful flush are NOT durable (they may or may not be on
    disk: only slot header validation tells), and every later call raises SyncFailed. The caller
    then starts a new generation with a checkpoint. CLOSED: any call but ``close`` is a bug.

    Concurrency: one thread at a time (the tier's commit thread); no locks.
    """

    def __init__(self, fs: FileSystem, gen: int, dev: Device, pos: int, seq: int,
                 capacity_bytes: int) -> None:
        self._fs, self._gen, self._dev, self._pos, self._seq = fs, gen, dev, pos, seq
        self._capacity, self._closed = capacity_bytes, False
        self._tail: list[bytes] = []
        self._failed: str | None = None
        self.bytes_written = 0  # bytes this writer wrote and synced, over all its files
        self.records_synced = 0  # records this writer made durable

    @classmethod
    def open(cls, fs: FileSystem, gen: int, *,
             capacity_bytes: int = DEFAULT_JOURNAL_BYTES) -> JournalWriter:
        """Create ``journal-{gen}.kvj`` (``capacity_bytes`` preallocated: DiskFull shows up here),
        or append to an existing one: after its last valid record, whose ignored tail is zeroed
        and synced first, so that no stale frame can ever follow a new one."""
        name = journal_name(gen)
        data = fs.read_file(name, max_bytes=_MAX_FILE_BYTES)
        if data is None:
            dev = fs.create_file(name, round_up(capacity_bytes, fs.io_align), direct=False)
            return cls(fs, gen, dev, 0, 0, capacity_bytes)
        dev, scan = fs.open_file(name, direct=False), _scan(data, checkpoint=False)
        try:
            if scan.torn_bytes:
                dev.pwrite(scan.end, [bytes(scan.torn_bytes)])
                dev.sync()
        except BaseException:
            dev.close()
            raise
        return cls(fs, gen, dev, scan.end, scan.last_seq, capacity_bytes)

    @property
    def gen(self) -> int:
        """The generation of the file the next flush writes to (it grows when the writer rolls
        over: rotate to ``gen + 1``, never to a generation counted elsewhere)."""
        return self._gen

    @property
    def pending_records(self) -> int:
        return len(self._tail)

    @property
    def failed(self) -> bool:
        """A sync failed: the writer is unusable; continue with a new writer at ``gen + 1``."""
        return self._failed is not None

    def _check(self) -> None:
        assert not self._closed, "journal writer used after close"
        if self._failed is not None:
            raise SyncFailed(f"journal {self._dev.path}: an earlier sync failed ({self._failed})",
                             err=errno.EIO)

    def append(self, record: Record) -> None:
        """Add ``record`` to the in-memory tail with the next seq (not durable until flushed)."""
        self._check()
        self._tail.append(encode_record(record, self._seq + 1))
        self._seq += 1

    def flush_and_sync(self) -> None:
        """Write the tail and sync; on return it is durable. Raises DiskError (see the class)."""
        self._check()
        try:
            while self._tail:
                room, n, size = self._dev.size - self._pos, 0, 0
                while n < len(self._tail) and size + len(self._tail[n]) <= room:
                    size += len(self._tail[n])
                    n += 1
                if n == 0:
                    self._roll()
                    continue
                self._dev.pwrite(self._pos, [b"".join(self._tail[:n])])
                self._dev.sync()
                self._pos, self.bytes_written, self.records_synced = (
                    self._pos + size, self.bytes_written + size, self.records_synced + n)
                del self._tail[:n]
        except SyncFailed as e:
            self._failed = str(e)
            raise

    def _roll(self) -> None:
        """Continue in a new file of the next generation (the current one is full and synced)."""
        need = max(self._capacity, len(self._tail[0]))
        dev = self._fs.create_file(journal_name(self._gen + 1), round_up(need, self._fs.io_align),
                                   direct=False)
        self._dev.close()
        self._dev, self._gen, self._pos = dev, self._gen + 1, 0

    def close(self) -> None:
        """Release the file; records not flushed are dropped (they were never durable)."""
        if not self._closed:
            self._closed = True
            self._tail.clear()
            self._dev.close()


def write_checkpoint(fs: FileSystem, records: Iterable[NsRecord | AddRecord], *,
                     journal_gen: int) -> None:
    """Atomically replace ``checkpoint.kvc`` by ``records`` (NS before the ADDs that use them),
    then END(count, journal_gen): tmp file (preallocated), fsync, rename, directory fsync. On any
    failure the old checkpoint stays. Streams in 1 MiB chunks (holds the record list, not its
    bytes). Independent of the writer: may run on any thread, one checkpoint at a time."""
    recs = list(records)
    assert not any(isinstance(r, DelRecord) for r in recs), "a checkpoint holds no DEL records"
    total = sum(ADD_FRAME_BYTES if isinstance(r, AddRecord) else len(encode_record(r, 0))
                for r in recs) + _OVERHEAD + END_BODY.size
    _remove_if_present(fs, CHECKPOINT_TMP)  # left by a crash during an earlier checkpoint
    dev = fs.create_file(CHECKPOINT_TMP, round_up(total, fs.io_align), direct=False)
    try:
        buf, off = bytearray(), 0
        for seq, rec in enumerate(recs, 1):
            buf += encode_record(rec, seq)
            if len(buf) >= _CHUNK_BYTES:
                off += dev.pwrite(off, [buf])
                buf = bytearray()
        buf += _frame(T_END, END_BODY.pack(len(recs), journal_gen), len(recs) + 1)
        assert off + len(buf) == total, (off, len(buf), total)
        dev.pwrite(off, [buf])
        dev.sync()
    except BaseException:
        dev.close()
        _remove_if_present(fs, CHECKPOINT_TMP)
        raise
    dev.close()
    fs.rename(CHECKPOINT_TMP, CHECKPOINT_NAME)


def _remove_if_present(fs: FileSystem, name: str) -> None:
    try:
        fs.remove(name)
    except DiskIOError as e:
        if e.errno != errno.ENOENT:
            raise


def remove_journals_before(fs: FileSystem, gen: int) -> int:
    """Remove the journal files of generations < ``gen`` (superseded by a checkpoint whose END
    names ``gen``); returns how many. Only regular files: anything else is fsck's to report."""
    old = [e.name for e in fs.entries()
           if e.kind == "file" and (g := parse_journal_name(e.name)) is not None and g < gen]
    for name in old:
        fs.remove(name)
    return len(old)


# -- recovery -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryStats:
    """What recovery read. ``torn_tail_bytes``: ignored bytes after the first torn or corrupt
    record of each journal, summed (the zero tail of a preallocated file is not counted).
    ``ignored_checkpoint``: a checkpoint.kvc was there but invalid. ``problems``: lines to log."""

    checkpoint_records: int  # NS + ADD records of the checkpoint used (0: none or ignored)
    journal_records: int  # records replayed from journals
    torn_tail_bytes: int
    ignored_checkpoint: bool
    journals: int  # journal files replayed
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recovery:
    """The index as the log describes it; the caller validates every entry's slot header.
    ``next_gen``: for the new JournalWriter, above every journal name present. ``max_slot_seq``:
    the highest slot_seq of any ADD read (new slot sequences continue above it)."""

    namespaces: dict[bytes, dict[str, Any]]
    entries: dict[tuple[bytes, bytes], AddRecord]
    next_gen: int
    max_slot_seq: int
    stats: RecoveryStats


class _Replay:
    """Applies records in order; ``by_location`` is the key each slot holds (for slot reuse)."""

    def __init__(self) -> None:
        self.namespaces: dict[bytes, dict[str, Any]] = {}
        self.entries: dict[tuple[bytes, bytes], AddRecord] = {}
        self.by_location: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        self.max_slot_seq = 0

    def apply(self, records: list[Record]) -> None:
        entries, by_location = self.entries, self.by_location
        for rec in records:
            if type(rec) is AddRecord:
                k, loc = (rec.digest, rec.key), (rec.file, rec.offset)
                if (old := entries.get(k)) is not None:
                    del by_location[old.file, old.offset]
                if (other := by_location.get(loc)) is not None:
                    del entries[other]  # the slot was reused: its previous key is gone
                entries[k], by_location[loc] = rec, k
                self.max_slot_seq = max(self.max_slot_seq, rec.slot_seq)
            elif isinstance(rec, DelRecord):
                k, loc = (rec.digest, rec.key), (rec.file, rec.offset)
                if (old := entries.get(k)) is not None and (old.file, old.offset) == loc:
                    del entries[k], by_location[loc]
            elif isinstance(rec, NsRecord):
                self.namespaces[rec.digest] = rec.spec


def recover(fs: FileSystem, progress: Progress | None = None, *,
            tick_every: int = 1 << 16) -> Recovery:
    """Read ``checkpoint.kvc`` (if present and valid), then replay the journals of generation >=
    its journal_gen (all of them without one) in generation order, each up to its first torn or
    corrupt record. Raises DiskError when a file cannot be read. Startup only, one thread.
    ``progress`` hears the records read so far, within a file every ``tick_every`` records."""
    names = {e.name: e.kind for e in fs.entries()}
    state, problems, ckpt_gen, ckpt_records = _Replay(), [], 0, 0
    read = [0]  # records of the files read before the current one

    def ticker(name: str) -> Callable[[int], None] | None:
        if progress is None:
            return None
        return lambda n: progress.tick(read[0] + n, f"reading {name}")

    ignored = CHECKPOINT_NAME in names
    if ignored:
        problem, scan = _read_checkpoint(fs, names[CHECKPOINT_NAME], ticker(CHECKPOINT_NAME),
                                         tick_every)
        read[0] += len(scan.records)
        if progress is not None:
            progress.tick(read[0], f"{CHECKPOINT_NAME} read")
        if problem is None and scan.end_record is not None:
            state.apply(scan.records)
            ckpt_records, ckpt_gen, ignored = len(scan.records), scan.end_record[1], False
        else:
            problems.append(f"{CHECKPOINT_NAME} ignored: {problem}")
    journals = sorted((g, name) for name in names if (g := parse_journal_name(name)) is not None)
    replayed, journal_records, torn = 0, 0, 0
    for g, name in journals:
        if g < ckpt_gen or names[name] != "file":
            continue  # superseded by the checkpoint; or not a regular file: fsck reports it
        scan = _scan(fs.read_file(name, max_bytes=_MAX_FILE_BYTES) or b"", checkpoint=False,
                     tick=ticker(name), tick_every=tick_every)
        state.apply(scan.records)
        replayed, journal_records = replayed + 1, journal_records + len(scan.records)
        read[0] += len(scan.records)
        if progress is not None:
            progress.tick(read[0], f"{name} replayed")
        torn += scan.torn_bytes
        if scan.problem:
            problems.append(f"{name}: replay stopped, {scan.problem}; {scan.torn_bytes} bytes ignored")
    if progress is not None:
        progress.finish(read[0], f"{ckpt_records} from the checkpoint, {journal_records} "
                                 f"replayed from {replayed} journal(s)")
    stats = RecoveryStats(ckpt_records, journal_records, torn, ignored, replayed, tuple(problems))
    next_gen = max([1, ckpt_gen] + [g + 1 for g, _ in journals])
    return Recovery(state.namespaces, state.entries, next_gen, state.max_slot_seq, stats)


def _read_checkpoint(fs: FileSystem, kind: str, tick: Callable[[int], None] | None = None,
                     tick_every: int = 1 << 16) -> tuple[str | None, _Scan]:
    """(why the checkpoint must be ignored or None, what it holds)."""
    if kind != "file":
        return f"a {kind}, not a regular file", _Scan()
    scan = _scan(fs.read_file(CHECKPOINT_NAME, max_bytes=_MAX_FILE_BYTES) or b"",
                 checkpoint=True, tick=tick, tick_every=tick_every)
    if scan.end_record is None:
        return f"no END record ({scan.problem or 'ends early'})", scan
    if scan.end_record[0] != len(scan.records):
        return f"END counts {scan.end_record[0]} records, {len(scan.records)} found", scan
    if scan.torn_bytes:
        return f"{scan.torn_bytes} non-zero bytes after END", scan
    return None, scan

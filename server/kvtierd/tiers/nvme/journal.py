"""The NVMe tier's index log: a journal of index changes plus checkpoints (docs/journal_format.md).

* :class:`JournalWriter`: appends NS / ADD / DEL records to ``journal-%08d.kvj`` (generation
  ``gen``), buffered in memory until ``flush_and_sync`` writes them in one ``pwrite`` and syncs.
* :func:`write_checkpoint`: atomically replaces ``checkpoint.kvc`` by the whole index (NS, ADD,
  then END naming the journal generation that continues after it); :func:`remove_journals_before`
  then drops the journals it supersedes.
* :func:`recover`: the checkpoint (if valid) + replay of the later journals -> :class:`Recovery`.
* :class:`GroupCommit`: the tier's group commit. Records are queued on the event loop and made
  durable in groups on one commit thread: a group first makes durable the block files written
  since the last group, then appends its records to the journal and syncs it (both done by the
  ``sync_group`` the tier hands it, the tier owning the files and the JournalWriter), so a block
  is reported durable only after its bytes, its header and its journal record are; a failed
  sync fails the whole group, never later "ok". Primitives: ``dirty(file)`` (a block file
  written), ``queue(record)`` (rides with the next group, nobody waits), ``await
  commit(record)`` (durable when it returns, or the group's DiskError), ``close()``.

Lifecycle: at startup ``recover(fs)``, then ``JournalWriter.open(fs, recovery.next_gen)``. Rotation
(commit thread): flush and close generation g; snapshot the index; open g + 1;
``write_checkpoint(fs, snapshot, journal_gen=g + 1)``; ``remove_journals_before(fs, g + 1)``.
A crash between any two steps leaves a log that recovers. All I/O goes through the device seam
and raises its typed DiskErrors; nothing here knows the index, the allocator or the slots' bytes.
Concurrency: a JournalWriter is used by one thread at a time (the tier's commit thread); a
checkpoint is written on any thread, one at a time; a GroupCommit lives on the event-loop thread
and runs its groups, one at a time, on the commit thread it owns.
The frame grammar and codec live in :mod:`kvtierd.tiers.nvme.records`, recovery in
:mod:`kvtierd.tiers.nvme.replay`; both are re-exported here (this module is the log's front door).
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtierd.tiers.nvme.device import Device, DiskError, DiskIOError, FileSystem, SyncFailed
from kvtierd.tiers.nvme.format import round_up
from kvtierd.tiers.nvme.records import (
    ADD_BODY,
    ADD_FRAME_BYTES,
    CHECKPOINT_NAME,
    CHECKPOINT_TMP,
    DEFAULT_JOURNAL_BYTES,
    DEL_BODY,
    END_BODY,
    FRAME_CRC,
    FRAME_HEAD,
    FRAME_OVERHEAD_BYTES,
    JOURNAL_FORMAT,
    MAGIC,
    MAX_LOG_FILE_BYTES,
    MAX_SPEC_BYTES,
    NS_DIGEST,
    T_ADD,
    T_DEL,
    T_END,
    T_NS,
    AddRecord,
    DelRecord,
    NsRecord,
    Record,
    encode_frame,
    encode_record,
    journal_name,
    parse_journal_name,
    scan_frames,
)
from kvtierd.tiers.nvme.replay import Recovery, RecoveryStats, recover

_CHUNK_BYTES = 1 << 20  # a checkpoint is written in chunks of this size

__all__ = [
    "ADD_BODY",
    "ADD_FRAME_BYTES",
    "CHECKPOINT_NAME",
    "CHECKPOINT_TMP",
    "DEFAULT_JOURNAL_BYTES",
    "DEL_BODY",
    "END_BODY",
    "FRAME_CRC",
    "FRAME_HEAD",
    "JOURNAL_FORMAT",
    "MAGIC",
    "MAX_SPEC_BYTES",
    "NS_DIGEST",
    "T_ADD",
    "T_DEL",
    "T_END",
    "T_NS",
    "AddRecord",
    "DelRecord",
    "GroupCommit",
    "JournalWriter",
    "NsRecord",
    "Record",
    "Recovery",
    "RecoveryStats",
    "SyncGroup",
    "encode_frame",
    "encode_record",
    "journal_name",
    "parse_journal_name",
    "recover",
    "remove_journals_before",
    "write_checkpoint",
]

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

    def __init__(
        self, fs: FileSystem, gen: int, dev: Device, pos: int, seq: int, capacity_bytes: int
    ) -> None:
        self._fs, self._gen, self._dev, self._pos, self._seq = fs, gen, dev, pos, seq
        self._capacity, self._closed = capacity_bytes, False
        self._tail: list[bytes] = []
        self._failed: str | None = None
        self.bytes_written = 0  # bytes this writer wrote and synced, over all its files
        self.records_synced = 0  # records this writer made durable

    @classmethod
    def open(cls, fs: FileSystem, gen: int, *, capacity_bytes: int = DEFAULT_JOURNAL_BYTES) -> JournalWriter:
        """Create ``journal-{gen}.kvj`` (``capacity_bytes`` preallocated: DiskFull shows up here),
        or append to an existing one: after its last valid record, whose ignored tail is zeroed
        and synced first, so that no stale frame can ever follow a new one."""
        name = journal_name(gen)
        data = fs.read_file(name, max_bytes=MAX_LOG_FILE_BYTES)
        if data is None:
            dev = fs.create_file(name, round_up(capacity_bytes, fs.io_align), direct=False)
            return cls(fs, gen, dev, 0, 0, capacity_bytes)
        dev, scan = fs.open_file(name, direct=False), scan_frames(data, checkpoint=False)
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
            raise SyncFailed(
                f"journal {self._dev.path}: an earlier sync failed ({self._failed})", err=errno.EIO
            )

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
                    self._pos + size,
                    self.bytes_written + size,
                    self.records_synced + n,
                )
                del self._tail[:n]
        except SyncFailed as e:
            self._failed = str(e)
            raise

    def _roll(self) -> None:
        """Continue in a new file of the next generation (the current one is full and synced)."""
        need = max(self._capacity, len(self._tail[0]))
        dev = self._fs.create_file(
            journal_name(self._gen + 1), round_up(need, self._fs.io_align), direct=False
        )
        self._dev.close()
        self._dev, self._gen, self._pos = dev, self._gen + 1, 0

    def close(self) -> None:
        """Release the file; records not flushed are dropped (they were never durable)."""
        if not self._closed:
            self._closed = True
            self._tail.clear()
            self._dev.close()


def write_checkpoint(fs: FileSystem, records: Iterable[NsRecord | AddRecord], *, journal_gen: int) -> None:
    """Atomically replace ``checkpoint.kvc`` by ``records`` (NS before the ADDs that use them),
    then END(count, journal_gen): tmp file (preallocated), fsync, rename, directory fsync. On any
    failure the old checkpoint stays. Streams in 1 MiB chunks (holds the record list, not its
    bytes). Independent of the writer: may run on any thread, one checkpoint at a time."""
    recs = list(records)
    assert not any(isinstance(r, DelRecord) for r in recs), "a checkpoint holds no DEL records"
    total = (
        sum(ADD_FRAME_BYTES if isinstance(r, AddRecord) else len(encode_record(r, 0)) for r in recs)
        + FRAME_OVERHEAD_BYTES
        + END_BODY.size
    )
    _remove_if_present(fs, CHECKPOINT_TMP)  # left by a crash during an earlier checkpoint
    dev = fs.create_file(CHECKPOINT_TMP, round_up(total, fs.io_align), direct=False)
    try:
        buf, off = bytearray(), 0
        for seq, rec in enumerate(recs, 1):
            buf += encode_record(rec, seq)
            if len(buf) >= _CHUNK_BYTES:
                off += dev.pwrite(off, [buf])
                buf = bytearray()
        buf += encode_frame(T_END, END_BODY.pack(len(recs), journal_gen), len(recs) + 1)
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
    old = [
        e.name
        for e in fs.entries()
        if e.kind == "file" and (g := parse_journal_name(e.name)) is not None and g < gen
    ]
    for name in old:
        fs.remove(name)
    return len(old)


# -- the group commit -----------------------------------------------------------------------------

SyncGroup = Callable[[Iterable[int], list[Any]], None]
"""Commit thread: ``(block files to sync, records to journal)``, durable when it returns."""


class GroupCommit:
    """Owns the commit thread, the records waiting for the next group (each with the future of
    whoever awaits it, or None), the block files written since the last group, the task running
    groups, and ``groups`` (how many committed). Handed: ``sync_group`` (what a group does) and
    ``on_failure`` (told of each failed group, before its waiters).

    Concurrency: event-loop thread only; one group at a time runs on the commit thread.
    """

    def __init__(self, sync_group: SyncGroup, on_failure: Callable[[DiskError], None]) -> None:
        self._sync_group = sync_group
        self._on_failure = on_failure
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-commit")
        self._pending: list[tuple[Any, asyncio.Future[None] | None]] = []
        self._dirty_files: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self.groups = 0

    def dirty(self, file: int) -> None:
        """Block file ``file`` was written: the next group syncs it before its records."""
        self._dirty_files.add(file)

    def queue(self, record: Any) -> None:
        """``record`` rides with the next group (which someone's ``commit`` starts)."""
        self._pending.append((record, None))

    async def commit(self, record: Any) -> None:
        """``record`` and everything queued before it, durable when this returns."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((record, fut))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())
        await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while any(f is not None for _, f in self._pending):
            batch, self._pending = self._pending, []
            files, self._dirty_files = self._dirty_files, set()
            try:
                await loop.run_in_executor(self._thread, self._sync_group, files, [r for r, _ in batch])
            except DiskError as e:
                self._on_failure(e)
                for _, f in batch:
                    if f is not None and not f.done():
                        f.set_exception(e)
                continue
            self.groups += 1
            for _, f in batch:
                if f is not None and not f.done():
                    f.set_result(None)

    def close(self) -> None:
        """Wait for the group in progress; then the commit thread ends."""
        self._thread.shutdown(wait=True)

"""One published index segment: a sealed memfd holding one generation of a namespace's READY
keys as an open-addressing table (layout and reader rules: :mod:`kvtier_contract.published_index`).

Role: the "bytes" half of :mod:`kvtierd.index.publisher` (:mod:`kvtierd.index.published`
re-exports :class:`Segment`): creating and sealing the memfd, inserting and removing keys one by
one or vectorized, filling a new generation in bulk, stamping liveness and retiring. Ownership:
a Segment owns its memfd and the daemon's writable mapping; its Publisher owns the Segment.
Concurrency: the event-loop thread writes a live segment; a build thread fills a new one that
no one sees until the loop installs it; readers are other processes, lock-free (aligned
8-byte stores: each slot, the stamp, the retired word).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np

from kvtier_contract import published_index as pi

_JOIN_CHUNK = 16384  # keys joined per step of a build
_F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1 (not in Python's fcntl module)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _any4(rows: np.ndarray) -> np.ndarray:
    """Per row of an (n, 4) bool array: any True (one u32 per row; ~8x faster than any(1))."""
    out: np.ndarray = rows.view(np.uint32).ravel() != 0
    return out


class Segment:
    """One generation of one namespace's table: the memfd, the daemon's writable mapping and
    its slot view. Owner: its Publisher (event-loop thread)."""

    def __init__(
        self, namespace_id: int, boot_epoch: int, generation: int, capacity: int, flags: int = 0
    ) -> None:
        self.capacity = capacity
        self.generation = generation
        self.bucket_mask = capacity // pi.BUCKET - 1
        self.size = pi.segment_bytes(capacity)
        self.fd = os.memfd_create(
            f"kvtier-index-{namespace_id:x}-{generation}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        )
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # no new writable mapping or write() from anyone, ours included; ours stays
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS | _F_SEAL_FUTURE_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.slots = memoryview(self.map)[pi.HEADER_BYTES :].cast("Q")
        self.words = memoryview(self.map)[: pi.HEADER_BYTES].cast("Q")  # the header's u64 words
        self.array = np.frombuffer(self.map, dtype="<u8", count=capacity, offset=pi.HEADER_BYTES)
        pi.HEADER.pack_into(
            self.map,
            0,
            pi.MAGIC,
            pi.VERSION,
            boot_epoch,
            namespace_id,
            generation,
            capacity,
            pi.MAX_PROBE,
            flags,
            0,
            0,
        )
        self.keys = 0
        self.tombstones = 0
        self.left_out = 0

    def stamp(self, value: int, retired: bool = False) -> None:
        """The liveness stamp ``value`` (ns), after ``retired`` when True: each one aligned
        8-byte store, so a reader's one aligned load sees the old word or the new one, never a
        mix (``struct.pack_into`` zero-fills its bytes, then writes them one by one: readers
        saw 0 and took the segment for stale)."""
        if retired:
            self.words[pi.RETIRED_WORD] = 1
        self.words[pi.STAMP_WORD] = value

    def _walk(self, key: bytes) -> tuple[int, Iterator[int]]:
        """``key``'s fingerprint, and the first slot of each bucket it may live in, in order."""
        fp, home = pi.fingerprint(key)
        b, bmask = home & self.bucket_mask, self.bucket_mask
        return fp, (((b + i) & bmask) * pi.BUCKET for i in range(pi.MAX_PROBE))

    def insert(self, key: bytes) -> None:
        fp, bases = self._walk(key)
        s = self.slots
        for base in bases:
            for j, v in enumerate(s[base : base + pi.BUCKET].tolist()):
                if v <= pi.TOMBSTONE:
                    s[base + j] = fp
                    self.keys += 1
                    self.tombstones -= v
                    return
        self.left_out += 1

    def _find(self, key: bytes) -> int:
        """The slot holding ``key``, or -1 (a bucket with an EMPTY slot ends the walk)."""
        fp, bases = self._walk(key)
        s = self.slots
        for base in bases:
            row: list[int] = s[base : base + pi.BUCKET].tolist()
            if fp in row:
                return int(base + row.index(fp))
            if pi.EMPTY in row:
                return -1
        return -1

    def remove(self, key: bytes) -> None:
        at = self._find(key)
        if at >= 0:  # (else never published: left out)
            self.slots[at] = pi.TOMBSTONE
            self.keys -= 1
            self.tombstones += 1

    def _heads(self, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        raw = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 4)
        fps = raw[:, 0] | np.uint64(pi.FP_BIT)
        return fps, (raw[:, 1] & np.uint64(self.bucket_mask)).astype(np.int64)

    def remove_many(self, keys: list[bytes]) -> None:
        """``remove`` for many keys: one vectorized pass over their home buckets (the rare key
        whose home bucket is full and does not hold it is walked on one by one)."""
        fps, home = self._heads(keys)
        rows = self.array.reshape(-1, pi.BUCKET).take(home, axis=0)
        match = rows == fps[:, None]
        hit = _any4(match)
        idx = np.flatnonzero(hit)
        at = home[idx] * pi.BUCKET + match[idx].argmax(axis=1)
        # Two keys of one fingerprint and home bucket find the same slot: one goes here, the
        # other one by one (it finds its own copy further on, or nothing).
        at, first = np.unique(at, return_index=True)
        self.array[at] = pi.TOMBSTONE
        self.keys -= int(at.size)
        self.tombstones += int(at.size)
        again = np.ones(idx.size, dtype=bool)
        again[first] = False
        walk = np.flatnonzero(~hit & ~_any4(rows == pi.EMPTY)).tolist() + idx[again].tolist()
        for i in walk:
            self.remove(keys[i])

    def insert_many(self, keys: list[bytes]) -> None:
        """``insert`` for many keys absent from the table: one vectorized round in which each
        home bucket takes as many of the keys asking for it as it has free (EMPTY or
        TOMBSTONE) slots, in key order; the few left over are inserted one by one."""
        fps, b = self._heads(keys)
        order = np.argsort(b, kind="stable")
        sb = b[order]
        starts = np.flatnonzero(np.concatenate(([True], sb[1:] != sb[:-1])))
        rank = np.arange(sb.size) - np.repeat(starts, np.diff(np.append(starts, sb.size)))
        free = self.array.reshape(-1, pi.BUCKET).take(sb, axis=0) <= pi.TOMBSTONE
        seen = np.cumsum(free, axis=1)
        fits = rank < seen[:, -1]
        j = ((seen == (rank + 1)[:, None]) & free).argmax(axis=1)  # its (rank+1)-th free slot
        at = sb[fits] * pi.BUCKET + j[fits]
        self.tombstones -= int(np.count_nonzero(self.array[at] == pi.TOMBSTONE))
        self.array[at] = fps[order[fits]]
        self.keys += int(at.size)
        for i in order[~fits].tolist():  # their home bucket was full: walk on
            self.insert(keys[i])

    def fill(self, keys: Iterable[bytes], count: int) -> None:
        """Insert ``count`` keys into this empty table at once (vectorized: each round, every
        bucket takes as many of the keys asking for it as it has free slots, in key order;
        the others move on to the next bucket)."""
        if not count:
            return
        raw = np.empty((count, 4), dtype="<u8")
        it = iter(keys)
        for start in range(0, count, _JOIN_CHUNK):  # (a build thread holds the GIL per chunk)
            n = min(_JOIN_CHUNK, count - start)
            raw[start : start + n] = np.frombuffer(b"".join(itertools.islice(it, n)), dtype="<u8").reshape(
                n, 4
            )
        fps = raw[:, 0] | np.uint64(pi.FP_BIT)
        bucket = (raw[:, 1] & np.uint64(self.bucket_mask)).astype(np.int64)
        used = np.zeros(self.bucket_mask + 1, dtype=np.int64)  # filled slots per bucket
        table = self.array
        pending = np.arange(count)
        for _ in range(pi.MAX_PROBE):
            if not pending.size:
                break
            b = bucket[pending]
            order = np.argsort(b, kind="stable")
            sb = b[order]
            starts = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
            sizes = np.diff(np.r_[starts, sb.size])
            rank = np.arange(sb.size) - np.repeat(starts, sizes)  # place in its bucket's queue
            fits = rank < pi.BUCKET - used[sb]
            chosen = pending[order[fits]]
            table[sb[fits] * pi.BUCKET + used[sb[fits]] + rank[fits]] = fps[chosen]
            np.add.at(used, sb[fits], 1)
            rest = np.sort(pending[order[~fits]])
            bucket[rest] = (bucket[rest] + 1) & self.bucket_mask
            pending = rest
        self.keys = count - int(pending.size)
        self.left_out = int(pending.size)

    def retire(self) -> None:
        """Say retired, close the descriptor and drop the daemon's mapping (clients keep
        theirs until they let go)."""
        with contextlib.suppress(ValueError):
            self.stamp(time.monotonic_ns(), retired=True)
        self.slots.release()
        self.words.release()
        del self.array
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)


def seals_future_writes() -> bool:
    """Whether this kernel seals a memfd against new writable mappings (Linux 5.1+)."""
    try:
        fd = os.memfd_create("kvtier-seal-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEAL_FUTURE_WRITE)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)

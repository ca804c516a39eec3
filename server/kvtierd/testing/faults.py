"""Fault injection over the NVMe tier's disk seam: for tests and fault-injection tooling only.

Never imported by the daemon (see the package docstring). Both doubles wrap the real
implementation, so every byte still lands in a real file and only the injected fault differs:

* :class:`FaultyDevice` wraps a :class:`~kvtierd.tiers.nvme.device.Device`: armed errors per
  operation, torn writes, flipped bytes (on write or now), latency, and call counters.
* :class:`FaultyFileSystem` is a real :class:`~kvtierd.tiers.nvme.device.FileSystem` whose
  Devices are FaultyDevices and whose preallocations fail on request.

Errors are the ones the real seam raises (``disk_error`` maps the injected errno), so a caller
cannot tell an injected fault from a real one.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvtier_contract.directio import aligned_buffer
from kvtierd.tiers.nvme.device import Buffer, Device, DiskIOError, FileSystem, SyncFailed, WBuffer, disk_error


def _nbytes(views: Sequence[Buffer]) -> int:
    return sum(memoryview(v).nbytes for v in views)


class FaultyDevice(Device):
    """Wraps a real Device and misbehaves on request (tests and crash tests only).

    ``fail_writes/reads/syncs(n, err)``: the next ``n`` calls raise the typed error the real device
    would raise for ``err``, having transferred nothing. ``tear_next_write(keep, succeed=...)``: the
    next write stores only its first ``keep`` bytes, then raises DiskIOError(EIO) or reports full
    success. ``flip_on_write(offset)``: after every write covering file offset ``offset``, that byte
    is inverted on the real device; ``flip_byte(offset)`` inverts it now. ``latency_s``: a sleep
    before every call; ``read_latency_s``: one more before every read (a slow disk to load from),
    or, when ``read_latency`` is set, what it answers at each read (a disk that slows and recovers
    while the daemon runs: :class:`LatencyFile`).
    Counters: ``writes``, ``reads``, ``syncs``, ``faults``. A failed sync is
    sticky, as on the real device. Thread-safe (fault state and counters under a lock).
    """

    def __init__(self, inner: Device, *, latency_s: float = 0.0, read_latency_s: float = 0.0) -> None:
        self.inner, self.latency_s, self.read_latency_s = inner, latency_s, read_latency_s
        self.read_latency: Callable[[], float] | None = None
        self.path, self.size, self.direct, self.align = inner.path, inner.size, inner.direct, inner.align
        self._lock = threading.Lock()
        self._fail: dict[str, tuple[int, int]] = {}  # op -> (calls left to fail, errno)
        self._tear: tuple[int, bool] | None = None
        self._flip_offsets: set[int] = set()
        self._sync_failed = False
        self.counts = {"write": 0, "read": 0, "sync": 0, "fault": 0}

    writes = property(lambda self: self.counts["write"])
    reads = property(lambda self: self.counts["read"])
    syncs = property(lambda self: self.counts["sync"])
    faults = property(lambda self: self.counts["fault"])

    def fail_writes(self, n: int = 1, err: int = errno.EIO) -> None:
        self._fail["write"] = (n, err)

    def fail_reads(self, n: int = 1, err: int = errno.EIO) -> None:
        self._fail["read"] = (n, err)

    def fail_syncs(self, n: int = 1, err: int = errno.EIO) -> None:
        self._fail["sync"] = (n, err)

    def tear_next_write(self, keep_bytes: int, *, succeed: bool = False) -> None:
        self._tear = (keep_bytes, succeed)

    def flip_on_write(self, offset: int) -> None:
        self._flip_offsets.add(offset)

    def _enter(self, op: str, offset: int | None) -> None:
        """Count the call, sleep, and raise the armed fault for ``op`` if there is one."""
        if self.latency_s:
            time.sleep(self.latency_s)
        if op == "read":
            delay = self.read_latency() if self.read_latency is not None else self.read_latency_s
            if delay > 0:
                time.sleep(delay)
        with self._lock:
            self.counts[op] += 1
            left, err = self._fail.get(op, (0, 0))
            if left <= 0:
                return
            self._fail[op] = (left - 1, err)
            self.counts["fault"] += 1
        where = f" at {offset}" if offset is not None else ""
        if op == "sync":
            self._sync_failed = True
        raise disk_error(
            OSError(err, os.strerror(err)), f"{op} {self.path}{where} (injected)", sync=op == "sync"
        )

    def pread_into(self, offset: int, views: Sequence[WBuffer]) -> int:
        self._enter("read", offset)
        return self.inner.pread_into(offset, views)

    def pwrite(self, offset: int, views: Sequence[Buffer]) -> int:
        self._enter("write", offset)
        with self._lock:
            tear, self._tear = self._tear, None
            if tear is not None:
                self.counts["fault"] += 1
        nbytes = _nbytes(views)
        if tear is not None:
            keep, succeed = tear
            data = b"".join(bytes(memoryview(v).cast("B")) for v in views)[:keep]
            if data:
                self.poke(offset, data)
            if not succeed:
                raise DiskIOError(
                    f"write {self.path} at {offset}: torn after {keep} bytes (injected)", err=errno.EIO
                )
        else:
            self.inner.pwrite(offset, views)
        for flip in sorted(self._flip_offsets):
            if offset <= flip < offset + nbytes:
                self.flip_byte(flip)
        return nbytes

    def sync(self) -> None:
        self._enter("sync", None)
        if self._sync_failed:
            raise SyncFailed(f"fdatasync {self.path}: an earlier sync failed", err=errno.EIO)
        self.inner.sync()

    @property
    def sync_failed(self) -> bool:
        return self._sync_failed or self.inner.sync_failed

    def close(self) -> None:
        self.inner.close()

    def _span(self, offset: int, nbytes: int) -> tuple[int, memoryview]:
        """The whole aligned blocks around ``[offset, offset + nbytes)``, read from the real device."""
        a = self.inner.align
        start = offset - offset % a
        end = min(-(-(offset + nbytes) // a) * a, self.inner.size)
        assert offset + nbytes <= end, (offset, nbytes, self.inner.size)
        buf = aligned_buffer(end - start, a)
        self.inner.pread_into(start, [buf])
        return start, buf

    def poke(self, offset: int, data: bytes) -> None:
        """Write ``data`` at any offset through the real device, bypassing faults (whole aligned
        blocks are read, patched and written back, so that it works under O_DIRECT too)."""
        start, buf = self._span(offset, len(data))
        buf[offset - start : offset - start + len(data)] = data
        self.inner.pwrite(start, [buf])

    def flip_byte(self, offset: int) -> None:
        """Invert the byte at file offset ``offset`` on the real device, now (bit rot)."""
        start, buf = self._span(offset, 1)
        self.poke(offset, bytes([buf[offset - start] ^ 0xFF]))


class LatencyFile:
    """A read latency that a file holds, in milliseconds (a number; a missing, empty or
    unreadable file, or one that is not a number >= 0, means 0), read again at most every
    ``refresh_s`` seconds: another process slows the disk and un-slows it by writing the file.
    Call it (any thread) for the latency in seconds now."""

    def __init__(
        self, path: str, *, refresh_s: float = 0.1, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path, self.refresh_s, self._clock = path, refresh_s, clock
        self._lock = threading.Lock()
        self._value_s = 0.0
        self._read_at: float | None = None

    def __call__(self) -> float:
        now = self._clock()
        with self._lock:
            if self._read_at is None or now - self._read_at >= self.refresh_s:
                self._read_at = now
                self._value_s = self._read()
            return self._value_s

    def _read(self) -> float:
        try:
            with open(self.path) as f:
                text = f.read(64).strip()
            ms = float(text) if text else 0.0
        except (OSError, ValueError):
            return 0.0
        return ms / 1000 if math.isfinite(ms) and ms >= 0 else 0.0


class FaultyFileSystem(FileSystem):
    """A real FileSystem whose Devices are :class:`FaultyDevice` (``devices[name]``: the latest
    one opened per name) and whose next preallocations fail on request (``fail_allocate``)."""

    def __init__(self, directory: str, *, io_align: int = 4096, create: bool = False) -> None:
        super().__init__(directory, io_align=io_align, create=create)
        self.devices: dict[str, FaultyDevice] = {}
        self._fail_allocate: list[int] = []

    def fail_allocate(self, err: int = errno.ENOSPC, n: int = 1) -> None:
        self._fail_allocate.extend([err] * n)

    def _preallocate(self, fd: int, nbytes: int) -> None:
        if self._fail_allocate:
            err = self._fail_allocate.pop(0)
            raise OSError(err, os.strerror(err))
        super()._preallocate(fd, nbytes)

    def open_file(self, name: str, *, direct: bool | None = None, readonly: bool = False) -> Device:
        dev = FaultyDevice(super().open_file(name, direct=direct, readonly=readonly))
        self.devices[name] = dev
        return dev

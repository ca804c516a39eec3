"""Direct moves between an engine's paged KV and the daemon's shm arena: no host bounce buffer.

``NamespaceHandle.put_blocks`` / ``get_blocks`` over the shm transport use an ``ArenaMover``:

* **CPU tensors**: the gather kernel writes straight into the reserved slots and the scatter
  reads straight from the pinned ones, one kernel per run of consecutive slots: every byte is
  copied once (the staging path copies it twice).
* **CUDA tensors**: the arena mapping is registered with ``cudaHostRegister`` once per session
  (on first use, ``ShmTransport.mover``), so host<->device copies are DMA at PCIe speed instead of pageable
  copies. A store gathers the engine blocks into a device staging tensor on the engine's current
  stream (one kernel), then a private copy stream, ordered after that stream by an event, copies
  each run of consecutive slots device->host with one ``cudaMemcpyAsync``; the calling thread
  then waits for the copy's end event (a store must see what the engine queued before it, the
  forward's KV included). A load copies the runs
  host->device on the copy stream, waits for that event (the daemon's pins must hold until the
  bytes have left the arena), then queues the scatter on the engine's stream (one kernel): a
  load never waits for work already queued on the engine's stream.

The daemon's slab allocator hands a batch consecutive slots whenever it can, so a batch is
usually a handful of large copies (``runs``). Ownership: the mover belongs to one Client's
transport attachment; the registration is undone by ``ShmTransport.close``. Not thread-safe: the
client serialises transfers. Importing this module imports torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from kvtier_contract.cudadrv import REGISTER_CHUNK
from kvtier_contract.errors import TransportError

Run = tuple[int, int, int]  # (first item, item count, arena offset of the first)


def register_ranges(lo: int, hi: int, chunk: int = REGISTER_CHUNK) -> list[tuple[int, int]]:
    """Bytes ``lo:hi`` of a mapping as the ranges it is page-locked in: cut at every multiple
    of ``chunk`` from the mapping's start, as :func:`runs` cuts copies."""
    cuts = [lo, *range((lo // chunk + 1) * chunk, hi, chunk), hi]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def runs(offsets: Sequence[int], block_bytes: int, chunk: int = REGISTER_CHUNK) -> list[Run]:
    """Group items whose slots follow each other in the arena: ``offsets[i+1] == offsets[i] +
    block_bytes`` continues a run, within one ``chunk`` (one cudaHostRegister range: a copy
    spanning two may not be treated as page-locked). Items keep their order."""
    out: list[Run] = []
    for i, off in enumerate(offsets):
        if out:
            first, count, start = out[-1]
            if off == start + count * block_bytes and (off + block_bytes - 1) // chunk == start // chunk:
                out[-1] = (first, count + 1, start)
                continue
        out.append((i, 1, off))
    return out


class ArenaMover:
    """Moves batches between a ``PagedKvLayout`` and slots of one mapped arena."""

    def __init__(
        self,
        arena: memoryview,
        device: torch.device,
        *,
        register: bool = True,
        writable_bytes: int | None = None,
    ) -> None:
        """``register``: page-lock the arena for CUDA (portable: valid for every device's
        context, so only the first CUDA mover of a mapping does it). ``writable_bytes``: the
        mapping's first bytes that stores may fill (the session's own arena; past them, its
        groups' arenas, mapped read-only and registered as such); None: all of it."""
        self.device = device
        self.host = torch.frombuffer(arena, dtype=torch.uint8)
        self.writable = self.host.numel() if writable_bytes is None else writable_bytes
        self.registered: list[tuple[int, int]] = []
        self.stream: Any = None
        if device.type == "cuda":
            if register:
                size = self.host.numel()
                self._register(0, self.writable, 1)  # cudaHostRegisterPortable
                if size > self.writable:  # its groups' arenas: ... | cudaHostRegisterReadOnly
                    self._register(self.writable, size, 1 | 8, required=False)
            self.stream = torch.cuda.Stream(device)

    # -- lifecycle ----------------------------------------------------------------------------

    def _register(self, lo: int, hi: int, flags: int, *, required: bool = True) -> None:
        """Page-lock bytes ``lo:hi`` of the mapping in ranges cut at multiples of
        ``REGISTER_CHUNK`` from its start (where ``runs`` cuts copies: no copy spans two). A
        failure: TransportError when ``required``; else (a read-only part the device cannot
        register) that part stays pageable, its copies slower, never wrong."""
        cudart, base = torch.cuda.cudart(), self.host.data_ptr()
        for start, end in register_ranges(lo, hi):
            err = cudart.cudaHostRegister(base + start, end - start, flags)
            if int(err) != 0:
                if not required:
                    return
                self.close()
                raise TransportError(f"cudaHostRegister of the shm arena failed ({err})")
            self.registered.append((base + start, end - start))

    def close(self) -> None:
        """Unregister the arena from CUDA and drop the tensor over it (its buffer export must
        be gone before the mapping can be closed)."""
        if self.registered:
            cudart = torch.cuda.cudart()
            for base, _length in self.registered:
                cudart.cudaHostUnregister(base)
            self.registered = []
        self.host = torch.empty(0, dtype=torch.uint8)

    # -- moves --------------------------------------------------------------------------------

    def store(self, layout: Any, block_ids: Sequence[int], offsets: Sequence[int], job_id: int = 0) -> None:
        """Engine blocks ``block_ids[i]`` -> the slot at ``offsets[i]``; returns once the arena
        holds the bytes (the daemon may then publish them). ``job_id`` is unused here (the
        cuda_ipc mover names the job to the daemon)."""
        bb = layout.block_bytes
        self._check(offsets, bb, self.writable)
        if self.stream is None:
            for first, count, off in runs(offsets, bb):
                layout.gather(block_ids[first : first + count], self._slots(off, count, bb))
            return
        staging = torch.empty((len(block_ids), bb), dtype=torch.uint8, device=self.device)
        layout.gather(block_ids, staging)  # on the engine's current stream
        engine = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(engine)
        with torch.cuda.stream(self.stream):
            for first, count, off in runs(offsets, bb):
                self._slots(off, count, bb).copy_(staging[first : first + count], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        staging.record_stream(self.stream)
        done.synchronize()

    def load(self, layout: Any, block_ids: Sequence[int], offsets: Sequence[int], job_id: int = 0) -> None:
        """The slot at ``offsets[i]`` -> engine block ``block_ids[i]``; the arena has been read
        when this returns (the caller may then unpin)."""
        bb = layout.block_bytes
        self._check(offsets, bb)
        if self.stream is None:
            for first, count, off in runs(offsets, bb):
                layout.scatter(block_ids[first : first + count], self._slots(off, count, bb))
            return
        engine = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # never waits for the engine's queued work
            staging = torch.empty((len(block_ids), bb), dtype=torch.uint8, device=self.device)
            for first, count, off in runs(offsets, bb):
                staging[first : first + count].copy_(self._slots(off, count, bb), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        staging.record_stream(engine)
        layout.scatter(block_ids, staging)  # queued on the engine's stream, after the copies

    def _slots(self, offset: int, count: int, block_bytes: int) -> torch.Tensor:
        return self.host[offset : offset + count * block_bytes].view(count, block_bytes)

    def _check(self, offsets: Sequence[int], block_bytes: int, size: int | None = None) -> None:
        size = self.host.numel() if size is None else size
        for off in offsets:
            if off < 0 or off + block_bytes > size:
                raise TransportError(f"slot offset {off} outside the {size}-byte arena")

"""The cuda_ipc copier: the daemon's CUDA side of the cuda_ipc transport (protocol and lifecycle:
:mod:`kvtierd.transports.cuda_ipc`, which re-exports :class:`CudaIpcCopier` and :func:`runs`).

Role: registers the host arenas with CUDA, opens clients' IPC handles (shared and counted per
(device, handle)), keeps the buffer table, and copies runs of slots on each device's worker
thread. Ownership: the opened mappings, the buffer table and the worker threads. Concurrency:
every method on the event-loop thread; the driver's calls on the device's worker thread only.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier_contract.cudadrv import REGISTER_CHUNK
from kvtier_contract.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvtierd.transports.cuda_driver import CudaDriver, CudaFailure, CudaUnavailable

log = logging.getLogger("kvtierd.cuda_ipc")
UUID_BYTES = 16
HANDLE_BYTES = 64


@dataclass(eq=False)
class _Mapping:
    device: int
    handle: bytes
    address: int  # where the opened allocation starts in the daemon
    nbytes: int  # the allocation's size: no buffer may reach past it
    refs: int


@dataclass(eq=False)
class CudaBuffer:
    id: int
    session_id: int
    device: int
    address: int  # the buffer's first byte in the daemon's address space
    nbytes: int
    mapping: _Mapping
    busy: int = 0  # copies in flight


@dataclass
class CopyFigures:
    copies: int = 0
    copy_errors: int = 0
    bytes_copied: int = 0


def runs(
    pairs: Sequence[tuple[int, int]],
    block_bytes: int,
    chunk: int = REGISTER_CHUNK,
    base: Callable[[int], int] = lambda _slot: 0,
) -> list[tuple[int, int, int]]:
    """``(slot offset, buffer offset)`` per block -> ``(slot offset, buffer offset, bytes)``,
    merging blocks whose slots and buffer offsets both follow the previous block's, within one
    ``chunk`` of an arena (one cudaHostRegister range: a copy spanning two may be staged);
    ``base(slot)``: where the slot's arena starts (arenas never touch: kvtierd.tiers.host)."""
    out: list[tuple[int, int, int]] = []
    for slot, buf in pairs:
        if out:
            s, b, n = out[-1]
            start = base(s)
            if (
                slot == s + n
                and buf == b + n
                and (slot + block_bytes - 1 - start) // chunk == (s - start) // chunk
            ):
                out[-1] = (s, b, n + block_bytes)
                continue
        out.append((slot, buf, block_bytes))
    return out


class CudaIpcCopier:
    """See the module docstring. Event-loop thread for every public method."""

    def __init__(
        self,
        host: Any,
        driver: CudaDriver,
        *,
        max_buffers_per_session: int = 16,
        max_buffer_bytes: int = 1 << 40,
    ) -> None:
        self.host = host  # kvtierd.tiers.HostTier: its arenas, one pool each
        self.driver = driver
        self.max_buffers = max_buffers_per_session
        self.max_buffer_bytes = max_buffer_bytes
        self.figures = CopyFigures()
        self.uuids: list[bytes] = []
        self._bases: list[int] = []  # per pool: the address of its arena's first byte
        self._started = False
        self._registered: list[int] = []
        self._buffers: dict[int, CudaBuffer] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._ids = itertools.count(1)
        self._workers: dict[int, ThreadPoolExecutor] = {}

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Learn the devices and page-lock every arena for every CUDA context (blocking: runs
        before the daemon is ready; pinning a large arena takes a while)."""
        self.uuids = self.driver.device_uuids()
        self._started = True
        for pool in range(len(self.host.arenas)):
            self.add_arena(pool)

    def add_arena(self, pool: int) -> None:
        """Page-lock the arena of ``pool`` (blocking; at start, or when a tenant's arena is
        made later). CudaUnavailable if CUDA refuses."""
        if not self._started:
            return  # start() registers it
        view = self.host.arenas[pool].view
        c = ctypes.c_char.from_buffer(view)
        base = ctypes.addressof(c)
        del c  # no export may outlive this call: the arena's mapping must stay closable
        size = len(view)
        try:
            for start in range(0, size, REGISTER_CHUNK):
                self.driver.register_host(base + start, min(REGISTER_CHUNK, size - start))
                self._registered.append(base + start)
        except CudaFailure as e:
            self.close()
            raise CudaUnavailable(f"cuda_ipc: cudaHostRegister of a host arena failed: {e}") from None
        self._bases.extend([0] * (pool + 1 - len(self._bases)))
        self._bases[pool] = base
        log.info("cuda_ipc: %d device(s), arena %d of %d bytes page-locked", len(self.uuids), pool, size)

    def _address(self, slot: int) -> int:
        pool: int = self.host.pool_of(slot)
        base: int = self.host.pool_bases[pool]
        return self._bases[pool] + slot - base

    def close(self) -> None:
        """Close every mapping and unregister the arena (blocking; after the last copy)."""
        for pool in self._workers.values():
            pool.shutdown(wait=True)
        self._workers.clear()
        for m in self._mappings.values():
            try:
                self.driver.close_handle(m.device, m.address)
            except CudaFailure as e:
                log.warning("cuda_ipc: closing a handle on device %d: %s", m.device, e)
        self._mappings.clear()
        self._buffers.clear()
        for address in self._registered:
            try:
                self.driver.unregister_host(address)
            except CudaFailure as e:
                log.warning("cuda_ipc: cudaHostUnregister: %s", e)
        self._registered = []

    @property
    def buffers(self) -> int:
        return len(self._buffers)

    # -- requests -----------------------------------------------------------------------------

    async def register(
        self, session_id: int, device_uuid: bytes, handle: bytes, handle_offset: int, nbytes: int
    ) -> CudaBuffer:
        device = self._check_request(session_id, device_uuid, handle, nbytes)
        key = (device, handle)
        m = self._mappings.get(key)
        if m is None:
            m = await self._open_mapping(device, handle)
        if handle_offset + nbytes > m.nbytes:
            # A copy past the allocation would fault on the copy engine and could poison the
            # daemon's context for every client: refused here, before any copy.
            if m.refs == 0:
                del self._mappings[key]
                self._on_nowait(device, self.driver.close_handle, device, m.address)
            raise InvalidArgument(
                f"{handle_offset} + {nbytes} bytes reach past the "
                f"{m.nbytes}-byte allocation the handle names",
                field="buffer_bytes",
            )
        m.refs += 1
        buf = CudaBuffer(next(self._ids), session_id, device, m.address + handle_offset, nbytes, m)
        self._buffers[buf.id] = buf
        return buf

    def _check_request(self, session_id: int, device_uuid: bytes, handle: bytes, nbytes: int) -> int:
        """The device a registration names, or the InvalidArgument / FailedPrecondition /
        ResourceExhausted that refuses it."""
        if len(device_uuid) != UUID_BYTES:
            raise InvalidArgument(f"must be {UUID_BYTES} bytes, got {len(device_uuid)}", field="device_uuid")
        if len(handle) != HANDLE_BYTES:
            raise InvalidArgument(f"must be {HANDLE_BYTES} bytes, got {len(handle)}", field="ipc_handle")
        if not 0 < nbytes <= self.max_buffer_bytes:
            raise InvalidArgument(
                f"must be in 1..{self.max_buffer_bytes}, got {nbytes}", field="buffer_bytes"
            )
        if device_uuid not in self.uuids:
            raise FailedPrecondition(
                f"no device with UUID {device_uuid.hex()} is visible to the "
                f"daemon ({len(self.uuids)} device(s); check "
                "CUDA_VISIBLE_DEVICES of the daemon)",
                field="device_uuid",
            )
        owned = sum(1 for b in self._buffers.values() if b.session_id == session_id)
        if owned >= self.max_buffers:
            raise ResourceExhausted(
                f"session holds {owned} buffers (max {self.max_buffers})", field="buffer_id"
            )
        return self.uuids.index(device_uuid)

    async def _open_mapping(self, device: int, handle: bytes) -> _Mapping:
        """The mapping of ``handle`` on ``device``, opened on the device's thread (another
        registration may have opened it meanwhile: then that one, and this one closed)."""
        try:
            address, size = await self._on(device, self.driver.open_handle, device, handle)
        except CudaFailure as e:
            raise FailedPrecondition(f"cudaIpcOpenMemHandle failed: {e}", field="ipc_handle") from None
        m = self._mappings.get((device, handle))
        if m is None:
            m = self._mappings[device, handle] = _Mapping(device, handle, address, size, 0)
        else:
            self._on_nowait(device, self.driver.close_handle, device, address)
        return m

    def release(self, session_id: int, buffer_id: int) -> None:
        self._drop(self.buffer(session_id, buffer_id))

    def release_session(self, session_id: int) -> None:
        for buf in [b for b in self._buffers.values() if b.session_id == session_id]:
            self._drop(buf)

    def buffer(self, session_id: int, buffer_id: int) -> CudaBuffer:
        buf = self._buffers.get(buffer_id)
        if buf is None or buf.session_id != session_id:  # another session's: as an absent one
            raise NotFound(f"unknown or released buffer {buffer_id}", field="buffer_id")
        return buf

    def plan(
        self, buf: CudaBuffer, slots: Sequence[int], block_bytes: int, buffer_offsets: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """Validate one copy (nothing is touched) -> runs of (slot, buffer offset, bytes)."""
        if len(buffer_offsets) != len(slots):
            raise InvalidArgument(
                f"has {len(buffer_offsets)} offsets for the job's {len(slots)} blocks", field="buffer_offsets"
            )
        for off in buffer_offsets:
            if off + block_bytes > buf.nbytes:
                raise InvalidArgument(
                    f"block at {off} ends past the {buf.nbytes}-byte buffer", field="buffer_offsets"
                )
        host = self.host
        for slot in slots:
            pool = host.pool_of(slot)
            if (
                pool < 0
                or pool >= len(self._bases)
                or slot + block_bytes > host.pool_bases[pool] + host.pool_bytes[pool]
            ):
                raise FailedPrecondition(f"slot {slot} outside the arenas", field="job_id")
        return runs(
            list(zip(slots, buffer_offsets, strict=True)),
            block_bytes,
            base=lambda s: host.pool_bases[host.pool_of(s)],
        )

    async def copy(self, buf: CudaBuffer, plan: Sequence[tuple[int, int, int]], to_device: bool) -> int:
        """Run a validated plan; returns the number of copies. Aborted on a CUDA error."""
        at = self._address
        if to_device:
            moves = [(buf.address + b, at(s), n) for s, b, n in plan]
        else:
            moves = [(at(s), buf.address + b, n) for s, b, n in plan]
        buf.busy += 1
        try:
            await self._on(buf.device, self.driver.copy, buf.device, moves, to_device)
        except CudaFailure as e:
            self.figures.copy_errors += 1
            raise Aborted(f"CUDA copy on device {buf.device} failed: {e}") from None
        finally:
            buf.busy -= 1
        self.figures.copies += len(moves)
        self.figures.bytes_copied += sum(n for _, _, n in moves)
        return len(moves)

    # -- internals ----------------------------------------------------------------------------

    def _drop(self, buf: CudaBuffer) -> None:
        del self._buffers[buf.id]
        m = buf.mapping
        m.refs -= 1
        if m.refs == 0:
            del self._mappings[(m.device, m.handle)]
            # Queued behind every copy already submitted for this device.
            self._on_nowait(m.device, self.driver.close_handle, m.device, m.address)

    def _worker(self, device: int) -> ThreadPoolExecutor:
        pool = self._workers.get(device)
        if pool is None:
            pool = self._workers[device] = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-cuda{device}")
        return pool

    async def _on(self, device: int, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker(device), fn, *args)

    def _on_nowait(self, device: int, fn: Any, *args: Any) -> None:
        def guarded() -> None:
            try:
                fn(*args)
            except CudaFailure as e:
                log.warning("cuda_ipc: %s on device %d: %s", fn.__name__, device, e)

        self._worker(device).submit(guarded)

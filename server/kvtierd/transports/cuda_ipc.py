"""cuda_ipc transport, daemon side: the daemon copies between clients' CUDA buffers and slots.

Enabled by ``cuda_ipc = true`` (off by default): only then does the daemon import cupy (the
``kvtierd[cuda]`` extra) and create CUDA contexts. Protocol (proto ``RegisterCudaBuffer`` /
``CudaCopy`` / ``ReleaseCudaBuffer``; docs/cuda_ipc.md)::

    client: RegisterCudaBuffer(device uuid, IPC handle, offset, bytes)   once per buffer
      -> PrepareStore / PrepareLoad (transport CUDA_IPC)
      -> CudaCopy(job, buffer, one buffer offset per block)   the daemon copies, then answers
      -> CompleteStore / CompleteLoad

Lifecycle of a ``CudaIpcCopier``: ``start()`` (registers the arena with CUDA once: page-locked
and portable, so every copy is DMA) -> ``register`` / ``copy`` / ``release`` /
``release_session`` -> ``close()`` (closes every handle, unregisters the arena; before the
arena is unmapped).

Everything a request names is checked on the event loop (lengths, ownership, the job's
transport, every offset against the buffer's size) before any CUDA call. The CUDA work of one
device runs on that device's worker thread (an executor of one thread): each batch on the
device's private stream, one ``cudaMemcpyAsync`` per run of consecutive slots and buffer
offsets, then the stream is synchronised and the RPC answers. A handle is closed on the same
thread, after the copies queued before it. One process may open an IPC handle only once, so
opened handles are shared and counted per (device, handle).

Ownership and concurrency: :class:`CudaIpcTransport` is the transport the service talks to; it
owns the copier and asks the cache which slots a job holds. The copier owns the opened mappings
and the buffer table (event-loop thread); the driver's calls run on the worker threads only.
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
from kvtier_contract.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    ResourceExhausted,
)
from kvtierd.cache import LoadJob, TieredCache
from kvtierd.domain import Transport
from kvtierd.sessions import Session
from kvtierd.transports.base import ServerTransport
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


def runs(pairs: Sequence[tuple[int, int]], block_bytes: int,
         chunk: int = REGISTER_CHUNK, base: Callable[[int], int] = lambda _slot: 0
         ) -> list[tuple[int, int, int]]:
    """``(slot offset, buffer offset)`` per block -> ``(slot offset, buffer offset, bytes)``,
    merging blocks whose slots and buffer offsets both follow the previous block's, within one
    ``chunk`` of an arena (one cudaHostRegister range: a copy spanning two may be staged);
    ``base(slot)``: where the slot's arena starts (arenas never touch: kvtierd.tiers.slabs)."""
    out: list[tuple[int, int, int]] = []
    for slot, buf in pairs:
        if out:
            s, b, n = out[-1]
            start = base(s)
            if slot == s + n and buf == b + n and \
                    (slot + block_bytes - 1 - start) // chunk == (s - start) // chunk:
                out[-1] = (s, b, n + block_bytes)
                continue
        out.append((slot, buf, block_bytes))
    return out


class CudaIpcCopier:
    """See the module docstring. Event-loop thread for every public method."""

    def __init__(self, host: Any, driver: CudaDriver, *, max_buffers_per_session: int = 16,
                 max_buffer_bytes: int = 1 << 40) -> None:
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
            raise CudaUnavailable(f"cuda_ipc: cudaHostRegister of a host arena failed: {e}"
                                  ) from None
        self._bases.extend([0] * (pool + 1 - len(self._bases)))
        self._bases[pool] = base
        log.info("cuda_ipc: %d device(s), arena %d of %d bytes page-locked", len(self.uuids),
                 pool, size)

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

    async def register(self, session_id: int, device_uuid: bytes, handle: bytes,
                       handle_offset: int, nbytes: int) -> CudaBuffer:
        if len(device_uuid) != UUID_BYTES:
            raise InvalidArgument(f"must be {UUID_BYTES} bytes, got {len(device_uuid)}",
                                  field="device_uuid")
        if len(handle) != HANDLE_BYTES:
            raise InvalidArgument(f"must be {HANDLE_BYTES} bytes, got {len(handle)}",
                                  field="ipc_handle")
        if not 0 < nbytes <= self.max_buffer_bytes:
            raise InvalidArgument(f"must be in 1..{self.max_buffer_bytes}, got {nbytes}",
                                  field="buffer_bytes")
        if device_uuid not in self.uuids:
            raise FailedPrecondition(f"no device with UUID {device_uuid.hex()} is visible to the "
                                     f"daemon ({len(self.uuids)} device(s); check "
                                     "CUDA_VISIBLE_DEVICES of the daemon)", field="device_uuid")
        owned = sum(1 for b in self._buffers.values() if b.session_id == session_id)
        if owned >= self.max_buffers:
            raise ResourceExhausted(f"session holds {owned} buffers (max {self.max_buffers})",
                                    field="buffer_id")
        device = self.uuids.index(device_uuid)
        key = (device, handle)
        m = self._mappings.get(key)
        if m is None:
            try:
                address, size = await self._on(device, self.driver.open_handle, device, handle)
            except CudaFailure as e:
                raise FailedPrecondition(f"cudaIpcOpenMemHandle failed: {e}",
                                         field="ipc_handle") from None
            m = self._mappings.get(key)  # another registration may have opened it meanwhile
            if m is None:
                m = self._mappings[key] = _Mapping(device, handle, address, size, 0)
            else:
                self._on_nowait(device, self.driver.close_handle, device, address)
        if handle_offset + nbytes > m.nbytes:
            # A copy past the allocation would fault on the copy engine and could poison the
            # daemon's context for every client: refused here, before any copy.
            if m.refs == 0:
                del self._mappings[key]
                self._on_nowait(device, self.driver.close_handle, device, m.address)
            raise InvalidArgument(f"{handle_offset} + {nbytes} bytes reach past the "
                                  f"{m.nbytes}-byte allocation the handle names",
                                  field="buffer_bytes")
        m.refs += 1
        buf = CudaBuffer(next(self._ids), session_id, device, m.address + handle_offset, nbytes, m)
        self._buffers[buf.id] = buf
        return buf

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

    def plan(self, buf: CudaBuffer, slots: Sequence[int], block_bytes: int,
             buffer_offsets: Sequence[int]) -> list[tuple[int, int, int]]:
        """Validate one copy (nothing is touched) -> runs of (slot, buffer offset, bytes)."""
        if len(buffer_offsets) != len(slots):
            raise InvalidArgument(f"has {len(buffer_offsets)} offsets for the job's "
                                  f"{len(slots)} blocks", field="buffer_offsets")
        for off in buffer_offsets:
            if off + block_bytes > buf.nbytes:
                raise InvalidArgument(f"block at {off} ends past the {buf.nbytes}-byte buffer",
                                      field="buffer_offsets")
        host = self.host
        for slot in slots:
            pool = host.pool_of(slot)
            if pool < 0 or pool >= len(self._bases) or \
                    slot + block_bytes > host.pool_bases[pool] + host.pool_bytes[pool]:
                raise FailedPrecondition(f"slot {slot} outside the arenas", field="job_id")
        return runs(list(zip(slots, buffer_offsets, strict=True)), block_bytes,
                    base=lambda s: host.pool_bases[host.pool_of(s)])

    async def copy(self, buf: CudaBuffer, plan: Sequence[tuple[int, int, int]],
                   to_device: bool) -> int:
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
            pool = self._workers[device] = ThreadPoolExecutor(
                1, thread_name_prefix=f"kvtier-cuda{device}")
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


class CudaIpcTransport(ServerTransport):
    """The cuda_ipc transport as the service sees it: buffers, copies, figures.

    Owns its :class:`CudaIpcCopier`; a copy's job is the cache's (``cache.jobs``), validated
    before any CUDA call, marked as copying while the copy runs (its completion is refused
    meanwhile), committed-ready after it (stores), aborted on a CUDA error (that job only).
    Lifecycle (kvtierd.transports.base): ``start()`` page-locks the arena on an executor thread
    -> requests -> ``close()`` (blocking: after the copies queued, before the arena is unmapped).
    """

    name = "cuda_ipc"

    def __init__(self, copier: CudaIpcCopier, cache: TieredCache) -> None:
        self.copier = copier
        self._cache = cache

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.copier.start)

    def close(self) -> None:
        self.copier.close()

    async def register(self, session: Session, device_uuid: bytes, handle: bytes,
                       handle_offset: int, nbytes: int) -> int:
        buf = await self.copier.register(session.id, device_uuid, handle, handle_offset, nbytes)
        if session.released:  # the lease lapsed while the handle was being opened
            self.copier.release(session.id, buf.id)
            raise NotFound(f"session {session.id} expired or closed", field="session_id")
        return buf.id

    def release(self, session: Session, buffer_id: int) -> None:
        self.copier.release(session.id, buffer_id)

    def release_session(self, session_id: int) -> None:
        self.copier.release_session(session_id)

    async def copy(self, session: Session, job_id: int, buffer_id: int,
                   buffer_offsets: Sequence[int]) -> tuple[int, int]:
        """Move a cuda_ipc job's blocks between the buffer and their slots: (copies, bytes)."""
        jobs = self._cache.jobs
        job = jobs.any(session.id, job_id)
        if job.transport is not Transport.CUDA_IPC:
            raise FailedPrecondition(f"job {job_id} was prepared for transport "
                                     f"{job.transport.label}, not cuda_ipc", field="job_id")
        jobs.moves_bytes(job)
        buf = self.copier.buffer(session.id, buffer_id)
        jobs.not_copying(job.id)
        keys = sorted(job.items)
        bb = job.ns.block_bytes
        plan = self.copier.plan(buf, [job.items[i].offset for i in keys], bb, buffer_offsets)
        jobs.copying.add(job.id)
        copy = asyncio.ensure_future(self.copier.copy(buf, plan, isinstance(job, LoadJob)))
        try:
            copies = await asyncio.shield(copy)
        except asyncio.CancelledError:
            # The RPC went (client deadline, server stop); the device copy did not. The job
            # stays copying (not completable, its slots held) until the copy itself ends, then
            # it is aborted: its client has given it up.
            def ended(f: asyncio.Future[int]) -> None:
                if not f.cancelled():
                    f.exception()  # retrieved: a CUDA error was counted by the copier
                jobs.copying.discard(job.id)
                self._cache.abort_job(session, job)

            copy.add_done_callback(ended)
            raise
        except KvtierError:
            jobs.copying.discard(job.id)
            self._cache.abort_job(session, job)  # a CUDA error fails this job, nothing else
            raise
        jobs.copying.discard(job.id)
        if not isinstance(job, LoadJob) and jobs.is_live(job):
            job.arrived(job.items)
        return copies, len(keys) * bb

    def stats(self) -> dict[str, int | bool]:
        f = self.copier.figures
        return {"enabled": True, "devices": len(self.copier.uuids),
                "buffers": self.copier.buffers, "copies": f.copies,
                "copy_errors": f.copy_errors, "bytes_copied": f.bytes_copied}

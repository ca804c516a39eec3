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
owns the copier and asks the cache which slots a job holds. The copier
(:mod:`kvtierd.transports.cuda_copier`) owns the opened mappings and the buffer table
(event-loop thread); the driver's calls run on the worker threads only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier_contract.errors import FailedPrecondition, KvtierError, NotFound
from kvtierd.cache import LoadJob, TieredCache
from kvtierd.domain import Transport
from kvtierd.sessions import Session
from kvtierd.transports.base import ServerTransport
from kvtierd.transports.cuda_copier import CudaIpcCopier, runs

__all__ = ["CudaIpcCopier", "CudaIpcTransport", "runs"]


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

    async def register(
        self, session: Session, device_uuid: bytes, handle: bytes, handle_offset: int, nbytes: int
    ) -> int:
        buf = await self.copier.register(session.id, device_uuid, handle, handle_offset, nbytes)
        if session.released:  # the lease lapsed while the handle was being opened
            self.copier.release(session.id, buf.id)
            raise NotFound(f"session {session.id} expired or closed", field="session_id")
        return buf.id

    def release(self, session: Session, buffer_id: int) -> None:
        self.copier.release(session.id, buffer_id)

    def release_session(self, session_id: int) -> None:
        self.copier.release_session(session_id)

    async def copy(
        self, session: Session, job_id: int, buffer_id: int, buffer_offsets: Sequence[int]
    ) -> tuple[int, int]:
        """Move a cuda_ipc job's blocks between the buffer and their slots: (copies, bytes)."""
        jobs = self._cache.jobs
        job = jobs.any(session.id, job_id)
        if job.transport is not Transport.CUDA_IPC:
            raise FailedPrecondition(
                f"job {job_id} was prepared for transport {job.transport.label}, not cuda_ipc", field="job_id"
            )
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
        return {
            "enabled": True,
            "devices": len(self.copier.uuids),
            "buffers": self.copier.buffers,
            "copies": f.copies,
            "copy_errors": f.copy_errors,
            "bytes_copied": f.bytes_copied,
        }

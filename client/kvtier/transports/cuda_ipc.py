"""cuda_ipc transport: the daemon copies between our CUDA staging buffer and its arena.

A ``cuda_ipc`` session is an shm session (host buffers in ``put``/``get`` and CPU layouts move
over the mapped arena exactly as with ``shm``) plus, per CUDA device, an ``IpcMover`` for
``put_blocks``/``get_blocks`` of CUDA layouts:

* once (and again only when a larger batch needs a larger buffer) a device staging buffer is
  exported (``kvtier_contract.cudadrv``: the allocation holding it, and that allocation's IPC handle);
  ``RegisterCudaBuffer`` sends the handle, the offset of the buffer inside that allocation and
  the device's UUID (ordinals differ between processes).
* a store gathers the engine blocks into the staging buffer on the engine's current stream (one
  kernel, ordered after the forward), waits for that gather's event, then ``CudaCopy`` has the
  daemon copy device->arena on its own stream; it answers once the bytes are in the slots.
* a load has the daemon copy arena->staging (``CudaCopy`` answers when done), then queues the
  scatter on the engine's stream (one kernel); the next use of the staging buffer first waits
  for that scatter's event.

The client process never registers the arena with CUDA and never copies host<->device itself.
Ownership: the transport owns its movers, each mover its staging buffer; the daemon closes the
handles with the session (or ``ReleaseCudaBuffer`` when a buffer is replaced). Not thread-safe:
the client serialises transfers. Importing this module imports neither torch nor CUDA.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.transports.shm import ShmTransport
from kvtier_contract import cudadrv
from kvtier_contract.errors import FailedPrecondition, TransportError
from kvtier_contract.v1 import kvtier_pb2 as pb

Rpc = Callable[[str, Any], Any]  # (method, request) -> reply; raises kvtier errors
_MIN_BUFFER = 64 << 20


class CudaIpcTransport(ShmTransport):
    """An shm attachment plus one IpcMover per CUDA device."""

    name = "cuda_ipc"
    proto_value = pb.TRANSPORT_CUDA_IPC

    def __init__(self) -> None:
        super().__init__()
        self._rpc: Rpc | None = None

    def bind_rpc(self, rpc: Rpc) -> None:
        self._rpc = rpc

    def mover(self, device: Any) -> Any:
        if getattr(device, "type", "cpu") != "cuda":
            return super().mover(device)  # CPU tensors: straight into the mapped slots
        key = str(device)
        if key not in self._movers:
            if self._rpc is None:
                raise TransportError("cuda_ipc transport is not bound to a session")
            self._movers[key] = IpcMover(device, self._rpc)
        return self._movers[key]


def device_uuid(device: Any) -> bytes:
    """The 16-byte UUID of a torch CUDA device."""
    import torch

    u = torch.cuda.get_device_properties(device).uuid
    raw = getattr(u, "bytes", None)
    if raw is not None and len(bytes(bytearray(raw))) == 16:
        return bytes(bytearray(raw))
    text = str(u)
    return uuid.UUID(text[4:] if text.startswith("GPU-") else text).bytes


def _export(address: int) -> tuple[bytes, int]:
    """(IPC handle of the allocation holding ``address``, offset of ``address`` in it). A
    failure is lasting, not a daemon away: it fails the batch, without a reconnect."""
    try:
        base, _size = cudadrv.address_range(address)
        return cudadrv.ipc_handle(base), address - base
    except cudadrv.CudaDriverError as e:
        raise FailedPrecondition(
            f"cuda_ipc: {e}; memory from torch's expandable segments "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be exported this way: "
            "use transport 'shm'",
            field="transport",
        ) from None


class IpcMover:
    """Moves batches between a CUDA ``PagedKvLayout`` and arena slots via the daemon."""

    def __init__(self, device: Any, rpc: Rpc) -> None:
        import torch

        self.device = device
        self._rpc = rpc
        self._uuid = device_uuid(device)
        self.staging: torch.Tensor | None = None
        self.buffer_id = 0
        self._last_use: Any = None  # event after the last kernel reading the staging buffer
        self._unexportable: FailedPrecondition | None = None  # set once export has failed

    def store(self, layout: Any, block_ids: Sequence[int], offsets: Sequence[int], job_id: int) -> None:
        """Engine blocks -> the job's slots; returns once the daemon holds the bytes."""
        import torch

        rows = self._rows(len(block_ids), layout.block_bytes)
        layout.gather(block_ids, rows)  # engine's current stream: after the forward
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()
        self._copy(job_id, len(block_ids), layout.block_bytes)

    def load(self, layout: Any, block_ids: Sequence[int], offsets: Sequence[int], job_id: int) -> None:
        """The job's slots -> engine blocks; the daemon has read the slots when this returns
        (the caller may then unpin); the scatter is queued on the engine's stream."""
        import torch

        rows = self._rows(len(block_ids), layout.block_bytes)
        self._copy(job_id, len(block_ids), layout.block_bytes)
        layout.scatter(block_ids, rows)
        self._last_use = torch.cuda.Event()
        self._last_use.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Drop the staging buffer (the daemon closes its handle with the session)."""
        self.staging = None
        self.buffer_id = 0

    # -- internals ----------------------------------------------------------------------------

    def _copy(self, job_id: int, n: int, block_bytes: int) -> None:
        self._rpc(
            "CudaCopy",
            pb.CudaCopyRequest(
                job_id=job_id, buffer_id=self.buffer_id, buffer_offsets=[i * block_bytes for i in range(n)]
            ),
        )

    def _rows(self, n: int, block_bytes: int) -> Any:
        """The staging buffer as ``n`` rows, free of earlier kernels, registered."""
        import torch

        need = n * block_bytes
        if self._last_use is not None:
            self._last_use.synchronize()  # the previous scatter has read the buffer
            self._last_use = None
        if self.staging is None or self.staging.numel() < need:
            size = max(need, _MIN_BUFFER, 2 * (self.staging.numel() if self.staging is not None else 0))
            self._replace(torch.empty(size, dtype=torch.uint8, device=self.device))
        assert self.staging is not None
        return self.staging[:need].view(n, block_bytes)

    def _replace(self, staging: Any) -> None:
        import torch

        old = self.buffer_id
        if self._unexportable is not None:
            raise self._unexportable
        # The new tensor may reuse memory that kernels queued on the engine's stream still use;
        # that reuse is safe only for work on that stream, and the daemon writes from another
        # process: wait for them. (A runtime call, it also makes the device's context current
        # on this thread for the driver calls below.)
        torch.cuda.current_stream(self.device).synchronize()
        with torch.cuda.device(self.device):
            try:
                handle, offset = _export(staging.data_ptr())
            except FailedPrecondition as e:
                self._unexportable = e  # every later batch fails at once, without a retry
                raise
        reply = self._rpc(
            "RegisterCudaBuffer",
            pb.RegisterCudaBufferRequest(
                device_uuid=self._uuid, ipc_handle=handle, handle_offset=offset, buffer_bytes=staging.numel()
            ),
        )
        self.staging, self.buffer_id = staging, reply.buffer_id
        if old:
            try:
                self._rpc("ReleaseCudaBuffer", pb.ReleaseCudaBufferRequest(buffer_id=old))
            except Exception:  # noqa: BLE001  (the session's end releases it anyway)
                pass

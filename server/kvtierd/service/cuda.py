"""Handlers of the cuda_ipc transport: RegisterCudaBuffer, ReleaseCudaBuffer, CudaCopy. Each
translates its request into a :class:`~kvtierd.transports.cuda_ipc.CudaIpcTransport` call
(FAILED_PRECONDITION on a daemon started without cuda_ipc). Event-loop thread only.
"""

from __future__ import annotations

from typing import Any

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.scope import Scope, ServiceSettings


class CudaHandlers:
    """RegisterCudaBuffer, ReleaseCudaBuffer, CudaCopy (see the module docstring)."""

    def __init__(self, scope: Scope, settings: ServiceSettings) -> None:
        self.scope = scope
        self.settings = settings

    async def RegisterCudaBuffer(self, request: pb.RegisterCudaBufferRequest, context: Any) -> Any:
        cuda = self.scope.cuda_transport()
        s = self.scope.session(request.session_id)
        buffer_id = await cuda.register(
            s, request.device_uuid, request.ipc_handle, request.handle_offset, request.buffer_bytes
        )
        return pb.RegisterCudaBufferReply(boot_epoch=self.settings.boot_epoch, buffer_id=buffer_id)

    async def ReleaseCudaBuffer(self, request: pb.ReleaseCudaBufferRequest, context: Any) -> Any:
        cuda = self.scope.cuda_transport()
        cuda.release(self.scope.session(request.session_id), request.buffer_id)
        return pb.ReleaseCudaBufferReply(boot_epoch=self.settings.boot_epoch)

    async def CudaCopy(self, request: pb.CudaCopyRequest, context: Any) -> Any:
        cuda = self.scope.cuda_transport()
        s = self.scope.session(request.session_id)
        copies, nbytes = await cuda.copy(s, request.job_id, request.buffer_id, list(request.buffer_offsets))
        return pb.CudaCopyReply(boot_epoch=self.settings.boot_epoch, copies=copies, bytes=nbytes)

"""The CUDA calls of the cuda_ipc transport's copier, behind one small seam.

:class:`CudaDriver` is what :class:`~kvtierd.transports.cuda_ipc.CudaIpcCopier` calls (from its
worker threads only); :class:`CupyDriver` implements it over cupy's runtime bindings, imported
when it is built (``cuda_ipc = true``), never at daemon import. Tests drive the copier with a
host-memory double of this seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier_contract import cudadrv

Move = tuple[int, int, int]  # (destination address, source address, bytes)


class CudaUnavailable(RuntimeError):
    """cuda_ipc = true, but cupy, CUDA or a device is missing: the daemon does not start."""


class CudaFailure(Exception):
    """A CUDA call failed (raised by drivers; becomes ABORTED for the job at hand)."""


class CudaDriver(Protocol):
    """The few CUDA runtime calls the copier makes. Called from worker threads only (one per
    device; ``register_host``/``unregister_host`` from the first)."""

    def device_uuids(self) -> list[bytes]: ...

    def register_host(self, address: int, nbytes: int) -> None: ...

    def unregister_host(self, address: int) -> None: ...

    def open_handle(self, device: int, handle: bytes) -> tuple[int, int]:
        """Map a client's allocation: (its address here, its size in bytes)."""

    def close_handle(self, device: int, address: int) -> None: ...

    def copy(self, device: int, moves: Sequence[Move], to_device: bool) -> None:
        """Queue every move on the device's stream, then wait for them all."""


class CupyDriver:
    """CudaDriver over cupy's runtime bindings (imported here, never at daemon import)."""

    def __init__(self) -> None:
        try:
            from cupy.cuda import runtime
        except ImportError as e:
            raise CudaUnavailable(
                f"cuda_ipc = true needs cupy: the kvtierd wheel's cuda extra (README.md, Install) ({e})"
            ) from None
        self.rt = runtime
        self._streams: dict[int, int] = {}
        try:
            n = runtime.getDeviceCount()
        except runtime.CUDARuntimeError as e:
            raise CudaUnavailable(f"cuda_ipc = true but CUDA is not usable: {e}") from None
        if n < 1:
            raise CudaUnavailable("cuda_ipc = true but no CUDA device is visible")

    def device_uuids(self) -> list[bytes]:
        try:
            return cudadrv.device_uuids(self.rt.getDeviceCount())
        except cudadrv.CudaDriverError as e:
            raise CudaUnavailable(f"cuda_ipc: {e}") from None

    def register_host(self, address: int, nbytes: int) -> None:
        self._run(lambda: self.rt.hostRegister(address, nbytes, 1))  # cudaHostRegisterPortable

    def unregister_host(self, address: int) -> None:
        self._run(lambda: self.rt.hostUnregister(address))

    def open_handle(self, device: int, handle: bytes) -> tuple[int, int]:
        self._run(lambda: self.rt.setDevice(device))
        address = int(self._run(lambda: self.rt.ipcOpenMemHandle(handle)))
        try:
            base, size = cudadrv.address_range(address)
        except cudadrv.CudaDriverError as e:
            self._run(lambda: self.rt.ipcCloseMemHandle(address))
            raise CudaFailure(f"sizing an opened handle: {e}") from None
        return address, size - (address - base)

    def close_handle(self, device: int, address: int) -> None:
        self._run(lambda: self.rt.setDevice(device))
        self._run(lambda: self.rt.ipcCloseMemHandle(address))

    def copy(self, device: int, moves: Sequence[Move], to_device: bool) -> None:
        rt = self.rt
        kind = rt.memcpyHostToDevice if to_device else rt.memcpyDeviceToHost

        def run() -> None:
            rt.setDevice(device)
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = rt.streamCreateWithFlags(1)  # non-blocking
            for dst, src, n in moves:
                rt.memcpyAsync(dst, src, n, kind, stream)
            rt.streamSynchronize(stream)

        self._run(run)

    def _run(self, fn: Any) -> Any:
        try:
            return fn()
        except self.rt.CUDARuntimeError as e:
            raise CudaFailure(str(e)) from None

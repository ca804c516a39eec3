"""The few CUDA driver-API calls neither torch nor cupy expose correctly, through ctypes.

Used by the cuda_ipc transport on both sides: the client exports its staging buffer
(``address_range`` + ``ipc_handle``), the daemon sizes what it opened (``address_range``) and
names its devices (``device_uuids``; cupy's ``getDeviceProperties()["uuid"]`` is cut at the first
zero byte). libcuda is already loaded in any process that uses CUDA; ``dlopen`` returns it.
Every call needs a current context on the calling thread (any runtime call on the device makes
the primary context current). Importing this module loads nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

# cudaHostRegister granularity for the arena (one huge registration can fail): both the client
# (its mapping) and the daemon (cuda_ipc) register in chunks of this size, and no copy run spans
# two chunks.
REGISTER_CHUNK = 1 << 30


class CudaDriverError(RuntimeError):
    """A driver call failed; ``code`` is its CUresult."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed (CUresult {code})")
        self.code = code


_lib: Any = None


def _libcuda() -> Any:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaDriverError(f"loading libcuda.so.1 ({e})", -1) from None
    return _lib


def _check(err: int, what: str) -> None:
    if err:
        raise CudaDriverError(what, int(err))


def address_range(address: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding ``address``."""
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    _check(
        _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address)),
        "cuMemGetAddressRange",
    )
    return int(base.value), int(size.value)


def ipc_handle(base: int) -> bytes:
    """The 64-byte IPC handle of the allocation starting at ``base``."""
    handle = (ctypes.c_char * 64)()
    _check(_libcuda().cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base)), "cuIpcGetMemHandle")
    return bytes(handle)


def device_uuids(count: int) -> list[bytes]:
    """The 16-byte UUID of devices 0..count-1 (ordinals as this process sees them)."""
    lib = _libcuda()
    _check(lib.cuInit(0), "cuInit")
    out = []
    for i in range(count):
        dev, raw = ctypes.c_int(0), (ctypes.c_char * 16)()
        _check(lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
        _check(lib.cuDeviceGetUuid_v2(raw, dev), "cuDeviceGetUuid")
        out.append(raw.raw)
    return out

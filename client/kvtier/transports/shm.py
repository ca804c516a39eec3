"""shm transport: map the daemon's memfd arena and copy bytes ourselves.

The fd arrives over the daemon's shm Unix socket (SCM_RIGHTS; handshake in
kvtier_contract.wire). Each block is one copy between the caller's buffer and its slot.

Copies are plain memoryview assignments (glibc memcpy), except reads whose destination lies 1 to
63 bytes after the source modulo 4 KiB: there glibc's ``rep movsb`` path (used for copies below
the L2 size on AMD Zen) runs at a quarter of its speed (measured 1.9 against 7.3 GB/s for
256 KiB blocks), and every read of a page-aligned slot into a large numpy array or bytearray,
whose data starts 16 bytes into a page, hit it. Those reads go through numpy's vectorised
``positive`` loop, which has no such penalty. Writes skip the check: their destination (a slot)
is page-aligned, so only sources starting in a page's last 32 bytes are slow, and the check
would cost more than it saves (docs/benchmarks.md).

Blocks of ``NOGIL_BYTES`` and more are copied with the GIL released (``ctypes.memmove``, the same
glibc memcpy; numpy's loop, which releases it too, for the aliased reads): a pipelined put or
get keeps its next jobs' RPCs in flight during a copy (kvtier.batches), on the session's RPC
threads, which must not wait for the interpreter's 5 ms switch interval to get the GIL
(docs/benchmarks.md §14). Smaller blocks keep the plain assignment (cheaper per call).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
from collections.abc import Sequence
from typing import Any

from kvtier.transports.base import DataTransport, Item
from kvtier_contract import wire
from kvtier_contract.digests import block_digest
from kvtier_contract.errors import TransportError
from kvtier_contract.v1 import kvtier_pb2 as pb

_PAGE = 4096
_ALIAS_BYTES = 64  # dst - src (mod 4 KiB) in (0, 64): the slow case of rep movsb
NOGIL_BYTES = 64 << 10  # blocks at least this large are copied with the GIL released


def _address(view: memoryview) -> int:
    """Address of a writable buffer's first byte (holds no export once it returns)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _vector_copy(dst: memoryview, src: memoryview, *, plain: bool = False) -> None:
    """numpy's copy (its vectorised ``positive`` loop, or ``plain``: its memcpy), with the
    GIL released."""
    import numpy as np  # only here; ``import kvtier`` stays numpy-free

    if plain:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        np.positive(np.frombuffer(src, np.uint8), out=np.frombuffer(dst, np.uint8))


class ShmTransport(DataTransport):
    """Owns the arena mapping of one session."""

    name = "shm"
    proto_value = pb.TRANSPORT_SHM

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0  # address of the mapping
        self.arena_bytes = 0
        self._movers: dict[str, Any] = {}  # device -> kvtier.direct.ArenaMover

    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None:
        path = reply.shm_socket
        if not path:
            raise TransportError("daemon does not offer shm (shm_enabled = false)")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
                s.sendall(wire.SHM_REQUEST.pack(wire.SHM_MAGIC, session_id))
                msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        except OSError as e:
            raise TransportError(f"shm handshake with {path} failed: {e}") from e
        if not fds:
            raise TransportError(f"shm handshake refused: {msg[4:].decode(errors='replace')}")
        fd = fds[0]
        try:
            magic, size, _epoch = wire.SHM_REPLY.unpack(msg[: wire.SHM_REPLY.size])
            if magic != wire.SHM_MAGIC or size != os.fstat(fd).st_size:
                raise TransportError("shm handshake: bad reply")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._base = _address(self._view)
        self.arena_bytes = size

    def write(self, job_id: int, items: list[Item], *, digest: bool = False) -> list[int] | None:
        # No alias check here: slots are page-aligned, so only a source that starts in the last
        # 32 bytes of a page is slow, and the check would cost more than it saves (measured
        # +40% per 16 KiB block).
        arena, base = self._arena(), self._base
        memmove, address, buffer = ctypes.memmove, ctypes.addressof, ctypes.c_char.from_buffer
        digests: list[int] | None = [] if digest else None
        for _index, offset, view in items:
            n = len(view)
            if n < NOGIL_BYTES:
                arena[offset : offset + n] = view
            elif view.readonly:  # e.g. bytes: numpy finds its address
                _vector_copy(arena[offset : offset + n], view, plain=True)
            else:
                memmove(base + offset, address(buffer(view)), n)
            if digests is not None:  # the slot's bytes, still in the CPU's cache
                digests.append(block_digest(arena[offset : offset + n]))
        return digests

    def read(self, job_id: int, items: list[Item], digests: Sequence[int] = ()) -> list[int]:
        arena, base = self._arena(), self._base
        memmove, address, buffer = ctypes.memmove, ctypes.addressof, ctypes.c_char.from_buffer
        bad: list[int] = []
        for k, (_index, offset, view) in enumerate(items):
            n = len(view)
            dst = address(buffer(view))
            if 0 < (dst - base - offset) % _PAGE < _ALIAS_BYTES:
                _vector_copy(view, arena[offset : offset + n])
            elif n >= NOGIL_BYTES:
                memmove(dst, base + offset, n)
            else:
                view[:] = arena[offset : offset + n]
            # The copy, not the slot: what the engine gets is what is checked.
            if digests and digests[k] and block_digest(view) != digests[k]:
                bad.append(k)
        return bad

    def mover(self, device: Any) -> Any:
        """An ``ArenaMover`` between tensors on ``device`` and this arena (made once per device;
        on CUDA this registers the mapping with ``cudaHostRegister``). Imports torch."""
        key = str(device)
        if key not in self._movers:
            from kvtier.direct import ArenaMover

            pinned = any(getattr(m, "registered", None) for m in self._movers.values())
            self._movers[key] = ArenaMover(self._arena(), device, register=not pinned)
        return self._movers[key]

    def _arena(self) -> memoryview:
        if self._view is None:
            raise TransportError("shm transport is not attached")
        return self._view

    def close(self) -> None:
        for mover in self._movers.values():  # a mover's staging may not outlive the mapping
            mover.close()
        self._movers.clear()
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

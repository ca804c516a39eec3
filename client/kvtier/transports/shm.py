"""shm transport: map the daemon's memfd arena and copy bytes ourselves.

The fd arrives over the daemon's shm Unix socket (SCM_RIGHTS; handshake in
kvtierd.transports.shm). Copies are single memcpy's between the caller's buffer and the slot.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import Any

from kvtier.errors import TransportError
from kvtier.transports.base import DataTransport, Item
from kvtier.v1 import kvtier_pb2 as pb

_REQUEST = struct.Struct("<4sQ")
_REPLY = struct.Struct("<4sQQ")


class ShmTransport(DataTransport):
    """Owns the arena mapping of one session."""

    name = "shm"
    proto_value = pb.TRANSPORT_SHM

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.arena_bytes = 0

    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None:
        path = reply.shm_socket
        if not path:
            raise TransportError("daemon does not offer shm (shm_enabled = false)")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(path)
                s.sendall(_REQUEST.pack(b"KVS1", session_id))
                msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
        except OSError as e:
            raise TransportError(f"shm handshake with {path} failed: {e}") from e
        if not fds:
            raise TransportError(f"shm handshake refused: {msg[4:].decode(errors='replace')}")
        fd = fds[0]
        try:
            magic, size, _epoch = _REPLY.unpack(msg[: _REPLY.size])
            if magic != b"KVS1" or size != os.fstat(fd).st_size:
                raise TransportError("shm handshake: bad reply")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self.arena_bytes = size

    def write(self, job_id: int, items: list[Item]) -> None:
        arena = self._arena()
        for _index, offset, view in items:
            arena[offset : offset + len(view)] = view

    def read(self, job_id: int, items: list[Item]) -> None:
        arena = self._arena()
        for _index, offset, view in items:
            view[:] = arena[offset : offset + len(view)]

    def _arena(self) -> memoryview:
        if self._view is None:
            raise TransportError("shm transport is not attached")
        return self._view

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

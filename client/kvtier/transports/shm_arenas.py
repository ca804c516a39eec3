"""The arenas an shm session maps (docs/shm_transport.md §2): the handshake on the daemon's shm
socket (``KVS3``, or ``KVS2`` for a daemon that predates it), the reply checked against the fds
it came with, and the mapping of the arenas one after another in one range, so an offset the
daemon tells is an offset in that range: the session's own arena read-write, its groups'
read-only (sealed by the daemon: writing them would fault, so the transport writes only below
the first arena's end). Functions only; :class:`kvtier.transports.shm.ShmTransport` owns the
mapping they return.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
from typing import NamedTuple

from kvtier_contract import wire
from kvtier_contract.errors import TransportError


def handshake(path: str, request: bytes, timeout_s: float) -> tuple[bytes, list[int]]:
    """One exchange on the daemon's shm socket: its answer and the fds it sent."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            s.sendall(request)
            msg, fds, _flags, _addr = socket.recv_fds(s, wire.SHM_MAX_REPLY_BYTES, wire.SHM_MAX_ARENAS)
    except OSError as e:
        raise TransportError(f"shm handshake with {path} failed: {e}") from e
    return msg, fds


class Arena(NamedTuple):
    """One arena of a session's mapping as the daemon handed it: its size, whether the session
    writes it (its own, the first) and, for a group's (read-only), the group's name."""

    size: int
    writable: bool
    group: str = ""


def arenas_of(msg: bytes, fds: list[int]) -> list[Arena]:
    """The arenas a KVS2 or KVS3 reply hands, checked against their fds: one writable arena
    first, the others read-only and named, every size its fd's and a whole number of pages."""
    if msg[:4] == wire.SHM_MAGIC and len(msg) == wire.SHM_REPLY.size:
        _magic, size, _epoch = wire.SHM_REPLY.unpack(msg)
        arenas = [Arena(size, True)]
    elif msg[:4] == wire.SHM_MAGIC_V3 and len(msg) >= wire.SHM_REPLY_V3.size:
        arenas = _v3(msg)
    else:
        raise TransportError("shm handshake: bad reply")
    if (
        len(arenas) != len(fds)
        or not arenas[0].writable
        or any(a.writable or not a.group for a in arenas[1:])
        or any(a.size <= 0 or a.size % mmap.PAGESIZE for a in arenas)
        or any(a.size != os.fstat(f).st_size for a, f in zip(arenas, fds, strict=True))
    ):
        raise TransportError("shm handshake: bad reply")
    return arenas


def _v3(msg: bytes) -> list[Arena]:
    """A KVS3 reply's arenas (wire.SHM_REPLY_V3), its group names read; TransportError when
    the reply does not hold exactly what its count says."""
    _magic, _total, _epoch, count = wire.SHM_REPLY_V3.unpack_from(msg)
    at, each = wire.SHM_REPLY_V3.size, wire.SHM_ARENA.size
    if not 0 < count <= wire.SHM_MAX_ARENAS or len(msg) < at + count * each:
        raise TransportError("shm handshake: bad reply")
    sizes = [wire.SHM_ARENA.unpack_from(msg, at + k * each) for k in range(count)]
    at += count * each
    names = [""]
    try:
        for _ in range(count - 1):
            (n,) = wire.SHM_GROUP_NAME.unpack_from(msg, at)
            at += wire.SHM_GROUP_NAME.size
            if at + n > len(msg):
                raise TransportError("shm handshake: bad reply")
            names.append(msg[at : at + n].decode())
            at += n
    except (struct.error, UnicodeDecodeError):
        raise TransportError("shm handshake: bad reply") from None
    if at != len(msg):
        raise TransportError("shm handshake: bad reply")
    return [
        Arena(size, bool(flags & wire.SHM_ARENA_WRITABLE), name)
        for (size, flags), name in zip(sizes, names, strict=True)
    ]


def map_arenas(arenas: list[Arena], fds: list[int]) -> mmap.mmap:
    """The arenas mapped one after another: one arena, an mmap of it; several, a range
    reserved as one anonymous mapping (nothing committed), each arena mapped over its part
    (``MAP_FIXED``), the writable one read-write, the others read-only. The returned mmap
    spans them all; closing it unmaps them all."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    if len(arenas) == 1:
        try:
            return mmap.mmap(fds[0], arenas[0].size, flags=flags, prot=rw)
        except OSError as e:
            raise TransportError(f"shm: mapping the arena failed: {e}") from e
    total = sum(a.size for a in arenas)
    whole = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=rw)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(whole))
        at = 0
        for (n, writable, _group), fd in zip(arenas, fds, strict=True):
            got = _libc_mmap(start + at, n, rw if writable else mmap.PROT_READ, flags | _MAP_FIXED, fd, 0)
            if got != start + at:
                raise TransportError(f"shm: mapping an arena failed (errno {ctypes.get_errno()})")
            at += n
    except BaseException:
        whole.close()
        raise
    return whole


_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Linux; the module names it from 3.13)
_libc = ctypes.CDLL(None, use_errno=True)
_libc_mmap = _libc.mmap
_libc_mmap.restype = ctypes.c_void_p
_libc_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]  # noqa: E501

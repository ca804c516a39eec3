"""shm transport: map the daemon's memfd arena and copy bytes ourselves.

The fd arrives over the daemon's shm Unix socket (SCM_RIGHTS; handshake in
kvtier_contract.wire: the session's id and data secret, from OpenSessionReply). Blocks whose
slots follow one another in the arena and whose buffers follow one another in memory (a batch's
keys in one slab, one batch buffer: the usual case) are moved by one copy per run; the others,
one copy per block. No per-block Python runs inside a run's copy.

Copies are glibc memcpy (plain memoryview assignments below ``NOGIL_BYTES``, ``ctypes.memmove``
above), except reads shorter than ``ALIAS_STOP_BYTES`` whose destination lies 1 to 63 bytes
after the source modulo 4 KiB: there glibc's ``rep movsb`` path (used for copies below the L2
size on AMD Zen) runs at a quarter of its speed (measured 1.4-1.9 against 7.0 GB/s for 256 KiB
blocks), and every read of a page-aligned slot into a large numpy array or bytearray, whose data
starts 16 bytes into a page, hit it. Those reads go block by block through numpy's vectorised
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from kvtier.transports.base import DataTransport, Item
from kvtier.transports.shm_arenas import arenas_of, handshake, map_arenas
from kvtier_contract import wire
from kvtier_contract.digests import block_digest, block_digests
from kvtier_contract.errors import TransportError
from kvtier_contract.v1 import kvtier_pb2 as pb

_PAGE = 4096
_ALIAS_BYTES = 64  # dst - src (mod 4 KiB) in (0, 64): the slow case of rep movsb
NOGIL_BYTES = 64 << 10  # blocks at least this large are copied with the GIL released
HASH_GROUP_BYTES = 4 << 20  # bytes hashed on the helper thread alongside one copy
INLINE_HASH_BYTES = 1 << 20  # smaller transfers hash in line (a thread hand-off costs ~50 µs)
ALIAS_STOP_BYTES = 1 << 20
"""Copies this large skip ``rep movsb`` (glibc stops using it at the L2 size on AMD, 512 KiB on
the development host), and with it the aliasing penalty: measured 5.3-6.8 GB/s for aliased
1-16 MiB copies, as for unaliased ones."""


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


class _Digests:
    """The digests of one transfer's blocks (kvtier_contract.digests), in order. Each group of
    about ``HASH_GROUP_BYTES`` is hashed on the transport's helper thread *while* the caller
    copies that same group (copy and hash both release the GIL): the two read the same bytes at
    the same time, so they come from memory once. Measured on the 2-vCPU development host
    (docs/benchmarks.md §18): hashing each block after its copy, in line, kept 0.65-0.76x of the
    unverified put and get_into; on the helper thread after each 4 MiB group 0.70-0.98x;
    alongside the copy 0.77-1.2x.

    A put hashes the caller's buffers (the bytes it hands over: a buffer changed during the
    copy only makes its own block a miss later); a get hashes the pinned slots as it copies
    them, so a slot altered after its commit is a miss (a write racing that very copy may go
    unseen this once; the block's digest stays and the next load checks again). Leaving the
    ``with`` block waits for every hash, also after a failed copy: no hash outlives the
    transfer, whose views the mapping's close would pull away."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._parts: list[Future[list[int]]] = []

    def __enter__(self) -> _Digests:
        return self

    def __exit__(self, *exc: object) -> None:
        wait(self._parts)

    def start(self, views: list[memoryview]) -> None:
        self._parts.append(self._pool.submit(block_digests, views))

    def result(self) -> list[int]:
        return [d for part in self._parts for d in part.result()]


def _small(items: list[Item]) -> bool:
    """A transfer of less than ``INLINE_HASH_BYTES``: hashed on the caller's thread."""
    return sum(len(view) for _i, _o, view in items) < INLINE_HASH_BYTES


def _groups(items: list[Item]) -> list[list[Item]]:
    """``items`` cut into runs of about ``HASH_GROUP_BYTES`` (at least one block each)."""
    groups: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if size >= HASH_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += len(item[2])
    return groups


def _runs(items: list[Item]) -> list[tuple[int, int, int, int, int]]:
    """``items`` (writable views) as runs ``(buffer address, arena offset, bytes, lo, hi)``:
    ``items[lo:hi]`` are blocks whose slots follow one another in the arena and whose buffers
    follow one another in memory, so one copy moves them all. A block that follows neither
    (another slab, a scattered buffer) starts a run of its own."""
    runs: list[tuple[int, int, int, int, int]] = []
    address, buffer = ctypes.addressof, ctypes.c_char.from_buffer
    end_addr = end_off = -1
    for k, (_index, offset, view) in enumerate(items):
        n, addr = len(view), address(buffer(view))
        if addr == end_addr and offset == end_off:
            a, o, size, lo, _hi = runs[-1]
            runs[-1] = (a, o, size + n, lo, k + 1)
        else:
            runs.append((addr, offset, n, k, k + 1))
        end_addr, end_off = addr + n, offset + n
    return runs


def _aliased(distance: int, n: int) -> bool:
    """A read of ``n`` bytes whose destination lies ``distance`` bytes after its source hits
    the slow case of ``rep movsb`` (module docstring): only below ``ALIAS_STOP_BYTES``."""
    return n < ALIAS_STOP_BYTES and 0 < distance % _PAGE < _ALIAS_BYTES


class ShmTransport(DataTransport):
    """Owns the arena mapping of one session."""

    name = "shm"
    proto_value = pb.TRANSPORT_SHM

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0  # address of the mapping
        self.arena_bytes = 0  # every arena mapped, one after another
        self.writable_bytes = 0  # the first of them: the session's own
        self.mapped_groups: frozenset[str] = frozenset()  # groups whose arenas it maps (KVS3)
        self._movers: dict[str, Any] = {}  # device -> kvtier.direct.ArenaMover
        self._hash_pool: ThreadPoolExecutor | None = None

    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None:
        """Map every arena the daemon hands the session (``KVS3``): its own read-write, its
        groups' read-only, one after another in one reserved range, so an offset the daemon
        tells is an offset in that range. A daemon that predates ``KVS3`` is asked ``KVS2``
        (its own arena alone)."""
        path = reply.shm_socket
        if not path:
            raise TransportError("daemon does not offer shm (shm_enabled = false)")
        secret = bytes(reply.data_secret)
        msg, fds = handshake(path, wire.shm_request(wire.SHM_MAGIC_V3, session_id, secret), timeout_s)
        if not fds and b"bad shm handshake" in msg:  # (an older daemon)
            msg, fds = handshake(path, wire.shm_request(wire.SHM_MAGIC, session_id, secret), timeout_s)
        if not fds:
            raise TransportError(f"shm handshake refused: {msg[4:].decode(errors='replace')}")
        try:
            arenas = arenas_of(msg, fds)
            self._mm = map_arenas(arenas, fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._view = memoryview(self._mm)
        self._base = _address(self._view)
        self.arena_bytes = len(self._mm)
        self.writable_bytes = arenas[0].size
        self.mapped_groups = frozenset(a.group for a in arenas[1:])

    def write(self, job_id: int, items: list[Item], *, digest: bool = False) -> list[int] | None:
        """With ``digest``: each group of blocks is hashed from the caller's buffers on the
        helper thread while this thread copies the same group into its slots (``_Digests``)."""
        self._writable(max((o + len(v) for _i, o, v in items), default=0))
        if not digest:
            self._copy_in(items)
            return None
        if _small(items):  # not worth a hand-off: hashed in line, still in the CPU's cache
            self._copy_in(items)
            return [block_digest(view) for _i, _o, view in items]
        with _Digests(self._pool) as digests:
            for group in _groups(items):
                digests.start([view for _i, _o, view in group])
                self._copy_in(group)
        return digests.result()

    def _copy_in(self, items: list[Item]) -> None:
        # No alias check here: slots are page-aligned, so only a source that starts in the last
        # 32 bytes of a page is slow, and the check would cost more than it saves (measured
        # +40% per 16 KiB block). Writable sources that follow one another into slots that
        # follow one another are copied as one run (``_runs``); read-only ones (bytes) block by
        # block, numpy finding their address.
        arena, base = self._arena(), self._base
        if not any(view.readonly for _i, _o, view in items):
            for src, offset, n, lo, hi in _runs(items):
                if hi - lo == 1 and n < NOGIL_BYTES:
                    arena[offset : offset + n] = items[lo][2]
                else:
                    ctypes.memmove(base + offset, src, n)
            return
        for _index, offset, view in items:
            n = len(view)
            if n < NOGIL_BYTES:
                arena[offset : offset + n] = view
            else:
                _vector_copy(arena[offset : offset + n], view, plain=True)

    def read(self, job_id: int, items: list[Item], digests: Sequence[int] = ()) -> list[int]:
        """With ``digests``: each group of slots is hashed on the helper thread while this
        thread copies the same group out (``_Digests``)."""
        if not digests:
            self._copy_out(items)
            return []
        if _small(items):  # not worth a hand-off: the copies hashed in line
            self._copy_out(items)
            return [
                k
                for k, (d, (_i, _o, view)) in enumerate(zip(digests, items, strict=True))
                if d and d != block_digest(view)
            ]
        arena = self._arena()
        with _Digests(self._pool) as got:
            for group in _groups(items):
                got.start([arena[off : off + len(view)] for _i, off, view in group])
                self._copy_out(group)
        return [k for k, (d, g) in enumerate(zip(digests, got.result(), strict=True)) if d and d != g]

    def store_hashed(
        self, offsets: Sequence[int], nbytes: int, copy: Callable[[int, int], None]
    ) -> list[int]:
        """The digests of the slots at ``offsets`` as ``copy(lo, hi)`` (a mover gathering an
        engine's blocks into slots ``offsets[lo:hi]``) fills them, one group of about
        ``HASH_GROUP_BYTES`` at a time: each group is hashed on the helper thread while the
        next one is copied (the bytes are in the slots only once a copy returns)."""
        arena = self._arena()
        self._writable(max(offsets, default=-nbytes) + nbytes)
        per = max(1, HASH_GROUP_BYTES // max(1, nbytes))
        with _Digests(self._pool) as digests:
            for lo in range(0, len(offsets), per):
                hi = min(len(offsets), lo + per)
                copy(lo, hi)
                digests.start([arena[off : off + nbytes] for off in offsets[lo:hi]])
        return digests.result()

    def check_slots(
        self, offsets: Sequence[int], nbytes: int, digests: Sequence[int], copy: Callable[[], None]
    ) -> list[int]:
        """Run ``copy`` (a mover reading the slots at ``offsets`` into an engine's layout, or
        the daemon's CUDA copy of them) while the helper thread hashes the same slots; the
        positions whose slot did not match its digest (0: not checked)."""
        arena = self._arena()
        views = [arena[off : off + nbytes] for off in offsets]
        per = max(1, HASH_GROUP_BYTES // max(1, nbytes))
        with _Digests(self._pool) as got:
            for i in range(0, len(views), per):
                got.start(views[i : i + per])
            copy()
        return [k for k, (d, g) in enumerate(zip(digests, got.result(), strict=True)) if d and d != g]

    def _copy_out(self, items: list[Item]) -> None:
        """One copy per run of slots that follow one another into buffers that follow one
        another (``_runs``: a get_into of one batch buffer is a single run per slab); a run
        shorter than ``ALIAS_STOP_BYTES`` whose destination aliases its source (module
        docstring) goes block by block through numpy's loop instead."""
        arena, base = self._arena(), self._base
        memmove = ctypes.memmove
        for dst, offset, n, lo, hi in _runs(items):
            if hi - lo == 1 and n < NOGIL_BYTES and not _aliased(dst - base - offset, n):
                items[lo][2][:] = arena[offset : offset + n]
            elif _aliased(dst - base - offset, n):
                for _index, off, view in items[lo:hi]:
                    _vector_copy(view, arena[off : off + len(view)])
            else:
                memmove(dst, base + offset, n)

    @property
    def _pool(self) -> ThreadPoolExecutor:
        """The thread that hashes copied blocks while the next ones are copied (made on first
        use; one per transport)."""
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-digest")
        return self._hash_pool

    def mover(self, device: Any) -> Any:
        """An ``ArenaMover`` between tensors on ``device`` and this arena (made once per device;
        on CUDA this registers the mapping with ``cudaHostRegister``). Imports torch."""
        key = str(device)
        if key not in self._movers:
            from kvtier.direct import ArenaMover

            pinned = any(getattr(m, "registered", None) for m in self._movers.values())
            self._movers[key] = ArenaMover(
                self._arena(), device, register=not pinned, writable_bytes=self.writable_bytes
            )
        return self._movers[key]

    def _writable(self, end: int) -> None:
        """Slots ending by ``end`` lie in the session's own arena (the daemon never hands a
        store another: a group's is mapped read-only, and writing it would fault)."""
        if end > self.writable_bytes:
            raise TransportError(
                f"a slot ends at {end}, past the session's own arena ({self.writable_bytes} bytes)"
            )

    def _arena(self) -> memoryview:
        if self._view is None:
            raise TransportError("shm transport is not attached")
        return self._view

    def close(self) -> None:
        if self._hash_pool is not None:  # (idle: a transfer waits for its hashes)
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        for mover in self._movers.values():  # a mover's staging may not outlive the mapping
            mover.close()
        self._movers.clear()
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

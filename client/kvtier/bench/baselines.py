"""Reference figures measured beside kvtier in the same run, on the same byte counts.

* ``memcpy``: single-thread ``numpy.copyto`` of each block into a preallocated batch buffer.
* ``socket``: a raw loopback TCP stream to a second process: ``sendall`` of each block here,
  ``recv_into`` of each block into a preallocated batch buffer there, timed until the receiver
  acknowledges the last byte (default buffer sizes, TCP_NODELAY as kvtier's channel has).
* ``redis_set`` / ``redis_get``: redis-py pipelines of SET / GET, one pipeline per batch.

Each returns ``Op``s (``plan.Op``) that the driver runs interleaved with kvtier's own.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import numpy as np

from kvtier.bench.plan import Op, Plan, size_label

_CMD = struct.Struct("<QQ")  # block bytes, total bytes (0, 0 = stop)


def block_views(buf: np.ndarray, block: int, n: int) -> list[memoryview]:
    """``n`` consecutive ``block``-byte views over ``buf``'s memory."""
    mv = buf.data.cast("B")
    return [mv[i * block : (i + 1) * block] for i in range(n)]


def random_batch(plan: Plan, block: int, seed: int = 0) -> np.ndarray:
    n = plan.blocks_per_batch(block) * block
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


# -- memcpy ----------------------------------------------------------------------------------------

def memcpy_ops(plan: Plan, block: int) -> list[Op]:
    n = plan.blocks_per_batch(block)
    src, dst = random_batch(plan, block), np.empty(n * block, dtype=np.uint8)
    pairs = [(dst[i * block : (i + 1) * block], src[i * block : (i + 1) * block]) for i in range(n)]
    batches, copyto = plan.batches(block), np.copyto

    def run() -> None:
        for _ in range(batches):
            for d, s in pairs:
                copyto(d, s)

    def check() -> None:
        assert np.array_equal(src, dst), "memcpy copied other bytes"

    return [Op("memcpy", f"memcpy {size_label(block)}", run, check)]


# -- raw loopback TCP stream -----------------------------------------------------------------------

def _sink(conn: Connection) -> None:
    """Child process: accept one stream, then per command receive its bytes and ack them."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        conn.send(ls.getsockname()[1])
        s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs: dict[int, list[memoryview]] = {}
    with s:
        cmd = bytearray(_CMD.size)
        while recv_exact(s, memoryview(cmd)):
            block, total = _CMD.unpack(cmd)
            if block == 0:
                return
            views = bufs.get(block)
            if views is None:
                n = max(1, min(total, 64 << 20) // block)
                views = bufs[block] = block_views(np.zeros(n * block, np.uint8), block, n)
            for i in range(total // block):
                recv_exact(s, views[i % len(views)])
            s.sendall(b"k")


def recv_exact(s: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``s``; False at end of stream."""
    got, n = 0, len(view)
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


class SocketStream:
    """A receiver process and one loopback connection to it; ``ops(block)`` streams to it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sink, args=(child,), daemon=True,
                                 name="kvtier-bench-sink")
        self._sock: socket.socket | None = None

    def __enter__(self) -> SocketStream:
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", self._conn.recv()))
        # No Nagle: the last segment of a sample must not wait for a delayed ACK (as in kvtier).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(_CMD.pack(0, 0))
            except OSError:
                pass
            self._sock.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def ops(self, plan: Plan, block: int) -> list[Op]:
        s = self._sock
        assert s is not None, "use SocketStream as a context manager"
        views = block_views(random_batch(plan, block), block, plan.blocks_per_batch(block))
        total, batches, ack = plan.sample_bytes(block), plan.batches(block), bytearray(1)

        def run() -> None:
            s.sendall(_CMD.pack(block, total))
            for _ in range(batches):
                for v in views:
                    s.sendall(v)
            if not recv_exact(s, memoryview(ack)):
                raise RuntimeError("socket sink went away")

        return [Op("socket", f"socket stream {size_label(block)}", run)]


# -- Redis -----------------------------------------------------------------------------------------

def redis_ops(plan: Plan, port: int, block: int) -> list[Op]:
    """SET then GET of the same blocks through redis-py pipelines (one per batch)."""
    import redis  # optional (the 'bench' extra); imported only when Redis is compared

    r: Any = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
    r.flushall()
    n = plan.blocks_per_batch(block)
    src = random_batch(plan, block)
    views = block_views(src, block, n)
    names = [[f"kvb:{block}:{j}:{i}".encode() for i in range(n)]
             for j in range(plan.batches(block))]
    got: list[bytes] = []

    def put() -> None:
        for batch in names:
            pipe = r.pipeline(transaction=False)
            for key, v in zip(batch, views, strict=True):
                pipe.set(key, v)
            pipe.execute()

    def get() -> None:
        for batch in names:
            pipe = r.pipeline(transaction=False)
            for key in batch:
                pipe.get(key)
            got[:] = pipe.execute()

    def check() -> None:
        assert b"".join(got) == src.tobytes(), "Redis GET returned other bytes than were SET"

    label = size_label(block)
    return [Op("redis_set", f"redis SET {label}", put),
            Op("redis_get", f"redis GET {label}", get, check)]

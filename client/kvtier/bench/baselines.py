"""Reference figures measured beside kvtier in the same run, on the same bytes and the same
amount of distinct memory, of the same kind.

A kvtier path touches, per sample, one ``batch_bytes`` buffer on the engine's side (put's source,
get_into's destination, reused for every batch) and ``sample_bytes`` of distinct memory on the
daemon's side (the fresh slots a put fills, the slots of the latest put that a get reads). Every
baseline touches the same, so that none copies from or into memory a cache still holds while
the kvtier path it is held against cannot (docs/benchmarks.md §13). Each ``Op.touches`` says how
many distinct bytes it reads and writes per sample.

The memory is of the same kind on both sides too (``bench.memory``): the engine's side is an
``engine_buffer`` (page-aligned, prefaulted), kvtier's paths using the same (bench.transfers);
the daemon's side of a memcpy is ``arena_memory`` (a memfd mapped shared, 4 KiB pages, as the
arena); ``bench.memory`` says why.

* ``memcpy_put``: single-thread ``numpy.copyto`` of each block of one batch into the next block
  of a ``sample_bytes`` destination (as put); ``memcpy_get``: each block of a ``sample_bytes``
  source into one batch buffer (as get_into, and as get, which reuses one batch buffer when
  the caller has dropped the previous get's blocks: kvtier.get_buffers).
* ``socket_put`` / ``socket_get``: a raw loopback TCP stream between this process and a second
  one (default buffer sizes, TCP_NODELAY on both ends as kvtier's channel has). ``socket_put``:
  this process ``sendall``s each block of one batch, the sink ``recv_into``s the blocks into
  ``sample_bytes`` of distinct memory and acknowledges the last byte. ``socket_get``: the sink
  ``sendall``s ``sample_bytes`` of distinct memory, this process ``recv_into``s it into one batch.
  The sink reports the distinct bytes it touched, and a run fails unless they are the sample's.
* ``redis_set`` / ``redis_get``: redis-py with the hiredis parser, one pipeline per batch. Every
  SET sample writes keys never written before (so redis-server allocates every value, as
  the daemon fills fresh slots); GET reads the keys of the latest SET.

Each returns ``Op``s (``plan.Op``) that the driver runs interleaved with kvtier's own.
"""

from __future__ import annotations

import functools
import itertools
import multiprocessing as mp
import socket
import struct
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import numpy as np

from kvtier.bench.memory import arena_memory, engine_batch, engine_buffer
from kvtier.bench.plan import Op, Plan, Touches, size_label

_CMD = struct.Struct("<QQQ")  # mode, block bytes, total bytes (mode 0 = stop)
_RECV, _SEND = 1, 2  # the sink receives (as the daemon in a put) / sends (as in a get)
_COUNT = struct.Struct("<Q")  # the sink's report: distinct bytes it touched for the command


def block_views(buf: np.ndarray, block: int, n: int) -> list[memoryview]:
    """``n`` consecutive ``block``-byte views over ``buf``'s memory."""
    mv = buf.data.cast("B")
    return [mv[i * block : (i + 1) * block] for i in range(n)]


def random_batch(plan: Plan, block: int, seed: int = 0) -> np.ndarray:
    n = plan.blocks_per_batch(block) * block
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def prefaulted(nbytes: int, fill: int = 0x5A) -> np.ndarray:
    """``nbytes`` of memory with every page written once (no page fault inside a timed run)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(fill)
    return buf


def distinct_bytes(views: list[memoryview]) -> int:
    """Bytes of distinct memory that ``views`` cover (views that start at one address count
    once; the views of one list never overlap otherwise)."""
    seen: dict[int, int] = {}
    for v in views:
        addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
        seen[addr] = max(seen.get(addr, 0), v.nbytes)
    return sum(seen.values())


# -- memcpy ----------------------------------------------------------------------------------------


def memcpy_ops(plan: Plan, block: int) -> list[Op]:
    """memcpy as put (one batch into fresh memory) and as get_into (distinct memory into one
    batch), each over ``plan.sample_bytes(block)`` bytes per sample."""
    batch = engine_batch(plan, block)
    return [_memcpy_put(plan, block, batch), _memcpy_get(plan, block, batch)]


def _memcpy_put(plan: Plan, block: int, batch: Any) -> Op:
    """put: the batch's blocks, batch after batch, into consecutive blocks of a sample-sized
    area."""
    n, batches = plan.blocks_per_batch(block), plan.batches(block)
    batch_views = block_views(batch, block, n)
    copyto = np.copyto
    fresh = arena_memory(plan.sample_bytes(block))
    fresh_views = block_views(fresh, block, n * batches)
    put_src = [batch_views[i % n] for i in range(n * batches)]
    put_pairs = [
        (np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))
        for d, s in zip(fresh_views, put_src, strict=True)
    ]

    def run_put() -> None:
        for d, s in put_pairs:
            copyto(d, s)

    def check_put() -> None:
        for j in range(batches):
            assert np.array_equal(fresh[j * n * block : (j + 1) * n * block], batch), (
                f"memcpy (as put) left batch {j} of the destination other than the source"
            )

    return Op(
        "memcpy_put",
        f"memcpy as put {size_label(block)}",
        run_put,
        check_put,
        Touches(src=distinct_bytes(put_src), dst=distinct_bytes(fresh_views)),
    )


def _memcpy_get(plan: Plan, block: int, batch: Any) -> Op:
    """get: a sample-sized area whose batches all differ, block by block into one batch
    buffer."""
    n, batches = plan.blocks_per_batch(block), plan.batches(block)
    copyto = np.copyto
    stored = arena_memory(plan.sample_bytes(block))
    for j in range(batches):
        np.bitwise_xor(batch, j & 0xFF, out=stored[j * n * block : (j + 1) * n * block])
    stored_views = block_views(stored, block, n * batches)
    dst = engine_buffer(n * block)
    dst_views = block_views(dst, block, n)
    get_dst = [dst_views[i % n] for i in range(n * batches)]
    get_pairs = [
        (np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))
        for d, s in zip(get_dst, stored_views, strict=True)
    ]

    def run_get() -> None:
        for d, s in get_pairs:
            copyto(d, s)

    def check_get() -> None:
        assert np.array_equal(dst, stored[(batches - 1) * n * block :]), (
            "memcpy (as get) copied other bytes than the last batch"
        )

    return Op(
        "memcpy_get",
        f"memcpy as get {size_label(block)}",
        run_get,
        check_get,
        Touches(src=distinct_bytes(stored_views), dst=distinct_bytes(get_dst)),
    )


# -- raw loopback TCP stream -----------------------------------------------------------------------


def _sink(conn: Connection) -> None:
    """Child process: accept one stream, then per command receive ``total`` bytes into (or send
    them from) ``total`` bytes of distinct, prefaulted memory, and report the distinct bytes
    touched."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        conn.send(ls.getsockname()[1])
        s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    area = np.empty(0, np.uint8)
    views: dict[tuple[int, int], list[memoryview]] = {}
    with s:
        cmd = bytearray(_CMD.size)
        while recv_exact(s, memoryview(cmd)):
            mode, block, total = _CMD.unpack(cmd)
            if mode == 0:
                return
            if total > area.nbytes:  # one area, as large as the largest sample
                views.clear()
                area = prefaulted(total)
            vs = views.get((block, total))
            if vs is None:
                vs = views[(block, total)] = block_views(area, block, total // block)
            if mode == _RECV:
                for v in vs:
                    recv_exact(s, v)
            else:
                for v in vs:
                    s.sendall(v)
            s.sendall(_COUNT.pack(distinct_bytes(vs)))


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
    """A sink process and one loopback connection to it; ``ops(block)`` streams to and from it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sink, args=(child,), daemon=True, name="kvtier-bench-sink")
        self._sock: socket.socket | None = None

    def __enter__(self) -> SocketStream:
        self._proc.start()
        self._sock = socket.create_connection(("127.0.0.1", self._conn.recv()))
        # No Nagle: the last segment of a sample must not wait for a delayed ACK (as in kvtier).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._sock is not None:
            try:
                self._sock.sendall(_CMD.pack(0, 0, 0))
            except OSError:
                pass
            self._sock.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def ops(self, plan: Plan, block: int) -> list[Op]:
        """``socket_put`` (one batch here into fresh memory there) and ``socket_get`` (distinct
        memory there into one batch here)."""
        s = self._sock
        assert s is not None, "use SocketStream as a context manager"
        n, batches = plan.blocks_per_batch(block), plan.batches(block)
        total = plan.sample_bytes(block)
        views = block_views(engine_batch(plan, block), block, n)
        send_views = [views[i % n] for i in range(n * batches)]
        dst_views = block_views(engine_buffer(n * block), block, n)
        recv_views = [dst_views[i % n] for i in range(n * batches)]
        count = bytearray(_COUNT.size)
        put = functools.partial(_stream_put, s, block, total, send_views, count)
        get = functools.partial(_stream_get, s, block, total, recv_views, count)
        label = size_label(block)
        return [
            Op(
                "socket_put",
                f"socket as put {label}",
                put,
                touches=Touches(src=distinct_bytes(send_views), dst=total),
            ),
            Op(
                "socket_get",
                f"socket as get {label}",
                get,
                touches=Touches(src=total, dst=distinct_bytes(recv_views)),
            ),
        ]


def _stream_put(s: socket.socket, block: int, total: int, views: list[memoryview], count: bytearray) -> None:
    """One ``socket_put`` sample: the sink receives ``total`` bytes, sent from ``views``."""
    s.sendall(_CMD.pack(_RECV, block, total))
    for v in views:
        s.sendall(v)
    _sink_count(s, total, count)


def _stream_get(s: socket.socket, block: int, total: int, views: list[memoryview], count: bytearray) -> None:
    """One ``socket_get`` sample: the sink sends ``total`` bytes, received into ``views``."""
    s.sendall(_CMD.pack(_SEND, block, total))
    for v in views:
        if not recv_exact(s, v):
            raise RuntimeError("socket sink went away")
    _sink_count(s, total, count)


def _sink_count(s: socket.socket, total: int, count: bytearray) -> None:
    """Read the sink's report into ``count``; RuntimeError unless it touched ``total`` distinct bytes."""
    if not recv_exact(s, memoryview(count)):
        raise RuntimeError("socket sink went away")
    touched = _COUNT.unpack(count)[0]
    if touched != total:
        raise RuntimeError(f"socket sink touched {touched} distinct bytes, not {total}")


# -- Redis -----------------------------------------------------------------------------------------


def redis_client(port: int) -> Any:
    """A redis-py client that parses replies with hiredis (RuntimeError without it: redis-py's
    own parser halves GET throughput and would make a poor baseline)."""
    import redis  # optional (the 'bench' extra); imported only when Redis is compared
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        raise RuntimeError(
            "hiredis is not installed (the kvtier wheel's bench extra; in a checkout: "
            "pip install -e '.[bench]')"
        )
    from redis._parsers import _HiredisParser

    pool = redis.ConnectionPool(host="127.0.0.1", port=port, socket_timeout=120, parser_class=_HiredisParser)
    return redis.Redis(connection_pool=pool)


def _redis_set(r: Any, batches: list[list[bytes]], views: list[Any]) -> None:
    """SET each batch of keys to ``views``, one pipeline per batch."""
    for batch in batches:
        pipe = r.pipeline(transaction=False)
        for key, v in zip(batch, views, strict=True):
            pipe.set(key, v)
        pipe.execute()


def _redis_get(r: Any, batches: list[list[bytes]], got: list[bytes | None]) -> None:
    """GET each batch of keys, one pipeline per batch; ``got``: the last batch's values."""
    for batch in batches:
        pipe = r.pipeline(transaction=False)
        for key in batch:
            pipe.get(key)
        got[:] = pipe.execute()
        if any(g is None for g in got):
            raise RuntimeError("Redis GET missed keys that were just SET")


def redis_ops(plan: Plan, port: int, block: int) -> list[Op]:
    """SET of fresh keys, then GET of those keys, through pipelines (one per batch)."""
    r = redis_client(port)
    r.flushall()
    n, batches = plan.blocks_per_batch(block), plan.batches(block)
    src = random_batch(plan, block)
    views = block_views(src, block, n)
    samples = itertools.count()

    def names(sample: int) -> list[list[bytes]]:
        return [[f"kvb:{block}:{sample}:{j}:{i}".encode() for i in range(n)] for j in range(batches)]

    # Keys of the warm-up and of every round, made now so that no timed SET pays for them.
    pending = [names(next(samples)) for _ in range(plan.repeat + 1)]
    current: list[list[bytes]] = []
    got: list[bytes | None] = []

    def put() -> None:
        current[:] = pending.pop(0) if pending else names(next(samples))
        _redis_set(r, current, views)

    def get() -> None:
        _redis_get(r, current, got)

    def check() -> None:
        assert b"".join(g or b"" for g in got) == src.tobytes(), (
            "Redis GET returned other bytes than were SET"
        )

    label = size_label(block)
    total = plan.sample_bytes(block)
    return [
        Op("redis_set", f"redis SET {label}", put, touches=Touches(src=distinct_bytes(views), dst=total)),
        Op("redis_get", f"redis GET {label}", get, check, touches=Touches(src=total, dst=total)),
    ]

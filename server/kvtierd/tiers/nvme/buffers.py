"""Scatter/gather lists of the NVMe tier's disk seam: the buffer types its calls take and the
arithmetic over a list of them (its byte count; what is left after a short transfer).

Role: what :mod:`kvtierd.tiers.nvme.device` (which re-exports ``Buffer`` and ``WBuffer``) loops
over in ``preadv`` / ``pwritev``; no I/O here (every disk system call stays in ``device``).
Ownership: pure functions over the caller's buffers, which they never copy. Concurrency: any
thread.
"""

from __future__ import annotations

from collections.abc import Sequence

Buffer = memoryview | bytes | bytearray
WBuffer = memoryview | bytearray


def nbytes(views: Sequence[Buffer]) -> int:
    """The bytes of ``views`` in all."""
    return sum(memoryview(v).nbytes for v in views)


def advance(views: Sequence[Buffer], n: int) -> list[memoryview]:
    """The part of ``views`` after its first ``n`` bytes."""
    out: list[memoryview] = []
    for v in views:
        m = memoryview(v).cast("B")
        if n >= m.nbytes:
            n -= m.nbytes
            continue
        out.append(m[n:])
        n = 0
    return out

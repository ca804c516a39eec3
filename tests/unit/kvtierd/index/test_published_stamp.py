"""The published index's stamp is read whole or not at all (issue 41): one lookup in 100,000 to
200,000 read it as 0 while the daemon rewrote it (``struct.pack_into`` zero-fills its 8 bytes,
then writes them one by one; the reader read them one by one too), took the index for stale and
went over gRPC.

The writer (kvtierd.index.segment) restamps as fast as it can in this process while a reader
(kvtier.local_index, the client's Segment) in another process reads the stamp; a torn read is a
value the writer never wrote. Bounded: the reader reads a fixed count, the writer writes until
the reader has answered; no sleeps.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import select
import subprocess
import sys
import time

from kvtier.local_index import Segment as ReaderSegment
from kvtier_contract import published_index as pi
from kvtierd.index.entry import NamespaceState
from kvtierd.index.published import Publishers

# Two stamps that differ in every byte, neither 0: any mix of the two, or a zero-filled word,
# is a value never written.
A, B = 0x0102_0304_0506_0708, 0x7F6E_5D4C_3B2A_1908
READS = 300_000

READER = f"""
import mmap, os, sys, time
from kvtier.local_index import Segment
fd, size, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
seg = Segment(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), time.monotonic)
torn, first, read = 0, None, seg.stamp_ns
for _ in range({READS}):
    stamp, _retired = read()
    if stamp != {A} and stamp != {B}:
        torn += 1
        first = stamp if first is None else first
os.write(out, f"{{torn}} {{first}}".encode())
"""


def _segment_fd() -> tuple[Publishers, NamespaceState, int, int]:
    ns, pubs = NamespaceState(7, None, 4096, 4096), Publishers(boot_epoch=3)  # type: ignore[arg-type]
    ns.ready[hashlib.sha256(b"k").digest()] = object()
    fd, size, _gen = pubs.handout(ns)
    return pubs, ns, fd, size


def test_a_reader_never_sees_a_torn_or_zero_stamp_while_the_daemon_restamps() -> None:
    pubs, ns, fd, size = _segment_fd()
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    assert seg is not None
    seg.stamp(A)
    r, w = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", READER, str(fd), str(size), str(w)], pass_fds=(fd, w))
    os.close(w)
    os.close(fd)
    try:
        writes, answer = 0, b""
        while not answer:  # restamp until the reader has done its reads and answered
            for _ in range(2_000):
                seg.stamp(B)
                seg.stamp(A)
            writes += 4_000
            if select.select([r], [], [], 0)[0]:
                answer = os.read(r, 100)
                if not answer:
                    raise AssertionError(f"the reader died: rc {reader.wait()}")
        torn, first = answer.decode().split()
        assert torn == "0", f"{torn} torn stamps in {READS} reads (first: {first}) over {writes} writes"
        assert reader.wait() == 0
    finally:
        os.close(r)
        if reader.poll() is None:
            reader.kill()
            reader.wait()
        pubs.close()


def test_the_stamp_and_retired_words_are_where_the_header_says() -> None:
    """The words the reader loads are the header's stamp and retired fields, as ``struct``
    lays them out (the layout the contract documents)."""
    pubs, ns, fd, size = _segment_fd()
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    reader = ReaderSegment(m, time.monotonic)
    seg = ns.ready.publisher.segment  # type: ignore[union-attr]
    assert seg is not None
    seg.stamp(A)
    assert reader.stamp_ns() == (A, False) == (pi.STAMP_RETIRED.unpack_from(m, pi.STAMP_OFFSET)[0], False)
    assert pi.HEADER.unpack_from(m, 0)[-2:] == (A, 0)
    seg.stamp(B, retired=True)
    assert reader.stamp_ns() == (B, True) and pi.HEADER.unpack_from(m, 0)[-2:] == (B, 1)
    assert reader.state(time.monotonic()) == "retired"
    pubs.close()

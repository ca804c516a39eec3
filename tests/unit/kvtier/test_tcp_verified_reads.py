"""A verified tcp read hashes each piece as it lands: the same digests as hashing each block
whole, the same bytes, and exactly the corrupt blocks reported, whatever the block sizes and
however the kernel splits the stream."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvtier.transports import tcp
from kvtier_contract.digests import block_digest

SIZES = [1, 4096, (256 << 10) - 3, 256 << 10, (256 << 10) + 5, 1 << 20, (3 << 20) + 17, 4096]


def received(blocks: list[bytes], digests: list[int], drip: int = 0) -> tuple[list[bytearray], list[int]]:
    """``blocks`` sent over a socket pair (in ``drip``-byte writes when set) and read with
    ``_recv_checked``: (what arrived, the positions it reported)."""
    a, b = socket.socketpair()
    payload = b"".join(blocks)

    def send() -> None:
        step = drip or len(payload)
        for i in range(0, len(payload), step):
            a.sendall(payload[i : i + step])

    t = threading.Thread(target=send)
    t.start()
    bufs = [bytearray(len(x)) for x in blocks]
    try:
        bad = tcp._recv_checked(b, [memoryview(x) for x in bufs], digests)
    finally:
        t.join()
        a.close()
        b.close()
    return bufs, bad


@pytest.mark.parametrize("drip", [0, 7919, 300_000])
def test_the_pieces_hash_to_each_blocks_digest(drip: int) -> None:
    blocks = [os.urandom(n) for n in SIZES]
    bufs, bad = received(blocks, [block_digest(x) for x in blocks], drip)
    assert bufs == [bytearray(x) for x in blocks]
    assert bad == []


def test_exactly_the_corrupt_blocks_are_reported_and_unchecked_ones_are_not() -> None:
    blocks = [os.urandom(n) for n in SIZES]
    digests = [block_digest(x) for x in blocks]
    digests[2] ^= 1  # a block whose bytes differ from its digest
    digests[4] ^= 1 << 63
    digests[6] = 0  # not checked (no digest known)
    bufs, bad = received(blocks, digests, 65536)
    assert bufs == [bytearray(x) for x in blocks]
    assert bad == [2, 4]


def test_a_closed_stream_is_a_transport_error() -> None:
    blocks = [os.urandom(1 << 20)]
    a, b = socket.socketpair()
    a.sendall(blocks[0][:1000])
    a.close()
    with pytest.raises(tcp.TransportError, match="closed"):
        tcp._recv_checked(b, [memoryview(bytearray(1 << 20))], [block_digest(blocks[0])])
    b.close()

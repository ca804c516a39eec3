"""The cluster tier's read path parser (kvtierd.tiers.cluster.bulk), fed byte streams cut at
every kind of boundary: payloads land in their destination views, everything else is parsed
from the scratch buffer, and no byte is ever written outside the destination asked for.

Against a real cluster (TLS, AUTH, errors): tests/integration/cluster/test_cluster_tier.py.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from redis.exceptions import ResponseError

from kvtierd.tiers.cluster.bulk import ProtocolFault, WrongSize, _Replies
from kvtierd.tiers.cluster.format import HEADER_BYTES, encode_header
from kvtierd.tiers.cluster.keys import FleetKeys

DIGEST = hashlib.sha256(b"ns").digest()
REALM = FleetKeys(hashlib.sha256(b"fleet").digest()).untenanted("tests")
N = 4096  # payload bytes


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def value(i: int) -> tuple[bytes, bytes]:
    key = hashlib.sha256(b"%d" % i).digest()
    payload = hashlib.shake_256(b"p%d" % i).digest(N)
    return encode_header(REALM, DIGEST, key, payload), payload


def stream() -> tuple[bytes, list[bytes], list[bytes]]:
    """Replies: value 0, nil, value 2, an error, a value of another size, value 5."""
    h0, p0 = value(0)
    h2, p2 = value(2)
    h5, p5 = value(5)
    bulk = lambda h, p: b"$%d\r\n%s%s\r\n" % (HEADER_BYTES + len(p), h, p)  # noqa: E731
    data = (
        bulk(h0, p0)
        + b"$-1\r\n"
        + bulk(h2, p2)
        + b"-MOVED 3999 127.0.0.1:7001\r\n"
        + b"$10\r\n0123456789\r\n"
        + bulk(h5, p5)
    )
    return data, [h0, h2, h5], [p0, p2, p5]


def feed(proto: _Replies, data: bytes, cut: int) -> None:
    """Deliver ``data`` as the transport would, at most ``cut`` bytes per read."""
    pos = 0
    while pos < len(data):
        buf = proto.get_buffer(-1)
        n = min(cut, len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        proto.buffer_updated(n)
        pos += n


@pytest.mark.parametrize("cut", [1, 2, 7, 127, 128, 129, 4097, 4200, 1 << 20])
def test_replies_cut_anywhere_are_parsed_and_payloads_land_in_their_slots(cut: int) -> None:
    async def run() -> None:
        data, headers, payloads = stream()
        proto = _Replies()
        proto.connection_made(FakeTransport())  # type: ignore[arg-type]
        arena = bytearray(b"\xee" * (6 * (N + 64)))
        dests = [memoryview(arena)[i * (N + 64) : i * (N + 64) + N] for i in range(6)]
        done = asyncio.get_running_loop().create_future()
        proto.expect(6, dests, N, done)
        feed(proto, data, cut)
        assert done.done() and done.exception() is None
        r = proto.results
        assert r[0] == headers[0] and r[2] == headers[1] and r[5] == headers[2]
        assert r[1] is None
        assert isinstance(r[3], ResponseError) and "MOVED" in str(r[3])
        assert isinstance(r[4], WrongSize) and r[4].length == 10
        assert bytes(dests[0]) == payloads[0] and bytes(dests[2]) == payloads[1]
        assert bytes(dests[5]) == payloads[2]
        for i in (1, 3, 4):  # nothing written where no value of ours arrived
            assert bytes(dests[i]) == b"\xee" * N
        for i in range(6):  # nor between the slots
            gap = arena[i * (N + 64) + N : (i + 1) * (N + 64)]
            assert bytes(gap) == b"\xee" * 64

    asyncio.run(run())


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"?what\r\n", "unexpected reply"),
        (b"$abc\r\n", "bad bulk length"),
        (b"x" * 5000, "reply line too long"),
    ],
)
def test_garbage_fails_the_request_and_aborts_the_connection(data: bytes, why: str) -> None:
    async def run() -> None:
        proto = _Replies()
        t = FakeTransport()
        proto.connection_made(t)  # type: ignore[arg-type]
        done: Any = asyncio.get_running_loop().create_future()
        proto.expect(1, [memoryview(bytearray(N))], N, done)
        feed(proto, data, 1 << 20)
        assert isinstance(done.exception(), ProtocolFault) and why in str(done.exception())
        assert t.aborted

    asyncio.run(run())


def test_a_value_not_followed_by_crlf_is_a_protocol_fault() -> None:
    async def run() -> None:
        h, p = value(1)
        proto = _Replies()
        t = FakeTransport()
        proto.connection_made(t)  # type: ignore[arg-type]
        done: Any = asyncio.get_running_loop().create_future()
        proto.expect(1, [memoryview(bytearray(N))], N, done)
        feed(proto, b"$%d\r\n%s%sXY" % (HEADER_BYTES + N, h, p), 1 << 20)
        assert isinstance(done.exception(), ProtocolFault) and t.aborted

    asyncio.run(run())


def test_bytes_after_the_last_reply_break_the_connection() -> None:
    async def run() -> None:
        proto = _Replies()
        t = FakeTransport()
        proto.connection_made(t)  # type: ignore[arg-type]
        done: Any = asyncio.get_running_loop().create_future()
        proto.expect(1, [memoryview(bytearray(N))], N, done)
        feed(proto, b"$-1\r\n+OK\r\n", 1 << 20)
        assert done.result() is None and proto.results == [None]
        assert t.aborted  # the stray reply would be taken for the next request's

    asyncio.run(run())

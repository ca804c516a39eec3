"""Pipelined GETs whose payloads land straight in host slots: the cluster tier's read path.

redis-py hands a value over as a ``bytes`` object after copying it several times (socket
buffer, stream buffer, parser, result); for a block that is then verified and copied again into
a host slot, that is most of an import's CPU (docs/benchmarks.md §16). Here one RESP2 connection
per master (``BulkConnection``, beside redis-py's, which keeps every other command) reads the
replies of ``GET k1 … kn`` with an ``asyncio.BufferedProtocol``: a value of the expected size
has its 128-byte header read into a small buffer and its payload received by the kernel directly
into the destination view; anything else (nil, an error reply such as ``MOVED``, a value of
another size) is parsed from a scratch buffer. The caller verifies header and payload afterwards
(kvtierd.tiers.cluster.format.verify_parts): a slot is entered into the index only then.

``get_into(rkeys, dests, payload_len, timeout)`` -> one result per key: a 128-byte header
(``bytes``: the payload is in its dest), ``None`` (absent), :class:`WrongSize` (a value of
another length: discarded, never copied) or a ``redis.exceptions.ResponseError`` (an error
reply). A timeout, a protocol error or a closed connection raises (the node's breaker decides);
the connection is then aborted before the call returns, so no byte is written into ``dests``
afterwards. AUTH (user, password) and TLS (a CA, a client certificate) as configured.

Concurrency: the cluster tier's loop only; one request at a time per connection (a lock).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, cast

from redis.exceptions import ResponseError

from kvtierd.tiers.cluster.format import HEADER_BYTES
from kvtierd.tiers.cluster.settings import Credentials

SCRATCH_BYTES = 64 << 10
MAX_LINE = 4096  # a reply line longer than this is a protocol error


class WrongSize:
    """A value of another length than asked for (its bytes were discarded)."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length


class ProtocolFault(ConnectionError):
    """The server sent something a RESP2 reply to our commands cannot be."""


LINE, HEADER, PAYLOAD, TAIL, DISCARD = range(5)


class _Replies(asyncio.BufferedProtocol):
    """Parses the replies of one request at a time; see the module docstring. Reply ``i`` of a
    request goes to ``dests[i]`` (``i`` = replies recorded so far)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(SCRATCH_BYTES)
        self._pending = bytearray()  # received into the scratch buffer, not parsed yet
        self._dests: list[memoryview] = []
        self._payload_len = 0
        self.results: list[Any] = []
        self._want = 0
        self._done: asyncio.Future[None] | None = None
        self._state = LINE
        self._header = bytearray()
        self._pos = 0  # payload bytes of the current value received
        self._left = 0  # TAIL / DISCARD: bytes still to skip
        self._wrong = 0  # DISCARD: the value's length
        self._into_dest = False  # the buffer handed out last is the current dest

    def expect(self, n: int, dests: list[memoryview], payload_len: int, done: asyncio.Future[None]) -> None:
        """Start a request of ``n`` replies (the connection is idle)."""
        self._want, self._dests, self._payload_len, self._done = n, dests, payload_len, done
        self.results = []
        self._state = LINE
        if n == 0:
            done.set_result(None)

    # -- asyncio.BufferedProtocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == PAYLOAD and not self._pending:
            self._into_dest = True  # the kernel writes the payload into the slot itself
            return self._dests[len(self.results)][self._pos : self._payload_len]
        self._into_dest = False
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._into_dest:
                self._pos += nbytes
                if self._pos == self._payload_len:
                    self._state, self._left = TAIL, 2
                return
            self._pending += memoryview(self._scratch)[:nbytes]
            self._parse()
        except ProtocolFault as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(exc or ConnectionError("connection closed by the server"))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    # -- parsing ----------------------------------------------------------------------------------

    def _parse(self) -> None:
        p = self._pending
        while p:
            if self._done is None or self._done.done():
                raise ProtocolFault("bytes after the last expected reply")
            if self._state == LINE:
                end = p.find(b"\r\n")
                if end < 0:
                    if len(p) > MAX_LINE:
                        raise ProtocolFault("reply line too long")
                    return
                line = bytes(p[:end])
                del p[: end + 2]
                self._line(line)
            elif self._state == HEADER:
                take = min(len(p), HEADER_BYTES - len(self._header))
                self._header += p[:take]
                del p[:take]
                if len(self._header) == HEADER_BYTES:
                    self._state, self._pos = PAYLOAD, 0
            elif self._state == PAYLOAD:
                take = min(len(p), self._payload_len - self._pos)
                self._dests[len(self.results)][self._pos : self._pos + take] = p[:take]
                del p[:take]
                self._pos += take
                if self._pos == self._payload_len:
                    self._state, self._left = TAIL, 2
            else:  # TAIL (the CRLF after one of our values) or DISCARD (a value of another size)
                take = min(len(p), self._left)
                if self._state == TAIL and bytes(p[:take]) != b"\r\n"[2 - self._left :][:take]:
                    raise ProtocolFault("bulk reply not followed by CRLF")
                del p[:take]
                self._left -= take
                if self._left == 0:
                    state, self._state = self._state, LINE
                    self._add(bytes(self._header) if state == TAIL else WrongSize(self._wrong))
        if self._state == PAYLOAD and self._pos == self._payload_len:  # (payload_len 0)
            self._state, self._left = TAIL, 2

    def _line(self, line: bytes) -> None:
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                n = int(rest)
            except ValueError:
                raise ProtocolFault(f"bad bulk length {rest[:32]!r}") from None
            if n < 0:
                self._add(None)
            elif self._dests and n == HEADER_BYTES + self._payload_len:
                self._state, self._header = HEADER, bytearray()
            else:
                self._state, self._left, self._wrong = DISCARD, n + 2, n
        elif kind == b"-":
            self._add(ResponseError(rest.decode(errors="replace")))
        elif kind in (b"+", b":"):
            self._add(rest.decode(errors="replace"))
        else:
            raise ProtocolFault(f"unexpected reply {line[:32]!r}")

    def _add(self, result: Any) -> None:
        self.results.append(result)
        if len(self.results) == self._want and self._done is not None and not self._done.done():
            self._done.set_result(None)


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class BulkConnection:
    """One master's read connection; see the module docstring. Opened on first use, aborted on
    any failure (the next request opens a new one)."""

    def __init__(self, host: str, port: int, creds: Credentials) -> None:
        self.host, self.port, self.creds = host, port, creds
        self._proto: _Replies | None = None
        self._lock = asyncio.Lock()
        self._ssl: ssl.SSLContext | None = None
        if creds.tls:
            ctx = ssl.create_default_context(cafile=creds.ca_file or None)
            if creds.cert_file:
                ctx.load_cert_chain(creds.cert_file, creds.key_file or None)
            self._ssl = ctx

    async def get_into(
        self, rkeys: list[bytes], dests: list[memoryview], payload_len: int, timeout: float
    ) -> list[Any]:
        """See the module docstring."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._get(rkeys, dests, payload_len), timeout)
            except BaseException:
                self.abort()  # no byte reaches ``dests`` after this returns
                raise

    async def _get(self, rkeys: list[bytes], dests: list[memoryview], payload_len: int) -> list[Any]:
        proto = self._proto
        if proto is None or proto.transport is None:
            proto = await self._connect()
        assert proto.transport is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        proto.expect(len(rkeys), dests, payload_len, done)
        proto.transport.write(b"".join(_command(b"GET", k) for k in rkeys))
        await done
        return proto.results

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(
            _Replies, self.host, self.port, ssl=self._ssl, server_hostname=self.host if self._ssl else None
        )
        self._proto = proto
        if self.creds.password:
            auth = (
                [b"AUTH"]
                + ([self.creds.username.encode()] if self.creds.username else [])
                + [self.creds.password.encode()]
            )
            done: asyncio.Future[None] = loop.create_future()
            proto.expect(1, [], 0, done)
            assert proto.transport is not None
            proto.transport.write(_command(*auth))
            await done
            if isinstance(proto.results[0], ResponseError):
                raise ConnectionError(f"AUTH refused: {proto.results[0]}")
        return proto

    def abort(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.abort()

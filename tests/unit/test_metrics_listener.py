"""The /metrics listener thread under connection pressure: it survives a stale event for a
connection it closed to make room, and backs off when accept() fails (out of descriptors).
A MetricsServer of its own (no daemon); its selector and listening socket are wrapped so that a
scenario can hold a select round or make accept() fail."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtierd.metrics import MetricsServer


class SteppedSelector:
    """Wraps the listener's selector: while ``paused`` the next select() waits for ``resume()``
    (``waiting`` is set meanwhile), so events can pile up for one round."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.paused = False
        self.waiting = threading.Event()
        self._go = threading.Event()

    def resume(self) -> None:
        self._go.set()

    def select(self, timeout: float | None = None) -> Any:
        if self.paused:
            self.waiting.set()
            assert self._go.wait(10), "never resumed"
            self.paused = False
        return self.inner.select(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class NoDescriptors:
    """The listening socket, whose accept() fails with EMFILE (counted in ``accepts``)."""

    def __init__(self, inner: socket.socket) -> None:
        self.inner = inner
        self.accepts = 0

    def accept(self) -> Any:
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def fileno(self) -> int:
        return self.inner.fileno()

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    m = MetricsServer("127.0.0.1", 0, asyncio.new_event_loop(), lambda _caller: {}, max_connections=1)
    yield m
    m.close()


def answers(port: int) -> bytes:
    """The status line of a request for a path that needs no snapshot ('' if none came)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        s.sendall(b"GET /nope HTTP/1.1\r\n\r\n")
        try:
            return s.recv(64).split(b"\r\n", 1)[0]
        except TimeoutError:
            return b""


def test_a_read_event_of_a_connection_closed_to_make_room_is_skipped(
        server: MetricsServer) -> None:
    sel = server._selector = SteppedSelector(server._selector)  # type: ignore[assignment]
    server.start()
    a = socket.create_connection(("127.0.0.1", server.port))
    while len(server._pending) < 1:  # the listener has accepted A (max_connections = 1)
        time.sleep(0.01)
    sel.paused = True
    server._wake_w.send(b"x")  # ends the round in progress; the next one waits
    assert sel.waiting.wait(5)
    server._wake_r.recv(1)
    b = socket.create_connection(("127.0.0.1", server.port))  # accepting B closes A ...
    a.sendall(b"GET /metr")  # ... whose read event is in the same round
    time.sleep(0.2)  # both have reached the listening host
    sel.resume()
    assert answers(server.port) == b"HTTP/1.1 404 Not Found"  # the listener is alive
    assert server._thread is not None and server._thread.is_alive()
    a.close()
    b.close()


def test_accept_failing_for_want_of_descriptors_backs_off(
        server: MetricsServer, caplog: pytest.LogCaptureFixture) -> None:
    server.start()
    assert server._sock is not None
    listener = NoDescriptors(server._sock)
    server._sock = listener  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="kvtierd.metrics"), \
            socket.create_connection(("127.0.0.1", server.port)):  # never accepted
        time.sleep(0.5)
    lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
    # ~5 tries (one per 100 ms), one line; without the backoff: a busy loop, a line per try.
    assert listener.accepts <= 10 and len(lines) == 1, (listener.accepts, len(lines))

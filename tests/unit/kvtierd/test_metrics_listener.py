"""The /metrics listener thread under connection pressure: it survives a stale event for a
connection it closed to make room, and backs off when accept() fails (out of descriptors).
A MetricsServer of its own (no daemon); its selector and listening socket are wrapped so that a
scenario can hold a select round or make accept() fail."""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtierd.metrics import ACCEPT_BACKOFF_S, MetricsServer


class SteppedSelector:
    """Wraps the listener's selector: the first select() called once ``pause_when()`` holds
    waits for ``resume()`` (``waiting`` is set meanwhile), so events can pile up for one round."""

    def __init__(self, inner: Any, pause_when: Callable[[], bool]) -> None:
        self.inner = inner
        self.pause_when: Callable[[], bool] | None = pause_when
        self.waiting = threading.Event()
        self._go = threading.Event()

    def resume(self) -> None:
        self._go.set()

    def select(self, timeout: float | None = None) -> Any:
        if self.pause_when is not None and self.pause_when():
            self.pause_when = None
            self.waiting.set()
            assert self._go.wait(10), "never resumed"
        return self.inner.select(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class NoDescriptors:
    """The listening socket, whose accept() fails with EMFILE (counted in ``accepts``)."""

    def __init__(self, inner: socket.socket, tries: int) -> None:
        self.inner = inner
        self.accepts = 0
        self.at: list[float] = []  # when each accept() was tried
        self.tried = threading.Event()  # set at the ``tries``-th accept()
        self._tries = tries

    def accept(self) -> Any:
        self.accepts += 1
        self.at.append(time.monotonic())
        if self.accepts >= self._tries:
            self.tried.set()
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


def test_a_read_event_of_a_connection_closed_to_make_room_is_skipped(server: MetricsServer) -> None:
    # The round after the listener accepted A (max_connections = 1) waits.
    sel = SteppedSelector(server._selector, lambda: len(server._pending) >= 1)
    server._selector = sel  # type: ignore[assignment]
    server.start()
    a = socket.create_connection(("127.0.0.1", server.port))
    assert sel.waiting.wait(5)
    (a_here,) = server._pending  # the listener's end of A
    b = socket.create_connection(("127.0.0.1", server.port))  # accepting B closes A ...
    a.sendall(b"GET /metr")  # ... whose read event is in the same round
    for waiting in (server._sock, a_here):  # both have reached the listening host
        assert waiting is not None and select.select([waiting], [], [], 5)[0]
    sel.resume()
    assert answers(server.port) == b"HTTP/1.1 404 Not Found"  # the listener is alive
    assert server._thread is not None and server._thread.is_alive()
    a.close()
    b.close()


def test_accept_failing_for_want_of_descriptors_backs_off(
    server: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.start()
    assert server._sock is not None
    listener = NoDescriptors(server._sock, tries=4)
    server._sock = listener  # type: ignore[assignment]
    with (
        caplog.at_level(logging.WARNING, logger="kvtierd.metrics"),
        socket.create_connection(("127.0.0.1", server.port)),
    ):  # never accepted
        assert listener.tried.wait(10)
    lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
    # One try per ACCEPT_BACKOFF_S, one line; without the backoff: a busy loop, a line per try.
    gaps = [b - a for a, b in itertools.pairwise(listener.at[:4])]
    assert min(gaps) >= ACCEPT_BACKOFF_S * 0.9 and len(lines) == 1, (gaps, len(lines))

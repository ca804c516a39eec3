"""The /metrics server under half-open connections: no thread per connection, a scrape still
answers. A real daemon; its thread count is read from /proc/PID/task."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from pathlib import Path

from conftest import DaemonProcess
from tests_helpers import wait_for

HALF_OPEN = 200


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def accept_queue(port: int) -> int:
    """Connections waiting in the kernel for the listener on ``port`` to accept them (the
    receive queue of a listening socket in /proc/net/tcp and tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                return int(f[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on port {port}")


def scrape(url: str) -> tuple[float, str]:
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read().decode()
    return time.monotonic() - t0, body


def test_half_open_connections_add_no_threads_and_a_scrape_still_answers(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    url = daemon.info["metrics"]
    scrape(url)  # the pool's first worker exists from here on
    before = threads(daemon.proc.pid)
    socks: list[socket.socket] = []
    try:
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        for _ in range(HALF_OPEN):  # half a request line, never finished
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /metr")
            socks.append(s)
        wait_for("the listener to accept them all", lambda: accept_queue(int(port)) == 0)
        grown = threads(daemon.proc.pid) - before
        took, body = scrape(url)
        assert grown < 10, f"{grown} threads added by {HALF_OPEN} half-open connections"
        assert took < 1.0 and "kvtier_host_capacity_bytes" in body
    finally:
        for s in socks:
            s.close()


def test_a_half_open_connection_is_closed_after_the_read_timeout(daemon: DaemonProcess) -> None:
    url: str = daemon.info["metrics"]
    host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # the head never ends
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the daemon, unanswered
        assert time.monotonic() - t0 < 12


def test_unknown_paths_and_methods(daemon: DaemonProcess) -> None:
    url: str = daemon.info["metrics"]
    base = url.rsplit("/", 1)[0]
    for path, method, code in (("/nope", "GET", 404), ("/metrics", "POST", 405)):
        req = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
        try:
            urllib.request.urlopen(req, timeout=5)
            raise AssertionError("expected an HTTP error")
        except urllib.error.HTTPError as e:
            assert e.code == code

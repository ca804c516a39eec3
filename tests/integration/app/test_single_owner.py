"""One daemon per NVMe directory and per socket: a second daemon on either exits at once, naming
the first one's pid, and the first keeps serving; ``fsck`` refuses a directory a live daemon holds.

Before the locks, two daemons on one directory both reported their blocks durable and after a
restart half of them were gone while ``fsck`` said clean; a second daemon on one socket path took
the first one's socket over and deleted it on exit.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import DaemonProcess, make_namespace
from tests_helpers import wait_for

import kvtier

SERVE = (
    "--host-bytes",
    "8MiB",
    "--slab-bytes",
    "1MiB",
    "--disk-bytes",
    "16MiB",
    "--write-policy",
    "write-through",
)


def second_daemon(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvtierd serve`` with ``args`` that is expected to exit by itself, at once (30 s: a
    daemon that starts instead is killed and the caller's assertions fail)."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "kvtierd",
        "serve",
        "--listen",
        "",
        "--data-listen",
        "127.0.0.1:0",
        "--metrics-port",
        "-1",
        *args,
    ]
    try:
        return subprocess.run(
            cmd,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(os.environ, KVTIER_LOG_LEVEL="INFO"),
        )  # still one line
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the second daemon did not exit: {e.stderr!r}") from None


def fsck(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtierd", "fsck", str(directory)], capture_output=True, text=True, timeout=60
    )


def refused_naming(done: subprocess.CompletedProcess[str], pid: int, path: Path) -> None:
    """Exited non-zero with one line on stderr naming the lock's path and the holder's pid."""
    assert done.returncode != 0, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback, no log lines
    assert f"pid {pid}" in lines[0] and str(path) in lines[0], lines[0]


def blocks(n: int, nbytes: int) -> list[bytes]:
    return [hashlib.shake_256(b"single owner %d" % i).digest(nbytes) for i in range(n)]


def put_durably(d: DaemonProcess) -> tuple[list[bytes], list[bytes]]:
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 8)))
        data = blocks(8, ns.block_bytes)
        assert ns.put(keys, data).stored == 8
        wait_for("blocks durable", lambda: all(ns.lookup_detail(keys).durable))
    return keys, data


def read(d: DaemonProcess, keys: list[bytes]) -> list[bytes | None]:
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        return [bytes(g) if g else None for g in ns.get(keys)]


def test_a_second_daemon_on_the_same_disk_directory_exits_and_fsck_refuses(
    daemon_factory: Any, tmp_path: Path
) -> None:
    disk = tmp_path / "nvme"
    first = daemon_factory(*SERVE, "--disk-dir", str(disk))
    keys, data = put_durably(first)

    other = second_daemon(tmp_path / "other", *SERVE, "--disk-dir", str(disk))
    refused_naming(other, first.info["pid"], disk)
    held = fsck(disk)
    assert held.returncode == 3 and f"pid {first.info['pid']}" in held.stderr, held
    assert read(first, keys) == data  # the first one serves on, its blocks intact

    assert first.stop(signal.SIGTERM) == 0
    assert fsck(disk).returncode == 0  # free again: checked, and clean
    after = daemon_factory(*SERVE, "--disk-dir", str(disk))  # a new daemon starts fine
    assert read(after, keys) == data


def test_a_second_daemon_on_the_same_socket_exits_and_leaves_the_first_ones_socket(
    daemon_factory: Any, tmp_path: Path
) -> None:
    first = daemon_factory("--host-bytes", "8MiB", "--slab-bytes", "1MiB")
    sock = first.run_dir / "kvtier.sock"

    other = second_daemon(
        tmp_path / "other", "--host-bytes", "8MiB", "--slab-bytes", "1MiB", "--socket", str(sock)
    )
    refused_naming(other, first.info["pid"], sock)
    assert sock.exists() and Path(first.info["shm"]).exists()  # not unlinked by the second
    with kvtier.Client.connect(first.unix, transport="shm") as client:  # and still the first's
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        data = blocks(2, ns.block_bytes)
        assert ns.put(keys, data).stored == 2
        assert [bytes(g) if g else None for g in ns.get(keys)] == data

    assert first.stop(signal.SIGTERM) == 0
    assert not sock.exists()  # the first one's own socket: removed at its stop
    daemon_factory("--host-bytes", "8MiB", "--slab-bytes", "1MiB", run_dir=first.run_dir)


def test_a_dead_daemons_socket_is_replaced(daemon_factory: Any) -> None:
    first = daemon_factory("--host-bytes", "8MiB", "--slab-bytes", "1MiB")
    first.kill()  # SIGKILL: its socket files stay, its lock goes with the process
    assert (first.run_dir / "kvtier.sock").exists()
    after = daemon_factory("--host-bytes", "8MiB", "--slab-bytes", "1MiB", run_dir=first.run_dir)
    with kvtier.Client.connect(after.unix, transport="shm") as client:
        assert int(client.stats()["boot_epoch"]) == after.info["boot_epoch"]

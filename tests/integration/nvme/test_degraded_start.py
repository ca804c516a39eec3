"""A daemon (re)started on a full or read-only NVMe filesystem: without ``--disk-optional`` it
refuses to start, in one line naming ``disk_dir`` and the way out, before serving anything; with
it, it serves the host tier, says so in its ready line, reports ``kvtier.nvme`` NOT_SERVING, and
resumes the NVMe tier once the disk is back, every durable block intact. The NVMe directory lives
on a small tmpfs of its own (skipped where tmpfs cannot be mounted, i.e. without root).

The tier: one 16 MiB block file and an 8 MiB journal preallocated at each start, on 48 MiB
(after a crash the old journal stays until a checkpoint: 32 MiB in use; the open's checkpoint
removes it before the new one is made, so a restart after a crash needs no new journal's room).
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvtier

SERVE = (
    "--host-bytes",
    "2MiB",
    "--slab-bytes",
    "1MiB",
    "--disk-bytes",
    "16MiB",
    "--write-policy",
    "write-through",
)
DEGRADE = (*SERVE, "--disk-optional")  # a restart that may serve without its NVMe tier
BLOCKS = 40
SERVING = health_pb2.HealthCheckResponse.SERVING


def block(i: int, nbytes: int) -> bytes:
    return hashlib.shake_256(b"degraded start %d" % i).digest(nbytes)


@pytest.fixture
def mnt(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs, unmounted after the test."""
    point = tmp_path / "mnt"
    point.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(point)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full (down to its last 4 KiB); returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096):
            try:
                while True:
                    os.write(fd, b"\xa5" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def nvme_health(d: DaemonProcess) -> int:
    with grpc.insecure_channel(d.unix) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.nvme"), timeout=5
        )
        return int(reply.status)


def wait_for(cond: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def store_durably(d: DaemonProcess) -> tuple[list[bytes], list[bytes]]:
    """BLOCKS blocks put and durable on NVMe (write-through); (keys, bytes)."""
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * BLOCKS)))
        data = [block(i, ns.block_bytes) for i in range(BLOCKS)]
        for i in range(0, BLOCKS, 8):
            assert ns.put(keys[i : i + 8], data[i : i + 8]).stored == 8
        assert wait_for(lambda: all(ns.lookup_detail(keys).durable))
    return keys, data


def refused(disk: Path, run: Path, why: str, *, opened: bool = False) -> None:
    """A start on ``disk`` without --disk-optional: exit 2 at once, one line naming disk_dir,
    the reason and the flag (before the arena is made: no other line, nothing written to the
    disk directory; after the tier's open, ``opened``: the tier's own log lines before it, and
    the open may have begun a journal), no traceback, no socket left behind."""
    before = sorted(p.name for p in disk.iterdir()) if disk.is_dir() else None
    done = start_expecting_exit(run, *SERVE, "--disk-dir", str(disk))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done
    assert len(lines) == 1 or opened and all(" kvtierd.nvme: " in x for x in lines[:-1]), lines
    lines = lines[-1:]
    assert lines[0].startswith(f"kvtierd serve: disk_dir {disk} (--disk-dir) cannot be used: ")
    assert why in lines[0] and "--disk-optional" in lines[0], lines[0]
    assert not (run / "kvtier.sock").exists() and not (run / "kvtier.sock.shm").exists()
    if not opened:
        assert (sorted(p.name for p in disk.iterdir()) if disk.is_dir() else None) == before


def start_expecting_exit(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    run.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "kvtierd",
        "serve",
        "--socket",
        str(run / "kvtier.sock"),
        "--metrics-port",
        "-1",
        *args,
    ]
    try:
        return subprocess.run(cmd, cwd=run, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the daemon started instead of refusing: {e.stderr!r}") from None


def check_degraded_then_resumed(d: DaemonProcess, keys: list[bytes], data: list[bytes], heal: Any) -> None:
    nvme_tier = d.info["tiers"]["nvme"]  # the ready line says the tier is not there yet
    assert nvme_tier["state"] == "degraded" and nvme_tier["reason"], d.info
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        assert nvme_health(d) != SERVING
        nvme = client.stats()["nvme"]
        assert not nvme["admitting"] and nvme["degraded_reason"]
        fresh = ns.block_keys(list(range(16 * 4)), parent=b"\x01" * 32)
        new = [block(1000 + i, ns.block_bytes) for i in range(4)]
        assert ns.put(fresh, new).stored == 4  # the host tier serves
        assert [bytes(g) if g else None for g in ns.get(fresh)] == new
        assert ns.lookup_detail(fresh).durable == [False] * 4
        heal()
        assert wait_for(lambda: nvme_health(d) == SERVING), client.stats()["nvme"]
        got = ns.get(keys)  # stored before the restart: all back, byte-exact
        assert [bytes(g) if g else None for g in got] == data
        more = ns.block_keys(list(range(16 * 4)), parent=b"\x02" * 32)
        assert ns.put(more, new).stored == 4  # and the tier admits again
        assert wait_for(lambda: all(ns.lookup_detail(more).durable))


@pytest.mark.parametrize("stop", ["graceful", "crash"])
def test_a_restart_on_a_full_disk_serves_the_host_tier_and_resumes(
    daemon_factory: Any, tmp_path: Path, mnt: Path, stop: str
) -> None:
    disk, run = mnt / "nvme", tmp_path / "run"
    d1 = daemon_factory(*SERVE, "--disk-dir", str(disk), run_dir=run)
    keys, data = store_durably(d1)
    if stop == "graceful":
        assert d1.stop(signal.SIGTERM) == 0  # checkpoint; the next start opens a new journal
    else:
        d1.kill()  # journals to replay; the next start wants a checkpoint and a journal
    filler = fill(mnt)
    if stop == "graceful":  # refused before the open: no room for the new journal
        refused(disk, tmp_path / "refused", "free, the NVMe tier needs 8.0 MiB more (a journal of 8.0 MiB)")
    else:  # the old journal's room would do, but not the checkpoint that frees it: the open says
        refused(disk, tmp_path / "refused", "the NVMe tier opened degraded: ", opened=True)
    d2 = daemon_factory(*DEGRADE, "--disk-dir", str(disk), run_dir=run)  # must start
    check_degraded_then_resumed(d2, keys, data, heal=filler.unlink)


def test_a_restart_after_a_crash_reuses_the_old_journals_room(
    daemon_factory: Any, tmp_path: Path, mnt: Path
) -> None:
    """Issue 39: the start's check demanded a whole new journal's free space although the
    open's checkpoint removes the crashed daemon's journal first: with 2 MiB free the tier
    opens, serving, every durable block back (before: refused, "needs 8.0 MiB more")."""
    disk, run = mnt / "nvme", tmp_path / "run"
    d1 = daemon_factory(*SERVE, "--disk-dir", str(disk), run_dir=run)
    keys, data = store_durably(d1)
    d1.kill()  # its journal (8 MiB) stays for the next start to replay
    filler = fill(mnt)
    os.truncate(filler, filler.stat().st_size - (2 << 20))  # 2 MiB free: less than a journal
    d2 = daemon_factory(*SERVE, "--disk-dir", str(disk), run_dir=run)
    assert d2.info["tiers"]["nvme"]["state"] == "serving", d2.info
    with kvtier.Client.connect(d2.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        assert [bytes(g) if g else None for g in ns.get(keys)] == data
        assert client.stats()["nvme"]["admitting"]


def test_a_restart_on_a_read_only_filesystem_serves_and_resumes(
    daemon_factory: Any, tmp_path: Path, mnt: Path
) -> None:
    disk, run = mnt / "nvme", tmp_path / "run"
    d1 = daemon_factory(*SERVE, "--disk-dir", str(disk), run_dir=run)
    keys, data = store_durably(d1)
    assert d1.stop(signal.SIGTERM) == 0
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    refused(disk, tmp_path / "refused", "read-only filesystem")
    d2 = daemon_factory(*DEGRADE, "--disk-dir", str(disk), run_dir=run)
    check_degraded_then_resumed(
        d2, keys, data, heal=lambda: subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
    )


def test_a_start_whose_directory_cannot_be_created_opens_the_tier_later(
    daemon_factory: Any, tmp_path: Path, mnt: Path
) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    refused(mnt / "nvme", tmp_path / "refused", "read-only filesystem")
    d = daemon_factory(*DEGRADE, "--disk-dir", str(mnt / "nvme"), run_dir=tmp_path / "run")
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        assert nvme_health(d) != SERVING
        keys = ns.block_keys(list(range(16 * 4)))
        blocks = [block(i, ns.block_bytes) for i in range(4)]
        assert ns.put(keys, blocks).stored == 4
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        assert wait_for(lambda: nvme_health(d) == SERVING)
        assert wait_for(lambda: client.stats()["nvme"]["admitting"])
        more = ns.block_keys(list(range(16 * 4)), parent=b"\x03" * 32)
        assert ns.put(more, blocks).stored == 4
        assert wait_for(lambda: all(ns.lookup_detail(more).durable))
        assert [bytes(g) if g else None for g in ns.get(keys)] == blocks


def test_a_disk_dir_that_is_a_file_refuses_the_start_and_degrades_with_disk_optional(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """No root needed: --disk-dir names a regular file."""
    disk = tmp_path / "not-a-dir"
    disk.write_bytes(b"x")
    refused(disk / "nvme", tmp_path / "refused", "is not a directory")
    d = daemon_factory(*DEGRADE, "--disk-dir", str(disk / "nvme"), run_dir=tmp_path / "run")
    assert d.info["tiers"]["nvme"]["state"] == "degraded"
    assert nvme_health(d) != SERVING
    assert disk.read_bytes() == b"x"


def test_a_tier_that_opens_degraded_refuses_the_start_and_serves_with_disk_optional(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The checks before the open pass (the directory is there, writable, its files too), the
    open finds a truncated block file: refused after the tier's own log lines, or degraded."""
    disk, run = tmp_path / "nvme", tmp_path / "run"
    d1 = daemon_factory(*SERVE, "--disk-dir", str(disk), run_dir=run)
    assert d1.info["tiers"]["nvme"]["state"] == "serving"
    assert d1.stop(signal.SIGTERM) == 0
    os.truncate(disk / "blocks-00000.kvt", 4096)
    refused(disk, tmp_path / "refused", "the NVMe tier opened degraded: ", opened=True)
    d2 = daemon_factory(*DEGRADE, "--disk-dir", str(disk), run_dir=run)
    assert "truncated" in d2.info["tiers"]["nvme"]["reason"]
    assert nvme_health(d2) != SERVING


def test_a_directory_of_another_kind_is_one_line_even_with_disk_optional(tmp_path: Path) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    (disk / "kvtier.meta").write_text("not a kvtier meta file")
    for optional in ((), ("--disk-optional",)):
        done = start_expecting_exit(tmp_path / "run", *SERVE, *optional, "--disk-dir", str(disk))
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done
        assert lines[0].startswith(
            f"kvtierd serve: disk_dir {disk} (--disk-dir) cannot be used: kvtier.meta: not JSON"
        ), lines[0]
        assert lines[0].endswith("check it with kvtierd fsck, or choose another directory")

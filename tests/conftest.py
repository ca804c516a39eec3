"""Shared fixtures: a real kvtierd process per test (or per module), with its own run dir."""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.bench.procs import DaemonAddresses, launch_daemon
from kvtier_contract import wire

ROOT = Path(__file__).resolve().parent.parent


class DaemonProcess(DaemonAddresses):
    """A kvtierd started with ``kvtier serve`` in a temporary run dir; ports chosen by the OS."""

    module: tuple[str, ...] = ("kvtierd",)  # what ``python -m`` runs (a test launcher instead)

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.args = list(args)
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stderr = open(self.run_dir / "kvtierd.log", "a")  # noqa: SIM115
        self.proc, self.info = launch_daemon(
            self.run_dir, self.args, self.stderr, metrics_port=0, timeout_s=timeout_s, module=self.module
        )
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(15)


class SlowDiskDaemon(DaemonProcess):
    """kvtierd whose NVMe reads sleep (``kvtierd.testing.serve``, test-only): ``latency_ms``
    before every read, or the milliseconds the file ``latency_file`` holds (0 while missing;
    read again at most every 100 ms, so a test slows the disk and lets it recover)."""

    def __init__(
        self, run_dir: Path, *args: str, latency_ms: int | None = None, latency_file: Path | None = None
    ) -> None:
        super().__init__(run_dir, *args)
        if (latency_ms is None) == (latency_file is None):
            raise ValueError("one of latency_ms and latency_file")
        fault = (
            ["--read-latency-ms", str(latency_ms)]
            if latency_file is None
            else ["--read-latency-file", str(latency_file)]
        )
        self.module = ("kvtierd.testing.serve", *fault)


def small_tiers(work: Path, host: str, slab: str, disk: str, policy: str) -> list[str]:
    """Daemon arguments: a host tier of ``host`` bytes in ``slab`` slabs over an NVMe tier of
    ``disk`` bytes in ``work/nvme`` with write ``policy``: a small host tier pushes blocks to
    the NVMe tier only, so a test can make their loads read the disk."""
    return [
        "--host-bytes",
        host,
        "--slab-bytes",
        slab,
        "--disk-dir",
        str(work / "nvme"),
        "--disk-bytes",
        disk,
        "--write-policy",
        policy,
    ]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def make(*args: str, run_dir: Path | None = None) -> DaemonProcess:
        d = DaemonProcess(run_dir or tmp_path / f"d{len(started)}", *args).start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.kill()


@pytest.fixture
def daemon(daemon_factory: Any) -> DaemonProcess:
    """A daemon with a 64 MiB host tier, 1 MiB slabs and short leases."""
    return daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--lease-ttl-s", "2")


def make_namespace(**overrides: Any) -> kvtier.Namespace:
    """A small namespace: 16 tokens x 2 layers x 2 heads x 64 dim x bf16 = 16 KiB blocks."""
    fields: dict[str, Any] = dict(
        model_id="test/model",
        model_revision="rev1",
        tokenizer_digest="none",
        kv_dtype="bfloat16",
        layout="contiguous",
        tokens_per_block=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )
    fields.update(overrides)
    return kvtier.Namespace(**fields)


@pytest.fixture(params=["shm", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def held() -> Iterator[int]:
    """A port another process listens on (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def shm_handshake(
    daemon: DaemonProcess, session_id: int, secret: bytes, magic: bytes = wire.SHM_MAGIC
) -> tuple[bytes, list[int]]:
    """The raw shm fd handshake (what a local process that opened the session can send, with
    its data secret from OpenSessionReply): the reply and the fds (``KVS3``: every arena)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(daemon.info["shm"])
        s.sendall(wire.shm_request(magic, session_id, secret))
        msg, fds, _flags, _addr = socket.recv_fds(s, 4096, wire.SHM_MAX_ARENAS)
    return msg, fds

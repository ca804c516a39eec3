"""Processes the bench starts and owns: its own kvtierd and, for comparison, a redis-server.

Both run in a private temporary directory, on loopback, with ports chosen by the OS (kvtierd)
or found free (redis), and are stopped (SIGTERM, then SIGKILL) when the context exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any


def launch_daemon(
    run_dir: Path,
    args: list[str],
    log: Any,
    *,
    metrics_port: int = -1,
    timeout_s: float = 60.0,
    module: Sequence[str] = ("kvtierd",),
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``kvtier serve`` in ``run_dir`` (its Unix socket there, TCP ports chosen by the OS,
    stderr to ``log``) and wait for its KVTIERD_READY line; (process, the line's JSON).
    ``module``: ``python -m`` what (and its own arguments) runs ``serve`` (a test launcher)."""
    cmd = [
        sys.executable,
        "-m",
        *module,
        "serve",
        "--socket",
        str(run_dir / "kvtier.sock"),
        "--listen",
        "127.0.0.1:0",
        "--data-listen",
        "127.0.0.1:0",
        "--metrics-port",
        str(metrics_port),
        *args,
    ]
    env = dict(os.environ, KVTIER_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=run_dir, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("KVTIERD_READY "):
            return proc, json.loads(line.split(" ", 1)[1])
        if not line and proc.poll() is not None:
            break
    _stop(proc)
    tail = (run_dir / "kvtierd.log").read_text()[-2000:] if (run_dir / "kvtierd.log").exists() else ""
    raise RuntimeError(f"kvtierd did not start:\n{tail}")


class DaemonAddresses:
    """Where a started daemon answers, read from its KVTIERD_READY line (``info``)."""

    info: dict[str, Any]

    @property
    def unix(self) -> str:
        return str(self.info["unix"])

    @property
    def grpc(self) -> str:
        return str(self.info["grpc"])

    def address(self, transport: str) -> str:
        """Same-host engines use the Unix socket (shm); remote ones gRPC over TCP (tcp)."""
        return self.unix if transport == "shm" else self.grpc


class DaemonProc(DaemonAddresses):
    """A ``kvtier serve`` subprocess; ``info`` is its KVTIERD_READY line."""

    def __init__(
        self, run_dir: Path, host_bytes: int, slab_bytes: int, extra_args: list[str] | None = None
    ) -> None:
        self.run_dir = run_dir
        self.args = [
            "--host-bytes",
            str(host_bytes),
            "--slab-bytes",
            str(slab_bytes),
            "--lease-ttl-s",
            "60",
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> DaemonProc:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.run_dir / "kvtierd.log", "w")  # noqa: SIM115  # closed in __exit__
        try:
            self.proc, self.info = launch_daemon(self.run_dir, self.args, self._log, metrics_port=-1)
        except RuntimeError:
            self._log.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        _stop(self.proc)
        self._log.close()


class RedisProc:
    """A throw-away ``redis-server`` on a free loopback port, without persistence."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str | None:
        return shutil.which("redis-server")

    def __enter__(self) -> RedisProc:
        exe = self.available()
        if exe is None:
            raise FileNotFoundError("redis-server not found on PATH")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            str(self.run_dir),
            "--logfile",
            str(self.run_dir / "redis.log"),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        _stop(self.proc)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        _stop(self.proc)


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A throw-away certificate for 127.0.0.1 and localhost and its key (openssl), for the tls
    suite: the client trusts that certificate itself as its CA."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=kvtier-bench",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[Any] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)

"""Helpers shared by test modules (importable: tests/ is on sys.path through conftest)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc


def worker_identity(model_id: str) -> Any:
    """The vLLM worker tests' engine: 16-token blocks of 2 layers x 2 KV heads x 64 dims in
    bfloat16 (16 KiB per block), vLLM's LBHNC layout, revision ``r1``."""
    from kvtier.integrations.vllm.connector.config import EngineIdentity

    return EngineIdentity(
        model_id=model_id,
        model_revision="r1",
        tokenizer_digest="none",
        kv_dtype="bfloat16",
        layout="vllm.LBHNC",
        tokens_per_block=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )


def worker_keys(ns: Any, seed: int, n_blocks: int) -> list[bytes]:
    """The keys tests/integration/app/worker.py computes for ``seed``."""
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, 150_000, 16 * n_blocks)]
    return list(ns.block_keys(tokens))


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``cond`` every 50 ms until it holds; AssertionError naming ``what`` after
    ``timeout`` seconds. Wait for the state an assertion needs, not for a proxy of it."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settled(what: str, sample: Callable[[], Any], *, quiet_s: float = 0.2, timeout: float = 20.0) -> Any:
    """Poll ``sample`` until it gives the same value twice ``quiet_s`` apart (a steady state:
    a daemon that took what it will, a buffer that stopped filling); that value. AssertionError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = sample()
    while True:
        time.sleep(quiet_s)
        now = sample()
        if now == last:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} to settle (last {last!r}, now {now!r})")
        last = now


def set_read_latency(path: Path, ms: int) -> None:
    """Write ``ms`` to the latency file of a ``conftest.SlowDiskDaemon`` and return once the
    daemon's next read takes it. The daemon reads the file again at most every ``refresh_s``
    (``kvtierd.testing.faults.LatencyFile``, 100 ms) and says nowhere when it did: once that long
    has passed since the write, any read refreshes it."""
    from kvtierd.testing.faults import LatencyFile

    path.write_text(str(ms))
    time.sleep(LatencyFile.__init__.__kwdefaults__["refresh_s"] + 0.05)  # sleep: the refresh is a timer


def open_fds(pid: int) -> int:
    """How many file descriptors process ``pid`` holds (a daemon's accepted and closed
    connections, seen from outside)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class ManualClock:
    """A clock that moves only when told (``advance``): timeouts pass without waiting."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def scrape_metrics(daemon: Any, token: str | None) -> tuple[int, str]:
    """GET the /metrics of ``daemon`` (a conftest.DaemonProcess: its ``info["metrics"]`` URL;
    one bound on 0.0.0.0 is asked on 127.0.0.1) with a bearer token, or none: (status, body),
    a 401's included."""
    import urllib.error  # (here, not at the top: this block stays apart from the others)
    import urllib.request

    url = daemon.info["metrics"].replace("://0.0.0.0:", "://127.0.0.1:")
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def until_unauthenticated(call: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """Repeat ``call`` (a gRPC call) until the daemon answers UNAUTHENTICATED: a SIGHUP reload
    of the tenants file that removed the credential has taken effect."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            return
        assert time.monotonic() < deadline, "the credential was still accepted"
        time.sleep(0.05)


class TokenStub:
    """A raw Kvtier stub on ``address`` with a bearer token (or none): what any process holding
    it can send. ``code`` returns the refusal a call must get."""

    def __init__(self, address: str, token: str | None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.KvtierStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),) if token else ()

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=5, metadata=self.md)

    def code(self, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as e:
            self(method, request)
        return e.value.code(), e.value.details() or ""


class Ticks:
    """A clock that moves one second each time it is read (progress reports without waiting)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def serve_cmd(run: Path, *args: str) -> list[str]:
    """``kvtierd serve`` on the socket ``run/kvtier.sock``, without /metrics, then ``args``."""
    return [
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


def serve_exits(
    run: Path, *args: str, prefix: Sequence[str] = (), timeout_s: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """``prefix`` then ``serve_cmd(run, *args)``, expected to exit by itself (a daemon that
    starts instead is killed at the timeout and the test fails); INFO logs."""
    run.mkdir(parents=True, exist_ok=True)
    try:
        return subprocess.run(
            [*prefix, *serve_cmd(run, *args)],
            cwd=run,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(os.environ, KVTIER_LOG_LEVEL="INFO"),
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the daemon did not exit: {e.stderr!r}") from None


def serve_ready(run: Path, *args: str, level: str = "INFO") -> tuple[dict[str, Any], str]:
    """Start ``serve_cmd(run, *args)``, read its KVTIERD_READY JSON, stop it: (that JSON, what
    it logged at ``level`` and above, in ``run/log``)."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "log", "w") as log:
        proc = subprocess.Popen(
            serve_cmd(run, *args),
            cwd=run,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=dict(os.environ, KVTIER_LOG_LEVEL=level),
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("KVTIERD_READY "), (run / "log").read_text()
        finally:
            proc.terminate()
            proc.wait(15)
    return json.loads(line.split(" ", 1)[1]), (run / "log").read_text()


def feed(channel: Any, data: bytes) -> None:
    """Hand ``data`` to a data-channel protocol (``kvtierd.transports.tcp.DataChannelProtocol``)
    as its event loop would, through ``get_buffer`` / ``buffer_updated`` (unit tests of the
    channel without a socket)."""
    while data:
        buf = channel.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        channel.buffer_updated(n)
        data = data[n:]


def event_streams(tmp_path: Path) -> list[str]:
    """``kvtierd serve`` flags of the operator stream and one stream per tenant, with their
    replay endpoints, as ipc:// sockets in ``tmp_path`` (ev.sock, replay.sock, ev-<tenant>.sock,
    replay-<tenant>.sock)."""
    return [
        "--events-endpoint",
        f"ipc://{tmp_path}/ev.sock",
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-replay-endpoint",
        f"ipc://{tmp_path}/replay.sock",
        "--events-tenant-endpoint",
        f"ipc://{tmp_path}/ev-{{tenant}}.sock",
        "--events-tenant-replay-endpoint",
        f"ipc://{tmp_path}/replay-{{tenant}}.sock",
    ]


def tenants_text(
    tokens: dict[str, str],
    *,
    operators: Sequence[str] = (),
    group: str = "",
    publishers: Sequence[str] = (),
    members: Sequence[str] = (),
    group_quotas: str = "",
    mapping: Sequence[str] = (),
    group_arena: str = "",
) -> str:
    """A tenants file (docs/security.md): each of ``tokens`` (name -> bearer token) a tcp-only
    tenant (``operators`` the operator; ``mapping`` allowed shm too: an arena of its own), and
    with ``group`` one ``[[group]]`` of ``publishers`` and ``members``, with ``group_quotas``
    (TOML lines) as its ``[group.quotas]`` and ``group_arena`` as its ``arena_bytes``."""
    body = ""
    for name, token in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        transports = '["shm", "tcp"]' if name in mapping else '["tcp"]'
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{digest}"]\ntransports = {transports}\n'
        body += ("operator = true\n" if name in operators else "") + "\n"
    if group:
        body += f'[[group]]\nname = "{group}"\npublishers = {json.dumps(list(publishers))}\n'
        body += f"members = {json.dumps(list(members))}\n"
        body += f'arena_bytes = "{group_arena}"\n' if group_arena else ""
        body += f"[group.quotas]\n{group_quotas}" if group_quotas else ""
    return body


def write_tenants(directory: Path, tokens: dict[str, str], **group: Any) -> Path:
    """``tenants_text(tokens, **group)`` as ``directory/tenants.toml``, each token in
    ``directory/<name>.token``, and ``directory/kvtierd.toml`` naming the file; that config's
    path (``--config`` of the daemon)."""
    (directory / "tenants.toml").write_text(tenants_text(tokens, **group))
    for name, token in tokens.items():
        (directory / f"{name}.token").write_text(token + "\n")
    config = directory / "kvtierd.toml"
    config.write_text(f'tenants_file = "{directory / "tenants.toml"}"\n')
    return config

"""A client that says why (issue 29, items 2, 6 and 7): ``Client.connect`` opens the session at
once and raises one error naming the address, the cause and the fix; with ``lazy=True`` (what
the engine integrations use) it never raises for the daemon and logs each cause once at WARNING.

Real daemons (plaintext, tenants, TLS, mTLS with certificates made by the test), real sockets;
a second CA stands for "a certificate nobody here signed".
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from redis_cluster import make_test_pki

import kvtier
from kvtier.aio import AsyncClient
from kvtier_contract import errors

TOKEN = "tok-a-29"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d)
    make_test_pki(d / "other")  # another CA: its certificates verify nowhere here
    return d


def secured(
    daemon_factory: Any,
    tmp_path: Path,
    pki: Path,
    *,
    tls: bool = True,
    require_cert: bool = False,
    run_dir: Path | None = None,
) -> DaemonProcess:
    """A daemon with one tenant (token TOKEN, client certificate name of the test PKI)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[[tenant]]\nname = "team-a"\nmtls_names = ["kvtier test client"]\n'
        f'tokens_sha256 = ["{hashlib.sha256(TOKEN.encode()).hexdigest()}"]\n'
    )
    body = f'tenants_file = "{tenants}"\n'
    if tls:
        body += (
            f'tls_cert = "{pki / "server.crt"}"\ntls_key = "{pki / "server.key"}"\nlisten = "127.0.0.1:0"\n'
        )
    if require_cert:
        body += f'tls_client_ca = "{pki / "ca.crt"}"\ntls_require_client_cert = true\n'
    cfg = tmp_path / f"kvtierd-{tls}-{require_cert}.toml"
    cfg.write_text(body)
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=run_dir
    )
    return d


def refused(address: str, kind: type[errors.KvtierError], field: str, *words: str, **kwargs: Any) -> str:
    """Connect must raise ``kind`` naming ``field``, with each of ``words``; returns the text.

    Each cause here is told at once (the daemon, or the socket asked, answered), not by running
    out of the connect's deadline: so the connect ends before ``timeout_s``. The deadline is long
    (10 s): what is bounded is "did not wait for it", which holds on a loaded machine; how well
    connect keeps to a short deadline is test_connect_keeps_to_timeout_s_with_every_step_slow's."""
    kwargs.setdefault("transport", "tcp")
    kwargs.setdefault("timeout_s", 10.0)
    t0 = time.monotonic()
    with pytest.raises(kind) as e:
        kvtier.Client.connect(address, **kwargs)
    assert time.monotonic() - t0 < kwargs["timeout_s"], "waited for the deadline: " + str(e.value)
    text = str(e.value)
    assert e.value.field == field, text
    for word in words:
        assert word in text, (word, text)
    return text


def test_no_daemon_at_the_address_is_one_error_naming_the_fix(tmp_path: Path) -> None:
    sock = tmp_path / "kvtier.sock"
    for address in (f"unix://{sock}", str(sock)):  # a bare socket path is that socket
        text = refused(
            address,
            errors.Unavailable,
            "address",
            f"no socket file {sock}",
            "is kvtierd running?",
            "make serve",
        )
        assert f"unix://{sock}" in text
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # a socket file nobody listens on (a daemon that exited)
    stale.close()
    refused(f"unix://{sock}", errors.Unavailable, "address", "nothing listens on", "restart")
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused(f"127.0.0.1:{port}", errors.Unavailable, "address", "connection refused", "--listen")
    refused("no-such-host.invalid:50051", errors.Unavailable, "address", "cannot resolve host")
    with pytest.raises(errors.Unavailable, match="no socket file"):
        asyncio.run(AsyncClient.connect(f"unix://{sock}.none", transport="tcp"))


def test_the_diagnosis_asks_the_socket_not_grpcs_last_words(tmp_path: Path) -> None:
    """Issue 41: the channels of one process share gRPC's connection (subchannel) to a target;
    while a lazy client's backs off after "No such file", a later connect read that attempt's
    words and said "no socket file" of a socket created since. The socket is asked itself."""
    sock = tmp_path / "kvtier.sock"
    engine = kvtier.Client.connect(f"unix://{sock}", transport="tcp", lazy=True)
    try:
        assert "no socket file" in engine.counters.last_error
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(sock))
        stale.close()
        for address in (f"unix://{sock}", str(sock)):
            text = refused(address, errors.Unavailable, "address", "nothing listens on", "restart")
            assert "no socket file" not in text, text
        sock.unlink()
        sock.write_text("")
        refused(f"unix://{sock}", errors.Unavailable, "address", "is not a socket", "fix the address")
    finally:
        engine.close()


def test_a_missing_or_refused_credential_is_named(daemon_factory: Any, tmp_path: Path, pki: Path) -> None:
    d = secured(daemon_factory, tmp_path, pki, tls=False)
    refused(d.unix, errors.Unauthenticated, "token", "gave no credential", "token_file=")
    refused(d.unix, errors.Unauthenticated, "token", "refused the token", token="wrong")
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKEN) as c:
        assert c.connected and c.register(make_namespace(tenant="team-a")).namespace_id


def test_tls_mistakes_name_their_likely_cause(daemon_factory: Any, tmp_path: Path, pki: Path) -> None:
    ca, other = str(pki / "ca.crt"), pki / "other"
    plain = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    tls = secured(daemon_factory, tmp_path, pki, run_dir=tmp_path / "tls")
    mtls = secured(daemon_factory, tmp_path, pki, require_cert=True, run_dir=tmp_path / "mtls")
    refused(plain.grpc, errors.Unavailable, "tls_ca", "TLS client on a plaintext port", tls_ca=ca)
    for d in (tls, mtls):  # a plaintext client on a TLS port, told apart by a handshake
        refused(d.grpc, errors.Unavailable, "tls_ca", "its port serves TLS", token=TOKEN)
    refused(
        tls.grpc,
        errors.Unavailable,
        "tls_ca",
        "not signed by the CA given",
        tls_ca=str(other / "ca.crt"),
        token=TOKEN,
    )
    refused(
        tls.grpc,
        errors.Unavailable,
        "tls_ca",
        "the system's CAs (no tls_ca= given)",
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
        token=TOKEN,
    )
    refused(
        mtls.grpc, errors.Unavailable, "tls_cert", "requires a client certificate", tls_ca=ca, token=TOKEN
    )
    refused(  # gRPC never asks for the certificate unless the daemon requires one
        tls.grpc,
        errors.Unauthenticated,
        "tls_cert",
        "does not ask for client certificates",
        "tls_require_client_cert = true",
        tls_ca=ca,
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    refused(
        mtls.grpc,
        errors.Unavailable,
        "tls_cert",
        "refused the client certificate",
        tls_ca=ca,
        tls_cert=str(other / "client.crt"),
        tls_key=str(other / "client.key"),
    )
    refused(
        tls.unix, errors.Unavailable, "tls_ca", "TLS data channel", "tls_ca=", token=TOKEN
    )  # gRPC on the Unix socket, the tcp data channel's TLS unverified
    with kvtier.Client.connect(
        mtls.grpc,
        transport="tcp",
        tls_ca=ca,
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    ) as c:
        assert c.connected


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "kvtier.client" and r.levelno == logging.WARNING
    ]


def test_a_lazy_client_logs_each_cause_once_and_connects_when_it_can(
    daemon_factory: Any, tmp_path: Path, pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.client")
    run_dir = tmp_path / "later"
    address = f"unix://{run_dir}/kvtier.sock"
    client = kvtier.Client.connect(address, transport="shm", timeout_s=0.5, lazy=True, backoff_s=(0.05, 0.1))
    try:
        ns = client.register(make_namespace(tenant="team-a"))
        keys = ns.block_keys(list(range(32)))
        for _ in range(20):  # every call misses or drops; the cause is said once
            assert ns.lookup(keys) == 0
            assert ns.put(keys, [b"\1" * ns.block_bytes] * 2).dropped == 2
        said = warnings_of(caplog)
        assert len(said) == 1 and "no socket file" in said[0] and "make serve" in said[0], said
        assert "no socket file" in client.counters.last_error
        # The daemon comes, with tenants: a new cause (no token), said once more.
        secured(daemon_factory, tmp_path, pki, tls=False, run_dir=run_dir)
        deadline = time.monotonic() + 20
        while len(warnings_of(caplog)) < 2 and time.monotonic() < deadline:
            assert ns.lookup(keys) == 0
            time.sleep(0.05)
        said = warnings_of(caplog)
        assert len(said) == 2 and "gave no credential" in said[1], said
        assert client.breaker.causes.seen() == ["no-socket", "no-token"]
    finally:
        client.close()


def test_a_lazy_client_connects_once_the_daemon_is_there(daemon_factory: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "later"
    client = kvtier.Client.connect(
        f"unix:{run_dir}/kvtier.sock", transport="shm", timeout_s=0.5, lazy=True, backoff_s=(0.05, 0.1)
    )
    try:
        assert not client.connected
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16)))
        daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
        deadline = time.monotonic() + 20
        while not ns.put(keys, [b"\2" * ns.block_bytes]).stored:
            assert time.monotonic() < deadline, client.counters.last_error
            time.sleep(0.05)
        assert [bytes(g) if g else None for g in ns.get(keys)] == [b"\2" * ns.block_bytes]
    finally:
        client.close()


def test_the_vllm_connector_starts_says_why_once_and_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine must not fail: the vLLM scheduler's backends (two, sharing this process's
    breaker for the address) start on an address with no daemon, say why once between them,
    and answer every lookup as a miss at once."""
    from kvtier.integrations.vllm.connector.backend import DaemonBackend
    from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, EngineIdentity

    caplog.set_level(logging.WARNING, logger="kvtier.client")
    cfg = ConnectorConfig(address=f"unix:{tmp_path}/none.sock", lookup_timeout_ms=300)
    identity = EngineIdentity(
        model_id="test/vllm",
        model_revision="r1",
        tokenizer_digest="none",
        kv_dtype="bfloat16",
        layout="vllm.LBHNC",
        tokens_per_block=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )
    backends = [DaemonBackend(identity, cfg, client_name=f"sched{i}") for i in range(2)]
    try:
        t0 = time.monotonic()
        for b in backends:
            b.warmup()
            for _ in range(10):
                assert b.lookup(BASE, list(range(64))).hits == 0
        assert time.monotonic() - t0 < 3
        said = warnings_of(caplog)
        assert len(said) == 1 and "no socket file" in said[0], said
    finally:
        for b in backends:
            b.close()


class StandIn:
    """A TCP port on which no daemon answers. It reads the first byte of each connection (b"P":
    gRPC's HTTP/2 preface; b"\\x16": a TLS ClientHello, the client's TLS probe) and closes a
    connection after ``hold_s`` without a word; a ClientHello it leaves unanswered ``hello_s``."""

    def __init__(self, hold_s: float = 0.0, hello_s: float = 0.0) -> None:
        self.hold_s, self.hello_s = hold_s, hello_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.first: list[bytes] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hold, args=(conn,), daemon=True).start()

    def _hold(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                first = conn.recv(1)
            except OSError:
                first = b""
            self.first.append(first)
            self._stop.wait(self.hello_s if first == b"\x16" else self.hold_s)

    def hellos(self) -> int:
        return self.first.count(b"\x16")

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def test_connect_keeps_to_timeout_s_with_every_step_slow(pki: Path) -> None:
    """One deadline for the whole connect: a port that closes gRPC's connection after a while
    and then holds the TLS probe unanswered costs timeout_s, not timeout_s plus probe_timeout_s;
    a port that never answers costs timeout_s, plaintext or TLS.

    The probe's timeout is 4x the deadline, so a connect that overran by a probe would take
    8.2 s or more (5 s on the silent port): the bounds (3 s and 2 s over the deadline)
    tell the two apart on a loaded machine, where 0.4 s of slack did not; the port closes after
    0.2 s of a 2 s deadline, so that gRPC has seen it close (and the probe is due) before the
    deadline however slow the machine (issue 41)."""
    slow = StandIn(hold_s=0.2, hello_s=10)
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never accepts, never reads
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.Unavailable):
            kvtier.Client.connect(slow.address, transport="tcp", timeout_s=2.0, probe_timeout_s=8.0)
        assert time.monotonic() - t0 < 2.0 + 3.0
        deadline = time.monotonic() + 10
        while slow.hellos() < 1:  # it did probe, within what was left (read on the port's thread)
            assert time.monotonic() < deadline, slow.first
            time.sleep(0.01)
        assert slow.hellos() == 1
        for tls in ({}, {"tls_ca": str(pki / "ca.crt")}):
            t0 = time.monotonic()
            address = f"127.0.0.1:{silent.getsockname()[1]}"
            with pytest.raises(errors.Unavailable, match="no answer within 1 s"):
                kvtier.Client.connect(address, transport="tcp", timeout_s=1.0, probe_timeout_s=4.0, **tls)
            assert time.monotonic() - t0 < 1.0 + 2.0
    finally:
        slow.close()
        silent.close()


def test_only_a_strict_connect_probes_for_tls() -> None:
    """A lazy client (an engine's thread) is never held by the TLS probe: on a port that closes
    connections, it logs the likely cause and returns; a strict connect probes once."""
    port = StandIn()
    try:
        lazy = kvtier.Client.connect(port.address, transport="tcp", timeout_s=1.0, lazy=True)
        lazy.close()
        assert "a plaintext client on a TLS port?" in lazy.counters.last_error
        with pytest.raises(errors.Unavailable):
            kvtier.Client.connect(port.address, transport="tcp", timeout_s=1.0)
        deadline = time.monotonic() + 5
        while port.hellos() < 1:  # the strict connect's probe, read after the lazy one's would be
            assert time.monotonic() < deadline, port.first
            time.sleep(0.01)
        assert port.hellos() == 1, port.first
    finally:
        port.close()


def test_a_tls_client_on_a_port_that_closes_plaintext_is_told_so(pki: Path) -> None:
    """A TLS client whose handshake the port closes: the probe finds no TLS there, so the error
    says TLS client on a plaintext port, not "requires a client certificate"."""
    port = StandIn()
    try:
        refused(
            port.address,
            errors.Unavailable,
            "tls_ca",
            "TLS client on a plaintext port",
            tls_ca=str(pki / "ca.crt"),
        )
    finally:
        port.close()


def test_the_health_port_says_it_is_one_and_where_grpc_is(daemon_factory: Any) -> None:
    """Issue 39: the health-only listener (50052, the port the image exposes) answered an SDK and
    `kvtier stats` with "Method not found!"; now both say it is the health port and name the
    daemon's gRPC addresses, and health checks still pass there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--health-listen", "127.0.0.1:0")
    health = d.info["health"]
    text = refused(health, errors.Unavailable, "address", "answers only health checks", d.grpc, d.unix)
    assert f"daemon at {health}" in text and "Method not found" not in text
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", health],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "answers only health checks" in out.stderr and d.grpc in out.stderr, out
    with grpc.insecure_channel(health) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvtier.v1.Kvtier"), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_health_only_server_that_says_method_not_found_is_explained() -> None:
    """A health-only gRPC server that answers only "Method not found!" (an older kvtierd's
    health port, another server): the error still says what such a port is and where to go."""
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        refused(
            f"127.0.0.1:{port}",
            errors.Unavailable,
            "address",
            "answers only health checks",
            "Method not found!",
            "--health-listen",
            "gRPC port (--listen",
        )
    finally:
        server.stop(None)


def test_a_namespace_takes_the_tenant_its_credential_proves(
    daemon_factory: Any, tmp_path: Path, pki: Path
) -> None:
    """Issue 39: a Namespace without tenant= takes the tenant the token proved (the same
    namespace, id and keys as one naming it); one naming another tenant stays refused; a token
    read with its newline works."""
    d = secured(daemon_factory, tmp_path, pki, tls=False)
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKEN + "\n") as c:
        assert c.tenant == "team-a"
        ns = c.register(make_namespace())
        named = c.register(make_namespace(tenant="team-a"))
        assert ns.namespace == named.namespace and ns.namespace_id == named.namespace_id
        keys = ns.block_keys(list(range(32)))
        assert keys == named.block_keys(list(range(32)))
        assert ns.put(keys, [b"\7" * ns.block_bytes] * 2).stored == 2
        assert [bytes(b) if b else None for b in named.get(keys)] == [b"\7" * ns.block_bytes] * 2
        with pytest.raises(errors.PermissionDenied, match="not the tenant of this credential"):
            c.register(make_namespace(tenant="team-b"))
    with kvtier.Client.connect(daemon_factory("--host-bytes", "64MiB").unix, transport="tcp") as c:
        assert c.tenant is None  # no tenants: a namespace stays as given
        assert c.register(make_namespace()).namespace.tenant is None

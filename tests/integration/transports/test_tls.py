"""TLS on the gRPC TCP listener (issue 11): a real daemon, certificates made by the test
(openssl, via tests/redis_cluster.make_test_pki: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate with CN "kvtier test client").

Plaintext to the TLS port fails; with mTLS required, a client without a certificate fails and
one with a tenant's certificate is that tenant without a token; a non-loopback plaintext
listener is refused at start unless allowed (then warned); reflection is on the Unix socket
only by default.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import make_namespace
from redis_cluster import make_test_pki

import kvtier
from kvtier_contract import errors


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_test_pki(d)
    return d


def tls_daemon(daemon_factory: Any, tmp_path: Path, pki: Path, *, require: bool) -> Any:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        '[[tenant]]\nname = "team-a"\nmtls_names = ["kvtier test client"]\n'
        f'tokens_sha256 = ["{hashlib.sha256(b"tok-a").hexdigest()}"]\n'
    )
    cfg = tmp_path / "kvtierd.toml"
    mtls = f'tls_client_ca = "{pki / "ca.crt"}"\ntls_require_client_cert = true\n'
    cfg.write_text(
        f'tls_cert = "{pki / "server.crt"}"\ntls_key = "{pki / "server.key"}"\n'
        f'{mtls if require else ""}tenants_file = "{tenants}"\n'
        'listen = "127.0.0.1:0"\n'
    )
    return daemon_factory(
        "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )


def test_mtls_identifies_the_tenant_and_plaintext_or_no_certificate_fails(
    daemon_factory: Any, tmp_path: Path, pki: Path
) -> None:
    d = tls_daemon(daemon_factory, tmp_path, pki, require=True)
    tls = dict(tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "client.crt"), tls_key=str(pki / "client.key"))
    with kvtier.Client.connect(d.grpc, transport="tcp", **tls) as c:  # no token: the cert
        ns = c.register(make_namespace(tenant="team-a"))
        keys = ns.block_keys(list(range(16 * 4)))
        assert ns.put(keys, [b"\x03" * ns.block_bytes] * 4).stored == 4
        assert [bytes(g) if g else None for g in ns.get(keys)] == [b"\x03" * ns.block_bytes] * 4
        assert [n["namespace_id"] for n in c.stats()["namespaces"]] == [ns.namespace_id]
    for kwargs in ({}, {"tls_ca": str(pki / "ca.crt")}):  # plaintext; TLS without a cert
        with kvtier.Client.connect(d.grpc, transport="tcp", timeout_s=2, lazy=True, **kwargs) as c:
            with pytest.raises((errors.Unavailable, errors.Unauthenticated)):
                c.stats()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "stats",
            "--address",
            d.grpc,
            "--json",
            *[f"--{k.replace('_', '-')}={v}" for k, v in tls.items()],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


def test_tls_without_client_certificates_takes_tokens(daemon_factory: Any, tmp_path: Path, pki: Path) -> None:
    d = tls_daemon(daemon_factory, tmp_path, pki, require=False)
    with kvtier.Client.connect(d.grpc, transport="tcp", tls_ca=str(pki / "ca.crt"), token="tok-a") as c:
        assert c.register(make_namespace(tenant="team-a")).namespace_id
        assert c.stats()["namespaces"]
    with kvtier.Client.connect(
        d.grpc, transport="tcp", tls_ca=str(pki / "ca.crt"), timeout_s=2, lazy=True
    ) as c:
        with pytest.raises(errors.Unauthenticated):
            c.stats()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(d.grpc) as ch:  # plaintext to the TLS port: not even health
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_the_data_channel_serves_tls_whenever_the_grpc_listener_does(
    daemon_factory: Any, tmp_path: Path, pki: Path
) -> None:
    """Stores and loads over tcp cross TLS (verified against the client's CA), from a client on
    the TLS listener or on the Unix socket; plaintext to the data port gets no frame back, and a
    client that cannot verify the daemon's certificate gets misses, never an exception."""
    import socket
    import ssl

    from kvtier_contract import wire

    d = tls_daemon(daemon_factory, tmp_path, pki, require=False)
    for address in (d.grpc, d.unix):
        with kvtier.Client.connect(address, transport="tcp", tls_ca=str(pki / "ca.crt"), token="tok-a") as c:
            ns = c.register(make_namespace(tenant="team-a", model_revision=address[-6:]))
            keys = ns.block_keys(list(range(16 * 8)))
            data = [hashlib.shake_256(b"%d" % i).digest(ns.block_bytes) for i in range(8)]
            assert ns.put(keys, data).stored == 8, c.counters.last_error
            assert [bytes(g) if g else None for g in ns.get(keys)] == data
            assert c.counters.last_error == ""
    host, _, port = d.info["data"].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:  # plaintext HELLO
        s.sendall(wire.hello(1, bytes(32)))
        try:
            reply = s.recv(64)
        except (ConnectionResetError, TimeoutError):
            reply = b""
        assert not reply.startswith(wire.MAGIC)  # a TLS alert or nothing, never a frame
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):  # TLS, a guessed secret
        s.sendall(wire.hello(1, bytes(32)))
        op, *_ = wire.unpack(s.recv(wire.HEADER.size))
        assert op is wire.Op.ERROR
    with kvtier.Client.connect(
        d.unix, transport="tcp", token="tok-a", timeout_s=2, lazy=True
    ) as c:  # (without lazy: an error naming tls_ca)
        ns = c.register(make_namespace(tenant="team-a"))  # no CA: the system's cannot verify
        keys = ns.block_keys(list(range(16)))
        assert ns.put(keys, [b"\x01" * ns.block_bytes]).stored == 0
        assert ns.get(keys) == [None]
        assert "certificate verify failed" in c.counters.last_error


def test_a_plaintext_non_loopback_listener_is_refused_unless_allowed(tmp_path: Path) -> None:
    base = [
        sys.executable,
        "-m",
        "kvtierd",
        "serve",
        "--socket",
        str(tmp_path / "k.sock"),
        "--metrics-port",
        "-1",
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
    ]
    for flags, field in (
        (["--listen", "0.0.0.0:0"], "listen"),
        (["--listen", "", "--data-listen", "0.0.0.0:0"], "data_listen"),
    ):
        out = subprocess.run(base + flags, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"configuration error: {field}:" in out.stderr, out.stderr
    from conftest import DaemonProcess

    tenants = tmp_path / "tenants.toml"  # plaintext allowed, but never without credentials
    tenants.write_text(f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{hashlib.sha256(b"t").hexdigest()}"]\n')
    d = DaemonProcess(
        tmp_path / "d",
        "--listen",
        "0.0.0.0:0",
        "--allow-plaintext-remote",
        "--tenants-file",
        str(tenants),
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
    ).start()
    try:
        log = (tmp_path / "d" / "kvtierd.log").read_text()
        assert "in plaintext (allow_plaintext_remote)" in log
    finally:
        d.kill()


def test_reflection_is_on_the_unix_socket_only(daemon: Any) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def services(target: str) -> list[str]:
        with grpc.insecure_channel(target) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            return [s.name for r in replies for s in r.list_services_response.service]

    assert "kvtier.v1.Kvtier" in services(daemon.unix)
    with pytest.raises(grpc.RpcError) as e:
        services(daemon.grpc)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED

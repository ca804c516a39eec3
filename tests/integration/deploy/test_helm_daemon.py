"""The Helm chart's kvtier container, as rendered, run as a real kvtierd.

The DaemonSet of deploy/helm/kvtier is rendered by the real helm; its kvtier container's
arguments and its tenants file start a real daemon, with only the paths (certificates, tenants
file, socket), the ports (0: chosen by the OS) and the host tier's size changed for this machine.
Listeners keep the chart's bind address, 0.0.0.0 (the pod IP), and are reached over loopback.

* /metrics: scrapeable from the pod network with the chart's scrape token (every figure), 401
  without one and with a tenant's (it can act: never asked for in plaintext); the scrape token
  refused by every gRPC call like an unknown one. The chart passes --allow-plaintext-metrics
  (plaintext /metrics off loopback is an explicit choice; without it the daemon refuses to
  start), never --allow-plaintext-remote, and the daemon binds /metrics off loopback only
  because its tenants file has a scrape token.
* TLS (the chart's tls values, mTLS): an engine on another node stores and loads over the TLS
  gRPC listener and the TLS data channel bound to 0.0.0.0 (advertised as such: the client dials
  the host it reached gRPC at).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from helm_chart import by_kind, container, render
from tests_helpers import TokenStub, scrape_metrics

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb

SCRAPE = "scrape-tok-1"
TEAM_A = "team-a-tok-1"
MiB = 1 << 20


def _chart(scrape: str | None = SCRAPE) -> tuple[list[str], str, str]:
    """(the kvtier container's command + args, the tenants file, the scrape token of its
    Secret) of the rendered DaemonSet; ``scrape`` None: the chart makes the token."""
    digest = hashlib.sha256(TEAM_A.encode()).hexdigest()
    docs = render(
        sets=(
            "mode=daemonset",
            "tenants.enabled=true",
            "tenants.list[0].name=team-a",
            f"tenants.list[0].tokensSha256={{{digest}}}",
            "tenants.list[0].transports={tcp}",
            "tenants.list[0].quotas.host_bytes=32MiB",
            "metrics.serviceMonitor.enabled=true",
            *((f"metrics.scrape.token={scrape}",) if scrape else ()),
        )
    )
    kvtier_c = container(docs)
    secrets = {s["metadata"]["name"].rpartition("-")[2]: s["stringData"] for s in by_kind(docs)["Secret"]}
    return (
        kvtier_c["command"] + kvtier_c["args"],
        secrets["tenants"]["tenants.toml"],
        secrets["token"]["token"],
    )


def _for_this_machine(argv: list[str], run_dir: Path, tenants: Path) -> list[str]:
    """The chart's ``serve`` arguments with paths, ports and sizes of this test."""
    swap = {
        "--socket": str(run_dir / "kvtier.sock"),
        "--tenants-file": str(tenants),
        "--metrics-port": "0",
        "--health-listen": "0.0.0.0:0",
        "--host-bytes": "64MiB",
    }
    out = list(argv[2:])
    for i, a in enumerate(out[:-1]):
        if a in swap:
            out[i + 1] = swap[a]
    return out


@pytest.fixture
def chart_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    argv, toml, _ = _chart()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(toml)
    args = _for_this_machine(argv, tmp_path / "run", tenants)
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
    d = DaemonProcess(tmp_path / "run", *args).start()
    assert d.info["metrics"].startswith("http://0.0.0.0:"), d.info["metrics"]  # the pod IP
    yield d
    d.kill()


def test_the_scrape_token_reads_every_figure_and_anonymous_or_tenant_scrapes_get_401(
    chart_daemon: DaemonProcess,
) -> None:
    with kvtier.Client.connect(chart_daemon.unix, transport="tcp", token=TEAM_A) as c:
        ns = c.register(make_namespace(tenant="team-a", model_id="org/model-of-a"))
        keys = ns.block_keys(list(range(16 * 2)))
        assert ns.put(keys, [b"\x5a" * ns.block_bytes] * 2).stored == 2
    for token in (None, "not-a-token"):
        code, body = scrape_metrics(chart_daemon, token)
        assert code == 401 and "model-of-a" not in body
    code, body = scrape_metrics(chart_daemon, SCRAPE)
    assert code == 200
    assert 'model="org/model-of-a"' in body  # another tenant's namespace: the operator's view
    assert 'method="RegisterNamespace"' in body  # daemon-wide figures
    assert all(k.hex() not in body for k in keys)  # figures, never keys
    assert "process_resident_memory_bytes" in body  # the operator's view: process figures too
    code, body = scrape_metrics(chart_daemon, TEAM_A)  # a tenant's token can act: not in plaintext
    assert code == 401 and "model-of-a" not in body


def test_the_scrape_token_is_refused_by_every_rpc(chart_daemon: DaemonProcess) -> None:
    """Sent in plaintext HTTP, the token must act on nothing: every Kvtier RPC refuses it as an
    unknown token (Stats included; tests/integration/tenancy/test_scrape_tokens.py: the handshakes)."""
    raw = TokenStub(chart_daemon.unix, SCRAPE)
    try:
        for method in pb.DESCRIPTOR.services_by_name["Kvtier"].methods:
            request = getattr(pb, method.input_type.name)()
            code, details = raw.code(method.name, request)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method.name, code, details)
        ns = make_namespace(tenant="team-a")
        fields: dict[str, Any] = {k: v for k, v in ns.to_dict().items() if v is not None}
        code, _ = raw.code(
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**fields), digest=ns.digest),
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        raw.channel.close()


def test_the_chart_sets_only_the_metrics_plaintext_flag_and_without_it_the_daemon_refuses(
    tmp_path: Path,
) -> None:
    """Plaintext /metrics on the pod IP is an explicit choice: the chart passes the narrow
    --allow-plaintext-metrics, and the same arguments without it are refused at start, naming
    metrics_host and both flags."""
    argv, toml, _ = _chart()
    assert "--allow-plaintext-metrics" in argv and "--allow-plaintext-remote" not in argv
    (tmp_path / "tenants.toml").write_text(toml)
    args = _for_this_machine(argv, tmp_path / "run", tmp_path / "tenants.toml")
    args.remove("--allow-plaintext-metrics")
    with pytest.raises(
        RuntimeError, match="metrics_host: .*--allow-plaintext-metrics.*--allow-plaintext-remote"
    ):
        DaemonProcess(tmp_path / "run", *args).start()


def test_without_its_scrape_token_the_charts_daemon_refuses(tmp_path: Path) -> None:
    """The scrape token in the tenants file is what lets /metrics onto the pod IP with tenants:
    the chart's arguments with a tenants file without metrics_tokens_sha256 are refused."""
    argv, toml, _ = _chart()
    (tmp_path / "tenants.toml").write_text(
        "\n".join(line for line in toml.splitlines() if not line.startswith("metrics_tokens_sha256"))
    )
    args = _for_this_machine(argv, tmp_path / "run", tmp_path / "tenants.toml")
    with pytest.raises(RuntimeError, match="metrics_host: .*metrics_tokens_sha256"):
        DaemonProcess(tmp_path / "run", *args).start()


def test_the_token_the_chart_makes_scrapes_the_charts_daemon(tmp_path: Path) -> None:
    """Issue 39: /metrics on the pod IP gets a scrape token by default. Given none, the chart
    makes one (its Secret, for the monitors) and lists its digest in the tenants file: the
    daemon starts with /metrics on the pod IP, the token reads every figure, none gets 401."""
    argv, toml, token = _chart(scrape=None)
    assert token and token != SCRAPE
    (tmp_path / "tenants.toml").write_text(toml)
    d = DaemonProcess(tmp_path / "run", *_for_this_machine(argv, tmp_path / "run", tmp_path / "tenants.toml"))
    d.start()
    try:
        assert d.info["metrics"].startswith("http://0.0.0.0:")
        code, body = scrape_metrics(d, token)
        assert code == 200 and "process_resident_memory_bytes" in body
        assert scrape_metrics(d, None)[0] == 401
    finally:
        d.kill()


def test_an_engine_on_another_node_stores_and_loads_over_the_charts_mtls_listeners(tmp_path: Path) -> None:
    from redis_cluster import make_test_pki

    pki = tmp_path / "pki"
    make_test_pki(pki)
    digest = hashlib.sha256(TEAM_A.encode()).hexdigest()
    docs = render(
        sets=(
            "mode=daemonset",
            "tls.enabled=true",
            "tls.existingSecret=kvtier-certs",
            "tls.requireClientCert=true",
            "tenants.enabled=true",
            "tenants.list[0].name=team-a",
            f"tenants.list[0].tokensSha256={{{digest}}}",
            "tenants.list[0].mtlsNames={kvtier test client}",
            "tenants.list[0].transports={tcp}",
            "tenants.list[0].quotas.host_bytes=32MiB",
            f"metrics.scrape.token={SCRAPE}",
        )
    )
    kvtier_c = container(docs)
    (secret,) = [s for s in by_kind(docs)["Secret"] if s["metadata"]["name"].endswith("-tenants")]
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    args = _for_this_machine(
        kvtier_c["command"] + kvtier_c["args"], tmp_path / "run", tmp_path / "tenants.toml"
    )
    files = {
        "/etc/kvtier/tls/tls.crt": "server.crt",
        "/etc/kvtier/tls/tls.key": "server.key",
        "/etc/kvtier/tls/ca.crt": "ca.crt",
    }
    args = [str(pki / files[a]) if a in files else a for a in args]
    for flag in ("--listen", "--data-listen"):  # the chart's 0.0.0.0, on a free port
        assert args[args.index(flag) + 1].startswith("0.0.0.0:")
        args[args.index(flag) + 1] = "0.0.0.0:0"
    d = DaemonProcess(tmp_path / "run", *args).start()
    try:
        assert d.info["grpc"].startswith("0.0.0.0:")
        address = "127.0.0.1:" + d.info["grpc"].rpartition(":")[2]  # "the pod IP"
        tls = dict(
            tls_ca=str(pki / "ca.crt"), tls_cert=str(pki / "client.crt"), tls_key=str(pki / "client.key")
        )
        with kvtier.Client.connect(address, transport="tcp", token=TEAM_A, **tls) as c:
            ns = c.register(make_namespace(tenant="team-a"))
            keys = ns.block_keys(list(range(16 * 4)))
            data = [hashlib.shake_256(b"%d" % i).digest(ns.block_bytes) for i in range(4)]
            assert ns.put(keys, data).stored == 4, c.counters.last_error
            assert [bytes(g) if g else None for g in ns.get(keys)] == data
            assert c.counters.last_error == ""
        from kvtier_contract.errors import KvtierError

        try:  # no client certificate: refused at connect, or every store dropped
            with kvtier.Client.connect(
                address, transport="tcp", token=TEAM_A, tls_ca=tls["tls_ca"], timeout_s=2
            ) as c:
                stored = c.register(make_namespace(tenant="team-a")).put(keys[:1], data[:1]).stored
        except KvtierError:
            stored = 0
        assert stored == 0
    finally:
        d.kill()

"""Scrape-only tokens (issue 29 item 10): a real daemon whose tenants file has
``metrics_tokens_sha256``.

* /metrics answers a scrape token with every figure, what the operator's token sees
  (``process_*`` included, never keys or bytes); a tenant's token still sees only its own; an
  unknown token or none gets 401.
* Everything else refuses it exactly like an unknown token: every Kvtier RPC (UNAUTHENTICATED),
  on another tenant's live session too, and every handshake of the shm socket and the data
  channel (which take a session's data secret, never a token).
* SIGHUP re-reads the list: a removed scrape token gets 401, an added one 200.
* /metrics off loopback in plaintext: refused at start without an explicit flag, naming
  metrics_host and both flags; with --allow-plaintext-metrics (not --allow-plaintext-remote)
  allowed when the file has a scrape token, and then it takes only scrape tokens (a tenant's or
  the operator's, which can act, gets 401); refused at start when the file has none.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import TokenStub, scrape_metrics, wait_for

import kvtier
from kvtier_contract import errors, wire
from kvtier_contract import published_index as pi
from kvtier_contract.v1 import kvtier_pb2 as pb

SCRAPE, SCRAPE_NEXT = "scrape-tok-3e1f", "scrape-tok-next-77d0"
TOKENS = {"team-a": "tok-a-5c1d", "team-b": "tok-b-0e9a", "ops": "tok-ops-4b21"}


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_tenants(path: Path, scrape_tokens: tuple[str, ...] = (SCRAPE,)) -> Path:
    body = f"metrics_tokens_sha256 = {[digest(t) for t in scrape_tokens]}\n\n".replace("'", '"')
    for name, token in TOKENS.items():
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{digest(token)}"]\n'
        body += "operator = true\n\n" if name == "ops" else 'transports = ["tcp", "shm"]\n\n'
    path.write_text(body)
    return path


def start(
    daemon_factory: Any, tmp_path: Path, *args: str, scrape_tokens: tuple[str, ...] = (SCRAPE,)
) -> DaemonProcess:
    tenants = write_tenants(tmp_path / "tenants.toml", scrape_tokens)
    d: DaemonProcess = daemon_factory(
        "--tenants-file",
        str(tenants),
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        *args,
        run_dir=tmp_path / "d",
    )
    return d


@pytest.fixture
def scraped(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    """/metrics on loopback (the default): every kind of token is taken there."""
    return start(daemon_factory, tmp_path)


def families(body: str) -> set[str]:
    return {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}


def put_two(d: DaemonProcess, tenant: str, model: str) -> list[bytes]:
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS[tenant]) as c:
        ns = c.register(make_namespace(tenant=tenant, model_id=model))
        keys = ns.block_keys(list(range(16 * 2)))
        assert ns.put(keys, [b"\x5a" * ns.block_bytes] * 2).stored == 2, c.counters.last_error
    return keys


def test_a_scrape_token_sees_every_figure_and_a_tenant_only_its_own(scraped: DaemonProcess) -> None:
    keys = put_two(scraped, "team-a", "org/model-of-a") + put_two(scraped, "team-b", "org/model-of-b")
    for token in (None, "not-a-token", digest(SCRAPE)):  # its digest is no token either
        code, body = scrape_metrics(scraped, token)
        assert code == 401 and "model-of" not in body, (token, code)
    code, body = scrape_metrics(scraped, SCRAPE)
    assert code == 200
    assert 'model="org/model-of-a"' in body and 'model="org/model-of-b"' in body
    assert 'method="RegisterNamespace"' in body  # daemon-wide: every tenant's RPCs
    assert "process_resident_memory_bytes" in body and "python_info" in body
    assert all(k.hex() not in body for k in keys)  # figures, never keys
    code, ops = scrape_metrics(scraped, TOKENS["ops"])
    assert code == 200 and families(ops) == families(body)  # the operator's view, no less
    code, a = scrape_metrics(scraped, TOKENS["team-a"])
    assert code == 200 and 'model="org/model-of-a"' in a and "model-of-b" not in a
    assert 'method="' not in a and "process_resident_memory_bytes" not in a


def test_every_rpc_refuses_a_scrape_token_even_on_a_known_session(scraped: DaemonProcess) -> None:
    owner = TokenStub(scraped.grpc, TOKENS["team-a"])
    scraper = TokenStub(scraped.grpc, SCRAPE)
    unknown = TokenStub(scraped.grpc, "not-a-token")
    try:
        victim = owner(
            "OpenSession",
            pb.OpenSessionRequest(client_name="a", lease_ttl_ms=30_000, transport=pb.TRANSPORT_TCP),
        ).session_id
        for method in pb.DESCRIPTOR.services_by_name["Kvtier"].methods:
            request = getattr(pb, method.input_type.name)()
            if "session_id" in request.DESCRIPTOR.fields_by_name:
                request.session_id = victim  # an id it knows, as the operator's token could use
            code, details = scraper.code(method.name, request)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method.name, code, details)
            assert (code, details) == unknown.code(method.name, request)  # exactly alike
        owner("Heartbeat", pb.HeartbeatRequest(session_id=victim))  # still the owner's, alive
    finally:
        owner.channel.close()
        scraper.channel.close()
        unknown.channel.close()
    for transport in ("tcp", "shm"):  # the SDK: no figures, nothing stored
        try:
            with kvtier.Client.connect(scraped.unix, transport=transport, token=SCRAPE, timeout_s=2) as c:
                with pytest.raises(errors.Unauthenticated):
                    c.stats()
                ns = c.register(make_namespace(tenant="team-a"))
                keys = ns.block_keys(list(range(16)))
                stored = ns.put(keys, [b"\1" * ns.block_bytes]).stored
        except errors.Unauthenticated:
            stored = 0
        assert stored == 0


def _shm_exchange(d: DaemonProcess, request: bytes) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(d.info["shm"])
        s.sendall(request)
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    for fd in fds:
        os.close(fd)
    return msg, fds


def test_no_handshake_takes_a_scrape_token(scraped: DaemonProcess) -> None:
    """The shm, control, index and data-channel handshakes take a session's data secret, which
    only OpenSession hands out: the scrape token (or its digest) in its place is refused."""
    with kvtier.Client.connect(scraped.unix, transport="shm", token=TOKENS["team-a"]) as a:
        ns = a.register(make_namespace(tenant="team-a"))
        owner = TokenStub(scraped.grpc, TOKENS["team-a"])
        try:
            victim = owner(
                "OpenSession",
                pb.OpenSessionRequest(client_name="a", lease_ttl_ms=30_000, transport=pb.TRANSPORT_SHM),
            ).session_id
        finally:
            owner.channel.close()
        for secret in (hashlib.sha256(SCRAPE.encode()).digest(), SCRAPE.encode().ljust(32, b"\0")):
            for request in (
                wire.shm_request(wire.SHM_MAGIC, victim, secret),
                wire.shm_request(wire.CONTROL_MAGIC, victim, secret),
                pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, victim, ns.namespace_id, secret),
            ):
                msg, fds = _shm_exchange(scraped, request)
                assert not fds and msg.startswith(wire.SHM_REFUSED), (request[:4], msg)
            host, _, port = scraped.info["data"].rpartition(":")
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(wire.hello(victim, secret))
                head = s.recv(wire.HEADER.size, socket.MSG_WAITALL)
                assert wire.unpack(head)[0] is wire.Op.ERROR
        msg, fds = _shm_exchange(scraped, wire.SHM_REQUEST.pack(wire.LOGIN_MAGIC, 0))
        assert not fds and msg.startswith(wire.SHM_REFUSED)  # no tenant logs this peer in


def test_sighup_revokes_a_removed_scrape_token(scraped: DaemonProcess, tmp_path: Path) -> None:
    assert scrape_metrics(scraped, SCRAPE)[0] == 200 and scrape_metrics(scraped, SCRAPE_NEXT)[0] == 401
    write_tenants(tmp_path / "tenants.toml", (SCRAPE_NEXT,))  # rotation: the old one goes
    assert scraped.proc is not None
    scraped.proc.send_signal(signal.SIGHUP)
    wait_for("the removed scrape token refused", lambda: scrape_metrics(scraped, SCRAPE)[0] == 401)
    assert scrape_metrics(scraped, SCRAPE_NEXT)[0] == 200 and scrape_metrics(scraped, TOKENS["ops"])[0] == 200
    write_tenants(tmp_path / "tenants.toml", ())
    scraped.proc.send_signal(signal.SIGHUP)
    wait_for("the last scrape token refused", lambda: scrape_metrics(scraped, SCRAPE_NEXT)[0] == 401)
    log = (tmp_path / "d" / "kvtierd.log").read_text()
    assert SCRAPE not in log and SCRAPE_NEXT not in log


def test_off_loopback_plaintext_metrics_take_scrape_tokens_only(daemon_factory: Any, tmp_path: Path) -> None:
    d = start(daemon_factory, tmp_path, "--metrics-host", "0.0.0.0", "--allow-plaintext-metrics")
    assert d.info["metrics"].startswith("http://0.0.0.0:")
    put_two(d, "team-a", "org/model-of-a")
    code, body = scrape_metrics(d, SCRAPE)
    assert code == 200 and 'model="org/model-of-a"' in body
    for token in (TOKENS["team-a"], TOKENS["ops"]):  # they can act: never asked for in the clear
        code, body = scrape_metrics(d, token)
        assert code == 401 and "model-of-a" not in body
    log = tmp_path / "d" / "kvtierd.log"
    assert "in plaintext HTTP" in log.read_text() and "scrape tokens only" in log.read_text()
    write_tenants(tmp_path / "tenants.toml", ())  # the last scrape token removed
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_for("the reload", lambda: "no metrics_tokens_sha256 now" in log.read_text())
    assert scrape_metrics(d, SCRAPE)[0] == 401 and scrape_metrics(d, TOKENS["ops"])[0] == 401


def test_off_loopback_metrics_without_a_scrape_token_is_refused_at_start(
    daemon_factory: Any, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="metrics_host: .*metrics_tokens_sha256"):
        start(
            daemon_factory,
            tmp_path,
            "--metrics-host",
            "0.0.0.0",
            "--allow-plaintext-metrics",
            scrape_tokens=(),
        )


@pytest.mark.parametrize("scrape_tokens", [(SCRAPE,), ()])
def test_off_loopback_metrics_without_an_explicit_flag_is_refused_at_start(
    daemon_factory: Any, tmp_path: Path, scrape_tokens: tuple[str, ...]
) -> None:
    """A scrape token in the file is not consent to plaintext off loopback: the flag is."""
    with pytest.raises(RuntimeError) as e:
        start(daemon_factory, tmp_path, "--metrics-host", "0.0.0.0", scrape_tokens=scrape_tokens)
    for said in (
        "metrics_host: 0.0.0.0 is not a loopback address",
        "--allow-plaintext-metrics",
        "--allow-plaintext-remote",
    ):
        assert said in str(e.value), (said, str(e.value))


def test_allow_plaintext_remote_still_takes_every_token_off_loopback(
    daemon_factory: Any, tmp_path: Path
) -> None:
    d = start(
        daemon_factory, tmp_path, "--metrics-host", "0.0.0.0", "--allow-plaintext-remote", scrape_tokens=()
    )
    put_two(d, "team-a", "org/model-of-a")
    code, body = scrape_metrics(d, TOKENS["team-a"])
    assert code == 200 and 'model="org/model-of-a"' in body
    assert "every token is accepted there" in (tmp_path / "d" / "kvtierd.log").read_text()


def test_without_tenants_off_loopback_metrics_also_need_the_flag(daemon_factory: Any, tmp_path: Path) -> None:
    """No token to leak, but the figures (model ids, counts) leave the host in plaintext all
    the same: the same explicit choice (DESIGN.md §9), and with it no token is asked."""
    common = ("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--metrics-host", "0.0.0.0")
    with pytest.raises(RuntimeError, match="metrics_host: 0.0.0.0 is not a loopback address"):
        daemon_factory(*common, run_dir=tmp_path / "refused")
    d = daemon_factory(*common, "--allow-plaintext-metrics", run_dir=tmp_path / "d")
    assert d.info["metrics"].startswith("http://0.0.0.0:")
    assert scrape_metrics(d, None)[0] == 200

"""kvtier.diagnose: the words a failure gets, and one WARNING per cause (issue 29, item 2).

The daemon-backed cases (no socket, refused token, each TLS trap) are in
tests/integration/sdk/test_connect_errors.py; here the cases a test daemon cannot stage (a hostname
mismatch, a silent host), on gRPC's own words, and the rate limit on an injected clock.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from kvtier.breaker import Breaker
from kvtier.connection import Connection
from kvtier.diagnose import CauseLog, Peer, explain_attach, explain_reached, explain_rpc
from kvtier.grpc_channel import GrpcChannel
from kvtier.reach import reach
from kvtier.settings import ClientSettings
from kvtier_contract import errors

TCP = Peer("kvtier.example:50051", "tcp", tls=True, ca=True, token=True, timeout_s=0.5)


def test_a_hostname_mismatch_names_the_host_and_the_fix() -> None:
    d = explain_rpc(
        TCP,
        "OpenSession",
        "UNAVAILABLE",
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:50051: "
        "Custom verification check failed with error: UNAUTHENTICATED: Hostname "
        "Verification Check failed.",
    )
    assert d.cause == "tls-hostname" and isinstance(d.error, errors.Unavailable)
    assert "does not name host 'kvtier.example'" in str(d.error) and "subjectAltName" in str(d.error)
    assert d.rpc == ("OpenSession", "UNAVAILABLE", d.rpc[2])


def test_a_silent_host_names_the_deadline() -> None:
    d = explain_rpc(TCP, "OpenSession", "DEADLINE_EXCEEDED", "Deadline Exceeded")
    assert d.cause == "silent" and "no answer within 0.5 s" in str(d.error)


def test_a_plaintext_port_that_does_not_speak_tls_is_not_called_a_tls_port() -> None:
    plain = Peer("h:1", "tcp")
    closed = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:1: Socket closed"
    guess = explain_rpc(plain, "OpenSession", "UNAVAILABLE", closed)  # not probed: a guess
    assert guess.cause == "plaintext-on-tls" and "(a plaintext client on a TLS port?)" in str(guess.error)
    d = explain_rpc(plain, "OpenSession", "UNAVAILABLE", closed, tls_probe=False)
    assert d.cause == "unreachable" and "TLS" not in str(d.error)
    sure = explain_rpc(plain, "OpenSession", "UNAVAILABLE", closed, tls_probe=True)
    assert "TLS port?" not in str(sure.error) and "its port serves TLS" in str(sure.error)


def test_other_refusals_keep_their_class_and_name_the_daemon() -> None:
    d = explain_rpc(TCP, "OpenSession", "RESOURCE_EXHAUSTED", "sessions: 3 open, the quota")
    assert isinstance(d.error, errors.ResourceExhausted)
    assert "daemon at kvtier.example:50051: OpenSession: sessions" in str(d.error)


def test_an_shm_attach_to_another_host_says_to_use_tcp() -> None:
    d = explain_attach(
        Peer("10.0.0.5:50051", "shm"), errors.TransportError("shm socket /run/kvtier.sock.shm: No such file")
    )
    assert d.error.field == "transport" and "transport='tcp'" in str(d.error)


def test_each_cause_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    causes = CauseLog(interval_s=60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="kvtier.client")
    assert causes.report("no-socket", "no socket file")
    for _ in range(50):
        assert not causes.report("no-socket", "no socket file")
    assert causes.report("no-token", "gave no credential")  # another cause: said at once
    now[0] += 59.9
    assert not causes.report("no-socket", "no socket file")
    now[0] += 0.2
    assert causes.report("no-socket", "no socket file")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        "kvtier: no socket file",
        "kvtier: gave no credential",
        "kvtier: no socket file (51 more times since the last warning)",
    ]
    assert causes.seen() == ["no-socket", "no-token"]


def test_the_sessions_of_one_breaker_share_its_cause_log() -> None:
    shared = CauseLog()
    assert Breaker(causes=shared).causes is shared
    assert Breaker().causes is not Breaker().causes


def test_a_failure_known_only_by_its_words_is_explained_too(tmp_path: Path) -> None:
    """Calls started on the RPC threads report ``Method: CODE: details``; the session explains
    those as a failed connect would, and any other words keep what failed as their cause."""
    settings = ClientSettings(heartbeat=False)
    channel = GrpcChannel(f"unix://{tmp_path}/k.sock", settings)
    session = Connection(channel, settings, Breaker(settings.backoff_s), time.monotonic)
    try:
        session.explainer.note(
            "PrepareStore: UNAVAILABLE: failed to connect to all addresses; last error: "
            f"FAILED_PRECONDITION: unix:{tmp_path}/k.sock: connect failed: No such file or directory"
        )
        assert f"no socket file {tmp_path}/k.sock: is kvtierd running?" in session.counters.last_error
        session.explainer.note("store transfer: data channel closed")
        assert session.counters.last_error.endswith("store transfer: data channel closed")
        assert session.breaker.causes.seen() == ["away-store transfer", "no-socket"]
    finally:
        session.close()


CLOSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:1: Socket closed"


def test_a_tls_client_whose_handshake_a_plaintext_port_closes_is_told_so() -> None:
    """gRPC says "Socket closed" both when a TLS daemon wants a client certificate and when a
    plaintext port drops a ClientHello: the probe (strict connect) tells them apart."""
    plain = explain_rpc(TCP, "OpenSession", "UNAVAILABLE", CLOSED, tls_probe=False)
    assert plain.cause == "tls-on-plaintext" and plain.error.field == "tls_ca"
    assert "TLS client on a plaintext port" in str(plain.error)
    sure = explain_rpc(TCP, "OpenSession", "UNAVAILABLE", CLOSED, tls_probe=True)
    assert sure.cause == "tls-cert-required" and "unless" not in str(sure.error)
    guess = explain_rpc(TCP, "OpenSession", "UNAVAILABLE", CLOSED)  # not probed (lazy)
    assert guess.cause == "tls-cert-required"
    assert "unless the port does not serve TLS: then drop tls_ca=" in str(guess.error)


@pytest.mark.parametrize("details", ["daemon is draining", "daemon is draining: stores are not admitted"])
def test_a_draining_daemon_is_said_to_be_draining_not_missing(details: str) -> None:
    for peer in (TCP, Peer("unix:///run/kvtier.sock")):
        d = explain_rpc(peer, "OpenSession", "UNAVAILABLE", details)
        text = str(d.error)
        assert d.cause == "draining" and isinstance(d.error, errors.Unavailable)
        assert "is draining" in text and "retry" in text, text
        assert "is kvtierd running" not in text and "make serve" not in text, text


NO_FILE = (
    "failed to connect to all addresses; last error: UNAVAILABLE: unix:/s: connect failed: "
    "No such file or directory"
)


def test_a_unix_socket_is_asked_itself_not_grpcs_last_words(tmp_path: Path) -> None:
    """Issue 41: gRPC's words can be an earlier attempt's (a subchannel shared with another
    channel, still backing off after "No such file"); what the socket file says now wins."""
    path = tmp_path / "k.sock"
    peer = Peer(f"unix://{path}", "tcp")

    def told(code: str = "UNAVAILABLE", details: str = NO_FILE) -> tuple[str, str]:
        d = explain_reached(peer, "OpenSession", code, details, 0.5)
        return d.cause, str(d.error)

    assert reach(peer.address, 0) == "missing" and told()[0] == "no-socket"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # a socket file nobody listens on, though gRPC said "No such file"
    assert reach(peer.address, 0) == "refused"
    cause, text = told()
    assert cause == "stale-socket" and f"nothing listens on {path}" in text, text
    stale.listen(1)  # listening now: gRPC's "No such file" was an earlier attempt's
    d = explain_reached(peer, "OpenSession", "UNAVAILABLE", NO_FILE, 0.5)
    assert d.cause == "answers-now" and d.transient and "no socket file" not in str(d.error)
    assert f"its socket {path} accepts connections now" in str(d.error) and "retry" in str(d.error)
    assert told(details="Socket closed")[0] == "unreachable"  # words that say it was reached
    assert told("DEADLINE_EXCEEDED", "Deadline Exceeded")[0] == "silent"  # not asked: it waited
    stale.close()
    path.unlink()
    path.write_text("")
    assert reach(peer.address, 0) == "not-socket" and told()[0] == "not-socket"
    assert explain_rpc(peer, "OpenSession", "UNAVAILABLE", NO_FILE).cause == "no-socket"  # not asked


def test_a_tcp_address_is_asked_with_a_connect() -> None:
    """A port's refusal is one connect's answer now; a port that accepts is never "refused"
    whatever gRPC last said; an unresolvable host is told by its resolver."""
    refused_words = (
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused"
    )
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        peer = Peer(f"127.0.0.1:{port}", "tcp")
        assert reach(peer.address, 1.0) == "listening"
        d = explain_reached(peer, "OpenSession", "UNAVAILABLE", refused_words, 1.0)
        assert d.cause == "answers-now" and d.transient and "nothing listens" not in str(d.error)
    d = explain_reached(peer, "OpenSession", "UNAVAILABLE", "Socket closed", 1.0)
    assert d.cause == "refused" and "nothing listens there" in str(d.error)
    assert reach("no-such-host.invalid:50051", 5.0) in ("unresolved", None)  # None: slower than 5 s
    assert reach("dns:///h:1", 1.0) is None and reach(peer.address, 0) is None

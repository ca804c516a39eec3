"""The control channel (issue 16, transfers): a same-host session's control calls as framed
protobufs on the shm socket instead of gRPC, served by the same handlers.

* the SDK's shm puts, gets, lookups and heartbeats go over it (byte-exact), a tcp session's
  over one on the data port (HELLO offering FEATURE_CONTROL), and over gRPC when the daemon does
  not serve it (``control_channel = false``);
* the handshake needs a live session and its data secret; a channel speaks only for its own
  session and, on a daemon with tenants, as that session's tenant;
* bad frames: an undecodable body is INVALID_ARGUMENT (the channel stays), an unknown method or
  an oversized length closes the connection, errors carry the handlers' status and message;
* a session's end closes its channels; at most 8 per session;
* a daemon that stops answering turns a call into a miss within the client's timeout.
"""

from __future__ import annotations

import hashlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import open_fds, until_unauthenticated, wait_for

import kvtier
from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

METHOD = {name: n + 1 for n, name in enumerate(wire.CONTROL_METHODS)}
TOKENS = {"team-a": "ctl-a-1", "team-b": "ctl-b-2"}


def connect(d: DaemonProcess, session_id: int, secret: bytes) -> tuple[socket.socket | None, bytes]:
    """A raw control handshake: (the connection, the reply), or (None, the refusal)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(d.info["shm"])
    s.sendall(wire.SHM_REQUEST.pack(wire.CONTROL_MAGIC, session_id) + secret)
    reply = s.recv(4096)
    if reply[:4] != wire.CONTROL_MAGIC:
        s.close()
        return None, reply
    return s, reply


def call(s: socket.socket, method: str | int, body: bytes, timeout_ms: int = 2000) -> tuple[int, bytes]:
    number = METHOD[method] if isinstance(method, str) else method
    s.sendall(wire.CALL.pack(len(body), number, timeout_ms) + body)
    head = _exactly(s, wire.RESULT.size)
    length, status = wire.RESULT.unpack(head)
    return status, _exactly(s, length)


def _exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def closed(s: socket.socket) -> bool:
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


class Raw:
    """A gRPC stub (with a tenant's token, if any)."""

    def __init__(self, d: DaemonProcess, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(d.grpc)
        self.stub = pb_grpc.KvtierStub(self.channel)
        self.md = (("authorization", f"Bearer {token}"),) if token else ()

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=5, metadata=self.md)

    def open(self) -> Any:
        return self(
            "OpenSession",
            pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=30_000, transport=pb.TRANSPORT_SHM),
        )


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[Raw]:
    r = Raw(daemon)
    yield r
    r.channel.close()


def data_for(ns: Any, n: int, tag: bytes = b"c") -> list[bytes]:
    return [hashlib.shake_256(tag + b"%d" % i).digest(ns.block_bytes) for i in range(n)]


def test_shm_transfers_lookups_and_heartbeats_use_the_control_channel(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, "shm", local_lookups=False) as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 8)))
        data = data_for(ns, 8)
        assert ns.put(keys, data).stored == 8
        assert ns.lookup(keys) == 8
        assert [bytes(b) for b in ns.get(keys)] == data  # type: ignore[arg-type]
        c.session.call("Heartbeat", pb.HeartbeatRequest())
        ctl = c.session.connection.control
        assert ctl is not None and ctl.calls >= 6  # put 2, get 2, lookup, beat
        metrics = _metrics(daemon)
        assert 'kvtier_connections{transport="control"} 1.0' in metrics
        # the same handlers: their latency histograms count these calls
        assert 'kvtier_rpc_duration_seconds_count{method="PrepareStore"} 1.0' in metrics


def test_without_the_control_channel_the_client_uses_grpc(daemon_factory: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text("control_channel = false\n")
    d = daemon_factory("--config", str(cfg), "--host-bytes", "16MiB", "--slab-bytes", "1MiB")
    with kvtier.Client.connect(d.unix, "shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        data = data_for(ns, 4)
        assert ns.put(keys, data).stored == 4
        assert [bytes(b) for b in ns.get(keys)] == data  # type: ignore[arg-type]
        assert c.session.connection.control is not None and c.session.connection.control.calls == 0
        assert "not served" in c.session.connection.control.refused
    with kvtier.Client.connect(d.grpc, "tcp") as c:
        ns = c.register(make_namespace())
        assert ns.put(keys, data).already_present == 4
        assert [bytes(b) for b in ns.get(keys)] == data  # type: ignore[arg-type]
        assert c.session.connection.control is not None and c.session.connection.control.calls == 0
        assert "serves no control channel" in c.session.connection.control.refused


def test_tcp_transfers_use_a_control_channel_on_the_data_port(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.grpc, "tcp") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 8)))
        data = data_for(ns, 8, b"t")
        assert ns.put(keys, data).stored == 8
        assert ns.lookup(keys) == 8
        assert [bytes(b) for b in ns.get(keys)] == data  # type: ignore[arg-type]
        assert c.session.connection.control is not None and c.session.connection.control.calls >= 5
        metrics = _metrics(daemon)
        assert 'kvtier_connections{transport="tcp"} 2.0' in metrics  # data + control
        assert 'kvtier_rpc_duration_seconds_count{method="PrepareLoad"} 1.0' in metrics


def test_a_control_connection_the_daemon_closed_while_idle_is_replaced(
    daemon_factory: Any, tmp_path: Path
) -> None:
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text("data_idle_timeout_s = 0.5\n")
    d = daemon_factory("--config", str(cfg), "--host-bytes", "16MiB", "--slab-bytes", "1MiB")
    with kvtier.Client.connect(d.grpc, "tcp", heartbeat=False) as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        data = data_for(ns, 2, b"i")
        assert ns.put(keys, data).stored == 2
        assert c.session.connection.control is not None
        busy = open_fds(d.info["pid"])
        wait_for(  # the daemon closes the idle data and control connections
            "the idle connections closed", lambda: open_fds(d.info["pid"]) <= busy - 2, timeout=10
        )
        calls = c.session.connection.control.calls
        assert ns.lookup(keys) == 2
        assert [bytes(b) for b in ns.get(keys)] == data  # type: ignore[arg-type]
        assert c.session.connection.control.calls >= calls + 3  # on new control connections
        assert c.breaker.trips == 0 and c.counters.puts_dropped == 0


def test_a_tcp_control_hello_needs_the_data_secret(daemon: DaemonProcess, raw: Raw) -> None:
    reply = raw.open()
    host, port = daemon.info["data"].rsplit(":", 1)
    for secret, ok in ((b"\0" * wire.DATA_SECRET_BYTES, False), (bytes(reply.data_secret), True)):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(wire.hello(reply.session_id, secret, wire.FEATURE_CONTROL))
            op, _job, _index, features, length = wire.unpack(_exactly(s, wire.HEADER.size))
            if not ok:
                assert op is wire.Op.ERROR and b"wrong data secret" in _exactly(s, length)
                continue
            assert op is wire.Op.HELLO_OK and features & wire.FEATURE_CONTROL
            status, body = call(
                s, "Heartbeat", pb.HeartbeatRequest(session_id=reply.session_id).SerializeToString()
            )
            assert status == 0 and pb.HeartbeatReply.FromString(body).boot_epoch
            raw("CloseSession", pb.CloseSessionRequest(session_id=reply.session_id))
            assert closed(s)  # the session's end closes it, without a KVD1 frame


def test_eight_control_connections_per_session_on_the_data_port(daemon: DaemonProcess, raw: Raw) -> None:
    reply = raw.open()
    host, port = daemon.info["data"].rsplit(":", 1)
    socks = []
    try:
        for n in range(9):
            s = socket.create_connection((host, int(port)), timeout=5)
            socks.append(s)
            s.sendall(wire.hello(reply.session_id, bytes(reply.data_secret), wire.FEATURE_CONTROL))
            op, _job, _index, _features, length = wire.unpack(_exactly(s, wire.HEADER.size))
            if n < 8:
                assert op is wire.Op.HELLO_OK
            else:
                assert op is wire.Op.ERROR
                assert b"8 control connections open already" in _exactly(s, length)
        # a data connection of the same session is still welcome
        s = socket.create_connection((host, int(port)), timeout=5)
        socks.append(s)
        s.sendall(wire.hello(reply.session_id, bytes(reply.data_secret), wire.FEATURE_RUNS))
        assert wire.unpack(_exactly(s, wire.HEADER.size))[0] is wire.Op.HELLO_OK
    finally:
        for s in socks:
            s.close()


def test_the_handshake_needs_a_live_session_and_its_data_secret(daemon: DaemonProcess, raw: Raw) -> None:
    reply = raw.open()
    s, msg = connect(daemon, reply.session_id, b"\0" * wire.DATA_SECRET_BYTES)
    assert s is None and msg.startswith(wire.SHM_REFUSED) and b"unknown or expired" in msg
    s, msg = connect(daemon, reply.session_id + 1, bytes(reply.data_secret))
    assert s is None and b"unknown or expired" in msg
    s, msg = connect(daemon, reply.session_id, bytes(reply.data_secret))
    assert s is not None
    with s:
        magic, epoch = wire.CONTROL_REPLY.unpack(msg)
        assert epoch == reply.boot_epoch
        status, body = call(
            s, "Heartbeat", pb.HeartbeatRequest(session_id=reply.session_id).SerializeToString()
        )
        assert status == 0 and pb.HeartbeatReply.FromString(body).boot_epoch == reply.boot_epoch


def test_a_channel_speaks_only_for_its_own_session(daemon: DaemonProcess, raw: Raw) -> None:
    mine, other = raw.open(), raw.open()
    s, _ = connect(daemon, mine.session_id, bytes(mine.data_secret))
    assert s is not None
    with s:
        status, body = call(
            s, "Heartbeat", pb.HeartbeatRequest(session_id=other.session_id).SerializeToString()
        )
        assert status == grpc.StatusCode.NOT_FOUND.value[0]
        assert b"unknown or expired session" in body
        # the channel stays usable, and errors are the handlers' own
        ns = raw("RegisterNamespace", pb.RegisterNamespaceRequest(spec=kvtier_spec(make_namespace())))
        status, body = call(
            s,
            "PrepareStore",
            pb.PrepareStoreRequest(
                session_id=mine.session_id,
                namespace_id=ns.namespace_id,
                keys=b"x" * 31,
                transport=pb.TRANSPORT_SHM,
            ).SerializeToString(),
        )
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"keys" in body
        status, body = call(
            s,
            "Lookup",
            pb.LookupRequest(
                session_id=mine.session_id, namespace_id=ns.namespace_id + 99, keys=b"k" * 32
            ).SerializeToString(),
        )
        assert status == grpc.StatusCode.NOT_FOUND.value[0] and b"namespace" in body


def test_bad_frames(daemon: DaemonProcess, raw: Raw) -> None:
    reply = raw.open()
    s, _ = connect(daemon, reply.session_id, bytes(reply.data_secret))
    assert s is not None
    with s:
        status, body = call(s, "PrepareLoad", b"\xff\xff\xff")  # undecodable: answered
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"could not be decoded as kvtier.v1.PrepareLoadRequest" in body
        assert (
            call(s, "Heartbeat", pb.HeartbeatRequest(session_id=reply.session_id).SerializeToString())[0] == 0
        )
        s.sendall(wire.CALL.pack(0, len(wire.CONTROL_METHODS) + 1, 1000))  # unknown method
        assert closed(s)
    s, _ = connect(daemon, reply.session_id, bytes(reply.data_secret))
    assert s is not None
    with s:
        s.sendall(wire.CALL.pack(wire.CONTROL_MAX_BYTES + 1, METHOD["Lookup"], 1000))
        assert closed(s)  # (before a byte of that body is buffered)
    # the daemon still serves everyone
    assert raw("Heartbeat", pb.HeartbeatRequest(session_id=reply.session_id)).boot_epoch
    # one warning for the daemon, not one per connection, and no session id in it (issue 26:
    # a peer opening channel after channel flooded the log, which showed a credential's half)
    log = (daemon.run_dir / "kvtierd.log").read_text()
    assert len([line for line in log.splitlines() if "bad frame" in line]) == 1, log
    assert str(reply.session_id) not in log


def test_a_sessions_end_closes_its_channels_and_eight_is_the_most(daemon: DaemonProcess, raw: Raw) -> None:
    reply = raw.open()
    socks = []
    for _ in range(8):
        s, _msg = connect(daemon, reply.session_id, bytes(reply.data_secret))
        assert s is not None
        socks.append(s)
    s, msg = connect(daemon, reply.session_id, bytes(reply.data_secret))
    assert s is None and b"control channels open already" in msg
    raw("CloseSession", pb.CloseSessionRequest(session_id=reply.session_id))
    assert all(closed(s) for s in socks)
    for s in socks:
        s.close()


def test_a_tenants_channel_acts_as_that_tenant(daemon_factory: Any, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        "".join(
            f'[[tenant]]\nname = "{n}"\ntokens_sha256 = ["{hashlib.sha256(t.encode()).hexdigest()}"]'
            '\ntransports = ["shm", "tcp"]\n\n'
            for n, t in TOKENS.items()
        )
    )
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tenants}"\ntenant_arena_bytes = "4MiB"\n')
    d = daemon_factory("--config", str(cfg), "--host-bytes", "8MiB", "--slab-bytes", "1MiB")
    b = kvtier.Client.connect(d.unix, "shm", token=TOKENS["team-b"])
    ns_b = b.register(make_namespace(tenant="team-b"))
    keys = ns_b.block_keys(list(range(16 * 2)))
    assert ns_b.put(keys, data_for(ns_b, 2)).stored == 2
    assert b.session.connection.control is not None and b.session.connection.control.calls >= 2
    a = Raw(d, TOKENS["team-a"])
    reply = a.open()
    s, _ = connect(d, reply.session_id, bytes(reply.data_secret))
    assert s is not None
    with s:
        # team-b's namespace is unknown to team-a's channel, as over gRPC
        status, body = call(
            s,
            "PrepareLoad",
            pb.PrepareLoadRequest(
                session_id=reply.session_id,
                namespace_id=ns_b.namespace_id,
                keys=b"".join(keys),
                transport=pb.TRANSPORT_SHM,
            ).SerializeToString(),
        )
        assert status == grpc.StatusCode.NOT_FOUND.value[0] and b"unknown namespace" in body
        # and team-b's session is not reachable through it either
        status, body = call(
            s,
            "Heartbeat",
            pb.HeartbeatRequest(session_id=b.session.connection.session_id).SerializeToString(),
        )
        assert status == grpc.StatusCode.NOT_FOUND.value[0]
    a.channel.close()
    b.close()


def test_a_tenant_removed_by_a_reload_loses_its_open_channel(daemon_factory: Any, tmp_path: Path) -> None:
    """The caller is the tenant the *current* tenants file names: the reload that removes a
    tenant closes its sessions, and with them a channel opened before it (issue 26: it used to
    answer UNAUTHENTICATED call by call, and its session lived on)."""
    tenants = tmp_path / "tenants.toml"

    def write(names: tuple[str, ...]) -> None:
        tenants.write_text(
            "".join(
                f'[[tenant]]\nname = "{n}"\n'
                f'tokens_sha256 = ["{hashlib.sha256(TOKENS[n].encode()).hexdigest()}"]'
                '\ntransports = ["shm", "tcp"]\n\n'
                for n in names
            )
        )

    write(("team-a", "team-b"))
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tenants}"\ntenant_arena_bytes = "4MiB"\n')
    d = daemon_factory("--config", str(cfg), "--host-bytes", "8MiB", "--slab-bytes", "1MiB")
    b = Raw(d, TOKENS["team-b"])
    reply = b.open()
    s, _ = connect(d, reply.session_id, bytes(reply.data_secret))
    assert s is not None
    heartbeat = pb.HeartbeatRequest(session_id=reply.session_id).SerializeToString()
    with s:
        assert call(s, "Heartbeat", heartbeat)[0] == 0
        write(("team-a",))
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        # the reload is done once team-b's token is refused over gRPC
        until_unauthenticated(lambda: b("Stats", pb.StatsRequest()))
        assert closed(s)
    b.channel.close()


def test_a_stopped_daemon_is_a_miss_within_the_timeout(daemon: DaemonProcess) -> None:
    c = kvtier.Client.connect(daemon.unix, "shm", timeout_s=0.3, local_lookups=False)
    try:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        assert ns.put(keys, data_for(ns, 2)).stored == 2
        assert c.session.connection.control is not None and c.session.connection.control.calls >= 2
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert ns.lookup(keys) == 0
            assert time.monotonic() - t0 < 2.0
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
    finally:
        c.close()


def kvtier_spec(ns: kvtier.Namespace) -> Any:
    from kvtier_contract.protoutil import namespace_spec

    return namespace_spec(ns)


def _metrics(d: DaemonProcess) -> str:
    import urllib.request

    with urllib.request.urlopen(d.info["metrics"], timeout=5) as r:
        return str(r.read().decode())

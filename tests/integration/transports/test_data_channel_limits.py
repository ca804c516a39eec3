"""The data channel under a hostile or stalled peer: a real daemon process and raw sockets.

Two guarantees (docs/tcp_data_channel.md §5 and §6):

* **bytes after unpin**: a load's DATA frames are views of its slots; the job keeps its pins
  until those views have reached the kernel or were dropped with the connection. However a
  client ends the job (CompleteLoad, lease expiry) while its bytes still wait, every byte it
  then receives is its own block's, or the connection is gone;
* **bounded connections**: HELLO within ``handshake_timeout_s``, idle ones closed, a global
  cap, no buffer per connection before HELLO, reading paused while replies go unread. The shm fd
  socket is bounded the same way.

Clients here are raw: a gRPC stub and hand-built frames (``kvtier_contract.wire``), so nothing
in the SDK hides what the daemon sends. Blocks are 16 KiB (``make_namespace``); block ``i`` of
namespace ``tag`` is 16 KiB of the 8-byte word ``tag << 32 | i``, so any foreign byte shows.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import resource
import select
import socket
import sys
import termios
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import open_fds, settled, wait_for

import kvtier
from kvtier_contract import wire
from kvtier_contract.protoutil import to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtier_contract.wire import Op, Status

T = 10.0  # RPC deadline
BB = 16 * 1024  # block bytes of make_namespace()
MIB = 1 << 20
StartDaemon = Callable[..., DaemonProcess]


def block(tag: int, i: int) -> bytes:
    return np.full(BB // 8, tag << 32 | i, dtype=np.uint64).tobytes()


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(31, "big") for i in range(n)]


@pytest.fixture
def start(daemon_factory: Any, tmp_path: Path) -> StartDaemon:
    """A daemon with a 1 MiB-slab host tier of ``host`` MiB and these DaemonConfig fields."""

    def make(host_mib: int = 64, **fields: Any) -> DaemonProcess:
        cfg = tmp_path / f"kvtierd{len(list(tmp_path.glob('*.toml')))}.toml"
        cfg.write_text("".join(f"{k} = {v!r}\n" for k, v in fields.items()))
        d: DaemonProcess = daemon_factory(
            "--config", str(cfg), "--host-bytes", f"{host_mib}MiB", "--slab-bytes", "1MiB"
        )
        return d

    return make


class Peer:
    """A raw client: one session (tcp transport), its stub, and data connections it opens."""

    def __init__(self, d: DaemonProcess, lease_ms: int = 60_000) -> None:
        self.d = d
        self.channel = grpc.insecure_channel(d.grpc)
        self.stub = pb_grpc.KvtierStub(self.channel)
        opened = self.stub.OpenSession(
            pb.OpenSessionRequest(client_name="limits", lease_ttl_ms=lease_ms, transport=pb.TRANSPORT_TCP),
            timeout=T,
        )
        self.sid, self.secret = opened.session_id, opened.data_secret

    def register(self, **overrides: Any) -> int:
        ns = make_namespace(**overrides)
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        return int(
            self.stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(spec=spec, digest=ns.digest), timeout=T
            ).namespace_id
        )

    def connect(self, rcvbuf: int = 0) -> socket.socket:
        """A data connection, HELLO done (no runs: one DATA frame per block)."""
        s = raw_socket(self.d, rcvbuf)
        s.sendall(wire.hello(self.sid, self.secret))
        op, sid, *_ = wire.unpack(recv_exact(s, wire.HEADER.size))
        assert (op, sid) == (Op.HELLO_OK, self.sid)
        return s

    def store(self, ns_id: int, tag: int, n: int) -> int:
        """Store blocks 0..n-1 of ``tag`` over the data channel: how many were committed."""
        prep = self.stub.PrepareStore(
            pb.PrepareStoreRequest(
                session_id=self.sid,
                namespace_id=ns_id,
                keys=b"".join(keys(tag, n)),
                transport=pb.TRANSPORT_TCP,
            ),
            timeout=T,
        )
        if not prep.job_id:
            return 0
        reserved = [i for i, st in enumerate(prep.status) if st == pb.STORE_RESERVED]
        with self.connect() as s:
            s.sendall(
                b"".join(wire.pack(Op.WRITE, prep.job_id, i, length=BB) + block(tag, i) for i in reserved)
                + wire.pack(Op.FLUSH, prep.job_id)
            )
            assert wire.unpack(recv_exact(s, wire.HEADER.size))[:4] == (Op.ACK, prep.job_id, 0, Status.OK)
        return int(
            self.stub.CompleteStore(
                pb.CompleteStoreRequest(session_id=self.sid, job_id=prep.job_id, ok=True), timeout=T
            ).committed
        )

    def prepare_load(self, ns_id: int, tag: int, n: int) -> int:
        prep = self.stub.PrepareLoad(
            pb.PrepareLoadRequest(
                session_id=self.sid,
                namespace_id=ns_id,
                keys=b"".join(keys(tag, n)),
                transport=pb.TRANSPORT_TCP,
            ),
            timeout=T,
        )
        assert prep.found == b"\1" * n
        return int(prep.job_id)

    def complete_load(self, job: int) -> None:
        self.stub.CompleteLoad(pb.CompleteLoadRequest(session_id=self.sid, job_id=job), timeout=T)

    def stats(self) -> dict[str, Any]:
        return to_dict(self.stub.Stats(pb.StatsRequest(), timeout=T))

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    made: list[Peer] = []

    def make(d: DaemonProcess, lease_ms: int = 60_000) -> Peer:
        made.append(Peer(d, lease_ms))
        return made[-1]

    yield make
    for p in made:
        p.close()


def raw_socket(d: DaemonProcess, rcvbuf: int = 0) -> socket.socket:
    host, _, port = d.info["data"].rpartition(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connect, so the window stays small
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(T)
    s.connect((host, int(port)))
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def drain(s: socket.socket, n: int) -> tuple[dict[int, bytes], str]:
    """Read DATA frames until ``n`` blocks came, or the daemon closed or went quiet: the blocks
    by key index, and how it ended."""
    got: dict[int, bytes] = {}
    s.settimeout(3.0)
    try:
        while len(got) < n:
            op, _job, index, _status, length = wire.unpack(recv_exact(s, wire.HEADER.size))
            payload = recv_exact(s, length)
            if op is Op.ERROR:
                return got, f"ERROR {payload.decode()}"
            assert op is Op.DATA and length == BB, (op, length)
            got[index] = payload
    except (EOFError, ConnectionError) as e:
        return got, f"closed: {e}"
    except TimeoutError:
        return got, "quiet"
    return got, "all"


def foreign(got: dict[int, bytes], tag: int) -> list[int]:
    """Key indexes whose block is not ``tag``'s own."""
    return sorted(i for i, payload in got.items() if payload != block(tag, i))


def eventually(cond: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def is_closed(s: socket.socket) -> bool:
    """The daemon closed ``s`` (EOF or reset, after any ERROR frame); never blocks."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(1 << 16):
                return True
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def queued(s: socket.socket, request: int) -> int:
    """Bytes in ``s``'s kernel queue: ``termios.FIONREAD``, received and not read by us, or
    ``termios.TIOCOUTQ``, sent and not yet taken by the peer."""
    return int.from_bytes(fcntl.ioctl(s.fileno(), request, b"\0" * 4), sys.byteorder)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")


# ---- bytes after unpin ---------------------------------------------------------------------------

N_A = 2048  # 32 MiB of blocks: far more than loopback socket buffers hold
HOST_MIB = 40  # 2560 slots of 16 KiB: A's blocks and 512 free slots


def test_complete_load_while_data_is_queued_sends_no_foreign_byte(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    d = start(HOST_MIB)
    reader, writer = peers(d), peers(d)
    ns_a, ns_b = reader.register(), writer.register(model_revision="b")
    assert reader.store(ns_a, 1, N_A) == N_A
    job = reader.prepare_load(ns_a, 1, N_A)
    s = reader.connect(rcvbuf=64 * 1024)
    s.sendall(wire.pack(Op.READ, job))
    # the daemon writes what the kernel takes; the rest waits in its buffer
    wait_for("the first bytes of the READ", lambda: queued(s, termios.FIONREAD) > 0)
    settled("the kernel's buffers filling", lambda: queued(s, termios.FIONREAD))
    reader.complete_load(job)  # answered at once: the engine never waits on the data channel
    pinned = reader.stats()["pinned_blocks"]
    # another namespace stores more blocks than the host tier holds
    stored = writer.store(ns_b, 2, HOST_MIB * 64)
    got, end = drain(s, N_A)
    s.close()
    assert foreign(got, 1) == []
    assert (len(got), end) == (N_A, "all")  # nothing was lost either
    # the job ended, its slots did not: pinned while their bytes waited on the connection, so
    # the other namespace got only the free slots
    assert pinned == N_A
    assert stored <= HOST_MIB * 64 - N_A
    assert eventually(lambda: reader.stats()["pinned_blocks"] == 0, 5.0)
    assert writer.store(ns_b, 3, 64) == 64  # the slots came back once the bytes had left


def test_a_lease_lapsing_while_data_is_queued_drops_the_connection_then_the_pins(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    d = start(HOST_MIB)
    writer = peers(d)
    ns_a, ns_b = writer.register(), writer.register(model_revision="b")
    assert writer.store(ns_a, 1, N_A) == N_A
    reader = peers(d, lease_ms=1000)  # no heartbeats: it lapses a second after its last call
    job = reader.prepare_load(ns_a, 1, N_A)
    s = reader.connect(rcvbuf=64 * 1024)
    s.sendall(wire.pack(Op.READ, job))
    # the lease lapses: the job is released and the connection holding its bytes dropped
    assert eventually(lambda: writer.stats()["pinned_blocks"] == 0, 8.0)
    writer.store(ns_b, 2, HOST_MIB * 64)  # reuses A's slots
    got, end = drain(s, N_A)
    s.close()
    assert foreign(got, 1) == []
    assert len(got) < N_A and end.startswith("closed"), (len(got), end)


# ---- bounded connections -------------------------------------------------------------------------

N_READS = 12_000
N_IDLE = 1_000


def send_within(s: socket.socket, data: bytes, within_s: float) -> int:
    """Send as much of ``data`` as the peer accepts within ``within_s``: bytes sent."""
    s.setblocking(False)
    sent, deadline = 0, time.monotonic() + within_s
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += s.send(data[sent : sent + (1 << 16)])
        except BlockingIOError:
            select.select([], [s], [], 0.05)
    return sent


def test_unread_replies_and_idle_sockets_keep_the_daemon_small(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    raise_fd_limit(N_IDLE + 200)
    d = start(handshake_timeout_s=4.0)
    pid = d.info["pid"]
    peer = peers(d)
    ns = peer.register()
    assert peer.store(ns, 1, 200) == 200
    job = peer.prepare_load(ns, 1, 200)  # 3.2 MiB per READ
    settled("the daemon's RSS at rest", lambda: round(rss_mib(pid)))
    base = rss_mib(pid)
    reader = peer.connect(rcvbuf=64 * 1024)
    sent = send_within(reader, wire.pack(Op.READ, job) * N_READS, 5.0)
    settled(  # the daemon takes what it will, then stops reading
        "the daemon's intake", lambda: (queued(reader, termios.TIOCOUTQ), round(rss_mib(pid)))
    )
    after_reads = rss_mib(pid)
    idle: list[socket.socket] = []
    try:
        for _ in range(N_IDLE):
            idle.append(raw_socket(d))
        # a connect returns once the kernel queued it; on a loaded machine the daemon's accepts
        # (and SYN retries past a full backlog) trail by seconds, and each socket's handshake
        # clock starts at its accept: the bound counts from the last connect, not the first
        opened = time.monotonic()
        after_idle = rss_mib(pid)
        print(
            f"daemon RSS: {base:.0f} MiB at rest, {after_reads:.0f} MiB after {sent // 32} "
            f"unread READs, {after_idle:.0f} MiB with {N_IDLE} idle sockets too"
        )
        assert after_idle - base < 64, (base, after_reads, after_idle)
        # never HELLOed: each is closed at the handshake timeout (4 s), all of them
        assert eventually(lambda: all(is_closed(s) for s in idle), 4.0 + 6.0 - (time.monotonic() - opened))
    finally:
        for s in idle:
            s.close()
    reader.close()  # its queued replies are dropped with it, and the pins they held
    peer.complete_load(job)
    assert eventually(lambda: peer.stats()["pinned_blocks"] == 0, 5.0)


def test_a_half_sent_header_is_closed(start: StartDaemon, peers: Callable[..., Peer]) -> None:
    d = start(handshake_timeout_s=1.0, data_idle_timeout_s=2.0)
    before_hello = raw_socket(d)
    before_hello.sendall(wire.pack(Op.HELLO, 1)[:16])
    after_hello = peers(d).connect()
    after_hello.sendall(wire.pack(Op.READ, 1)[:16])
    t0 = time.monotonic()
    assert eventually(lambda: is_closed(before_hello), 5.0)
    assert time.monotonic() - t0 < 5.0
    assert eventually(lambda: is_closed(after_hello), 8.0)  # idle: 2 to 3 s
    before_hello.close()
    after_hello.close()


def test_connections_beyond_the_cap_are_closed_at_once(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    d = start(data_max_connections=8, handshake_timeout_s=20.0)
    peer = peers(d)
    held = [peer.connect() for _ in range(8)]  # past HELLO: none of them makes room
    extra = raw_socket(d)
    extra.settimeout(2.0)
    op, *_, length = wire.unpack(recv_exact(extra, wire.HEADER.size))
    assert op is Op.ERROR and b"too many data connections" in recv_exact(extra, length)
    assert eventually(lambda: is_closed(extra), 2.0)
    assert not any(is_closed(s) for s in held)
    text = urllib.request.urlopen(d.info["metrics"], timeout=5).read().decode()
    assert 'kvtier_connections_closed_total{reason="refused",transport="tcp"} 1.0' in text
    assert 'kvtier_connections{transport="tcp"}' in text
    held.pop().close()  # a place frees up: the next connection is served
    assert eventually(lambda: _hello_ok(peer), 3.0)
    for s in [*held, extra]:
        s.close()


def test_connections_that_never_send_hello_do_not_keep_a_client_out(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    d = start(data_max_connections=16, handshake_timeout_s=30.0)  # no timeout helps here
    peer = peers(d)
    flood = [raw_socket(d) for _ in range(48)]  # three times the cap, none proves a session
    t0 = time.monotonic()
    s = peer.connect()  # the oldest waiting connection makes room: HELLO_OK at once
    assert time.monotonic() - t0 < 2.0
    # every connection that waited beyond the cap was closed (ERROR naming why), the newest stay
    assert eventually(lambda: sum(not is_closed(f) for f in flood) <= 15, 3.0)
    assert not is_closed(s)
    for f in [*flood, s]:
        f.close()


def test_at_most_data_max_unauthenticated_connections_wait_for_hello(
    start: StartDaemon, peers: Callable[..., Peer]
) -> None:
    d = start(data_max_unauthenticated=4, handshake_timeout_s=30.0)
    peer = peers(d)
    bound = [peer.connect() for _ in range(6)]  # past HELLO: not waiting, never closed for room
    waiting = [raw_socket(d) for _ in range(12)]
    # the oldest waiting ones made room, each answered ERROR; the newest 4 still wait
    assert eventually(lambda: [is_closed(w) for w in waiting] == [True] * 8 + [False] * 4, 3.0)
    assert not any(is_closed(s) for s in bound)
    peer.connect().close()  # and a client's HELLO goes through
    for s in [*bound, *waiting]:
        s.close()


TENANT_TOKENS = {"team-a": "limits-a-1", "team-b": "limits-b-2"}


def test_one_tenant_cannot_take_every_data_connection(start: StartDaemon, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(
        "".join(
            f'[[tenant]]\nname = "{name}"\ntransports = ["tcp"]\n'
            f'tokens_sha256 = ["{hashlib.sha256(token.encode()).hexdigest()}"]\n\n'
            for name, token in TENANT_TOKENS.items()
        )
    )
    d = start(data_max_connections=8, tenants_file=str(tenants))  # a tenant's share: 8 / 2
    a, b = tenant_session(d, "team-a"), tenant_session(d, "team-b")
    held = [hello(d, *a) for _ in range(4)]
    assert all(op is Op.HELLO_OK for _s, op, _m in held)
    extra, op, message = hello(d, *a)
    assert op is Op.ERROR and b"data_max_connections_per_tenant" in message, message
    assert eventually(lambda: is_closed(extra), 2.0)
    others = [hello(d, *b) for _ in range(4)]  # the other tenant's share is whole
    assert all(op is Op.HELLO_OK for _s, op, _m in others)
    held.pop()[0].close()  # one of team-a's closes: its next one is served
    assert eventually(lambda: hello(d, *a)[1] is Op.HELLO_OK, 3.0)
    for s, _op, _m in [*held, *others]:
        s.close()
    extra.close()


def tenant_session(d: DaemonProcess, tenant: str) -> tuple[int, bytes]:
    """A tcp session of ``tenant`` (its id and data secret)."""
    with grpc.insecure_channel(d.grpc) as ch:
        opened = pb_grpc.KvtierStub(ch).OpenSession(
            pb.OpenSessionRequest(client_name="limits", lease_ttl_ms=60_000, transport=pb.TRANSPORT_TCP),
            timeout=T,
            metadata=(("authorization", f"Bearer {TENANT_TOKENS[tenant]}"),),
        )
    return opened.session_id, opened.data_secret


def hello(d: DaemonProcess, sid: int, secret: bytes) -> tuple[socket.socket, Op, bytes]:
    """A data connection that sent HELLO: the socket, the daemon's answer and its payload."""
    s = raw_socket(d)
    s.sendall(wire.hello(sid, secret))
    op, *_, length = wire.unpack(recv_exact(s, wire.HEADER.size))
    return s, op, recv_exact(s, length) if op is Op.ERROR else b""


def _hello_ok(peer: Peer) -> bool:
    with contextlib.suppress(OSError, EOFError, AssertionError):
        peer.connect().close()
        return True
    return False


def test_shm_handshakes_are_bounded(start: StartDaemon) -> None:
    d = start(shm_max_connections=4, handshake_timeout_s=1.5)
    path = d.info["shm"]

    def shm_socket() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    fds = open_fds(d.info["pid"])
    held = [shm_socket() for _ in range(4)]
    wait_for("the daemon to accept the four", lambda: open_fds(d.info["pid"]) >= fds + 4)
    extra = shm_socket()
    assert eventually(lambda: is_closed(extra), 0.5)  # at once, long before the timeout
    assert not any(is_closed(s) for s in held)
    assert eventually(lambda: all(is_closed(s) for s in held), 4.0)
    for s in [*held, extra]:
        s.close()


def test_the_sdk_reconnects_quietly_after_an_idle_close(start: StartDaemon) -> None:
    """The daemon closes an idle data connection; the SDK's next transfer reopens it first, so
    nothing fails and nothing trips."""
    d = start(data_idle_timeout_s=0.5)
    ns = make_namespace()
    ks = keys(7, 8)
    with kvtier.Client.connect(d.grpc, "tcp", lease_ttl_s=30) as client:
        h = client.register(ns)
        assert h.put(ks[:4], [block(7, i) for i in range(4)]).stored == 4
        sock = client.session.data()._sock  # type: ignore[union-attr]
        # idle: ERROR then EOF from the daemon, on the data connection and on the control
        # channel the first put used (closed on the daemon's own idle tick: waited for too, or a
        # call sent on it as the daemon closes it would race the close, which is not this test)
        for s in [sock, *client.session.connection.control._idle]:  # type: ignore[union-attr]
            assert select.select([s], [], [], 5.0)[0]
        assert h.put(ks[4:], [block(7, i) for i in range(4, 8)]).stored == 4
        got = h.get(ks)
        assert [bytes(b) if b is not None else None for b in got] == [block(7, i) for i in range(8)]
        assert client.breaker.allows() and client.session.data().reconnects >= 1  # type: ignore[union-attr]
        assert client.counters.puts_dropped == 0 and client.counters.gets_failed == 0


def test_transfers_get_the_sessions_timeout_not_the_opens(start: StartDaemon) -> None:
    """A session reopened by the breaker's probe (probe_timeout_s) keeps the session's own
    timeout for its transfers: a large READ is not cut off after 250 ms."""
    d = start()
    with kvtier.Client.connect(d.grpc, "tcp", timeout_s=3.0, probe_timeout_s=0.25) as client:
        client.register(make_namespace())
        assert client.session.data()._sock.gettimeout() == 3.0  # type: ignore[union-attr]
        client.session.trip("test: reopened by the probe")
        assert client.breaker.wait_closed(10.0)
        client.session.ensure()
        assert client.session.data()._sock.gettimeout() == 3.0  # type: ignore[union-attr]

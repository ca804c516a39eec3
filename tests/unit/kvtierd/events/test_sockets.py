"""Where KV-event sockets may be bound: never over the daemon's own sockets or another live
one, never where the engines' group reaches a tenant's stream, and private before they exist.

Real files, real Unix and ZMQ sockets in a temporary directory.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtierd.events import EventQueue
from kvtierd.events.publisher import EventPublisher, EventSettings
from kvtierd.events.sockets import SocketRules, bind, check_ipc_path, exposure, release

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgpack")

MINE = os.getegid()


@pytest.fixture
def ctx() -> Iterator[object]:
    c = zmq.Context()
    yield c
    c.term()


def listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


def test_the_daemons_own_sockets_and_other_files_are_never_taken(tmp_path: Path) -> None:
    grpc = tmp_path / "kvtier.sock"
    rules = SocketRules(reserved=frozenset({str(grpc)}))
    with pytest.raises(ValueError, match=r"^events_tenant_endpoint: .* the daemon's own sockets"):
        check_ipc_path(str(grpc), "events_tenant_endpoint", rules, private=True)
    (tmp_path / "data").write_text("x")
    with pytest.raises(ValueError, match=r"^events_endpoint: .* not a stale KV-event socket"):
        check_ipc_path(str(tmp_path / "data"), "events_endpoint", rules, private=False)
    live = listening(tmp_path / "live.sock")  # another daemon's socket: in use
    try:
        with pytest.raises(ValueError, match=r"^events_endpoint: .* in use"):
            check_ipc_path(str(tmp_path / "live.sock"), "events_endpoint", rules, private=False)
    finally:
        live.close()
    with pytest.raises(ValueError, match=r"^events_endpoint: .* directory does not exist"):
        check_ipc_path(str(tmp_path / "none" / "ev.sock"), "events_endpoint", rules, private=True)
    # closed, its file left behind: a stale socket of ours, replaced
    check_ipc_path(str(tmp_path / "live.sock"), "events_endpoint", rules, private=False)


def test_the_daemons_own_sockets_are_found_under_every_spelling(tmp_path: Path) -> None:
    """A symlinked directory (``/var/run`` for ``/run``) names the same socket: refused, naming
    the setting (compared as strings, ``alias/kvtier.sock`` passed and libzmq took it)."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "alias").symlink_to(run)
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "up").symlink_to(tmp_path / "alias")
    rules = SocketRules(reserved=frozenset({str(run / "kvtier.sock"), str(run / "kvtier.sock.shm")}))
    for spelling in (
        "alias/kvtier.sock",
        "alias/kvtier.sock.shm",
        "deep/up/kvtier.sock",
        "deep/../run/kvtier.sock",
    ):
        with pytest.raises(ValueError, match=r"^events_tenant_endpoint: .* the daemon's own sockets"):
            check_ipc_path(os.path.join(tmp_path, spelling), "events_tenant_endpoint", rules, private=True)
    check_ipc_path(str(tmp_path / "alias" / "ev-kvtier.sock"), "events_tenant_endpoint", rules, private=True)


def test_a_tenant_named_like_the_daemons_socket_leaves_it_alone(tmp_path: Path) -> None:
    """libzmq unlinks an ipc path before binding it: a tenant "kvtier" with the template
    ``{tenant}.sock`` beside the gRPC socket would take it over."""
    grpc = listening(tmp_path / "kvtier.sock")
    settings = EventSettings(
        tenant_endpoint=f"ipc://{tmp_path}/{{tenant}}.sock",
        rules=SocketRules(reserved=frozenset({str(tmp_path / "kvtier.sock")})),
        private=True,
    )
    pub = EventPublisher(settings, EventQueue(16))
    try:
        with pytest.raises(ValueError, match=r"^events_tenant_endpoint: .*kvtier.sock"):
            pub.start({"kvtier": 1 << 20})
        pub.add_tenants({"kvtier": 1 << 20})  # a reload: refused again (logged)
        assert pub.figures()["event_streams"] == 0
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(tmp_path / "kvtier.sock"))  # still the daemon's, still listening
        probe.close()
    finally:
        pub.close()
        grpc.close()


@pytest.mark.parametrize(
    ("dir_mode", "sock_mode", "exposed"),
    [
        (0o750, 0o660, "the engines' group"),  # the group enters and connects
        (0o750, 0o600, ""),  # the owner only
        (0o700, 0o660, ""),  # nobody else enters
        (0o755, 0o666, "every local user"),
        (0o711, 0o606, "every local user"),
    ],
)
def test_a_tenant_stream_the_engines_group_could_read_is_refused(
    tmp_path: Path, dir_mode: int, sock_mode: int, exposed: str
) -> None:
    d = tmp_path / "run"
    d.mkdir()
    os.chmod(d, dir_mode)
    os.chown(d, -1, MINE)
    rules = SocketRules(mode=sock_mode, engine_gids=frozenset({MINE}))
    assert exposure(str(d / "ev-a.sock"), rules).startswith(exposed)
    if exposed:
        with pytest.raises(ValueError, match=r"^events_tenant_endpoint: .*events_socket_mode"):
            check_ipc_path(str(d / "ev-a.sock"), "events_tenant_endpoint", rules, private=True)
    else:
        check_ipc_path(str(d / "ev-a.sock"), "events_tenant_endpoint", rules, private=True)
    # the operator stream of a single-tenant daemon is the operator's choice
    check_ipc_path(str(d / "ev.sock"), "events_endpoint", rules, private=False)


def test_a_socket_has_its_mode_before_it_appears_whatever_the_umask(tmp_path: Path, ctx: object) -> None:
    """Bound inside a fresh 0700 directory, set to its mode there, renamed into place: under
    umask 000 no moment exists where the file is at its path with a wider mode."""
    old = os.umask(0)
    try:
        pub = ctx.socket(zmq.PUB)  # type: ignore[attr-defined]
        b = bind(pub, f"ipc://{tmp_path}/ev.sock", 0o600)
    finally:
        os.umask(old)
    try:
        st = (tmp_path / "ev.sock").stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.sock"]  # no directory left
        sub = ctx.socket(zmq.SUB)  # type: ignore[attr-defined]
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/ev.sock")  # reachable at its final path
        for _ in range(200):
            pub.send(b"x")
            if sub.poll(20):
                break
        assert sub.recv() == b"x"
        sub.close(0)
    finally:
        pub.close(0)
        release(b)
    assert not (tmp_path / "ev.sock").exists()  # unlinked at close: it was ours

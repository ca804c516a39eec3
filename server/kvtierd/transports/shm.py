"""shm fd server: gives a session's host arena memfd, and namespaces' published indexes, to
same-host clients.

Which arenas: those ``arena(session)`` names (kvtierd.app: the shared arena on a single-tenant
daemon, the tenant's own arena on a daemon with tenants, a session with none refused; with
``KVS3``, after it, the arena of each group its tenant reads, sealed against every client's
writes). A client therefore maps only memory that holds its own tenant's blocks, and its groups'
read-only. ``KVS2`` hands the first arena alone (a client that predates group arenas).

Handshakes on a Unix stream socket (one exchange per connection, then the daemon closes it),
stated once in :mod:`kvtier_contract.wire` (``SHM_REQUEST`` / ``SHM_REPLY`` / ``SHM_REFUSED``)
and :mod:`kvtier_contract.published_index` (``INDEX_REQUEST`` / ``INDEX_REPLY``: a read-only
descriptor of one namespace's published index, for a live session). Both carry the session's id
and data secret (OpenSessionReply.data_secret; a session id alone is no credential), checked as
the control channel's is (``_session``: one answer for an unknown session, a wrong secret and a
peer the tenant does not allow). A connection that asked for
an index stays open as its session's index channel (further index requests of the session; it
closes when the session ends or the daemon dies, which tells the client to stop reading).

A fourth, ``CONTROL_MAGIC`` (with the session's id and data secret), turns the connection into
that session's control channel (:mod:`kvtierd.transports.control`): its control calls as framed
protobufs, served by the gRPC handlers, until the session ends or either side closes it; at most
``CONTROL_CHANNELS_PER_SESSION`` per session, not counted against ``max_connections``.

A third exchange, ``LOGIN_MAGIC``, is the Unix peer login: the daemon reads the peer's uid and
gid (SO_PEERCRED) and answers a bearer token of the tenant that logs in by them (or refuses),
which the client then presents on the gRPC socket (grpcio shows handlers no peer credentials).

The peer's credentials (SO_PEERCRED) must be allowed for the session's tenant (a daemon with a
tenants file: docs/security.md); the socket file's mode (``socket_mode``: 0600 by default,
owner only) decides who may connect. Bounded: a handshake must arrive within
``handshake_timeout_s``, at most ``max_connections`` are served at once and at most ``per_uid``
of one peer uid (SO_PEERCRED at accept; one more is refused at once, counted in ``refused``),
and running out of descriptors pauses accepting instead of ending it. Index channels: at most
one per live session (a newer one replaces it; the session's end closes it): they are served
by :mod:`kvtierd.transports.shm_index`; the socket helpers are :mod:`~kvtierd.transports.shm_socket`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from kvtier_contract import published_index as pi
from kvtier_contract import wire
from kvtier_contract.errors import FailedPrecondition, KvtierError, NotFound, ResourceExhausted
from kvtierd.domain import Transport
from kvtierd.ratelog import RateLimitedLog
from kvtierd.sessions import Session, SessionTable
from kvtierd.tenancy import Ledger
from kvtierd.transports.base import CONTROL_CHANNELS_PER_SESSION, ChannelFactory, ServerTransport
from kvtierd.transports.shm_index import IndexChannels
from kvtierd.transports.shm_socket import peer, recv_exactly, refuse

log = logging.getLogger("kvtierd.shm")
HANDSHAKES = "handshakes"  # what a peer uid holds of the socket (its ledger's resource)
_SETTLE_TURNS = 4  # loop turns a handshake at a cap waits for one in progress to end


class MappedArena(NamedTuple):
    """One arena a session maps: its memfd (the daemon's; sent, never closed here), its size,
    whether the session writes it (its own) or only reads it (a group's, sealed: ``group``
    names it)."""

    fd: int
    size: int
    writable: bool
    group: str = ""


class Channel(Protocol):
    """A control channel as this server keeps it (kvtierd.transports.control.ControlChannel)."""

    session_id: int

    def close(self) -> None: ...


class ShmFdServer(ServerTransport):
    """Owns the listening socket and its file. Event-loop thread only.

    What the daemon hands it: ``arena(session, groups)``: the arenas that session maps, in the
    order its offsets count them (:class:`MappedArena`, its own first; ``groups``: its groups'
    after it, for a KVS3 client), or None (refused).
    ``index(session_id, namespace_id)``: a read-only descriptor of that namespace's published
    index (the caller here closes it), its size and generation; raises a
    KvtierError or OSError to refuse. None: index requests are refused.
    ``index_hold(namespace_id, +1 / -1)``: a channel starts / stops reading a namespace's
    index (the daemon stops publishing one that no channel reads). ``login(uid, gid)``: a
    bearer token for that Unix peer (kvtierd.tenants.UnixLogins), or a KvtierError; None:
    logins are refused. ``control(session, on_close)``: the protocol serving a control
    channel of that session (it calls ``on_close(itself)`` when its connection ends); None:
    control channels are refused. ``per_uid``: handshakes in progress at once from one peer
    uid (SO_PEERCRED at accept), within ``max_connections``.
    """

    name = "shm"
    socket_mode = 0o600  # of the socket file (DaemonConfig.socket_mode); set before start()

    def __init__(
        self,
        path: str,
        arena: Callable[[Session, bool], list[MappedArena] | None],
        boot_epoch: int,
        sessions: SessionTable,
        *,
        handshake_timeout_s: float = 5.0,
        max_connections: int = 128,
        per_uid: int = 16,
        index: Callable[[int, int], tuple[int, int, int]] | None = None,
        index_hold: Callable[[int, int], None] = lambda _ns, _delta: None,
        peer_ok: Callable[[Session, int, int], bool] = lambda _s, _u, _g: True,
        login: Callable[[int, int], str] | None = None,
        control: ChannelFactory | None = None,
    ) -> None:
        """The arguments: see the class docstring."""
        self.path = os.path.abspath(path)
        self._arena = arena
        self._epoch = boot_epoch
        self._sessions = sessions
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._timeout_s = handshake_timeout_s
        self._max = max_connections
        self._indexes = None if index is None else IndexChannels(index, index_hold, boot_epoch, self._session)
        self._peer_ok = peer_ok  # (session, uid, gid): SO_PEERCRED against the session's tenant
        self._login = login
        self._control = control
        self._controls: dict[int, set[Channel]] = {}  # session id -> its control channels
        self._open = 0  # handshakes being served
        self._uids = Ledger()  # ... of each peer uid (HANDSHAKES), at most per_uid (0: no cap)
        self._per_uid = per_uid
        self.handed_out = 0
        self.refused = 0
        self.logins = 0
        self._accept_log = RateLimitedLog(log, 10.0)

    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead daemon's (the daemon holds the socket's lock)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created owner-only: no window before the chmod
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, self.socket_mode)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: wait for descriptors to come back
                self._accept_log.warning("shm fd socket: accept failed (%s); retrying", e)
                await asyncio.sleep(0.1)
                continue
            try:
                uid = peer(conn)[0]
            except OSError:
                conn.close()
                continue
            if not await self._admit(uid):
                self.refused += 1
                refuse(
                    conn,
                    ResourceExhausted(
                        "too many shm handshakes in progress (from this uid, or in all)",
                        field="shm_handshakes_per_uid",
                    ),
                )
                conn.close()
                continue
            self._open += 1
            self._uids.take(uid, HANDSHAKES, 1, None)  # (_admit checked the cap)
            loop.create_task(self._serve(conn, uid))

    async def _admit(self, uid: int) -> bool:
        """Whether a handshake of ``uid`` may start now. At a cap, the handshakes in progress
        get a few turns of the loop first: a burst of honest ones (each a few loop turns, their
        requests already sent) drains in that time; a peer that connects and sends nothing
        holds its slots until the handshake timeout, its next connections are refused."""
        for _ in range(_SETTLE_TURNS):
            if self._open < self._max and not (
                self._per_uid and self._uids.held(uid, HANDSHAKES) >= self._per_uid
            ):
                return True
            await asyncio.sleep(0)
        return False

    async def _serve(self, conn: socket.socket, uid: int) -> None:
        handshake = True
        with conn:
            try:
                data = await self._request(conn)
                if data[:4] == pi.INDEX_MAGIC:
                    if self._indexes is None:
                        raise ValueError("published indexes are not served here")
                    held: dict[int, int] = {}  # namespace -> generation handed out here
                    try:
                        session_id = self._indexes.answer(conn, data, held)
                        handshake = False
                        self._handshake_done(uid)
                        await self._indexes.serve(conn, session_id, held)
                    finally:
                        self._indexes.unhold(held)
                elif data[:4] == wire.LOGIN_MAGIC:
                    self._serve_login(conn)
                elif data[:4] == wire.CONTROL_MAGIC:
                    await self._serve_control(conn, data)
                else:
                    self._serve_arena(conn, data)
            except (KvtierError, ValueError) as e:
                refuse(conn, e)
            except (OSError, TimeoutError) as e:
                log.debug("shm handshake failed: %s", e)
            finally:
                if handshake:
                    self._handshake_done(uid)

    def _handshake_done(self, uid: int) -> None:
        self._open -= 1
        self._uids.give(uid, HANDSHAKES, 1)

    async def _request(self, conn: socket.socket) -> bytes:
        """A whole handshake request, within ``handshake_timeout_s`` all told (TimeoutError);
        ValueError for an unknown or retired magic."""
        async with asyncio.timeout(self._timeout_s):
            data = await recv_exactly(conn, wire.SHM_REQUEST.size)
            magic = data[:4]
            if magic in (wire.SHM_MAGIC_V1, pi.INDEX_MAGIC_V1):
                raise ValueError(
                    f"the {magic.decode()} handshake (a session id alone) is no "
                    "longer served: this daemon asks for the session's data "
                    "secret (KVS2 / KVI2; upgrade the kvtier client)"
                )
            if magic == pi.INDEX_MAGIC:
                return data + await recv_exactly(conn, pi.INDEX_REQUEST.size - len(data))
            if magic in (wire.SHM_MAGIC, wire.SHM_MAGIC_V3, wire.CONTROL_MAGIC):
                return data + await recv_exactly(conn, wire.DATA_SECRET_BYTES)
            if magic != wire.LOGIN_MAGIC:
                raise ValueError("bad shm handshake")
            return data

    def _session(self, conn: socket.socket, session_id: int, secret: bytes) -> Session:
        """The live session ``session_id``, when ``secret`` is its data secret and the peer
        (SO_PEERCRED) may act for its tenant; else NotFound: an unknown session, a wrong secret
        and a foreign peer get one answer, so an id tells a stranger nothing."""
        session = self._sessions.with_secret(session_id, secret)
        if session is None or not self._peer_ok(session, *peer(conn)):
            raise NotFound(f"unknown or expired session {session_id}", field="session_id")
        return session

    def _serve_arena(self, conn: socket.socket, data: bytes) -> None:
        """Hand the session's arena fd (KVS2), or every arena it maps (KVS3); KvtierError:
        refused."""
        magic, session_id = wire.SHM_REQUEST.unpack(data[: wire.SHM_REQUEST.size])
        session = self._session(conn, session_id, data[wire.SHM_REQUEST.size :])
        if session.transport is Transport.TCP:
            # a tcp session moves bytes over the data channel only: the arena is never
            # mapped by it (it may come from another host, or be a shm-less tenant)
            raise FailedPrecondition(
                f"session {session_id} was opened for the tcp transport: the arena is not handed to it",
                field="transport",
            )
        mapped = self._arena(session, magic == wire.SHM_MAGIC_V3)
        if mapped is None:  # a tenant whose own arena could not be made: never another
            raise FailedPrecondition(
                f"tenant {session.tenant} has no arena of its own (see the daemon's log)", field="transport"
            )
        conn.setblocking(True)
        if magic == wire.SHM_MAGIC:
            reply = wire.SHM_REPLY.pack(wire.SHM_MAGIC, mapped[0].size, self._epoch)
            socket.send_fds(conn, [reply], [mapped[0].fd])
        else:
            total = sum(a.size for a in mapped)
            reply = wire.SHM_REPLY_V3.pack(wire.SHM_MAGIC_V3, total, self._epoch, len(mapped)) + b"".join(
                wire.SHM_ARENA.pack(a.size, wire.SHM_ARENA_WRITABLE if a.writable else 0) for a in mapped
            )
            for a in mapped[1:]:  # (a group's name: 1..128 characters, at most 512 bytes)
                name = a.group.encode()
                reply += wire.SHM_GROUP_NAME.pack(len(name)) + name
            socket.send_fds(conn, [reply], [a.fd for a in mapped])
        self.handed_out += 1

    async def _serve_control(self, conn: socket.socket, data: bytes) -> None:
        """Make ``conn`` a control channel of the session it names, if ``data`` carries that
        session's data secret and the peer may act for its tenant (KvtierError: refused)."""
        if self._control is None:
            raise FailedPrecondition("control channels are not served here", field="control_channel")
        _, session_id = wire.SHM_REQUEST.unpack(data[: wire.SHM_REQUEST.size])
        session = self._session(conn, session_id, data[wire.SHM_REQUEST.size :])
        if len(self._controls.get(session_id, ())) >= CONTROL_CHANNELS_PER_SESSION:
            raise ResourceExhausted(
                f"session {session_id} has {CONTROL_CHANNELS_PER_SESSION} control channels open already",
                field="control_channel",
            )
        conn.setblocking(False)  # a few bytes: they fit the socket buffer of any peer
        conn.send(wire.CONTROL_REPLY.pack(wire.CONTROL_MAGIC, self._epoch))
        channel: Any = self._control(session, self._control_closed)
        self._controls.setdefault(session_id, set()).add(channel)  # (its loss removes it)
        try:
            # The transport gets its own descriptor: ``conn`` is closed when the handshake ends.
            await asyncio.get_running_loop().connect_accepted_socket(lambda: channel, sock=conn.dup())
        except BaseException:
            self._control_closed(channel)
            raise
        if session.released:  # (ended while the transport was being made)
            self.release_session(session_id)

    def _control_closed(self, channel: Channel) -> None:
        mine = self._controls.get(channel.session_id)
        if mine is not None:
            mine.discard(channel)
            if not mine:
                del self._controls[channel.session_id]

    def _serve_login(self, conn: socket.socket) -> None:
        """A Unix peer logs in: a token for the tenant its uid/gid are (KvtierError: refused)."""
        if self._login is None:
            raise FailedPrecondition("Unix peer logins are not served here", field="login")
        uid, gid = peer(conn)
        token = self._login(uid, gid).encode()
        assert len(token) <= wire.LOGIN_MAX_TOKEN_BYTES
        conn.setblocking(False)  # a few bytes: they fit the socket buffer of any peer
        conn.send(wire.LOGIN_REPLY.pack(wire.LOGIN_MAGIC, len(token)) + token)
        self.logins += 1

    def release_session(self, session_id: int) -> None:
        if self._indexes is not None:
            self._indexes.release(session_id)
        for channel in list(self._controls.pop(session_id, ())):
            channel.close()

    def figures(self) -> dict[str, int]:
        return {
            "shm_connections": self._open,
            "shm_connections_refused": self.refused,
            "index_connections": len(self._indexes or ()),
            "control_connections": sum(len(c) for c in self._controls.values()),
        }

    def advertise(self) -> dict[str, Any]:
        return {"shm_socket": self.path}

    def close(self) -> None:
        if self._indexes is not None:
            self._indexes.close()
        for mine in list(self._controls.values()):
            for channel in list(mine):
                channel.close()
        self._controls.clear()
        if self._task:
            self._task.cancel()
        if self._sock:
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

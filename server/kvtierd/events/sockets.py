"""Where KV-event sockets may be bound, and binding them private before they exist.

Primitives: :func:`check_ipc_path` (ValueError naming the setting: a path that is one of the
daemon's own sockets under any spelling (:func:`same_place`: a symlinked directory, ``/var/run``
for ``/run``), an existing file that is not a stale socket of ours, or, for a stream
that must stay private, a socket the engines' group could reach), :func:`bind` (an
``ipc://`` endpoint bound inside a fresh 0700 directory beside its path, given its mode there,
then renamed into place: no moment where another user could connect, and no process-wide
umask touched from a thread), :func:`release` (the file unlinked at close, while it is still
the one we bound).

libzmq unlinks an ipc path before binding it (a stale socket of an earlier run would otherwise
be in the way), so a path that is another live socket (the daemon's gRPC socket, for a tenant
named like it) would be taken over: these checks run before every bind.

Pure functions over the filesystem; any thread (the publisher's, or the event loop's at start
and at a tenants-file reload).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SocketRules:
    """What binding an event socket must respect (from the daemon's configuration)."""

    mode: int = 0o600
    """The socket files' mode (``events_socket_mode``)."""
    reserved: frozenset[str] = frozenset()
    """Absolute paths of the daemon's own sockets and lock: never an event socket's, however
    spelt (compared by :func:`same_place`)."""
    engine_gids: frozenset[int] = frozenset()
    """Groups that reach the daemon's gRPC socket (the engines'): a private stream's socket
    must not be reachable by them."""


@dataclass(frozen=True)
class Bound:
    """A socket file this process bound: unlinked at close only while it is still this one."""

    path: str
    dev: int
    ino: int


def ipc_path(endpoint: str) -> str | None:
    """The absolute path of an ``ipc://`` endpoint; None for another transport."""
    if not endpoint.startswith("ipc://"):
        return None
    return os.path.abspath(endpoint.removeprefix("ipc://"))


def check_ipc_path(path: str, setting: str, rules: SocketRules, *, private: bool) -> None:
    """ValueError naming ``setting`` when ``path`` may not become an event socket; ``private``:
    the stream carries tenants' blocks, and the engines' group must not reach it."""
    if any(same_place(path, r) for r in rules.reserved):
        raise ValueError(f"{setting}: {path} is one of the daemon's own sockets; choose another path")
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"{setting}: {path}: its directory does not exist; create it first")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(
                f"{setting}: {path} exists and is not a stale KV-event socket of this user "
                "(it would be replaced); choose another path"
            )
        if _live(path):
            raise ValueError(f"{setting}: {path} is a socket in use (another daemon's?); choose another path")
    if private:
        why = exposure(path, rules)
        if why:
            raise ValueError(
                f"{setting}: {path} would be readable by {why}, and the stream carries tenants' "
                "token ids: set events_socket_mode = 0o600, or put it in a directory that group "
                "cannot enter (docs/events.md §5)"
            )


def same_place(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file, the files themselves needing not exist:
    the same name in the same directory, the directories compared resolved (symlinks followed)
    and, where both exist, by device and inode (a bind mount too)."""
    if os.path.basename(a) != os.path.basename(b):
        return False
    da, db = os.path.dirname(a), os.path.dirname(b)
    if os.path.realpath(da) == os.path.realpath(db):
        return True
    try:
        return os.path.samefile(da, db)
    except OSError:  # (one does not exist: then they are not one directory)
        return False


def exposure(path: str, rules: SocketRules) -> str:
    """Who besides the owner could connect to a socket of mode ``rules.mode`` at ``path``
    ("" = nobody): every local user, or the engines' group (the daemon's gRPC socket's)."""
    parent = os.stat(os.path.dirname(path))
    mode = rules.mode
    sock_gid = parent.st_gid if parent.st_mode & stat.S_ISGID else os.getegid()
    if parent.st_mode & 0o001 and mode & 0o002:
        return "every local user (events_socket_mode grants others access)"
    engines = rules.engine_gids
    enter = parent.st_mode & 0o010 if parent.st_gid in engines else parent.st_mode & 0o001
    write = mode & 0o020 if sock_gid in engines else mode & 0o002
    if enter and write:
        return f"the engines' group (gid {', '.join(map(str, sorted(engines)))})"
    return ""


def bind(sock: Any, endpoint: str, mode: int) -> Bound | None:
    """Bind ``sock`` (a ZMQ socket) to ``endpoint``; an ``ipc://`` one is made in a fresh 0700
    directory beside it, set to ``mode`` there and renamed into place (replacing a stale socket
    :func:`check_ipc_path` allowed). ZMQError or OSError when it cannot be bound."""
    path = ipc_path(endpoint)
    if path is None:
        sock.bind(endpoint)
        return None
    private = tempfile.mkdtemp(prefix=".kv", dir=os.path.dirname(path))  # 0700, ours
    tmp = os.path.join(private, "s")
    try:
        sock.bind("ipc://" + tmp)
        try:
            os.chmod(tmp, mode)
            os.rename(tmp, path)
        except OSError:
            sock.unbind("ipc://" + tmp)
            raise
    finally:
        _remove_dir(private, tmp)
    st = os.lstat(path)
    return Bound(path, st.st_dev, st.st_ino)


def release(bound: Bound | None) -> None:
    """Unlink a socket file :func:`bind` made, unless something else is there now."""
    if bound is None:
        return
    try:
        st = os.lstat(bound.path)
        if (st.st_dev, st.st_ino) == (bound.dev, bound.ino):
            os.unlink(bound.path)
    except OSError:
        pass


def _remove_dir(private: str, tmp: str) -> None:
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.rmdir(private)
    except OSError:
        pass


def _live(path: str) -> bool:
    """Whether something listens on the Unix socket at ``path`` (a refused connect: stale)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(path)
        except OSError as e:
            return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
        return True

"""One owner per resource: an exclusive ``flock`` on a lock file, the holder's pid written inside.

A daemon takes the lock of each resource it owns (its NVMe directory, its Unix sockets) before it
unlinks, binds or opens anything there for writing, and keeps it until it exits; the kernel drops
the lock when the process ends, however it ends, so a crashed daemon never leaves a stale lock
behind (its socket files stay, and the next daemon to take the lock replaces them). A second
daemon finds the lock held and stops at once, naming the holder (:class:`InUse`).

Lock files are never removed: unlinking one while another process waits to open it would let two
processes lock two different files of the same name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


class InUse(Exception):
    """Another live process holds the lock of ``path``; ``pid`` is the one its file names (None:
    unreadable or not alive: e.g. an fsck holds it, which writes no pid)."""

    def __init__(self, path: str, pid: int | None) -> None:
        self.path, self.pid = path, pid
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(
            f"{path} is held by {holder} (another kvtierd is using it): stop it, "
            "or give this daemon a --socket and --disk-dir of its own"
        )


class OwnerLock:
    """Owns one open lock file and its exclusive flock until :meth:`release` (or the process's
    end). Taken and released by the daemon's startup and shutdown only (not thread-safe)."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd, self.path = fd, path

    @classmethod
    def take(cls, path: str) -> OwnerLock:
        """Lock ``path`` (created 0600 if absent; never a symlink) and write this pid in it.
        InUse when another process holds it; OSError when the file cannot be opened."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise InUse(path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        data = f"{os.getpid()}\n".encode()
        with contextlib.suppress(OSError):  # a full disk: the lock holds, its pid reads stale
            os.pwrite(fd, data, 0)  # overwrite first: no new block needed on a full disk
            os.ftruncate(fd, len(data))
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # drops the flock


@contextlib.contextmanager
def shared(path: str) -> Iterator[None]:
    """Hold a shared lock on ``path`` for a reader that writes nothing (fsck): InUse when a
    daemon holds it; nothing to lock when the file does not exist (no daemon ever held it) or
    cannot be opened by this user (the reader's own checks then say what it cannot read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUse(path, _read_pid(fd)) from None
        yield
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return int(text)

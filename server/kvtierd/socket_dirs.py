"""Whether another local user could replace a Unix socket: the directory a socket is bound in.

A socket file's mode says who may connect to it; the directory it sits in says who may rename it
away and bind a socket of their own at its path. A client then connects to that one and sends it
its bearer token (the audit's takeover: a member of the engines' group, in a 0770 directory of
that group, collected another tenant's token). Connecting clients cannot tell, so the daemon
refuses to bind where that is possible.

Primitives: :func:`socket_dir_problem` (why a socket at a path could be replaced by another
user, in words, or ``""``), :func:`socket_dir_refusal` (that as one line naming the setting and
the fix: the daemon's start refuses with it; the KV-event sockets' checks can use it too).

The rules, for the socket's directory and every directory above it (symlinks resolved):

* writable by its group or by every user without the sticky bit: refused (anyone who may write
  a directory may rename its entries). With the sticky bit (``chmod +t``: 1770, or 1777 like
  /tmp) only an entry's owner, the directory's owner and root may rename or remove it: the
  daemon's socket stays the daemon's, so that is accepted;
* the socket's own directory owned by a user other than the daemon's and root: refused (its
  owner may do anything there, sticky bit or not). Directories above it may belong to anyone
  (a checkout owned by its user, a daemon run as root in it): only their write bits count;
* a file already at one of the daemon's socket paths owned by another user: refused (in a sticky
  directory the daemon could not remove it; in any directory it is not a stale socket of ours).

Pure functions over the filesystem (``stat`` only); any thread.
"""

from __future__ import annotations

import os
import stat

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def socket_dir_problem(path: str) -> str:
    """Why another user than this process's could replace a Unix socket bound at ``path`` (words
    that follow "the socket {path}: "), or ``""`` when only it and root can. Directories that
    do not exist yet are skipped (the daemon makes them 0700)."""
    me = os.geteuid()
    full = os.path.abspath(path)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        pass
    else:
        if st.st_uid not in (me, 0):
            return (
                f"a file is already there, owned by uid {st.st_uid}, not this daemon's user "
                f"(uid {me}): remove it, or find out who put it there"
            )
    directory = os.path.realpath(os.path.dirname(full))
    own = True
    while True:
        why = _dir_problem(directory, me, own)
        if why:
            return why
        own = False
        parent = os.path.dirname(directory)
        if parent == directory:
            return ""
        directory = parent


def _dir_problem(directory: str, me: int, own: bool) -> str:
    """Why another user could replace entries of ``directory`` (``own``: the socket's own
    directory, whose owner must be this user or root), or ``""``."""
    try:
        st = os.stat(directory)
    except OSError:  # not there yet (made 0700), or not ours to look at (nor to bind in)
        return ""
    where = f"its directory {directory}" if own else f"the directory {directory} above it"
    if own and st.st_uid not in (me, 0):
        return (
            f"{where} belongs to uid {st.st_uid}, not to this daemon's user (uid {me}) "
            f"or root, and its owner can rename the socket away and bind a fake one at its path: "
            f"give the socket a directory owned by uid {me} that only it can write"
        )
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        who = "its group" if st.st_mode & stat.S_IWGRP else "every user"
        if st.st_mode & stat.S_IWGRP and st.st_mode & stat.S_IWOTH:
            who = "its group and every user"
        return (
            f"{where} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by {who} "
            "without the sticky bit: any of them can rename the socket away and bind a fake one "
            f"at its path, collecting the tokens of the clients that connect; run `chmod +t "
            f"{directory}` (only the socket's owner may then rename it) or give the socket a "
            f"directory only this daemon's user (uid {me}) can write"
        )
    return ""


def socket_dir_refusal(setting: str, path: str) -> str:
    """One line refusing the socket ``path`` of ``setting`` (e.g. ``"socket_path (--socket
    /run/kvtier/kvtier.sock)"``) when :func:`socket_dir_problem` finds one, else ``""``."""
    why = socket_dir_problem(path)
    return f"{setting}: the Unix socket {os.path.abspath(path)}: {why}" if why else ""

"""A daemon refuses Unix sockets that another user could replace (issue 39, audit H2): the
chart's socket directory was 0770 for the engines' group, and a member of that group renamed
kvtier.sock away, served a fake gRPC server at its path and logged another tenant's token.

Each scenario is a real daemon process started on a directory given the mode under test (as
this user: the check is about modes and owners, no second user needed):

* a directory its group or every user may write, without the sticky bit: one line naming the
  setting, the directory and the fix (``chmod +t``); nothing made there;
* the same with the sticky bit (1770, or 1777 like /tmp): it starts and a client connects;
* a directory above the socket's, writable without the sticky bit: refused, naming that one;
* the socket's directory owned by another user, or a file of another user at the socket's
  path: refused (as root only: only root can give a file away).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tests_helpers import serve_exits, serve_ready

import kvtier

SMALL = ("--host-bytes", "8MiB", "--slab-bytes", "1MiB")
OTHER_UID = 54_321  # a user other than this one and root
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done  # no traceback, no log line
    return lines[0]


def socket_dir(tmp_path: Path, mode: int) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)  # (mkdir's mode is cut by the umask; chmod is not)
    return run


@pytest.mark.parametrize(("mode", "who"), [(0o770, "its group"), (0o777, "its group and every user")])
def test_a_directory_others_may_write_without_the_sticky_bit_is_refused(
    tmp_path: Path, mode: int, who: str
) -> None:
    run = socket_dir(tmp_path, mode)
    line = one_line(serve_exits(run, *SMALL))
    assert line == (
        f"kvtierd serve: socket_path (--socket {run}/kvtier.sock): the Unix socket {run}/kvtier.sock: "
        f"its directory {run} (mode {mode:04o}) is writable by {who} without the sticky bit: any of "
        "them can rename the socket away and bind a fake one at its path, collecting the tokens of "
        f"the clients that connect; run `chmod +t {run}` (only the socket's owner may then rename "
        f"it) or give the socket a directory only this daemon's user (uid {os.geteuid()}) can write"
    )
    assert os.listdir(run) == []  # refused before the lock file or a socket is made


@pytest.mark.parametrize("mode", [0o1770, 0o1777])
def test_the_same_directory_with_the_sticky_bit_starts_and_serves(tmp_path: Path, mode: int) -> None:
    run = socket_dir(tmp_path, mode)
    info, _ = serve_ready(run, *SMALL)
    assert info["unix"] == f"unix://{run}/kvtier.sock"
    # (serve_ready stopped it; a second start on the socket it left behind is fine too)
    info, _ = serve_ready(run, *SMALL)
    assert info["unix"] == f"unix://{run}/kvtier.sock"


def test_the_sticky_directory_serves_a_client(tmp_path: Path, daemon_factory: Any) -> None:
    run = socket_dir(tmp_path, 0o1770)
    d = daemon_factory(*SMALL, run_dir=run)
    with kvtier.Client.connect(d.unix) as client:
        assert client.stats() is not None


def test_a_directory_above_it_that_others_may_write_is_refused(tmp_path: Path) -> None:
    above = tmp_path / "shared"
    above.mkdir()
    os.chmod(above, 0o775)
    run = above / "run"
    run.mkdir(mode=0o700)
    line = one_line(serve_exits(run, *SMALL))
    assert f"the directory {above} above it (mode 0775) is writable by its group" in line, line
    assert f"`chmod +t {above}`" in line


@as_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    run = socket_dir(tmp_path, 0o700)
    os.chown(run, OTHER_UID, -1)
    line = one_line(serve_exits(run, *SMALL))
    assert f"its directory {run} belongs to uid {OTHER_UID}, not to this daemon's user" in line, line


@as_root
def test_a_file_of_another_user_at_the_socket_path_is_refused(tmp_path: Path) -> None:
    """In a sticky directory a user of the group may create kvtier.sock while the daemon is
    down (engines then reach theirs): the daemon says so instead of failing to remove it."""
    run = socket_dir(tmp_path, 0o1770)
    (run / "kvtier.sock").touch()
    os.chown(run / "kvtier.sock", OTHER_UID, -1)
    line = one_line(serve_exits(run, *SMALL))
    assert line.endswith(
        f"the Unix socket {run}/kvtier.sock: a file is already there, owned by uid {OTHER_UID}, "
        f"not this daemon's user (uid 0): remove it, or find out who put it there"
    ), line

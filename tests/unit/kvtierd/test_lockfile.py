"""The owner lock: one holder at a time, its pid written inside, gone with its holder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.lockfile import InUse, OwnerLock, shared


def test_a_second_owner_is_refused_naming_the_first_and_may_take_it_once_released(tmp_path: Path) -> None:
    path = str(tmp_path / "kvtier.lock")
    first = OwnerLock.take(path)
    assert Path(path).read_text() == f"{os.getpid()}\n"
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    with pytest.raises(InUse) as exc:
        OwnerLock.take(path)
    assert exc.value.pid == os.getpid() and path in str(exc.value)
    with pytest.raises(InUse), shared(path):
        pass
    first.release()
    with shared(path):  # a reader (fsck) between two daemons
        pass
    OwnerLock.take(path).release()


def test_a_dead_holders_lock_is_free_and_its_stale_pid_replaced(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.lock"
    code = (
        "import sys; from kvtierd.lockfile import OwnerLock; OwnerLock.take(sys.argv[1]); "
        "import os; os._exit(0)"
    )  # dies holding it: the kernel drops the lock
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)
    dead = int(path.read_text())
    assert dead != os.getpid()
    lock = OwnerLock.take(str(path))
    assert path.read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_lock_file_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    (tmp_path / "kvtier.lock").symlink_to(target)
    with pytest.raises(OSError):
        OwnerLock.take(str(tmp_path / "kvtier.lock"))
    assert target.read_text() == "precious"

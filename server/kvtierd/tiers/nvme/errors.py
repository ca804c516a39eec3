"""The NVMe tier's typed disk errors: every ``OSError`` of the disk seam becomes one of these.

Role: the error half of the disk seam (:mod:`kvtierd.tiers.nvme.device`, which re-exports them).
:class:`DiskFull` (ENOSPC, EDQUOT), :class:`SyncFailed` (fsync / fdatasync failed),
:class:`UnsafeFile` (a symlink or non-regular file) or :class:`DiskIOError` (everything else);
``errno`` is kept. :func:`disk_error` types one OSError, :func:`as_disk_errors` every OSError
raised in a ``with`` block (the device's calls). Ownership: plain exception types and pure
functions, no state. Concurrency: any thread.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from kvtierd.tiers.base import TierUnavailable


class DiskError(TierUnavailable):
    """An environment failure of the disk; ``errno`` is the OS error number when there is one."""

    code_name = "UNAVAILABLE"

    def __init__(self, message: str, *, err: int | None = None) -> None:
        self.errno = err
        super().__init__(message)


class DiskFull(DiskError):
    """ENOSPC or EDQUOT: stop admitting to the tier; what is stored stays readable."""


class DiskIOError(DiskError):
    """EIO and every other failed read, write, open or metadata call."""


class SyncFailed(DiskError):
    """fsync / fdatasync failed: writes since the last successful sync are NOT durable."""


class UnsafeFile(DiskError):
    """A symlink, directory, device or FIFO where a regular file was expected; never followed."""


def disk_error(exc: OSError, what: str, *, sync: bool = False) -> DiskError:
    """The typed error for ``exc``, raised by ``what`` (a short description with the path)."""
    err = exc.errno
    msg = f"{what}: {os.strerror(err) if err else exc}"
    if sync:
        return SyncFailed(msg, err=err)
    if err in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(msg, err=err)
    if err == errno.ELOOP:
        return UnsafeFile(f"{what}: is a symlink (never followed)", err=err)
    return DiskIOError(msg, err=err)


@contextmanager
def as_disk_errors(what: str, *, sync: bool = False) -> Iterator[None]:
    """Turn an OSError raised inside the block into its DiskError."""
    try:
        yield
    except OSError as e:
        raise disk_error(e, what, sync=sync) from e

"""How many cores this process may keep busy: what sizes work cut into one part per core.

``os.cpu_count()`` counts the machine's cores; in a container that over-counts (a pod limited
to 2 CPUs on a 64-core node sees 64). :func:`usable_cores` is the least of

* the CPUs the process may run on (``os.sched_getaffinity``, where the OS has it; else
  ``os.cpu_count()``);
* the cgroup v2 CPU quota (``cpu.max``: ``"max 100000"`` is no limit, ``"200000 100000"`` two
  CPUs; a fraction rounds up: ``"150000 100000"`` is two);
* the cgroup v1 CFS quota (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; ``-1``: no limit),

and at least 1. Only the cgroup the process sees at the root of its cgroup mount (a container's
own) is read, not its ancestors. A file that is missing, unreadable or holds anything else is
no limit. Read once per process (the limits are the deployment's, fixed while it runs);
:func:`cores_allowed` reads them afresh under any root (tests pass a fake one). Thread-safe.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_DIRS = ("cpu", "cpu,cpuacct")  # where a cgroup v1 mount puts the cpu controller


@functools.cache
def usable_cores() -> int:
    """:func:`cores_allowed` under the real cgroup mount, read on the first call."""
    return cores_allowed(CGROUP_ROOT)


def cores_allowed(cgroup_root: Path) -> int:
    """The least of the affinity mask and the cgroup v2 and v1 quotas under ``cgroup_root``,
    at least 1."""
    limits = [affinity_cores(), quota_v2(cgroup_root / "cpu.max")]
    limits += [
        quota_v1(cgroup_root / d / "cpu.cfs_quota_us", cgroup_root / d / "cpu.cfs_period_us")
        for d in V1_CPU_DIRS
    ]
    return max(1, min(n for n in limits if n is not None))


def affinity_cores() -> int:
    """The CPUs this process may run on (every core the OS counts, where it has no affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def quota_v2(cpu_max: Path) -> int | None:
    """Whole CPUs (rounded up) a cgroup v2 ``cpu.max`` ("$QUOTA $PERIOD") allows; None: no limit."""
    fields = _read(cpu_max).split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def quota_v1(quota_us: Path, period_us: Path) -> int | None:
    """Whole CPUs (rounded up) a cgroup v1 CFS quota allows; None: no limit (``-1``)."""
    return _ratio(_read(quota_us).strip(), _read(period_us).strip())


def _ratio(quota: str, period: str) -> int | None:
    """ceil(quota / period) when both are positive integers; None otherwise."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None
    return -(-q // p)


def _read(path: Path) -> str:
    """The file's text; "" when it is missing or unreadable."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""

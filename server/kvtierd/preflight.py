"""Startup checks of kvtierd: each refusal is one :class:`StartupError` line naming the setting
(and its flag) and the fix, raised before the host arena is reserved or any socket is bound.

``check(cfg)`` runs them all (``kvtierd.app`` calls it once the sockets' lock is held and before
the daemon is built); each is a function of its own, for tests:

* :func:`check_memory`: the host arena plus every tenant's arena must fit in the memory this
  daemon can still get, less :data:`DAEMON_RESERVE_BYTES` for the daemon itself. The available
  figure is the smaller of ``/proc/meminfo`` MemAvailable and the memory cgroup's headroom
  (v2 ``memory.max`` - ``memory.current``, v1 ``memory.limit_in_bytes`` - ``usage_in_bytes``,
  each less its inactive page cache, at every level up to the root). The arenas are shared
  memory: past that figure the OOM killer picks other processes first, with nothing logged here;
  ``allow_host_bytes_over_available`` turns the refusal into a warning. :class:`MemorySource`
  names the files (tests feed fake ones).
* :func:`check_ports`: every TCP port the daemon binds (``listen``, ``data_listen``,
  ``health_listen``, ``metrics_port``) can be bound now (port 0: the OS picks one, not checked).
* :func:`check_disk_dir`: the NVMe directory exists as a directory or can be made, on a writable
  filesystem, unless ``disk_optional`` (then the tier opens when it can: the daemon's probe).

Nothing here writes, binds for longer than the check or logs; ports are checked by binding and
closing at once, so another process may still take one before the daemon binds it (that bind then
fails with the same kind of line, see ``kvtierd.app``).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtier_contract.units import format_bytes
from kvtierd.config import DaemonConfig
from kvtierd.tenants import Tenants
from kvtierd.tenants_file import load_tenants
from kvtierd.tiers.nvme.format import parse_data_file_name
from kvtierd.tiers.nvme.journal import DEFAULT_JOURNAL_BYTES, parse_journal_name
from kvtierd.tiers.nvme.tier import NvmeConfig

DAEMON_RESERVE_BYTES = 256 << 20
"""Memory left to the daemon itself (and the system) beyond its arenas: an idle daemon's own
pages are ~60 MiB (RssAnon + RssFile, measured with a 64 MiB arena); the rest is room for its
connections' queued replies and the NVMe tier's I/O buffers."""
_UNLIMITED = 1 << 60  # a cgroup v1 "no limit" reads 9223372036854771712


class StartupError(Exception):
    """A check refused the start: ``str()`` is the one line to print (setting, flag, fix)."""


@dataclass(frozen=True)
class MemorySource:
    """Where the memory figures are read: the proc and cgroup filesystems' mount points."""

    proc: str = "/proc"
    cgroup: str = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Available:
    """Memory this process can still get, in bytes, and where that figure comes from."""

    bytes: int
    source: str


def check(cfg: DaemonConfig) -> list[str]:
    """Every check, in order (memory, disk directory, ports); returns warnings to log (the
    memory check overridden), raises StartupError on the first refusal."""
    warnings = check_memory(cfg, arenas_bytes(cfg))
    check_disk_dir(cfg)
    check_ports(cfg)
    return warnings


# -- memory ---------------------------------------------------------------------------------------


def tenant_arena_bytes(cfg: DaemonConfig, tenants: Tenants) -> dict[str, int]:
    """Each tenant allowed shm or cuda_ipc, and each group one of whose readers is -> the size
    of its own arena (whole slabs, >= one)."""
    slab = cfg.host_tier.slab_bytes
    return {
        t.name: max(slab, t.arena_size(cfg.tenancy.tenant_arena_bytes) // slab * slab)
        for t in tenants.by_name.values()
        if tenants.maps_memory(t)
    }


def arenas_bytes(cfg: DaemonConfig) -> tuple[int, int]:
    """(the shared arena's bytes, the tenants' arenas' bytes together) that the daemon makes."""
    shared = cfg.host_tier.host_bytes // cfg.host_tier.slab_bytes * cfg.host_tier.slab_bytes
    try:
        tenants = load_tenants(cfg.tenancy.tenants_file) if cfg.tenancy.tenants_file else None
    except ValueError as e:  # (the CLI read it: it changed since, or an embedder's run(cfg))
        raise StartupError(f"{e}") from None
    return shared, sum(tenant_arena_bytes(cfg, tenants).values()) if tenants else 0


def check_memory(
    cfg: DaemonConfig, arenas: tuple[int, int], source: MemorySource = MemorySource()
) -> list[str]:
    """Refuse arenas larger than the available memory less the daemon's reserve; with
    ``allow_host_bytes_over_available``, a warning (returned) instead. No figure: no check."""
    avail = available_memory(source)
    shared, tenants = arenas
    if avail is None or shared + tenants + DAEMON_RESERVE_BYTES <= avail.bytes:
        return []
    what = f"host_bytes {format_bytes(shared)} (--host-bytes)"
    if tenants:
        what += (
            f" plus {format_bytes(tenants)} of tenant arenas (tenant_arena_bytes, "
            "arena_bytes in the tenants file)"
        )
    slab = cfg.host_tier.slab_bytes
    room = max(0, avail.bytes - DAEMON_RESERVE_BYTES - tenants) // slab * slab
    line = (
        f"{what} exceeds the memory available, {format_bytes(avail.bytes)} ({avail.source}) "
        f"less {format_bytes(DAEMON_RESERVE_BYTES)} kept for the daemon itself"
    )
    if cfg.host_tier.allow_host_bytes_over_available:
        return [
            f"{line}: starting anyway (allow_host_bytes_over_available); once the arenas "
            "fill, the OOM killer may end other processes"
        ]
    if room >= cfg.host_tier.slab_bytes:
        fix = f"lower --host-bytes to at most {room >> 20}MiB"
    else:  # the tenant arenas alone leave no room for a shared arena of one slab
        over = tenants + cfg.host_tier.slab_bytes + DAEMON_RESERVE_BYTES - avail.bytes
        fix = (
            f"the tenant arenas alone leave no room: lower them by at least {format_bytes(over)} "
            "(arena_bytes in the tenants file, tenant_arena_bytes)"
        )
    raise StartupError(
        f"{line}: {fix}, or set allow_host_bytes_over_available = true "
        "(--allow-host-bytes-over-available) if that memory will be free before the arena fills"
    )


def available_memory(source: MemorySource = MemorySource()) -> Available | None:
    """The smaller of MemAvailable and the memory cgroup's headroom (None: neither readable)."""
    found: list[Available] = []
    try:
        for line in Path(source.proc, "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(Available(int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    found += _cgroup_headroom(source)
    return min(found, key=lambda a: a.bytes) if found else None


def _cgroup_headroom(source: MemorySource) -> list[Available]:
    """The headroom of each memory-limited cgroup from this process's up to its hierarchy's
    root: limit - (usage - inactive page cache), the working set as Kubernetes counts it."""
    try:
        lines = Path(source.proc, "self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out: list[Available] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":  # v2: unified at the mount point, or under it
            root = Path(source.cgroup)
            root = root if (root / "cgroup.controllers").exists() else root / "unified"
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root, names = (
                Path(source.cgroup, "memory"),
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        leaf = root / rel.strip("/")
        out += _walk_up(leaf if leaf.is_dir() else root, root, names)  # (cgroup namespace)
    return out


def _walk_up(d: Path, root: Path, names: tuple[str, str, str]) -> list[Available]:
    out: list[Available] = []
    while True:
        limit, usage = _read_int(d / names[0]), _read_int(d / names[1])
        if limit is not None and usage is not None and limit < _UNLIMITED:
            inactive = _stat(d / "memory.stat", names[2])
            room = max(0, limit - max(0, usage - inactive))
            out.append(Available(room, f"cgroup {d}: limit {format_bytes(limit)}"))
        if d == root or d.parent == d:
            return out
        d = d.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


# -- ports ----------------------------------------------------------------------------------------


def bound_ports(cfg: DaemonConfig) -> list[tuple[str, str, int]]:
    """(setting, host, port) of every TCP listener the daemon makes."""
    out = []
    for name, value in (
        ("listen", cfg.grpc.listen),
        ("data_listen", cfg.transports.data_listen),
        ("health_listen", cfg.grpc.health_listen),
    ):
        if value:
            host, _, port = value.rpartition(":")
            out.append((name, host, int(port)))
    if cfg.metrics.metrics_port >= 0:
        out.append(("metrics_port", cfg.metrics.metrics_host, cfg.metrics.metrics_port))
    return out


def check_ports(cfg: DaemonConfig) -> None:
    """Each configured port (not 0) can be bound now, and no two settings name the same port on
    the same (or a wildcard) address."""
    seen: list[tuple[str, str, int]] = []
    for name, host, port in bound_ports(cfg):
        if port == 0:
            continue
        for other, other_host, other_port in seen:
            if port == other_port and (host == other_host or _wildcard(host) or _wildcard(other_host)):
                raise StartupError(
                    f"{_where(name, host, port)} names the port of {other}: "
                    f"choose another port ({_fix(name)})"
                )
        seen.append((name, host, port))
        err = try_bind(host, port)
        if err is not None:
            raise StartupError(bind_refusal(name, host, port, err))


def _wildcard(host: str) -> bool:
    return host.strip("[]") in ("", "0.0.0.0", "::")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _where(name: str, host: str, port: int) -> str:
    """``listen 127.0.0.1:50051 (--listen)``; the metrics port by its number alone."""
    return f"{name} {port if name == 'metrics_port' else f'{host}:{port}'} ({_flag(name)})"


def _fix(name: str) -> str:
    if name == "metrics_port":
        return "--metrics-port 0 picks a free one, -1 disables /metrics"
    return f"{_flag(name)} HOST:0 picks a free port, '' disables it"


def bind_refusal(name: str, host: str, port: int, err: OSError | None) -> str:
    """The line refusing a start whose listener ``name`` cannot bind ``host:port``."""
    if err is not None and err.errno == errno.EADDRINUSE:
        return (
            f"{_where(name, host, port)} is in use: another process listens on "
            f"{host}:{port}; stop it, or choose another port ({_fix(name)})"
        )
    why = f": {err.strerror or err}" if err is not None else ""
    return (
        f"{_where(name, host, port)}: cannot bind {host}:{port}{why}; choose another address ({_fix(name)})"
    )


def try_bind(host: str, port: int) -> OSError | None:
    """Bind and close a TCP socket on every address of ``host`` (SO_REUSEADDR, as the daemon's
    listeners do): the error that says the port is taken, else the last error when no address
    could be bound (None: bindable)."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        return OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {e.strerror}")
    last: OSError | None = None
    bound = 0
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
                bound += 1
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return e
                last = e
    return None if bound else last


# -- disk -----------------------------------------------------------------------------------------


def check_disk_dir(cfg: DaemonConfig) -> None:
    """The NVMe directory (or, when it does not exist yet, the nearest directory above it) is a
    directory this user may write on a writable filesystem; skipped with ``disk_optional``."""
    if not cfg.nvme_tier.disk_dir or cfg.nvme_tier.disk_optional:
        return
    path = Path(os.path.abspath(cfg.nvme_tier.disk_dir))
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    problem = None
    if not probe.is_dir():
        problem = f"{probe} is not a directory"
    elif os.statvfs(probe).f_flag & os.ST_RDONLY:
        problem = f"{probe} is on a read-only filesystem"
    elif not os.access(probe, os.W_OK | os.X_OK):
        problem = f"{probe} is not writable by uid {os.geteuid()}"
    elif probe == path and not os.access(path, os.R_OK):  # (its block files are listed)
        problem = f"{path} is not readable by uid {os.geteuid()}"
    else:
        problem = _cannot_create(probe) or _space_problem(cfg, path, probe)
    if problem is not None:
        raise StartupError(disk_refusal(cfg, problem))


def _cannot_create(probe: Path) -> str | None:
    """Whether a directory can really be made in ``probe`` (made and removed at once): access()
    says yes to root everywhere, and a pseudo filesystem such as /proc refuses what it allows."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvtierd-probe-", dir=probe))
    except OSError as e:
        return f"cannot create a directory in {probe}: {e.strerror or e}"
    return None


def _space_problem(cfg: DaemonConfig, path: Path, probe: Path) -> str | None:
    """Whether the filesystem lacks the room the tier's open preallocates: its block files not
    made yet and a new journal (a fuller one opens degraded: every write would fail), less the
    journals there already, which the open's checkpoint removes (a crashed daemon's)."""
    ncfg = nvme_config(cfg)
    files = max(1, ncfg.capacity_bytes // ncfg.file_bytes)
    try:
        names = os.listdir(path) if path.is_dir() else []
        journals = sum((path / n).stat().st_size for n in names if parse_journal_name(n) is not None)
    except OSError as e:  # (a race with the checks above, or a filesystem that refuses)
        return f"cannot list {path}: {e.strerror or e}"
    present = {parse_data_file_name(n) for n in names}
    missing = files - sum(1 for i in present if i is not None and i < files)
    journal = max(0, DEFAULT_JOURNAL_BYTES - journals)
    need = missing * ncfg.file_bytes + journal
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    if need <= free:
        return None
    parts = [f"{missing} block file(s) of {format_bytes(ncfg.file_bytes)}"] if missing else []
    parts += [f"a journal of {format_bytes(journal)}"] if journal else []
    return (
        f"its filesystem has {format_bytes(free)} free, the NVMe tier needs {format_bytes(need)} "
        f"more ({' and '.join(parts)}): lower --disk-bytes or free space"
    )


def nvme_config(cfg: DaemonConfig) -> NvmeConfig:
    """The NVMe tier's geometry from ``cfg`` (block files of whole NVMe slabs)."""
    slab = 2 * cfg.host_tier.slab_bytes  # room for the header region plus the largest block
    file_bytes = max(slab, min(cfg.nvme_tier.disk_file_bytes, cfg.nvme_tier.disk_bytes) // slab * slab)
    return NvmeConfig(
        directory=cfg.nvme_tier.disk_dir,
        capacity_bytes=max(cfg.nvme_tier.disk_bytes, file_bytes),
        io_align=cfg.nvme_tier.io_align_bytes,
        file_bytes=file_bytes,
        slab_bytes=slab,
        io_threads=cfg.nvme_tier.io_threads,
    )


def disk_refusal(cfg: DaemonConfig, problem: str) -> str:
    """The line refusing a start whose NVMe tier cannot be used (here or after its open)."""
    return (
        f"disk_dir {cfg.nvme_tier.disk_dir} (--disk-dir) cannot be used: {problem}; fix it, choose "
        "another directory, or set disk_optional = true (--disk-optional) to start with the "
        "host tier alone and open the NVMe tier once it can"
    )

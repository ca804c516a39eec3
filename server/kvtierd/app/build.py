"""Building the daemon's storage from its config, in the order of the refusals: the tenants
file, the cluster tier's files, the KV-event publisher, the NVMe directory's lock and the tier's
open (all before any host memory is reserved), then the host tier, the tenants' arenas and the
storage tier's place in the cache's chain.

Every function here runs in ``Daemon.__init__`` (or, for :class:`TenantArenas`, on the event
loop at a tenants-file reload); a configuration that cannot be served is a
:class:`~kvtierd.preflight.StartupError` naming the setting.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier_contract.units import exact_bytes
from kvtierd.cache import TieredCache, TierLink
from kvtierd.config import ClusterTierConfig, DaemonConfig
from kvtierd.events import NO_EVENTS, BlockEvents, EventSink
from kvtierd.policies import make_write_policy
from kvtierd.preflight import StartupError, disk_refusal, nvme_config, tenant_arena_bytes
from kvtierd.tenancy import Tenancy
from kvtierd.tenancy.exposure import check_metrics_exposure
from kvtierd.tenants import Tenants
from kvtierd.tenants_file import load_tenants
from kvtierd.tiers import Arena, HostTier, Recovered
from kvtierd.tiers.base import TierUnavailable
from kvtierd.tiers.cluster.settings import ClusterSettings, Credentials, parse_url
from kvtierd.tiers.nvme.format import META_NAME, CorruptMeta, StoreMeta
from kvtierd.tiers.nvme.tier import NvmeTier
from kvtierd.transports.cuda_driver import CudaDriver
from kvtierd.transports.cuda_ipc import CudaIpcCopier, CudaIpcTransport

log = logging.getLogger("kvtierd")
if TYPE_CHECKING:  # pyzmq and msgpack: only when events are on
    from kvtierd.events.publisher import EventPublisher
    from kvtierd.events.sockets import SocketRules

T = TypeVar("T")


def host_tier(cfg: DaemonConfig) -> tuple[Arena, HostTier]:
    """The shared arena (reserved, and prefaulted, here) and the host tier over it."""
    h = cfg.host_tier
    slabs = h.host_bytes // h.slab_bytes
    arena = Arena(slabs * h.slab_bytes, prefault=h.prefault)
    # With an NVMe tier, host slots are io-aligned too: O_DIRECT reads and writes go straight
    # between a host slot and its disk slot, padding included.
    n = cfg.nvme_tier
    align = max(h.slot_align_bytes, n.io_align_bytes if n.disk_dir else 0)
    return arena, HostTier(arena, slab_bytes=h.slab_bytes, slot_align_bytes=align)


class TenantArenas:
    """The host arenas of their own of tenants allowed shm or cuda_ipc, and of groups one of
    whose readers is (sealed: clients map them read-only): tenant or group -> its pool in the
    host tier. An arena lives as long as the daemon and never changes owner, so no slot ever
    moves to another tenant (nothing to zero). Owned by the Daemon; built in its ``__init__``,
    grown on the event loop at a reload."""

    def __init__(self, host: HostTier, cfg: DaemonConfig, tenants: Tenants | None) -> None:
        self.host = host
        self.cfg = cfg
        # (group?, name) -> its arena's pool; never reassigned. A group and a tenant of one name
        # (a reload that turns one into the other) never share an arena: a tenant's holds its
        # private blocks and is unsealed, a group's is sealed against its readers.
        self.pools: dict[tuple[bool, str], int] = {}
        if tenants is not None:  # (no cuda_ipc yet: it registers every arena when made)
            self.add(tenants, None)

    def add(self, tenants: Tenants, copier: CudaIpcCopier | None) -> None:
        """An arena for each such tenant that has none yet (at start and on reload). A size
        changed in the file takes effect at the next start (arenas are sealed against
        resizing)."""
        for name, size in tenant_arena_bytes(self.cfg, tenants).items():
            group = tenants.by_name[name].group
            pool = self.pools.get((group, name))
            if pool is not None:
                if self.host.pool_bytes[pool] != size:
                    log.warning(
                        "tenant %s: arena of %d bytes kept (the file asks %d; sizes "
                        "change at the next start)",
                        name,
                        self.host.pool_bytes[pool],
                        size,
                    )
                continue
            try:
                arena = Arena(
                    size, prefault=self.cfg.host_tier.prefault, name=f"kvtier-{name}"[:200], read_only=group
                )
            except OSError as e:  # its shm sessions are refused; never handed another arena
                log.error("tenant %s: cannot make its arena of %d bytes: %s", name, size, e)
                continue
            pool = self.host.add_arena(arena)
            if copier is not None:
                copier.add_arena(pool)
            self.pools[(group, name)] = pool
            log.info("tenant %s: arena of %d bytes", name, size)

    def groups(self) -> dict[int, str]:
        """Each group's arena (pool) -> the group's name."""
        return {pool: name for (group, name), pool in self.pools.items() if group}

    def of(self, owner: str | None, group: bool = False) -> int:
        """The arena (pool) of a tenant's blocks (``group``: a group's): its own, or the
        shared one (0)."""
        return self.pools.get((group, owner or ""), 0)


def cuda_transport(
    cfg: DaemonConfig, host: HostTier, cache: TieredCache, driver: CudaDriver | None
) -> CudaIpcTransport | None:
    """cuda_ipc: CUDA (cupy) only when enabled (or a driver given: tests); the arenas are
    page-locked when it starts."""
    if not cfg.transports.cuda_ipc and driver is None:
        return None
    if driver is None:
        from kvtierd.transports.cuda_driver import CupyDriver

        driver = CupyDriver()
    return CudaIpcTransport(CudaIpcCopier(host, driver), cache)


def open_storage(cfg: DaemonConfig) -> tuple[NvmeTier | None, Recovered | None]:
    """The NVMe tier (None: not configured), its directory locked and the tier opened: one
    daemon per disk directory, its lock before anything there is read or written
    (lockfile.InUse: another daemon holds it; run() exits with it)."""
    if not cfg.nvme_tier.disk_dir:
        return None, None
    nvme = _nvme_tier(cfg)
    _lock_disk(nvme, cfg)
    return nvme, _open_nvme(nvme, cfg)  # its index read; a degraded tier refused


def attach_storage(
    cache: TieredCache, nvme: NvmeTier, opened: Recovered | None, cfg: DaemonConfig
) -> TierLink:
    """``nvme`` added to the cache's chain with its write policy (its recovered copies put
    into the index); a directory that is not a kvtier one refuses the start."""
    n = cfg.nvme_tier
    try:
        return cache.add_storage_tier(
            nvme,
            make_write_policy(
                n.write_policy, flush_watermark=n.flush_watermark, write_after_hits=n.write_after_hits
            ),
            opened,
        )
    except (CorruptMeta, ValueError) as e:  # not a kvtier directory, or another layout's
        nvme.close()
        raise StartupError(
            f"disk_dir {n.disk_dir} (--disk-dir) cannot be used: {e}; "
            f"check it with kvtierd fsck, or choose another "
            f"directory"
        ) from None


def event_publisher(cfg: DaemonConfig, tenants: Tenants | None) -> EventPublisher:
    """The KV-event publisher (pyzmq and msgpack imported here), its sockets bound private
    (ipc://: then set to ``events_socket_mode``, before they appear) and its thread started;
    ValueError naming the setting when the packages are missing or an endpoint cannot be
    bound (or would reach the engines, or is one of the daemon's sockets)."""
    from kvtierd.events import EventQueue
    from kvtierd.events.publisher import EventPublisher, EventSettings, check_dependencies

    check_dependencies()
    e = cfg.events
    publisher = EventPublisher(
        EventSettings(
            endpoint=e.events_endpoint,
            replay_endpoint=e.events_replay_endpoint,
            tenant_endpoint=e.events_tenant_endpoint,
            tenant_replay_endpoint=e.events_tenant_replay_endpoint,
            topic=e.events_topic,
            block_hashes=e.events_block_hashes,
            heartbeat_s=e.events_heartbeat_s,
            buffer_batches=e.events_buffer_batches,
            stream_buffer_bytes=e.events_stream_buffer_bytes,
            buffer_bytes=e.events_buffer_bytes,
            max_message_bytes=e.events_max_message_bytes,
            replay_max_bytes=e.events_replay_max_bytes,
            send_hwm=e.events_send_queue_messages,
            max_peers=e.events_max_connections,
            rules=event_socket_rules(cfg),
            private=tenants is not None,
        ),
        EventQueue(e.events_queue_blocks),
    )
    publisher.start(event_buffer_caps(Tenancy(tenants), list(tenants.by_name)) if tenants is not None else {})
    return publisher


def event_sink(publisher: EventPublisher | None) -> EventSink:
    """What the cache tells of blocks entering and leaving its tiers: the publisher's queue, or
    (events off) the no-op sink. Chosen once, here."""
    return BlockEvents(publisher.queue) if publisher is not None else NO_EVENTS


def event_buffer_caps(tenancy: Tenancy, names: list[str]) -> dict[str, int]:
    """Each tenant's KV-event replay buffer bytes: its ``buffered_bytes`` quota."""
    return {n: tenancy.quota(n, "buffered_bytes") or 0 for n in names}


def event_socket_rules(cfg: DaemonConfig) -> SocketRules:
    """Where event sockets may not go: the daemon's own sockets and lock; who they must not
    reach: the group of the daemon's gRPC socket (its directory's, when that is setgid)."""
    from kvtierd.events.sockets import SocketRules

    shm = os.path.abspath(cfg.shm_socket_path)
    base = shm.removesuffix(".shm")
    gids = {os.getegid()}
    try:
        parent = os.stat(os.path.dirname(base))
        if parent.st_mode & stat.S_ISGID:
            gids.add(parent.st_gid)
    except OSError:
        pass
    return SocketRules(
        mode=cfg.events.events_socket_mode,
        reserved=frozenset({base, shm, base + ".lock"}),
        engine_gids=frozenset(gids),
    )


def _lock_disk(nvme: NvmeTier, cfg: DaemonConfig) -> None:
    """The NVMe directory's lock, now. A directory that cannot be made or opened yet (a
    read-only or missing mount) refuses the start (StartupError), or with ``disk_optional`` is
    locked by the tier's later open instead."""
    try:
        nvme.lock()
    except OSError as e:
        if not cfg.nvme_tier.disk_optional:
            raise StartupError(disk_refusal(cfg, f"cannot lock it: {e.strerror or e}")) from None
        log.warning(
            "nvme directory %s not locked yet (%s): the tier locks it when it opens",
            nvme.cfg.directory,
            e.strerror or e,
        )


def cluster_settings(cfg: DaemonConfig) -> ClusterSettings:
    """The cluster tier's settings from ``cfg`` (the password and the fleet key read from their
    files here)."""
    c = cfg.cluster_tier
    seeds, tls = parse_url(c.cluster)
    try:
        import hiredis  # noqa: F401  (the parser redis-py uses when it is there)
        import redis  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "cluster: the cluster tier needs redis-py and hiredis (the kvtierd wheel's cluster "
            f"extra, README.md, Install): {e}"
        ) from None
    creds = _cluster_credentials(c, tls)
    from kvtierd.tiers.cluster.keys import read_fleet_key

    return ClusterSettings(
        seeds=seeds,
        fleet_key=read_fleet_key(c.cluster_fleet_key_file),
        tenanted=bool(cfg.tenancy.tenants_file),
        realm=c.cluster_realm,
        creds=creds,
        write_policy=c.cluster_write_policy,
        ttl_s=c.cluster_ttl_s,
        lookup_timeout_s=c.cluster_lookup_timeout_ms / 1000,
        fetch_timeout_s=c.cluster_fetch_timeout_ms / 1000,
        write_timeout_s=c.cluster_write_timeout_ms / 1000,
        # blocks waiting for the cluster stay pinned in the host tier: never more than a quarter
        queue_bytes=min(c.cluster_queue_bytes, cfg.host_tier.host_bytes // 4),
        inflight_bytes=c.cluster_inflight_bytes,
        breaker_s=c.cluster_breaker_s,
    )


def _cluster_credentials(c: ClusterTierConfig, tls: bool) -> Credentials:
    """How the daemon signs in to the cluster: its user, the password read from
    ``cluster_password_file`` here (its first line), its TLS files."""
    password = ""
    if c.cluster_password_file:
        try:
            password = Path(c.cluster_password_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ValueError(f"cluster_password_file: cannot read a password: {e}") from None
    return Credentials(
        username=c.cluster_username,
        password=password,
        tls=tls,
        ca_file=c.cluster_tls_ca,
        cert_file=c.cluster_tls_cert,
        key_file=c.cluster_tls_key,
    )


def _nvme_tier(cfg: DaemonConfig) -> NvmeTier:
    """The NVMe tier over ``cfg.nvme_tier.disk_dir`` (not opened yet: ``_open_nvme``)."""
    return NvmeTier(nvme_config(cfg))


def _open_nvme(nvme: NvmeTier, cfg: DaemonConfig) -> Recovered | None:
    """Open the NVMe tier (its index read and its files opened; nothing put into a cache yet)
    before any host memory is reserved. A tier that is not a kvtier directory, or opens
    degraded (disk full, read-only, unreadable index), refuses the start (StartupError, the
    tier closed) unless ``disk_optional``: then it serves degraded, said in the ready line, and
    a probe resumes it. None: not opened (the cache's restore tries once more, then defers)."""
    try:
        opened: Recovered | None = nvme.open()
    except TierUnavailable:
        opened = None
    except CorruptMeta as e:  # not a kvtier directory
        nvme.close()
        raise StartupError(
            f"disk_dir {cfg.nvme_tier.disk_dir} (--disk-dir) cannot be used: "
            f"{e}; check it with kvtierd fsck, or choose another directory"
        ) from None
    except ValueError as e:  # formatted with another layout (another size)
        nvme.close()
        raise StartupError(layout_refusal(cfg, f"{e}")) from None
    if not nvme.admitting and not cfg.nvme_tier.disk_optional:
        reason = nvme.degraded_reason
        nvme.close()
        raise StartupError(disk_refusal(cfg, f"the NVMe tier opened degraded: {reason}"))
    return opened


def layout_refusal(cfg: DaemonConfig, why: str) -> str:
    """The line refusing an NVMe directory formatted with another layout than ``cfg`` makes
    (``why``: the tier's words), with the settings it was made with and how to reformat it."""
    n = cfg.nvme_tier
    try:
        meta = StoreMeta.decode(Path(n.disk_dir, META_NAME).read_bytes())
    except (OSError, CorruptMeta):  # (it was read a moment ago)
        return f"disk_dir {n.disk_dir} (--disk-dir) cannot be used: {why}; choose another directory"
    now = nvme_config(cfg)
    same = f"--disk-bytes {exact_bytes(meta.file_bytes * meta.files)}"
    if meta.files > 1:  # its file size came from disk_file_bytes
        same += f' and disk_file_bytes = "{exact_bytes(meta.file_bytes)}"'
    if meta.io_align != now.io_align:
        same += f" and --io-align {meta.io_align}"
    return (
        f"disk_dir {n.disk_dir} (--disk-dir) was formatted with {meta.files} block file(s) of "
        f"{exact_bytes(meta.file_bytes)} (io_align {meta.io_align}); this configuration makes "
        f"block files of {exact_bytes(now.file_bytes)} (io_align {now.io_align}: --disk-bytes, "
        "disk_file_bytes, --slab-bytes and --io-align set them), and a directory keeps the "
        f"layout it was formatted with. Start with {same} as before, or reformat it, losing "
        f"every block cached there: stop the daemon, remove the directory (rm -r {n.disk_dir}) "
        "and start again; or choose another --disk-dir"
    )


def tenants(cfg: DaemonConfig) -> Tenants | None:
    """The tenants file, checked against the metrics exposure; StartupError when it is not
    valid (it may have changed since the CLI read it)."""
    if not cfg.tenancy.tenants_file:
        return None
    found = config_checked(load_tenants, cfg.tenancy.tenants_file)
    config_checked(check_metrics_exposure, cfg, len(found.metrics_digests))
    return found


def config_checked(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, its configuration ValueError (a file read at start) a StartupError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise StartupError(f"{e}") from None

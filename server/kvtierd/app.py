"""Composition root and lifecycle of kvtierd.

``Daemon(cfg)`` builds every component (arena, host tier, policy, cache, sessions, service,
transports, metrics); ``run(cfg)`` drives the lifecycle:

    checks (the sockets' lock; kvtierd.preflight: memory, NVMe directory, ports; then, in
            Daemon(), the tenants file, the cluster tier's files, the NVMe directory's lock
            and the tier's open, a tier that opens degraded refused unless disk_optional):
            a refusal is one StartupError line, exit 2, before the host arena is reserved
            (and prefaulted) and before any socket is bound; the arena comes next, then the
            NVMe tier's recovered copies are put into the index
      -> startup (bind everything, health SERVING, print the ready line)
      -> serve (lease sweeper runs)
      -> drain on SIGTERM/SIGINT (health NOT_SERVING, stores refused, in-flight jobs get
         ``drain_timeout_s`` to finish) -> shutdown.   A second signal exits at once.

The ready line is ``KVTIERD_READY {json}`` on stdout with the bound addresses (ports chosen by the
OS when configured as 0) and every tier's state (``tiers``), so supervisors and tests need not
guess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import ssl
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier_contract import published_index as pi
from kvtier_contract.errors import NotFound
from kvtier_contract.protoutil import to_dict
from kvtier_contract.published_index import STAMP_INTERVAL_S
from kvtier_contract.units import format_bytes
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd import preflight
from kvtierd.cache import TieredCache, TierLink
from kvtierd.config import DaemonConfig, is_loopback
from kvtierd.index import Entry, NamespaceState
from kvtierd.index.published import Publishers
from kvtierd.lockfile import InUse, OwnerLock
from kvtierd.metrics import MetricsServer
from kvtierd.policies import EvictionPolicy, make_policy, make_write_policy
from kvtierd.preflight import (
    StartupError,
    bind_refusal,
    disk_refusal,
    nvme_config,
    tenant_arena_bytes,
)
from kvtierd.service import CALLER, KvtierService, add_to_server
from kvtierd.sessions import Session, SessionTable
from kvtierd.tenancy import Shares, Tenancy
from kvtierd.tenancy.exposure import check_metrics_exposure, metrics_scrape_only
from kvtierd.tenants import Tenant, Tenants, load_tenants
from kvtierd.tiers import Arena, HostTier, Recovered
from kvtierd.tiers.base import TierUnavailable
from kvtierd.tiers.cluster.settings import ClusterSettings, Credentials, parse_url
from kvtierd.tiers.nvme.format import CorruptMeta
from kvtierd.tiers.nvme.tier import NvmeTier
from kvtierd.transports.base import ServerTransport
from kvtierd.transports.control import ControlChannel
from kvtierd.transports.cuda_driver import CudaDriver, CudaUnavailable
from kvtierd.transports.cuda_ipc import CudaIpcCopier, CudaIpcTransport
from kvtierd.transports.shm import ShmFdServer
from kvtierd.transports.tcp import DataChannelLimits, DataChannelServer

log = logging.getLogger("kvtierd")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Kvtier"].full_name
NVME_HEALTH_NAME = "kvtier.nvme"  # NOT_SERVING while the NVMe tier is degraded
if TYPE_CHECKING:  # pyzmq and msgpack: only when events are on
    from kvtierd.events.publisher import EventPublisher

T = TypeVar("T")


class Daemon:
    """Owns every component; the event loop that runs ``start`` owns all cache state."""

    def __init__(self, cfg: DaemonConfig, *, cuda_driver: CudaDriver | None = None) -> None:
        self.cfg = cfg
        # Every refusal of the configuration comes before any memory is reserved: the tenants
        # file (read again: it may have changed since the CLI's check), then the NVMe tier.
        tenants = _tenants(cfg)
        cluster = _config_checked(cluster_settings, cfg) if cfg.cluster_tier.cluster else None  # files read
        # KV events: bound and publishing before the NVMe recovery, which they announce
        self.events: EventPublisher | None = _config_checked(_event_publisher, cfg, tenants) \
            if cfg.events.events_endpoint or cfg.events.events_tenant_endpoint else None
        # One daemon per disk directory: its lock before anything there is read or written
        # (lockfile.InUse: another daemon holds it; run() exits with it). Sockets: start().
        nvme = _nvme_tier(cfg) if cfg.nvme_tier.disk_dir else None
        opened: Recovered | None = None
        if nvme is not None:
            _lock_disk(nvme, cfg)
            opened = _open_nvme(nvme, cfg)  # its index read; a degraded tier refused
        self._socket_lock: OwnerLock | None = None
        self.boot_epoch = time.time_ns()
        slabs = cfg.host_tier.host_bytes // cfg.host_tier.slab_bytes
        self.arena = Arena(slabs * cfg.host_tier.slab_bytes, prefault=cfg.host_tier.prefault)  # reserved here
        # With an NVMe tier, host slots are io-aligned too: O_DIRECT reads and writes go straight
        # between a host slot and its disk slot, padding included.
        align = max(cfg.host_tier.slot_align_bytes, cfg.nvme_tier.io_align_bytes if cfg.nvme_tier.disk_dir else 0)
        self.host = HostTier(self.arena, slab_bytes=cfg.host_tier.slab_bytes, slot_align_bytes=align)
        # Tenants allowed shm or cuda_ipc get arenas of their own, before anything (NVMe
        # recovery included) registers a namespace: a namespace's arena is its tenant's.
        self._tenant_arenas: dict[str, int] = {}  # tenant -> its arena's pool; never reassigned
        self.cuda: CudaIpcTransport | None = None  # (made below; registers every arena)
        if tenants is not None:
            self._add_tenant_arenas(tenants)
        # Ghost history for ARC: as many entries as the arena holds of its smallest slots.
        policy: EvictionPolicy[Entry] = make_policy(
            cfg.host_tier.eviction_policy, ghost_capacity=min(1 << 20, self.host.num_slabs * 64))
        self.cache = TieredCache(self.host, policy, max_namespaces=cfg.sessions.max_namespaces,
                                 policy_name=cfg.host_tier.eviction_policy, arena_of=self._arena_of)
        self.cache.verify_bytes = cfg.transports.verify_bytes
        self.cache.host_quota = self._host_quota
        if self.events is not None:
            from kvtierd.events import BlockEvents

            self.cache.residency.events = BlockEvents(self.events.queue)
        if cfg.nvme_tier.disk_dir:
            assert nvme is not None
            try:
                link = self.cache.add_storage_tier(nvme, make_write_policy(
                    cfg.nvme_tier.write_policy, flush_watermark=cfg.nvme_tier.flush_watermark,
                    write_after_hits=cfg.nvme_tier.write_after_hits), opened)
            except (CorruptMeta, ValueError) as e:  # not a kvtier directory, or another layout's
                nvme.close()
                raise StartupError(f"disk_dir {cfg.nvme_tier.disk_dir} (--disk-dir) cannot be used: {e}; "
                                   f"check it with kvtierd fsck, or choose another "
                                   f"directory") from None
            link.tenant_quota = self._nvme_quota
            link.quota_refused = lambda tenant: self.tenancy.count_refusal(tenant, "nvme_bytes")
        if cfg.cluster_tier.cluster:  # started in start(); redis-py only when configured
            from kvtierd.tiers.cluster.tier import ClusterTier

            assert cluster is not None
            self.cache.add_cluster_tier(ClusterTier(cluster))
        # cuda_ipc: CUDA (cupy) only when enabled; the arenas are page-locked in start().
        if cfg.transports.cuda_ipc or cuda_driver is not None:
            if cuda_driver is None:
                from kvtierd.transports.cuda_driver import CupyDriver

                cuda_driver = CupyDriver()
            self.cuda = CudaIpcTransport(CudaIpcCopier(self.host, cuda_driver), self.cache)
        self.sessions = SessionTable(
            max_sessions=cfg.sessions.max_sessions, default_ttl_s=cfg.sessions.lease_ttl_s,
            min_ttl_s=cfg.sessions.min_lease_ttl_s, max_ttl_s=cfg.sessions.max_lease_ttl_s,
            on_release=self._release_session)
        self.published = Publishers(self.boot_epoch, enabled=cfg.transports.publish_index,
                                    idle_retire_s=cfg.transports.publish_index_idle_s,
                                    flags=pi.FLAG_SHARED_TIER if cfg.cluster_tier.cluster else 0)
        self.tenancy = Tenancy(tenants, Shares(
            max_sessions=cfg.sessions.max_sessions, max_namespaces=cfg.sessions.max_namespaces,
            shared_arena_bytes=self.arena.size, disk_bytes=cfg.nvme_tier.disk_bytes,
            tenant_arena_bytes=cfg.tenancy.tenant_arena_bytes))
        self.service = KvtierService(self.cache, self.sessions, boot_epoch=self.boot_epoch,
                                     max_batch_blocks=cfg.requests.max_batch_blocks,
                                     advertise=self._advertise, cuda=self.cuda,
                                     max_inflight=cfg.requests.max_inflight_rpcs, tenancy=self.tenancy)
        self.service.after_rpc = self.published.flush
        self.service.verify_store = cfg.transports.verify_store
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None  # the Unix socket's
        self.tcp_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.transports: list[ServerTransport] = [t for t in (self.cuda,) if t is not None]
        self.metrics: MetricsServer | None = None
        self.addresses: dict[str, Any] = {}
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._stamper: asyncio.Task[None] | None = None
        self._nvme_serving: bool | None = None
        self._arena_ok = True

    def _host_quota(self, ns: NamespaceState) -> int | None:
        """The ``host_bytes`` quota of ``ns``'s tenant (None: none, or single-tenant); for a
        namespace left in the shared arena by a tenant that got an arena of its own later, a
        tcp-only tenant's share of it."""
        who = self.tenancy.tenant(ns.spec.tenant)
        if who is None:
            return None
        quota = self.tenancy.quota(who, "host_bytes")
        return self.tenancy.shared_share(who) if quota is None and ns.pool == 0 else quota

    def _nvme_quota(self, tenant: str) -> int | None:
        """The tenant's ``nvme_bytes`` quota (None: unlimited)."""
        return self.tenancy.quota(tenant, "nvme_bytes") if self.tenancy.tenants else None

    def _add_tenant_arenas(self, tenants: Tenants) -> None:
        """An arena of its own for each tenant allowed shm or cuda_ipc that has none yet (at
        start and on reload). An arena lives as long as the daemon and never changes tenant,
        so no slot ever moves to another tenant (nothing to zero). A size changed in the file
        takes effect at the next start (arenas are sealed against resizing)."""
        for name, size in tenant_arena_bytes(self.cfg, tenants).items():
            pool = self._tenant_arenas.get(name)
            if pool is not None:
                if self.host.pool_bytes[pool] != size:
                    log.warning("tenant %s: arena of %d bytes kept (the file asks %d; sizes "
                                "change at the next start)", name, self.host.pool_bytes[pool],
                                size)
                continue
            try:
                arena = Arena(size, prefault=self.cfg.host_tier.prefault, name=f"kvtier-{name}"[:200])
            except OSError as e:  # its shm sessions are refused; never handed another arena
                log.error("tenant %s: cannot make its arena of %d bytes: %s", name, size, e)
                continue
            pool = self.host.add_arena(arena)
            if self.cuda is not None:
                self.cuda.copier.add_arena(pool)
            self._tenant_arenas[name] = pool
            log.info("tenant %s: arena of %d bytes", name, size)

    def _metrics_caller(self, token: str | None) -> tuple[bool, Tenant | None]:
        """/metrics (its threads): single-tenant, anyone sees everything; with tenants, a scrape
        token (metrics_tokens_sha256) everything (caller None: the operator's view), a
        tenant's token that tenant's figures, the operator's everything, none: 401; off
        loopback in plaintext (tenancy.exposure.metrics_scrape_only) scrape tokens only."""
        if self.tenancy.tenants is None or self.tenancy.is_metrics_token(token):
            return True, None
        if metrics_scrape_only(self.cfg):
            return False, None
        caller = self.tenancy.caller_of(token)
        return caller is not None, caller

    def _arena_of(self, tenant: str | None) -> int:
        """The arena (pool) of ``tenant``'s blocks: its own, or the shared one (0)."""
        return self._tenant_arenas.get(tenant or "", 0)

    def _session_arena(self, session: Session) -> tuple[int, int] | None:
        """fd and size of the arena ``session`` maps (shm handshake), or None: refused."""
        pool = self.service.mapped_arena(session)
        if pool is None:
            return None
        arena = self.host.arenas[pool]
        return arena.fd, arena.size

    def _release_session(self, session: Session) -> None:
        self.cache.release_session(session)
        for t in self.transports:
            t.release_session(session.id)

    def _advertise(self) -> dict[str, Any]:
        adv: dict[str, Any] = {"shm_socket": "", "data_host": "", "data_port": 0,
                               "arena_bytes": self.arena.size}
        for t in self.transports:
            adv.update(t.advertise())
        return adv

    def _index_handout(self, session_id: int, namespace_id: int) -> tuple[int, int, int]:
        """A read-only descriptor of a namespace's published index, for a live session (of the
        namespace's tenant: another tenant's namespace answers as an absent one)."""
        s = self.sessions.get(session_id)
        ns = self.cache.namespace(namespace_id)
        if not self._may_see(s, ns.spec.tenant):
            raise NotFound(f"unknown namespace {namespace_id} (register it first)",
                           field="namespace_id")
        return self.published.handout(ns)

    def _may_see(self, session: Session, tenant: str | None) -> bool:
        """Whether ``session`` may use objects of ``tenant`` (the operator's may)."""
        return self.tenancy.may_see(session.tenant, tenant)

    def _control_channel(self, session: Session,
                         on_close: Callable[[ControlChannel], None]) -> ControlChannel:
        """The protocol of a control channel of ``session`` (shm socket handshake)."""
        return ControlChannel(self.service, session.id, session.tenant, on_close)

    def _peer_ok(self, session: Session, uid: int, gid: int) -> bool:
        """shm handshakes: the Unix peer (SO_PEERCRED) must be allowed for the session's
        tenant (its unix_uids / unix_gids)."""
        return self.tenancy.allows_peer(session.tenant, uid, gid)

    def tiers(self) -> dict[str, Any]:
        """Every tier and its state (the ready line's ``tiers``); None: a tier not configured."""
        host = {"bytes": self.host.capacity_bytes, "shared_arena_bytes": self.arena.size,
                "tenant_arenas": len(self._tenant_arenas),
                "eviction_policy": self.cfg.host_tier.eviction_policy}
        nvme: dict[str, Any] | None = None
        for link in self.cache.chain:
            nvme = {"directory": self.cfg.nvme_tier.disk_dir, "bytes": self.cfg.nvme_tier.disk_bytes,
                    "state": "serving" if link.tier.admitting else "degraded",
                    "reason": link.tier.degraded_reason, "recovered_blocks": link.restored,
                    "write_policy": self.cfg.nvme_tier.write_policy}
        cluster: dict[str, Any] | None = None
        if self.cache.fleet is not None:
            seeds, tls = parse_url(self.cfg.cluster_tier.cluster)
            cluster = {"seeds": list(seeds), "tls": tls,
                       "state": "connected" if self.cache.fleet.tier.connected else "connecting",
                       "write_policy": self.cfg.cluster_tier.cluster_write_policy}
        return {"host": host, "nvme": nvme, "cluster": cluster}

    async def abort_start(self) -> None:
        """A start that failed half-way (a port taken since the startup checks): the servers
        and transports made so far closed, the NVMe tier closed (its directory unlocked), the
        Unix socket files this daemon bound removed."""
        for server in (self.server, self.tcp_server, self.health_server):
            if server is not None:
                await server.stop(None)
        for t in self.transports:
            t.close()
        for link in self.cache.chain:  # its files, I/O threads and the directory's lock
            await asyncio.get_running_loop().run_in_executor(None, link.tier.close)
        if self.events is not None:
            self.events.close(0.0)
        for key in ("unix", "shm"):
            path = str(self.addresses.get(key, "")).removeprefix("unix://")
            if path and self._socket_lock is not None:  # ours: we hold their lock
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again; a bad file keeps the current tenants."""
        if not self.cfg.tenancy.tenants_file:
            return
        try:
            tenants = load_tenants(self.cfg.tenancy.tenants_file)
        except ValueError as e:
            log.error("tenants file not reloaded (the current one stays): %s", e)
            return
        self._add_tenant_arenas(tenants)
        self.tenancy.reload(tenants)
        if metrics_scrape_only(self.cfg) and not tenants.metrics_digests:
            log.warning("the tenants file has no metrics_tokens_sha256 now: every scrape of "
                        "/metrics (plaintext, off loopback) is refused until it has one again")
        revoked = self.tenancy.revoked(self.sessions.all())
        for s in revoked:  # (their channels and data connections close with them)
            try:
                self.sessions.close(s.id)
            except Exception:  # (a bug; the other revocations still happen)
                log.exception("closing revoked session %d failed", s.id)
        for s in self.sessions.all():
            who = self.tenancy.tenant(s.tenant)
            if who is not None and who.max_lease_s is not None:
                self.sessions.clamp(s, who.max_lease_s)
        (log.warning if revoked else log.info)(
            "tenants file reloaded: %d tenants; %d sessions closed (their tenant or credential "
            "is no longer in the file)", len(tenants), len(revoked))

    def _grpc_server(self, *, reflect: bool) -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_to_server(self.service, server)  # lenient request decoding (service.py)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if reflect:
            reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME,
                                                 health.SERVICE_NAME), server)
        return server

    def _socket_path(self) -> str:
        path = self.cfg.grpc.socket_path
        return os.path.abspath(path) if path else ""

    async def start(self) -> None:
        cfg = self.cfg
        # One daemon per socket: its lock before anything is unlinked or bound (InUse: exit).
        # A daemon process (_main) has taken it before the daemon was even built.
        if self._socket_lock is None:
            self._socket_lock = _lock_sockets(cfg)
        _raise_fd_limit()
        if self.cuda is not None:
            await self.cuda.start()  # page-locks the arena before anything is served
        if self.cache.fleet is not None:  # connects in the background: never blocks a start
            self.cache.fleet.tier.start()
        # One server per kind of listener: the Unix socket (reflection by default), the TCP
        # listener (TLS when configured; no reflection unless "all"), a health-only one.
        if cfg.grpc.socket_path:
            self.server = self._grpc_server(reflect=cfg.grpc.reflection in ("unix", "all"))
            path = self._socket_path()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead daemon's (this one holds the socket's lock)
            with _private_umask():  # created owner-only: no window before the chmod
                self.server.add_insecure_port(f"unix://{path}")
            os.chmod(path, cfg.grpc.socket_mode)
            self.addresses["unix"] = f"unix://{path}"
        if cfg.grpc.listen:
            self.tcp_server = self._grpc_server(reflect=cfg.grpc.reflection == "all")
            creds = _tls_credentials(cfg) if cfg.grpc.tls_cert else None
            port = _add_port(self.tcp_server, "listen", cfg.grpc.listen, creds)
            if creds is None and not is_loopback(cfg.grpc.listen):
                log.warning("gRPC listens on %s in plaintext (allow_plaintext_remote): "
                            "tokens and figures cross the network unencrypted", cfg.grpc.listen)
            self.addresses["grpc"] = f"{cfg.grpc.listen.rpartition(':')[0]}:{port}"
        if cfg.grpc.health_listen:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            port = _add_port(self.health_server, "health_listen", cfg.grpc.health_listen, None)
            self.addresses["health"] = f"{cfg.grpc.health_listen.rpartition(':')[0]}:{port}"
        if cfg.transports.data_listen and not cfg.grpc.tls_cert and not is_loopback(cfg.transports.data_listen):
            log.warning("the data channel listens on %s in plaintext (allow_plaintext_remote)",
                        cfg.transports.data_listen)
        if cfg.transports.data_listen:
            host, _, port_s = cfg.transports.data_listen.rpartition(":")
            data = DataChannelServer(host, int(port_s), self.cache, self.sessions, DataChannelLimits(
                hello_timeout_s=cfg.transports.handshake_timeout_s, idle_timeout_s=cfg.transports.data_idle_timeout_s,
                max_connections=cfg.transports.data_max_connections,
                max_queued_bytes=cfg.transports.data_max_queued_bytes,
                max_unauthenticated=cfg.transports.data_max_unauthenticated,
                per_tenant=cfg.transports.data_max_connections_per_tenant or
                max(1, cfg.transports.data_max_connections // 2)),
                ssl_context=_data_tls(cfg) if cfg.grpc.tls_cert else None,
                control=self._control_channel if cfg.transports.control_channel else None)
            try:
                await data.start()
            except OSError as e:
                raise StartupError(bind_refusal("data_listen", host, int(port_s), e)) from None
            self.transports.append(data)
            self.addresses["data"] = f"{host}:{data.port}"
        if cfg.transports.shm_enabled:
            shm = ShmFdServer(cfg.shm_socket_path, self._session_arena,
                              self.boot_epoch, self.sessions,
                              handshake_timeout_s=cfg.transports.handshake_timeout_s,
                              max_connections=cfg.transports.shm_max_connections,
                              per_uid=cfg.transports.shm_handshakes_per_uid,
                              index=self._index_handout, index_hold=self.published.hold,
                              peer_ok=self._peer_ok, login=self.tenancy.unix_login,
                              control=self._control_channel if cfg.transports.control_channel else None)
            shm.socket_mode = cfg.grpc.socket_mode
            await shm.start()
            self.transports.append(shm)
            self.addresses["shm"] = shm.path
        for server in (self.server, self.tcp_server, self.health_server):
            if server is not None:
                await server.start()
        if cfg.metrics.metrics_port >= 0:
            self.metrics = MetricsServer(cfg.metrics.metrics_host, cfg.metrics.metrics_port,
                                         asyncio.get_running_loop(), self.snapshot,
                                         authorize=self._metrics_caller)
            try:
                self.metrics.start()
            except OSError as e:
                self.metrics = None
                raise StartupError(bind_refusal("metrics_port", cfg.metrics.metrics_host,
                                                cfg.metrics.metrics_port, e)) from None
            self.addresses["metrics"] = f"http://{cfg.metrics.metrics_host}:{self.metrics.port}/metrics"
            if cfg.tenancy.tenants_file and not is_loopback(f"{cfg.metrics.metrics_host}:{self.metrics.port}"):
                log.warning("/metrics listens on %s in plaintext HTTP: the bearer tokens of its "
                            "scrapes travel in the clear (%s)", self.addresses["metrics"],
                            "scrape tokens only: figures, no keys or bytes"
                            if metrics_scrape_only(cfg) else "every token is accepted there, "
                            "tenants' and the operator's too: allow_plaintext_remote")
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._stamper = asyncio.get_running_loop().create_task(self._stamp())
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        for link in self.cache.chain:  # a tier that opened degraded says so from the start
            await self._set_nvme_health(link.tier.admitting)

    async def _stamp(self) -> None:
        """The published indexes' tick: pending changes, liveness stamps, idle ones retired."""
        while True:
            await asyncio.sleep(STAMP_INTERVAL_S)
            self.published.tick()

    async def _sweep(self) -> None:
        next_probe = next_expiry = 0.0
        while True:
            await asyncio.sleep(self.cfg.sessions.lease_sweep_s)
            n = self.sessions.sweep()
            if n:
                log.info("expired %d session lease(s)", n)
            self.cache.sweep_limbo()
            if self.cfg.sessions.namespace_idle_s and time.monotonic() >= next_expiry:
                next_expiry = time.monotonic() + min(1.0, self.cfg.sessions.namespace_idle_s / 4)
                self._expire_namespaces()
            if self._arena_ok and not self.host.intact():
                self._arena_ok = False  # cannot happen while sealed; if it does, say so loudly
                log.critical("a host arena changed size or lost its seals: every mapping may "
                             "fault; health is NOT_SERVING until restart")
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            for link in self.cache.chain:
                if not link.tier.admitting and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.cfg.nvme_tier.probe_interval_s
                    # In the background: a late open may take minutes, and leases, limbo and
                    # health keep ticking meanwhile; drain waits for it (link.settle()).
                    link.probe_soon()
                await self._set_nvme_health(link.tier.admitting)
                link.maybe_flush()

    def _expire_namespaces(self) -> None:
        """Forget empty namespaces idle for ``namespace_idle_s`` (config docstring)."""
        for ns in self.cache.expire_idle(self.cfg.sessions.namespace_idle_s, self.published.reading):
            self.published.forget(ns)
            log.info("namespace %d (%s) expired: empty and idle for %.0f s", ns.id,
                     ns.spec.model_id, self.cfg.sessions.namespace_idle_s)

    async def _set_nvme_health(self, admitting: bool) -> None:
        if admitting != self._nvme_serving:
            self._nvme_serving = admitting
            status = health_pb2.HealthCheckResponse.SERVING if admitting else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(NVME_HEALTH_NAME, status)

    def snapshot(self, caller: Tenant | None = None) -> dict[str, Any]:
        """Stats as plain data (event-loop thread): the Stats reply plus RPC figures; for a
        tenant's credential (not the operator's), the Stats reply it would get and nothing
        daemon-wide (RPC errors and latency, connections, published indexes)."""
        scope = CALLER.set(caller)
        try:
            snap = to_dict(self.service.stats_reply())
        finally:
            CALLER.reset(scope)
        snap["draining"] = self.service.draining  # kvtier_draining: not ready, shutting down
        if caller is not None and not caller.operator:
            snap.update(rpc_errors={}, rpc_latency={}, connections={}, published={})
            return snap
        errors: dict[str, dict[str, int]] = {}
        for (method, code), n in self.service.errors.items():
            errors.setdefault(method, {})[code] = n
        snap["rpc_errors"] = errors  # method -> status code name -> count
        snap["rpc_latency"] = {m: (h.cumulative(), h.sum) for m, h in self.service.latency.items()}
        snap["connections"] = {k: v for t in self.transports for k, v in t.figures().items()}
        snap["connections"]["control_bad_frames"] = self.service.bad_frames
        snap["published"] = self.published.figures()
        if self.events is not None:
            snap["events"] = self.events.figures()
        return snap

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def drain_and_stop(self) -> None:
        log.info("draining: refusing new stores, waiting up to %.1fs for in-flight jobs",
                 self.cfg.requests.drain_timeout_s)
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + self.cfg.requests.drain_timeout_s
        while (self.cache.writing_blocks or self.cache.pinned_blocks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._sweeper:
            self._sweeper.cancel()
        if self._stamper:
            self._stamper.cancel()
        loop = asyncio.get_running_loop()
        for link in self.cache.chain:
            # A probe or late open in progress ends first (its copies back in the index), then
            # the flushes, then the promotions: the checkpoint reads the index off-loop.
            settled = await self._settle(link, deadline)
            flushed = await link.flush_all(deadline)
            settled = await self._settle(link, deadline) and settled
            if not settled:  # still opening or reading: no checkpoint, the journals stay
                log.warning("%s: still busy at the drain deadline; no checkpoint (the next "
                            "start replays the journals)", link.tier.name)
                continue
            try:
                if await loop.run_in_executor(None, link.checkpoint):  # (or it said why not)
                    log.info("%s checkpoint written (%d blocks flushed while draining)",
                             link.tier.name, flushed)
            except Exception as e:  # noqa: BLE001  (the next start replays the journal instead)
                log.error("%s checkpoint failed: %s", link.tier.name, e)
            await loop.run_in_executor(None, link.tier.close)
        for server in (self.server, self.tcp_server, self.health_server):
            if server is not None:
                await server.stop(grace=0.5)
        if self.cache.fleet is not None:  # imports end by their deadline; queued writes get
            fleet = self.cache.fleet       # the drain deadline, then are dropped (counted)
            while fleet.tier.pending_writes and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fleet.settle(), 2.0)
            await loop.run_in_executor(None, self.cache.fleet.close)
        if self.metrics is not None:
            self.metrics.close()
        self.sessions.close_all()
        if self.events is not None:  # the drain's last events (demotions) sent, then closed
            if self.cache.residency.events is not None:
                self.cache.residency.events.flush()
            await loop.run_in_executor(None, self.events.close, 1.0)
        self.published.close()  # clients stop reading them at once (retired)
        for t in self.transports:  # cuda_ipc unregisters before the arena is unmapped
            t.close()
        self.host.close()
        if self.cfg.grpc.socket_path and self._socket_lock is not None:  # ours: we hold its lock
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._socket_path())
        if self._socket_lock is not None:
            self._socket_lock.release()


    @staticmethod
    async def _settle(link: TierLink, deadline: float) -> bool:
        """Wait (until ``deadline``, at least 0.1 s) for the link's tasks; whether they ended."""
        try:
            await asyncio.wait_for(link.settle(), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True


def _event_publisher(cfg: DaemonConfig, tenants: Tenants | None) -> EventPublisher:
    """The KV-event publisher (pyzmq and msgpack imported here), its sockets bound owner-only
    (ipc://: then set to ``socket_mode``) and its thread started; ValueError naming the
    setting when the packages are missing or an endpoint cannot be bound."""
    from kvtierd.events import EventQueue
    from kvtierd.events.publisher import EventPublisher, EventSettings, check_dependencies

    check_dependencies()
    publisher = EventPublisher(EventSettings(
        endpoint=cfg.events.events_endpoint, replay_endpoint=cfg.events.events_replay_endpoint,
        tenant_endpoint=cfg.events.events_tenant_endpoint,
        tenant_replay_endpoint=cfg.events.events_tenant_replay_endpoint, topic=cfg.events.events_topic,
        buffer_batches=cfg.events.events_buffer_batches, socket_mode=cfg.grpc.socket_mode),
        EventQueue(cfg.events.events_queue_blocks))
    with _private_umask():
        publisher.start(list(tenants.by_name) if tenants is not None else [])
    return publisher


def _lock_sockets(cfg: DaemonConfig) -> OwnerLock | None:
    """The lock of the daemon's Unix sockets (``<socket>.lock``: the gRPC socket and the shm
    socket beside it), its directory made (0700 when new); None when it has neither."""
    if not cfg.grpc.socket_path and not cfg.transports.shm_enabled:
        return None
    base = os.path.abspath(cfg.shm_socket_path.removesuffix(".shm"))
    os.makedirs(os.path.dirname(base), mode=0o700, exist_ok=True)
    return OwnerLock.take(base + ".lock")


def _lock_disk(nvme: NvmeTier, cfg: DaemonConfig) -> None:
    """The NVMe directory's lock, now. A directory that cannot be made or opened yet (a
    read-only or missing mount) refuses the start (StartupError), or with ``disk_optional`` is
    locked by the tier's later open instead."""
    try:
        nvme.lock()
    except OSError as e:
        if not cfg.nvme_tier.disk_optional:
            raise StartupError(disk_refusal(cfg, f"cannot lock it: {e.strerror or e}")) from None
        log.warning("nvme directory %s not locked yet (%s): the tier locks it when it opens",
                    nvme.cfg.directory, e.strerror or e)


@contextlib.contextmanager
def _private_umask() -> Iterator[None]:
    """umask 0177 (sockets and files owner-only) around a bind: the mode is then widened, if
    configured, by a chmod; never narrowed after others could connect."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def _add_port(server: grpc.aio.Server, name: str, address: str,
              creds: grpc.ServerCredentials | None) -> int:
    """Bind ``address`` (setting ``name``) on ``server``; the port bound. StartupError (one
    line) when it cannot be bound: the preflight found it free, someone took it since."""
    try:
        port = int(server.add_secure_port(address, creds) if creds is not None else
                   server.add_insecure_port(address))
    except RuntimeError:  # grpcio >= 1.50 raises where older ones returned 0
        port = 0
    if port == 0:
        host, _, port_s = address.rpartition(":")
        raise StartupError(bind_refusal(name, host, int(port_s), preflight.try_bind(
            host, int(port_s))))
    return port


def _raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: every bound on connections (data, shm, index
    channels one per session, metrics) is the daemon's own, not a default soft limit of 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d: %s", soft, e)


def _tls_credentials(cfg: DaemonConfig) -> grpc.ServerCredentials:
    """The TCP listener's TLS (mTLS with ``tls_client_ca``); files read here, at start."""
    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: cannot read {path}: {e.strerror}") from None

    ca = read("tls_client_ca", cfg.grpc.tls_client_ca) if cfg.grpc.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read("tls_key", cfg.grpc.tls_key), read("tls_cert", cfg.grpc.tls_cert))],
        root_certificates=ca, require_client_auth=cfg.grpc.tls_require_client_cert)


def _data_tls(cfg: DaemonConfig) -> ssl.SSLContext:
    """The data channel's TLS: the gRPC listener's certificate and key (TLS 1.2+); client
    certificates are asked for exactly as the gRPC listener asks (a connection still binds to a
    session only with that session's data secret)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.grpc.tls_cert, cfg.grpc.tls_key)
        if cfg.grpc.tls_client_ca:
            ctx.load_verify_locations(cfg.grpc.tls_client_ca)
    except OSError as e:
        raise ValueError(f"tls_cert/tls_key/tls_client_ca: cannot read: {e.strerror}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED if cfg.grpc.tls_require_client_cert else \
        ssl.CERT_OPTIONAL if cfg.grpc.tls_client_ca else ssl.CERT_NONE
    return ctx


def cluster_settings(cfg: DaemonConfig) -> ClusterSettings:
    """The cluster tier's settings from ``cfg`` (the password and the fleet key read from their
    files here)."""
    seeds, tls = parse_url(cfg.cluster_tier.cluster)
    try:
        import hiredis  # noqa: F401  (the parser redis-py uses when it is there)
        import redis  # noqa: F401
    except ImportError as e:
        raise ValueError(f"cluster: the cluster tier needs redis-py and hiredis "
                         f"(pip install 'kvtier[cluster]'): {e}") from None
    password = ""
    if cfg.cluster_tier.cluster_password_file:
        try:
            password = Path(cfg.cluster_tier.cluster_password_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ValueError(f"cluster_password_file: cannot read a password: {e}") from None
    creds = Credentials(username=cfg.cluster_tier.cluster_username, password=password, tls=tls,
                        ca_file=cfg.cluster_tier.cluster_tls_ca, cert_file=cfg.cluster_tier.cluster_tls_cert,
                        key_file=cfg.cluster_tier.cluster_tls_key)
    from kvtierd.tiers.cluster.keys import read_fleet_key

    return ClusterSettings(
        seeds=seeds, fleet_key=read_fleet_key(cfg.cluster_tier.cluster_fleet_key_file),
        tenanted=bool(cfg.tenancy.tenants_file), creds=creds, write_policy=cfg.cluster_tier.cluster_write_policy,
        ttl_s=cfg.cluster_tier.cluster_ttl_s,
        lookup_timeout_s=cfg.cluster_tier.cluster_lookup_timeout_ms / 1000,
        fetch_timeout_s=cfg.cluster_tier.cluster_fetch_timeout_ms / 1000,
        write_timeout_s=cfg.cluster_tier.cluster_write_timeout_ms / 1000,
        # blocks waiting for the cluster stay pinned in the host tier: never more than a quarter
        queue_bytes=min(cfg.cluster_tier.cluster_queue_bytes, cfg.host_tier.host_bytes // 4),
        inflight_bytes=cfg.cluster_tier.cluster_inflight_bytes, breaker_s=cfg.cluster_tier.cluster_breaker_s)


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
    except (CorruptMeta, ValueError) as e:  # not a kvtier directory, or another layout's
        nvme.close()
        raise StartupError(f"disk_dir {cfg.nvme_tier.disk_dir} (--disk-dir) cannot be used: {e}; check it "
                           "with kvtierd fsck, or choose another directory") from None
    if not nvme.admitting and not cfg.nvme_tier.disk_optional:
        reason = nvme.degraded_reason
        nvme.close()
        raise StartupError(disk_refusal(cfg, f"the NVMe tier opened degraded: {reason}"))
    return opened


def _tenants(cfg: DaemonConfig) -> Tenants | None:
    """The tenants file, checked against the metrics exposure; StartupError when it is not
    valid (it may have changed since the CLI read it)."""
    if not cfg.tenancy.tenants_file:
        return None
    tenants = _config_checked(load_tenants, cfg.tenancy.tenants_file)
    _config_checked(check_metrics_exposure, cfg, len(tenants.metrics_digests))
    return tenants


def _config_checked(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, its configuration ValueError (a file read at start) a StartupError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise StartupError(f"{e}") from None


async def _main(cfg: DaemonConfig) -> None:
    socket_lock = _lock_sockets(cfg)  # first of all: a second daemon exits before any work
    try:  # every check before the arena is reserved or a socket bound
        for warning in preflight.check(cfg):
            log.warning("%s", warning)
        daemon = Daemon(cfg)
    except ValueError as e:  # a file read at start that the CLI found valid (changed since)
        raise StartupError(f"{e}") from None
    daemon._socket_lock = socket_lock
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        daemon.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_tenants)
    try:
        await daemon.start()
    except (StartupError, ValueError) as e:  # a port taken since the preflight, a TLS file
        await daemon.abort_start()  # no socket left behind, the NVMe tier closed
        raise e if isinstance(e, StartupError) else StartupError(f"{e}") from None
    tiers = daemon.tiers()
    ready = {"boot_epoch": daemon.boot_epoch, "pid": os.getpid(), **daemon.addresses,
             "host_bytes": daemon.host.capacity_bytes, "eviction_policy": cfg.host_tier.eviction_policy,
             "cuda_ipc": daemon.cuda is not None,
             "tenants": len(daemon.tenancy.tenants) if daemon.tenancy.tenants else 0,
             "tiers": tiers}
    print("KVTIERD_READY " + json.dumps(ready), flush=True)
    log.info("kvtierd ready: %s; %s", describe_tiers(tiers),
             ", ".join(f"{k} {v}" for k, v in daemon.addresses.items()))
    await daemon.wait_stopped()
    await daemon.drain_and_stop()
    log.info("kvtierd stopped")


def run(cfg: DaemonConfig) -> None:
    """Run the daemon until SIGTERM/SIGINT (blocking). Uses uvloop when available."""
    logging.basicConfig(level=os.environ.get("KVTIER_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(_main(cfg))
        else:
            uvloop.run(_main(cfg))
    except CudaUnavailable as e:
        print(f"kvtierd: {e}", file=sys.stderr)
        sys.exit(2)
    except InUse as e:  # one line, no traceback: which lock, whose
        print(f"kvtierd: {e}", file=sys.stderr)
        sys.exit(1)
    except StartupError as e:  # a startup check (kvtierd.preflight): setting, flag and fix
        print(f"kvtierd serve: {e}", file=sys.stderr)
        sys.exit(2)


def describe_tiers(tiers: dict[str, Any]) -> str:
    """The ready log line's tiers: ``host 1.0 GiB (lru); nvme /d serving, 12 blocks; ...``."""
    host = tiers["host"]
    parts = [f"host {format_bytes(host['bytes'])} ({host['eviction_policy']}"
             + (f", {host['tenant_arenas']} tenant arena(s))" if host["tenant_arenas"] else ")")]
    nvme = tiers["nvme"]
    if nvme is None:
        parts.append("nvme off")
    elif nvme["state"] == "serving":
        parts.append(f"nvme {nvme['directory']} serving ({format_bytes(nvme['bytes'])}, "
                     f"{nvme['recovered_blocks']} blocks recovered)")
    else:
        parts.append(f"nvme {nvme['directory']} DEGRADED, not admitting ({nvme['reason']}): "
                     "the host tier serves alone until it opens")
    cluster = tiers["cluster"]
    parts.append("cluster off" if cluster is None else
                 f"cluster {','.join(cluster['seeds'])} ({cluster['state']})")
    return "; ".join(parts)


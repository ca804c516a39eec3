"""The composition root: ``Daemon(cfg)`` builds every component (arena, host tier, policy,
cache, sessions, service, transports, metrics) and wires them; ``start`` binds and serves,
``drain_and_stop`` drains and closes (lifecycle: :mod:`kvtierd.app`).

The parts are built by :mod:`~kvtierd.app.build` (the storage, in the order of the refusals),
bound by :mod:`~kvtierd.app.listeners` (the gRPC servers, /metrics) and drained by
:mod:`~kvtierd.app.drain`; :mod:`~kvtierd.app.figures` reads them as plain data (the ready line's
tiers, /metrics' snapshot) and :mod:`~kvtierd.app.reload` applies a tenants file read again on
SIGHUP. The Daemon holds the parts and the callbacks that tie them together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier_contract import published_index as pi
from kvtier_contract.errors import NotFound
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.app import build, drain, figures, listeners, reload
from kvtierd.app.housekeeping import Housekeeper
from kvtierd.cache import TieredCache
from kvtierd.config import DaemonConfig
from kvtierd.index import Entry
from kvtierd.index.published import Publishers
from kvtierd.lockfile import OwnerLock
from kvtierd.metrics import MetricsServer
from kvtierd.policies import EvictionPolicy, make_policy
from kvtierd.service import ChannelDispatch, KvtierService, add_to_server
from kvtierd.sessions import Session, SessionTable
from kvtierd.tenancy import Shares, Tenancy
from kvtierd.tenancy.exposure import metrics_scrape_only
from kvtierd.tenancy.prefix_file import PrefixFile
from kvtierd.tenancy.prefixes import PublishedPrefixes
from kvtierd.tenants import Tenant, Tenants
from kvtierd.tiers import Recovered
from kvtierd.tiers.cluster.settings import ClusterSettings
from kvtierd.tiers.nvme.tier import NvmeTier
from kvtierd.transports.base import ServerTransport
from kvtierd.transports.control import ControlChannel
from kvtierd.transports.cuda_driver import CudaDriver
from kvtierd.transports.cuda_ipc import CudaIpcTransport
from kvtierd.transports.shm import MappedArena, ShmFdServer

log = logging.getLogger("kvtierd")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Kvtier"].full_name
if TYPE_CHECKING:  # pyzmq and msgpack: only when events are on
    from kvtierd.events.publisher import EventPublisher


class Daemon:
    """Owns every component; the event loop that runs ``start`` owns all cache state."""

    def __init__(self, cfg: DaemonConfig, *, cuda_driver: CudaDriver | None = None) -> None:
        self.cfg = cfg
        # Every refusal of the configuration comes before any memory is reserved: the tenants
        # file (read again: it may have changed since the CLI's check), then the NVMe tier.
        tenants = build.tenants(cfg)
        cluster = (
            build.config_checked(build.cluster_settings, cfg) if cfg.cluster_tier.cluster else None
        )  # files read
        # KV events: bound and publishing before the NVMe recovery, which they announce
        self.events: EventPublisher | None = (
            build.config_checked(build.event_publisher, cfg, tenants)
            if cfg.events.events_endpoint or cfg.events.events_tenant_endpoint
            else None
        )
        # One daemon per disk directory: its lock before anything there is read or written
        # (lockfile.InUse: another daemon holds it; run() exits with it). Sockets: start().
        nvme, opened = build.open_storage(cfg)  # its index read; a degraded tier refused
        self._socket_lock: OwnerLock | None = None
        self.boot_epoch = time.time_ns()
        self.arena, self.host = build.host_tier(cfg)  # reserved here
        # Tenants allowed shm or cuda_ipc get arenas of their own, before anything (NVMe
        # recovery included) registers a namespace: a namespace's arena is its tenant's.
        self.tenant_arenas = build.TenantArenas(self.host, cfg, tenants)
        self._build_sessions(tenants)  # (the cache's admission counts their sessions)
        self.cache = self._build_cache(nvme, opened, cluster)
        # cuda_ipc (registers every arena made so far; later ones as they come)
        self.cuda: CudaIpcTransport | None = build.cuda_transport(cfg, self.host, self.cache, cuda_driver)
        self._build_service()
        self._build_serving()

    def _build_cache(
        self, nvme: NvmeTier | None, opened: Recovered | None, cluster: ClusterSettings | None
    ) -> TieredCache:
        """The cache over the host tier, the NVMe tier in its chain, the cluster tier beside."""
        cfg = self.cfg
        # Ghost history for ARC: as many entries as the arena holds of its smallest slots.
        policy: EvictionPolicy[Entry] = make_policy(
            cfg.host_tier.eviction_policy, ghost_capacity=min(1 << 20, self.host.num_slabs * 64)
        )
        cache = TieredCache(
            self.host,
            policy,
            max_namespaces=cfg.sessions.max_namespaces,
            policy_name=cfg.host_tier.eviction_policy,
            arena_of=self.tenant_arenas.of,
            tenancy=self.tenancy,
            sessions=self.sessions,
        )
        cache.verify_bytes = cfg.transports.verify_bytes
        cache.residency.events = build.event_sink(self.events)
        if nvme is not None:
            build.attach_storage(cache, nvme, opened, cfg)
        if cluster is not None:  # started in start(); redis-py only when configured
            from kvtierd.tiers.cluster.tier import ClusterTier

            cache.add_shared_tier(ClusterTier(cluster))
        return cache

    def _build_sessions(self, tenants: Tenants | None) -> None:
        """The session table, the published indexes, the tenancy and the published prefixes."""
        cfg = self.cfg
        s = cfg.sessions
        self.sessions = SessionTable(
            max_sessions=s.max_sessions,
            default_ttl_s=s.lease_ttl_s,
            min_ttl_s=s.min_lease_ttl_s,
            max_ttl_s=s.max_lease_ttl_s,
            on_release=self._release_session,
        )
        self.published = Publishers(
            self.boot_epoch,
            enabled=cfg.transports.publish_index,
            idle_retire_s=cfg.transports.publish_index_idle_s,
            flags=pi.FLAG_SHARED_TIER if cfg.cluster_tier.cluster else 0,
        )
        self.tenancy = Tenancy(
            tenants,
            Shares(
                max_sessions=s.max_sessions,
                max_namespaces=s.max_namespaces,
                shared_arena_bytes=self.arena.size,
                disk_bytes=cfg.nvme_tier.disk_bytes,
                tenant_arena_bytes=cfg.tenancy.tenant_arena_bytes,
            ),
        )
        # published prefixes: in the NVMe tier's directory when there is one (else memory only)
        disk_dir = cfg.nvme_tier.disk_dir
        self.prefixes = PublishedPrefixes(self.tenancy, PrefixFile(disk_dir) if disk_dir else None)

    def _build_service(self) -> None:
        """The Kvtier service over the cache, the sessions and the tenancy."""
        cfg = self.cfg
        self.service = KvtierService(
            self.cache,
            self.sessions,
            boot_epoch=self.boot_epoch,
            max_batch_blocks=cfg.requests.max_batch_blocks,
            advertise=self._advertise,
            cuda=self.cuda,
            max_inflight=cfg.requests.max_inflight_rpcs,
            tenancy=self.tenancy,
            prefixes=self.prefixes,
        )
        self.service.after_rpc = self.published.flush
        self.service.verify_store = cfg.transports.verify_store

    def _build_serving(self) -> None:
        """Health, the listeners (bound in start()), the transports list and the tasks."""
        self.health = health.aio.HealthServicer()
        self.listeners = listeners.Listeners(self.cfg, self.health, self._grpc_server)
        self.addresses: dict[str, Any] = self.listeners.addresses
        self.transports: list[ServerTransport] = [t for t in (self.cuda,) if t is not None]
        self.metrics: MetricsServer | None = None
        self.housekeeper = Housekeeper(
            self.cfg, self.sessions, self.cache, self.host, self.published, self.health, SERVICE_NAME
        )
        self._stop = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._stamper: asyncio.Task[None] | None = None

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

    def _session_arena(self, session: Session, groups: bool) -> list[MappedArena] | None:
        """The arenas ``session`` maps (shm handshake; ``groups``: its groups' too, KVS3), its
        own (written) first, or None: refused."""
        pools = self.service.session_arenas(session, groups)
        if pools is None:
            return None
        names = self.tenant_arenas.groups()
        arenas = [(self.host.arenas[p], names.get(p, "")) for p in pools]
        return [MappedArena(a.fd, a.size, n == 0, name) for n, (a, name) in enumerate(arenas)]

    def _release_session(self, session: Session) -> None:
        self.cache.release_session(session)
        for t in self.transports:
            t.release_session(session.id)

    def _advertise(self) -> dict[str, Any]:
        adv: dict[str, Any] = {
            "shm_socket": "",
            "data_host": "",
            "data_port": 0,
            "arena_bytes": self.arena.size,
        }
        for t in self.transports:
            adv.update(t.advertise())
        return adv

    def _index_handout(self, session_id: int, namespace_id: int) -> tuple[int, int, int]:
        """A read-only descriptor of a namespace's published index, for a live session (of the
        namespace's tenant: another tenant's namespace answers as an absent one)."""
        s = self.sessions.get(session_id)
        ns = self.cache.namespace(namespace_id)
        if not self.tenancy.may_see(s.tenant, ns.spec.owner):  # (the operator's, a member's may)
            raise NotFound(f"unknown namespace {namespace_id} (register it first)", field="namespace_id")
        return self.published.handout(ns)

    def _control_channel(
        self, session: Session, on_close: Callable[[ControlChannel], None]
    ) -> ControlChannel:
        """The protocol of a control channel of ``session`` (shm socket handshake)."""
        return ControlChannel(ChannelDispatch(self.service), session.id, session.tenant, on_close)

    def _peer_ok(self, session: Session, uid: int, gid: int) -> bool:
        """shm handshakes: the Unix peer (SO_PEERCRED) must be allowed for the session's
        tenant (its unix_uids / unix_gids)."""
        return self.tenancy.allows_peer(session.tenant, uid, gid)

    def tiers(self) -> dict[str, Any]:
        """Every tier and its state (the ready line's ``tiers``; kvtierd.app.figures)."""
        return figures.tiers(self.cfg, self.host, self.arena, self.tenant_arenas, self.cache)

    async def abort_start(self) -> None:
        """A start that failed half-way (a port taken since the startup checks): the servers
        and transports made so far closed, the NVMe tier closed (its directory unlocked), the
        Unix socket files this daemon bound removed."""
        await self.listeners.stop(None)
        for t in self.transports:
            t.close()
        for link in self.cache.chain:  # its files, I/O threads and the directory's lock
            await asyncio.get_running_loop().run_in_executor(None, link.tier.close)
        if self.events is not None:
            self.events.close(0.0)
        if self._socket_lock is not None:  # ours: we hold their lock
            self.listeners.unlink_sockets("unix", "shm")

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again; a bad file keeps the current tenants
        (kvtierd.app.reload)."""
        reload.reload_tenants(self.cfg, self.tenancy, self.tenant_arenas, self.sessions, self.cuda)
        self.prefixes.prune()  # (the prefixes of groups the file no longer has)
        tenants = self.tenancy.tenants
        if self.events is not None and tenants is not None:  # new tenants' event streams
            self.events.add_tenants(build.event_buffer_caps(self.tenancy, list(tenants.by_name)))

    def _grpc_server(self, reflect: bool) -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_to_server(self.service, server)  # lenient request decoding (service/registration.py)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if reflect:
            reflection.enable_server_reflection(
                (SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME), server
            )
        return server

    async def start(self) -> None:
        cfg = self.cfg
        # One daemon per socket: its lock before anything is unlinked or bound (InUse: exit).
        # A daemon process (serve_daemon) has taken it before the daemon was even built.
        if self._socket_lock is None:
            self._socket_lock = listeners.lock_sockets(cfg)
        listeners.raise_fd_limit()
        if self.cuda is not None:
            await self.cuda.start()  # page-locks the arena before anything is served
        if self.cache.fleet is not None:  # connects in the background: never blocks a start
            self.cache.fleet.tier.start()
        self.listeners.bind()
        if cfg.transports.data_listen:
            self.transports.append(
                await listeners.start_data_channel(
                    cfg, self.cache, self.sessions, self._control_channel, self.addresses
                )
            )
        if cfg.transports.shm_enabled:
            await self._start_shm()
        await self.listeners.start()
        if cfg.metrics.metrics_port >= 0:
            self.metrics = listeners.start_metrics(cfg, self.addresses, self.snapshot, self._metrics_caller)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._stamper = asyncio.get_running_loop().create_task(self.housekeeper.stamp())
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        for link in self.cache.chain:  # a tier that opened degraded says so from the start
            await self.housekeeper.set_nvme_health(link.tier.admitting)

    async def _start_shm(self) -> None:
        cfg = self.cfg
        t = cfg.transports
        shm = ShmFdServer(
            cfg.shm_socket_path,
            self._session_arena,
            self.boot_epoch,
            self.sessions,
            handshake_timeout_s=t.handshake_timeout_s,
            max_connections=t.shm_max_connections,
            per_uid=t.shm_handshakes_per_uid,
            index=self._index_handout,
            index_hold=self.published.hold,
            peer_ok=self._peer_ok,
            login=self.tenancy.unix_login,
            control=self._control_channel if t.control_channel else None,
        )
        shm.socket_mode = cfg.grpc.socket_mode
        await shm.start()
        self.transports.append(shm)
        self.addresses["shm"] = shm.path

    async def _sweep(self) -> None:
        await self.housekeeper.sweep()

    def snapshot(self, caller: Tenant | None = None) -> dict[str, Any]:
        """Stats as plain data (event-loop thread): the Stats reply plus RPC figures, a tenant's
        own only for its credential (kvtierd.app.figures)."""
        return figures.snapshot(self.service, self.transports, self.published, self.events, caller)

    def request_stop(self) -> None:
        self._stop.set()

    async def wait_stopped(self) -> None:
        await self._stop.wait()

    async def drain_and_stop(self) -> None:
        """Health NOT_SERVING, stores refused, in-flight jobs given ``drain_timeout_s``; then
        every tier, server, transport and the host arenas closed (kvtierd.app.drain)."""
        timeout_s = self.cfg.requests.drain_timeout_s
        log.info("draining: refusing new stores, waiting up to %.1fs for in-flight jobs", timeout_s)
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + timeout_s
        await drain.wait_jobs(self.cache, deadline)
        for task in (self._sweeper, self._stamper):
            if task:
                task.cancel()
        for link in self.cache.chain:
            await drain.close_storage(link, deadline)
        await self.listeners.stop(0.5)
        if self.cache.fleet is not None:
            await drain.close_fleet(self.cache.fleet, deadline)
        if self.metrics is not None:
            self.metrics.close()
        self.sessions.close_all()
        if self.events is not None:  # the drain's last events (demotions) sent, then closed
            await drain.close_events(self.events, self.cache.residency.events)
        self.published.close()  # clients stop reading them at once (retired)
        for t in self.transports:  # cuda_ipc unregisters before the arena is unmapped
            t.close()
        self.host.close()
        if self._socket_lock is not None:  # ours: we hold its lock
            if self.cfg.grpc.socket_path:
                self.listeners.unlink_sockets("unix")
            self._socket_lock.release()

"""The daemon's periodic work while it serves: session leases expired, limbo swept, idle
namespaces forgotten, the host arenas' seals watched, a degraded storage tier probed (and its
health name set), write-back flushes started, and the published indexes' tick.

:class:`Housekeeper` is owned by the Daemon, which runs its two loops as tasks from ``start`` to
the drain (which cancels them). Event-loop thread only; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time

from grpc_health.v1 import health, health_pb2

from kvtier_contract.published_index import STAMP_INTERVAL_S
from kvtierd.cache import TieredCache
from kvtierd.config import DaemonConfig
from kvtierd.index.published import Publishers
from kvtierd.sessions import SessionTable
from kvtierd.tiers import HostTier

log = logging.getLogger("kvtierd")
NVME_HEALTH_NAME = "kvtier.nvme"  # NOT_SERVING while the NVMe tier is degraded


class Housekeeper:
    """Runs the sweep (every ``lease_sweep_s``) and the published indexes' stamp; holds what
    the health service was last told about the storage tier and the arenas."""

    def __init__(
        self,
        cfg: DaemonConfig,
        sessions: SessionTable,
        cache: TieredCache,
        host: HostTier,
        published: Publishers,
        health_servicer: health.aio.HealthServicer,
        service_name: str,
    ) -> None:
        self.cfg = cfg
        self.sessions = sessions
        self.cache = cache
        self.host = host
        self.published = published
        self.health = health_servicer
        self.service_name = service_name
        self._nvme_serving: bool | None = None
        self._arena_ok = True

    async def stamp(self) -> None:
        """The published indexes' tick: pending changes, liveness stamps, idle ones retired."""
        while True:
            await asyncio.sleep(STAMP_INTERVAL_S)
            self.published.tick()

    async def sweep(self) -> None:
        next_probe = next_expiry = 0.0
        idle_s = self.cfg.sessions.namespace_idle_s
        while True:
            await asyncio.sleep(self.cfg.sessions.lease_sweep_s)
            n = self.sessions.sweep()
            if n:
                log.info("expired %d session lease(s)", n)
            self.cache.sweep_limbo()
            if idle_s and time.monotonic() >= next_expiry:
                next_expiry = time.monotonic() + min(1.0, idle_s / 4)
                self._expire_namespaces()
            await self._check_arenas()
            for link in self.cache.chain:
                if not link.tier.admitting and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.cfg.nvme_tier.probe_interval_s
                    # In the background: a late open may take minutes, and leases, limbo and
                    # health keep ticking meanwhile; drain waits for it (link.settle()).
                    link.recovery.probe_soon()
                await self.set_nvme_health(link.tier.admitting)
                link.maybe_flush()

    async def _check_arenas(self) -> None:
        if self._arena_ok and not self.host.intact():
            self._arena_ok = False  # cannot happen while sealed; if it does, say so loudly
            log.critical(
                "a host arena changed size or lost its seals: every mapping may "
                "fault; health is NOT_SERVING until restart"
            )
            for name in ("", self.service_name):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _expire_namespaces(self) -> None:
        """Forget empty namespaces idle for ``namespace_idle_s`` (config docstring)."""
        idle_s = self.cfg.sessions.namespace_idle_s
        for ns in self.cache.expire_idle(idle_s, self.published.reading):
            self.published.forget(ns)
            log.info("namespace %d (%s) expired: empty and idle for %.0f s", ns.id, ns.spec.model_id, idle_s)

    async def set_nvme_health(self, admitting: bool) -> None:
        if admitting != self._nvme_serving:
            self._nvme_serving = admitting
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if admitting
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self.health.set(NVME_HEALTH_NAME, status)

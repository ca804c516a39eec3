"""The Stats handler and the reply it builds (also what /metrics renders): everything for the
operator or a single-tenant daemon; for a tenant, its own namespaces and totals over them, its
sessions, and no per-tier detail. A cache salt is shown only as :func:`salt_tag`. Event-loop
thread only .
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

from kvtier_contract.protoutil import namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.index import NamespaceState
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.sessions import SessionTable
from kvtierd.stats import COUNTER_FIELDS, Counters
from kvtierd.tenancy import QUOTA_NAMES, Tenancy
from kvtierd.transports.cuda_ipc import CudaIpcTransport


class StatsHandlers:
    """Stats (see the module docstring)."""

    def __init__(
        self,
        scope: Scope,
        settings: ServiceSettings,
        cache: TieredCache,
        sessions: SessionTable,
        tenancy: Tenancy,
        cuda: CudaIpcTransport | None,
    ) -> None:
        self.scope = scope
        self.settings = settings
        self.cache = cache
        self.sessions = sessions
        self.tenancy = tenancy
        self.cuda = cuda

    async def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        return self.stats_reply()

    def stats_reply(self) -> pb.StatsReply:
        """Everything (the operator, a single-tenant daemon, /metrics), or, for a tenant, its
        own namespaces and totals over them, its sessions, and no per-tier detail."""
        scope = self.scope.scope()
        if scope is not None:
            return self._tenant_stats(scope)
        c = self.cache
        host = c.host.stats()
        reply = pb.StatsReply(
            boot_epoch=self.settings.boot_epoch,
            uptime_s=time.monotonic() - self.settings.started,
            total=_counters(c.totals()),
            host_capacity_bytes=host["capacity_bytes"],
            host_used_bytes=host["used_bytes"],
            sessions=len(self.sessions),
            leases_expired=self.sessions.expired_total,
            tier_figures=self.scope.tier_figures(),
            **c.figures(),
        )
        self._add_tiers(reply)
        tenants = self.tenancy.tenants
        self._add_identities(
            reply, list(c.namespaces.values()), sorted(tenants.by_name) if tenants is not None else []
        )
        return reply

    def _add_tiers(self, reply: pb.StatsReply) -> None:
        """The per-tier detail (the operator's): the storage tier, the cluster tier and its
        nodes, cuda_ipc; each left unset when not configured."""
        c = self.cache
        for link in c.chain:  # one storage tier today: NVMe
            reply.nvme.CopyFrom(
                pb.NvmeStats(
                    enabled=True,
                    write_policy=link.write_policy.name,
                    flushes_in_flight=link.flushes_in_flight,
                    **link.tier.stats(),
                )
            )
        if c.fleet is not None:
            fig = c.fleet.tier.stats()
            nodes = fig.pop("nodes")
            reply.cluster.CopyFrom(pb.ClusterStats(enabled=True, **fig))
            for n in nodes:
                reply.cluster.nodes.add(**n)
        if self.cuda is not None:
            reply.cuda_ipc.CopyFrom(pb.CudaIpcStats(**self.cuda.stats()))

    def _tenant_stats(self, scope: str) -> pb.StatsReply:
        """What tenant ``scope`` sees: its namespaces, totals over them, its sessions (not the
        namespaces of its groups: their figures count the other members' use too)."""
        c = self.cache
        visible = [ns for ns in c.namespaces.values() if ns.spec.owner == scope]
        total = Counters()
        for ns in visible:
            total.add(ns.counters)
        reply = pb.StatsReply(  # the capacity of the arena its blocks live in
            boot_epoch=self.settings.boot_epoch,
            uptime_s=time.monotonic() - self.settings.started,
            total=_counters(total),
            host_capacity_bytes=c.host.pool_bytes[c.arena_of(scope, False)],
            host_used_bytes=sum(ns.counters.resident_blocks * ns.slot_bytes for ns in visible),
            sessions=len(self.sessions.of_tenant(scope)),
        )
        self._add_identities(reply, visible, [scope])
        return reply

    def _add_identities(
        self, reply: pb.StatsReply, namespaces: list[NamespaceState], tenant_names: list[str]
    ) -> None:
        """Each namespace (every identity field, the cache salt as ``salt_tag``'s tag, never
        itself, and the tenant holding it: a tenant of the tenants file, else "") and each
        tenant (sessions, namespaces, quotas and refusals)."""
        self._add_namespaces(reply, namespaces)
        held: dict[str, int] = {}  # the namespaces each one's quota is charged with
        for ns in self.cache.namespaces.values():
            held[ns.charged_to or ""] = held.get(ns.charged_to or "", 0) + 1
        self._add_tenants(reply, tenant_names, held)

    def _add_namespaces(self, reply: pb.StatsReply, namespaces: list[NamespaceState]) -> None:
        """Each namespace's identity and counters (see ``_add_identities``)."""
        for ns in namespaces:
            tenant = ns.spec.owner or ""
            tenant = tenant if self.tenancy.tenant(tenant) is not None else ""
            spec = namespace_spec(ns.spec)
            if ns.spec.cache_salt is not None:  # an isolation secret (vLLM: per user)
                spec.cache_salt = salt_tag(ns.spec.cache_salt)
            reply.namespaces.add(
                namespace_id=ns.id,
                model_id=ns.spec.model_id,
                model_revision=ns.spec.model_revision,
                block_bytes=ns.block_bytes,
                counters=_counters(ns.counters),
                spec=spec,
                tenant=tenant,
            )

    def _add_tenants(self, reply: pb.StatsReply, tenant_names: list[str], held: dict[str, int]) -> None:
        """Each tenant of ``tenant_names`` in the tenants file: its sessions, the namespaces
        it holds (``held``), its quotas and refusals."""
        for name in tenant_names:
            t = self.tenancy.tenant(name)
            if t is None:
                continue
            ts = reply.tenants.add(
                name=name,
                operator=t.operator,
                namespaces=held.get(name, 0),
                sessions=len(self.sessions.of_tenant(name)),
                group=t.group,
                group_stores_refused=self.tenancy.group_store_refusals(name),
            )
            for quota in QUOTA_NAMES:
                limit = self.tenancy.quota(t, quota)
                ts.quotas.add(
                    name=quota,
                    limited=limit is not None,
                    limit=limit or 0,
                    refusals=self.tenancy.refusals(name, quota),
                )


def _counters(c: Counters) -> pb.Counters:
    return pb.Counters(**{f: getattr(c, f) for f in COUNTER_FIELDS})


_SALT_TAG_KEY = secrets.token_bytes(32)  # one per daemon process, never written anywhere


def salt_tag(salt: str) -> str:
    """What Stats shows for a cache salt: ``hmac:`` and 12 hex digits of its HMAC-SHA256 under
    a key of this daemon process. Equal salts get equal tags in one daemon's run (two salted
    namespaces can be told apart), and the tag neither reveals a salt nor confirms a guessed
    one (unlike a plain digest of a guessable salt); it changes when the daemon restarts."""
    return "hmac:" + hmac.new(_SALT_TAG_KEY, salt.encode(), hashlib.sha256).hexdigest()[:12]

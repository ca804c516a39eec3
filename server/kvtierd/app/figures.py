"""The daemon's state as plain data: ``tiers`` (every tier and its state: the ready line's
``tiers``) and ``snapshot`` (the Stats reply plus the RPC figures: what /metrics renders).

Readers only: they change nothing of the parts the :class:`~kvtierd.app.daemon.Daemon` owns and
hands them. Event-loop thread only (the cache's state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_contract.protoutil import to_dict
from kvtierd.service import CALLER, KvtierService
from kvtierd.tiers.cluster.settings import parse_url

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvtierd.app.build import TenantArenas
    from kvtierd.cache import TieredCache
    from kvtierd.config import DaemonConfig
    from kvtierd.events.publisher import EventPublisher
    from kvtierd.index.published import Publishers
    from kvtierd.tenants import Tenant
    from kvtierd.tiers import Arena, HostTier
    from kvtierd.transports.base import ServerTransport


def tiers(
    cfg: DaemonConfig, host: HostTier, arena: Arena, tenant_arenas: TenantArenas, cache: TieredCache
) -> dict[str, Any]:
    """Every tier and its state (the ready line's ``tiers``); None: a tier not configured."""
    host_tier = {
        "bytes": host.capacity_bytes,
        "shared_arena_bytes": arena.size,
        "tenant_arenas": len(tenant_arenas.pools),
        "eviction_policy": cfg.host_tier.eviction_policy,
    }
    nvme: dict[str, Any] | None = None
    for link in cache.chain:
        nvme = {
            "directory": cfg.nvme_tier.disk_dir,
            "bytes": cfg.nvme_tier.disk_bytes,
            "state": "serving" if link.tier.admitting else "degraded",
            "reason": link.tier.degraded_reason,
            "recovered_blocks": link.recovery.restored,
            "write_policy": cfg.nvme_tier.write_policy,
        }
    cluster: dict[str, Any] | None = None
    if cache.fleet is not None:
        seeds, tls = parse_url(cfg.cluster_tier.cluster)
        cluster = {
            "seeds": list(seeds),
            "tls": tls,
            "state": "connected" if cache.fleet.tier.connected else "connecting",
            "write_policy": cfg.cluster_tier.cluster_write_policy,
        }
    return {"host": host_tier, "nvme": nvme, "cluster": cluster}


def snapshot(
    service: KvtierService,
    transports: Sequence[ServerTransport],
    published: Publishers,
    events: EventPublisher | None,
    caller: Tenant | None = None,
) -> dict[str, Any]:
    """Stats as plain data: the Stats reply plus RPC figures; for a tenant's credential (not
    the operator's), the Stats reply it would get and nothing daemon-wide (RPC errors and
    latency, connections, published indexes, published prefixes per group)."""
    scope = CALLER.set(caller)
    try:
        snap = to_dict(service.stats_reply())
    finally:
        CALLER.reset(scope)
    snap["draining"] = service.draining  # kvtier_draining: not ready, shutting down
    if caller is not None and not caller.operator:
        snap.update(rpc_errors={}, rpc_latency={}, connections={}, published={})
        return snap
    errors: dict[str, dict[str, int]] = {}
    for (method, code), n in service.errors.items():
        errors.setdefault(method, {})[code] = n
    snap["rpc_errors"] = errors  # method -> status code name -> count
    snap["rpc_latency"] = {m: (h.cumulative(), h.sum) for m, h in service.latency.items()}
    snap["connections"] = {k: v for t in transports for k, v in t.figures().items()}
    snap["connections"]["control_bad_frames"] = service.bad_frames
    snap["published"] = published.figures()
    snap["published_prefixes"] = service.prefixes.prefixes.counts()  # group -> prefixes
    if events is not None:
        snap["events"] = events.figures()
    return snap

"""The metric families of /metrics: a daemon snapshot turned into Prometheus families.

Pulled: at scrape time :class:`KvtierCollector` asks for one consistent snapshot (the ``Stats``
reply as a dict, plus RPC figures for the operator) and yields families. Names carry the
``kvtier_`` prefix and base units; counters end in ``_total``. Labels stay bounded: ``namespace``
and ``model`` per registered namespace, ``tenant`` from the tenants file ("" for a namespace no
tenant of the file holds), ``tier``, ``transport``, ``direction``, ``outcome``, ``quota``, ``node``
(a cluster master), ``method`` and ``code`` (gRPC). No key, digest, token or block byte is ever a
label or a value. docs/metrics.md lists every family.

The families of the NVMe and cluster tiers, cuda_ipc and the per-tier read figures are in
:mod:`kvtierd.metric_families_tiers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from kvtierd.metric_families_tiers import cluster_families, cuda_families, nvme_families, tier_read_families
from kvtierd.stats import COUNTER_FIELDS, GAUGE_FIELDS

log = logging.getLogger("kvtierd.metrics")
Snapshot = dict[str, Any]

_HIT = (
    "kvtier_lookup_blocks_hit_total",
    "Blocks found by lookups the daemon answered, by the tier that held them",
)
_BYTES = ("kvtier_transfer_bytes_total", "Payload bytes moved between clients and the host tier")
# Counter field -> (metric name, help, extra labels). Several fields share one family by label.
_FAMILIES: dict[str, tuple[str, str, dict[str, str]]] = {
    "lookups": ("kvtier_lookups_total", "Lookups (gRPC and published index)", {}),
    "blocks_requested": ("kvtier_lookup_blocks_requested_total", "Blocks asked for by lookups", {}),
    "blocks_hit_host": (*_HIT, {"tier": "host"}),
    "blocks_hit_nvme": (*_HIT, {"tier": "nvme"}),
    "blocks_hit_cluster": (*_HIT, {"tier": "cluster"}),
    "blocks_hit_local": (
        "kvtier_local_lookup_blocks_hit_total",
        "Blocks found by lookups that clients answered from the published index "
        "(held in the host or the NVMe tier; the index does not say which)",
        {},
    ),
    "cluster_imports": (
        "kvtier_cluster_imports_total",
        "Blocks fetched from the cluster tier into the host tier",
        {},
    ),
    "cluster_corrupt": (
        "kvtier_cluster_corrupt_total",
        "Cluster values that failed verification (a miss; deleted)",
        {},
    ),
    "corrupt_blocks": (
        "kvtier_corrupt_blocks_total",
        "Host blocks whose bytes no longer matched their digest (dropped)",
        {},
    ),
    "local_lookups": (
        "kvtier_local_lookups_total",
        "Lookups answered by clients from the published index",
        {},
    ),
    "blocks_missed": ("kvtier_lookup_blocks_missed_total", "Blocks not found", {}),
    "tokens_requested": ("kvtier_lookup_tokens_requested_total", "Tokens asked for", {}),
    "tokens_hit": ("kvtier_lookup_tokens_hit_total", "Tokens found", {}),
    "tokens_missed": ("kvtier_lookup_tokens_missed_total", "Tokens not found", {}),
    "stores_accepted": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "accepted"}),
    "stores_already_present": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "already_present"}),
    "stores_rejected": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "rejected"}),
    "stores_dropped": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "dropped"}),
    "loads": ("kvtier_load_blocks_total", "Blocks loaded by clients", {}),
    "evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "host"}),
    "bytes_in_shm": (*_BYTES, {"transport": "shm", "direction": "in"}),
    "bytes_out_shm": (*_BYTES, {"transport": "shm", "direction": "out"}),
    "bytes_in_tcp": (*_BYTES, {"transport": "tcp", "direction": "in"}),
    "bytes_out_tcp": (*_BYTES, {"transport": "tcp", "direction": "out"}),
    "bytes_in_cuda_ipc": (*_BYTES, {"transport": "cuda_ipc", "direction": "in"}),
    "bytes_out_cuda_ipc": (*_BYTES, {"transport": "cuda_ipc", "direction": "out"}),
    "resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "host"}),
    "resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "host"}),
    "nvme_resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "nvme"}),
    "nvme_resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "nvme"}),
    "promotions": ("kvtier_promotions_total", "Blocks promoted NVMe -> host", {}),
    "demotions": ("kvtier_demotions_total", "Blocks written host -> NVMe", {}),
    "nvme_evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "nvme"}),
    "checksum_failures": ("kvtier_checksum_failures_total", "NVMe reads failing verification", {}),
    "nvme_bytes_read": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes", {"direction": "read"}),
    "nvme_bytes_written": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes", {"direction": "write"}),
}
assert set(_FAMILIES) == set(COUNTER_FIELDS)
NAMESPACE_LABELS = ("namespace", "model", "tenant")


def _counter_families(snap: Snapshot) -> Iterator[Any]:
    """The per-namespace counters, labelled ``namespace``, ``model``, ``tenant`` (+ extras)."""
    families: dict[str, Any] = {}
    for field, (name, help_, labels) in _FAMILIES.items():
        fam = families.get(name)
        if fam is None:
            keys = [*NAMESPACE_LABELS, *labels]
            cls = GaugeMetricFamily if field in GAUGE_FIELDS else CounterMetricFamily
            fam = families[name] = cls(
                name.removesuffix("_total") if cls is CounterMetricFamily else name, help_, labels=keys
            )
        for ns in snap["namespaces"]:
            fam.add_metric(
                [str(ns["namespace_id"]), ns["model_id"], ns.get("tenant", ""), *labels.values()],
                ns["counters"][field],
            )
    yield from families.values()


def _tenant_families(tenants: list[dict[str, Any]]) -> Iterator[Any]:
    """Per tenant of the tenants file: sessions, namespaces, quota limits and refusals."""
    sessions = GaugeMetricFamily("kvtier_tenant_sessions", "Open sessions of a tenant", labels=["tenant"])
    namespaces = GaugeMetricFamily("kvtier_tenant_namespaces", "Namespaces a tenant holds", labels=["tenant"])
    limit = GaugeMetricFamily(
        "kvtier_quota_limit",
        "A tenant's quota (the file's value, else the daemon's default; absent: unlimited); *_bytes in bytes",
        labels=["tenant", "quota"],
    )
    refused = CounterMetricFamily(
        "kvtier_quota_refusals",
        "Requests refused (RESOURCE_EXHAUSTED) because a tenant's quota was reached",
        labels=["tenant", "quota"],
    )
    group_refused = CounterMetricFamily(
        "kvtier_group_stores_refused",
        "Stores refused (PERMISSION_DENIED) into a group's namespace the tenant reads, not publishes",
        labels=["tenant"],
    )
    for t in tenants:
        sessions.add_metric([t["name"]], t["sessions"])
        group_refused.add_metric([t["name"]], t.get("group_stores_refused", 0))
        namespaces.add_metric([t["name"]], t["namespaces"])
        for q in t["quotas"]:
            if q["limited"]:
                limit.add_metric([t["name"], q["name"]], q["limit"])
            refused.add_metric([t["name"], q["name"]], q["refusals"])
    yield from (sessions, namespaces, limit, refused, group_refused)


def _host_families(snap: Snapshot) -> Iterator[Any]:
    g = GaugeMetricFamily
    yield g("kvtier_host_capacity_bytes", "Host tier capacity", value=snap["host_capacity_bytes"])
    yield g("kvtier_host_used_bytes", "Host tier bytes in use (slots)", value=snap["host_used_bytes"])
    yield g("kvtier_sessions", "Open sessions", value=snap["sessions"])
    yield g("kvtier_pinned_blocks", "Blocks pinned by loads", value=snap["pinned_blocks"])
    yield g("kvtier_writing_blocks", "Blocks reserved and being written", value=snap["writing_blocks"])
    yield g("kvtier_limbo_blocks", "Slots held back after a lease expiry", value=snap["limbo_blocks"])
    yield g(
        "kvtier_orphaned_blocks",
        "Blocks held whose ancestor left the cache, offered first (eviction_policy prefix)",
        value=snap.get("orphaned_blocks", 0),
    )
    yield CounterMetricFamily(
        "kvtier_orphans_evicted",
        "Blocks evicted (host slots, NVMe copies) while offered first as orphans (eviction_policy prefix)",
        value=snap.get("orphans_evicted", 0),
    )
    yield g(
        "kvtier_draining",
        "1 while the daemon drains to stop (health NOT_SERVING, stores refused)",
        value=1 if snap.get("draining") else 0,
    )


def _published_families(pub: dict[str, Any]) -> Iterator[Any]:
    if not pub:
        return
    g = GaugeMetricFamily
    yield g(
        "kvtier_published_indexes",
        "Namespaces whose index is published in shared memory",
        value=pub["published_indexes"],
    )
    yield g(
        "kvtier_published_index_bytes",
        "Shared memory of the published indexes",
        value=pub["published_index_bytes"],
    )
    yield g(
        "kvtier_published_index_left_out",
        "Blocks left out of a published index (no slot within the probe bound)",
        value=pub["published_index_left_out"],
    )
    yield g(
        "kvtier_published_index_building",
        "Published indexes being built on a thread (big namespaces)",
        value=pub["published_index_building"],
    )


def _prefix_families(counts: dict[str, int] | None) -> Iterator[Any]:
    """Published prefixes per group (the operator's view only: absent for a tenant)."""
    if counts is None:
        return
    fam = GaugeMetricFamily(
        "kvtier_published_prefixes",
        "Prefixes a group's publishers published (docs/security.md § Groups)",
        labels=["group"],
    )
    for group, n in sorted(counts.items()):
        fam.add_metric([group], n)
    yield fam


def _event_families(ev: dict[str, Any]) -> Iterator[Any]:
    """KV events (docs/events.md): daemon-wide, only while events are on."""
    if not ev:
        return
    c = CounterMetricFamily
    yield c("kvtier_events_published_total", "KV events sent (all streams)", value=ev["events_published"])
    yield c(
        "kvtier_event_batches_published_total",
        "KV event messages (batches) sent",
        value=ev["event_batches_published"],
    )
    yield c(
        "kvtier_event_blocks_dropped_total",
        "Blocks whose events were dropped because the publisher's queue was full",
        value=ev["event_blocks_dropped"],
    )
    yield c(
        "kvtier_event_replay_requests_total", "Replay requests answered", value=ev["event_replay_requests"]
    )
    yield GaugeMetricFamily(
        "kvtier_event_blocks_queued", "Blocks waiting to be published", value=ev["event_blocks_queued"]
    )
    yield GaugeMetricFamily(
        "kvtier_event_streams", "Event streams bound (operator and tenants)", value=ev["event_streams"]
    )
    yield from _event_bound_families(ev)


def _event_bound_families(ev: dict[str, Any]) -> Iterator[Any]:
    """What the KV-event publisher holds, and what its bounds refused or dropped."""
    c = CounterMetricFamily
    yield GaugeMetricFamily(
        "kvtier_event_buffered_bytes",
        "Bytes the replay buffers hold (all streams)",
        value=ev["event_buffered_bytes"],
    )
    yield c(
        "kvtier_event_buffer_dropped_messages_total",
        "Messages dropped from replay buffers, oldest first, to stay within their bytes",
        value=ev["event_buffer_dropped_messages"],
    )
    yield c(
        "kvtier_event_replays_cut_total",
        "Replay answers cut short: the requester's queue was full or it left",
        value=ev["event_replays_cut"],
    )
    yield c(
        "kvtier_event_connections_refused_total",
        "Connections to an event socket refused: events_max_connections open already",
        value=ev["event_connections_refused"],
    )
    yield c(
        "kvtier_event_subscriptions_dropped_total",
        "Subscriptions to an event socket dropped: no prefix of events_topic (its connection closed)",
        value=ev["event_subscriptions_dropped"],
    )


def _boot_families(snap: Snapshot) -> Iterator[Any]:
    """The boot epoch exactly (an info label: a float64 value keeps only ~16 of its 19 digits),
    the start time in seconds, and the old float gauge (kept for readers of the old name)."""
    epoch = int(snap["boot_epoch"])
    yield InfoMetricFamily(
        "kvtier_boot",
        "This daemon's boot epoch (nanoseconds since the Unix "
        "epoch at start; it changes on every start), exact",
        value={"boot_epoch": str(epoch)},
    )
    yield GaugeMetricFamily(
        "kvtier_boot_time_seconds", "Start time, seconds since the Unix epoch", value=epoch / 1e9
    )
    yield GaugeMetricFamily(
        "kvtier_boot_epoch",
        "Boot epoch as a float (rounded: use kvtier_boot_info's boot_epoch label)",
        value=epoch,
    )
    yield GaugeMetricFamily("kvtier_uptime_seconds", "Seconds since start", value=snap["uptime_s"])


def _rpc_families(snap: Snapshot) -> Iterator[Any]:
    yield CounterMetricFamily(
        "kvtier_leases_expired_total", "Sessions whose lease lapsed", value=snap["leases_expired"]
    )
    errors = CounterMetricFamily(
        "kvtier_rpc_errors", "RPC errors by method and status", labels=["method", "code"]
    )
    for method, by_code in sorted(snap["rpc_errors"].items()):
        for code, n in sorted(by_code.items()):
            errors.add_metric([method, code], n)
    yield errors
    h = HistogramMetricFamily("kvtier_rpc_duration_seconds", "RPC service time", labels=["method"])
    for method, (buckets, total) in sorted(snap["rpc_latency"].items()):
        h.add_metric([method], buckets, total)
    yield h


def _connection_families(figures: dict[str, int]) -> Iterator[Any]:
    """Open connections and refusals per transport (``<transport>_connections[_what]``)."""
    open_ = GaugeMetricFamily("kvtier_connections", "Open transport connections", labels=["transport"])
    closed = CounterMetricFamily(
        "kvtier_connections_closed", "Connections the daemon closed", labels=["transport", "reason"]
    )
    bad = CounterMetricFamily(
        "kvtier_bad_frames",
        "Connections closed for a frame that broke the protocol (tcp: the data channel; "
        "control: control channels)",
        labels=["transport"],
    )
    for key, n in sorted(figures.items()):
        if key.endswith("_bad_frames"):
            bad.add_metric([key.removesuffix("_bad_frames")], n)
            continue
        transport, _, what = key.partition("_connections")
        if not what:
            open_.add_metric([transport], n)
        elif what in ("_refused", "_timed_out"):
            closed.add_metric([transport, what[1:]], n)
    yield open_
    yield closed
    yield bad


class KvtierCollector:
    """Turns a snapshot into metric families at scrape time. Called on the HTTP server thread."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        try:
            snap = self._snapshot()
        except Exception as e:  # the daemon is shutting down: expose nothing rather than fail
            log.debug("metrics snapshot failed: %s", e)
            return
        yield from _counter_families(snap)
        yield from _host_families(snap)
        yield from nvme_families(snap["nvme"])
        yield from cuda_families(snap["cuda_ipc"])
        yield from cluster_families(snap.get("cluster") or {})
        yield from tier_read_families(snap.get("tier_figures") or [])
        yield from _tenant_families(snap.get("tenants") or [])
        yield from _connection_families(snap.get("connections", {}))
        yield from _published_families(snap.get("published", {}))
        yield from _prefix_families(snap.get("published_prefixes"))
        yield from _event_families(snap.get("events", {}))
        yield from _boot_families(snap)
        yield from _rpc_families(snap)

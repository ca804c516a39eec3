"""The metric families of the tiers below the host tier and of the cuda_ipc copier: the NVMe
tier, the cluster tier (and its nodes), cuda_ipc, and the read figures of every tier.

Role: part of the /metrics table of :mod:`kvtierd.metric_families` (whose collector yields these;
docs/metrics.md lists every family). Ownership: pure functions from a snapshot's parts to
families, no state. Concurrency: the HTTP server's thread, at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def nvme_families(nv: dict[str, Any]) -> Iterator[Any]:
    if not nv["enabled"]:
        return
    g = GaugeMetricFamily
    yield g("kvtier_nvme_capacity_bytes", "NVMe tier capacity", value=nv["capacity_bytes"])
    yield g("kvtier_nvme_used_bytes", "NVMe tier bytes in slots", value=nv["used_bytes"])
    yield g(
        "kvtier_nvme_degraded",
        "1 while the NVMe tier does not admit blocks",
        value=0 if nv["admitting"] else 1,
    )
    yield CounterMetricFamily(
        "kvtier_nvme_quarantined_slots", "Slots quarantined", value=nv["quarantined_slots"]
    )
    yield CounterMetricFamily("kvtier_nvme_write_errors", "NVMe writes that failed", value=nv["write_errors"])
    yield g("kvtier_nvme_recovery_seconds", "Time the last recovery took", value=nv["recovery_seconds"])
    yield g("kvtier_nvme_recovered_blocks", "Blocks the last recovery restored", value=nv["recovered_blocks"])


def cuda_families(cu: dict[str, Any]) -> Iterator[Any]:
    if not cu["enabled"]:
        return
    yield GaugeMetricFamily(
        "kvtier_cuda_ipc_buffers", "Client CUDA buffers opened by the daemon", value=cu["buffers"]
    )
    yield CounterMetricFamily(
        "kvtier_cuda_ipc_copies_total", "cudaMemcpyAsync calls of cuda_ipc transfers", value=cu["copies"]
    )
    yield CounterMetricFamily(
        "kvtier_cuda_ipc_copy_errors_total",
        "cuda_ipc transfers failed by a CUDA error (job aborted)",
        value=cu["copy_errors"],
    )


def cluster_families(cl: dict[str, Any]) -> Iterator[Any]:
    """The cluster tier's figures (per node: :func:`cluster_node_families`)."""
    if not cl.get("enabled"):
        return
    g, c = GaugeMetricFamily, CounterMetricFamily
    yield g(
        "kvtier_cluster_connected",
        "1 while a slot map is known and a master answers",
        value=1 if cl.get("connected") else 0,
    )
    yield g(
        "kvtier_cluster_queued_bytes",
        "Bytes waiting to be written to the cluster",
        value=cl.get("queued_bytes", 0),
    )
    yield c("kvtier_cluster_writes_total", "Blocks written to the cluster", value=cl.get("writes", 0))
    yield c(
        "kvtier_cluster_mac_failures_total",
        "Cluster values refused because their MAC did "
        "not verify (not written by a daemon of this fleet and tenant): misses",
        value=cl.get("mac_failures", 0),
    )
    yield c(
        "kvtier_cluster_write_drops_total",
        "Blocks not written: queue full, node down, late",
        value=cl.get("write_drops", 0),
    )
    yield c(
        "kvtier_cluster_corrupt_exports_total",
        "Blocks not written to the cluster: their bytes no longer matched their digest",
        value=cl.get("corrupt_exports", 0),
    )
    yield c(
        "kvtier_cluster_lookup_timeouts_total",
        "Lookups whose cluster part ran past the deadline",
        value=cl.get("lookup_timeouts", 0),
    )
    yield from cluster_node_families(cl.get("nodes", []))


def cluster_node_families(nodes: list[dict[str, Any]]) -> Iterator[Any]:
    """Per node (``node`` = the master's host:port): keys, bytes, errors, latency, health."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    per_node = [
        (
            "kvtier_cluster_node_keys_total",
            "Keys asked of a node, by outcome",
            "outcome",
            (("hit", "hits"), ("miss", "misses")),
        ),
        (
            "kvtier_cluster_node_bytes_total",
            "Value bytes moved, by direction",
            "direction",
            (("read", "bytes_read"), ("write", "bytes_written")),
        ),
    ]
    for name, help_, label, pairs in per_node:
        fam = c(name, help_, labels=["node", label])
        for n in nodes:
            for value, key in pairs:
                fam.add_metric([n["address"], value], n.get(key, 0))
        yield fam
    errors = c("kvtier_cluster_node_errors_total", "Pipelines failed or late", labels=["node"])
    requests = c("kvtier_cluster_node_requests_total", "Pipelines sent", labels=["node"])
    latency = c(
        "kvtier_cluster_node_latency_seconds_total",
        "Time of answered pipelines (divide by requests - errors)",
        labels=["node"],
    )
    healthy = g("kvtier_cluster_node_healthy", "0 while a node's breaker is open", labels=["node"])
    for n in nodes:
        errors.add_metric([n["address"]], n.get("errors", 0))
        requests.add_metric([n["address"]], n.get("requests", 0))
        latency.add_metric([n["address"]], n.get("latency_seconds_sum", 0.0))
        healthy.add_metric([n["address"]], 1 if n.get("healthy") else 0)
    yield from (errors, requests, latency, healthy)


_TIER_LABELS = {1: "host", 2: "nvme", 3: "cluster"}  # kvtier.v1.Tier


def tier_read_families(figures: list[dict[str, Any]]) -> Iterator[Any]:
    """What reading each tier below the host tier into it costs now (kvtierd.cache.read_figures):
    one sample per tier that has been read since the start (none before; the operator's view)."""
    latency = GaugeMetricFamily(
        "kvtier_tier_read_latency_seconds",
        "Recent fixed cost of a read into the host tier, queueing in the daemon included "
        "(a read of n bytes costs about this + n / kvtier_tier_read_bytes_per_second)",
        labels=["tier"],
    )
    bandwidth = GaugeMetricFamily(
        "kvtier_tier_read_bytes_per_second",
        "Recent marginal payload bandwidth of reads into the host tier",
        labels=["tier"],
    )
    for f in figures:
        tier = _TIER_LABELS.get(f["tier"])
        if tier is None:
            continue
        latency.add_metric([tier], f["latency_us"] / 1e6)
        bandwidth.add_metric([tier], f["bytes_per_s"])
    yield latency
    yield bandwidth

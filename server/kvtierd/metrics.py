"""Prometheus exposition. The only module that imports prometheus_client.

Metrics are pulled: at scrape time the collector asks the daemon loop for one consistent snapshot
(``StatsReply`` plus RPC latency histograms) and turns it into families. Names carry the
``kvtier_`` prefix and base units; counters end in ``_total``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvtierd.stats import COUNTER_FIELDS, GAUGE_FIELDS

log = logging.getLogger("kvtierd.metrics")
Snapshot = dict[str, Any]

# Counter field -> (metric name, help, extra labels). Several fields share one family by label.
_FAMILIES: dict[str, tuple[str, str, dict[str, str]]] = {
    "lookups": ("kvtier_lookups_total", "Lookup RPCs", {}),
    "blocks_requested": ("kvtier_lookup_blocks_requested_total", "Blocks asked for by lookups", {}),
    "blocks_hit_host": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier", {"tier": "host"}),
    "blocks_hit_nvme": ("kvtier_lookup_blocks_hit_total", "Blocks found, by tier", {"tier": "nvme"}),
    "blocks_missed": ("kvtier_lookup_blocks_missed_total", "Blocks not found", {}),
    "tokens_requested": ("kvtier_lookup_tokens_requested_total", "Tokens asked for", {}),
    "tokens_hit": ("kvtier_lookup_tokens_hit_total", "Tokens found", {}),
    "tokens_missed": ("kvtier_lookup_tokens_missed_total", "Tokens not found", {}),
    "stores_accepted": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "accepted"}),
    "stores_already_present": ("kvtier_store_blocks_total", "Store outcomes",
                               {"outcome": "already_present"}),
    "stores_rejected": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "rejected"}),
    "stores_dropped": ("kvtier_store_blocks_total", "Store outcomes", {"outcome": "dropped"}),
    "loads": ("kvtier_load_blocks_total", "Blocks loaded by clients", {}),
    "evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "host"}),
    "bytes_in_shm": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                     {"transport": "shm", "direction": "in"}),
    "bytes_out_shm": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                      {"transport": "shm", "direction": "out"}),
    "bytes_in_tcp": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                     {"transport": "tcp", "direction": "in"}),
    "bytes_out_tcp": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                      {"transport": "tcp", "direction": "out"}),
    "bytes_in_cuda_ipc": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                          {"transport": "cuda_ipc", "direction": "in"}),
    "bytes_out_cuda_ipc": ("kvtier_transfer_bytes_total", "Payload bytes moved",
                           {"transport": "cuda_ipc", "direction": "out"}),
    "resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "host"}),
    "resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "host"}),
    "nvme_resident_blocks": ("kvtier_resident_blocks", "Blocks resident", {"tier": "nvme"}),
    "nvme_resident_bytes": ("kvtier_resident_bytes", "Payload bytes resident", {"tier": "nvme"}),
    "promotions": ("kvtier_promotions_total", "Blocks promoted NVMe -> host", {}),
    "demotions": ("kvtier_demotions_total", "Blocks written host -> NVMe", {}),
    "nvme_evictions": ("kvtier_evictions_total", "Blocks evicted", {"tier": "nvme"}),
    "checksum_failures": ("kvtier_checksum_failures_total", "NVMe reads failing verification", {}),
    "nvme_bytes_read": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes", {"direction": "read"}),
    "nvme_bytes_written": ("kvtier_nvme_io_bytes_total", "NVMe payload bytes",
                           {"direction": "write"}),
}
assert set(_FAMILIES) == set(COUNTER_FIELDS)


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
        g = GaugeMetricFamily
        yield g("kvtier_host_capacity_bytes", "Host tier capacity", value=snap["host_capacity_bytes"])
        yield g("kvtier_host_used_bytes", "Host tier bytes in use (slots)",
                value=snap["host_used_bytes"])
        yield g("kvtier_sessions", "Open sessions", value=snap["sessions"])
        yield g("kvtier_pinned_blocks", "Blocks pinned by loads", value=snap["pinned_blocks"])
        yield g("kvtier_writing_blocks", "Blocks reserved and being written",
                value=snap["writing_blocks"])
        yield g("kvtier_limbo_blocks", "Slots held back after a lease expiry",
                value=snap["limbo_blocks"])
        nv = snap["nvme"]
        if nv["enabled"]:
            yield g("kvtier_nvme_capacity_bytes", "NVMe tier capacity", value=nv["capacity_bytes"])
            yield g("kvtier_nvme_used_bytes", "NVMe tier bytes in slots", value=nv["used_bytes"])
            yield g("kvtier_nvme_degraded", "1 while the NVMe tier does not admit blocks",
                    value=0 if nv["admitting"] else 1)
            yield CounterMetricFamily("kvtier_nvme_quarantined_slots", "Slots quarantined",
                                      value=nv["quarantined_slots"])
            yield g("kvtier_nvme_recovery_seconds", "Time the last recovery took",
                    value=nv["recovery_seconds"])
            yield g("kvtier_nvme_recovered_blocks", "Blocks the last recovery restored",
                    value=nv["recovered_blocks"])
        cu = snap["cuda_ipc"]
        if cu["enabled"]:
            yield g("kvtier_cuda_ipc_buffers", "Client CUDA buffers opened by the daemon",
                    value=cu["buffers"])
            yield CounterMetricFamily("kvtier_cuda_ipc_copies_total",
                                      "cudaMemcpyAsync calls of cuda_ipc transfers",
                                      value=cu["copies"])
            yield CounterMetricFamily("kvtier_cuda_ipc_copy_errors_total",
                                      "cuda_ipc transfers failed by a CUDA error (job aborted)",
                                      value=cu["copy_errors"])
        yield g("kvtier_boot_epoch", "Boot epoch of this daemon", value=snap["boot_epoch"])
        yield g("kvtier_uptime_seconds", "Seconds since start", value=snap["uptime_s"])
        yield CounterMetricFamily("kvtier_leases_expired_total", "Sessions whose lease lapsed",
                                  value=snap["leases_expired"])
        errors = CounterMetricFamily("kvtier_rpc_errors_total", "RPC errors by status", labels=["code"])
        for code, n in sorted(snap["rpc_errors"].items()):
            errors.add_metric([code], n)
        yield errors
        h = HistogramMetricFamily("kvtier_rpc_duration_seconds", "RPC service time", labels=["method"])
        for method, (buckets, total) in sorted(snap["rpc_latency"].items()):
            h.add_metric([method], buckets, total)
        yield h


def _counter_families(snap: Snapshot) -> Iterator[Any]:
    families: dict[str, Any] = {}
    for field, (name, help_, labels) in _FAMILIES.items():
        fam = families.get(name)
        keys = ["namespace", "model", *labels]
        if fam is None:
            cls = GaugeMetricFamily if field in GAUGE_FIELDS else CounterMetricFamily
            fam = families[name] = cls(name.removesuffix("_total") if cls is CounterMetricFamily
                                       else name, help_, labels=keys)
        for ns in snap["namespaces"]:
            fam.add_metric([str(ns["namespace_id"]), ns["model_id"], *labels.values()],
                           ns["counters"][field])
    yield from families.values()


class MetricsServer:
    """Owns the /metrics HTTP server thread. ``start()`` -> ``port`` -> ``close()``."""

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop,
                 snapshot: Callable[[], Snapshot]) -> None:
        self.host, self.port = host, port
        self._loop = loop
        self._snapshot = snapshot
        self._server: Any = None

    def _threadsafe_snapshot(self) -> Snapshot:
        async def take() -> Snapshot:
            return self._snapshot()

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=5)

    def start(self) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(KvtierCollector(self._threadsafe_snapshot))
        self._server, _thread = start_http_server(self.port, addr=self.host, registry=registry)
        self.port = self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

"""Checks of the settings, one function per group of :mod:`kvtierd.config.groups` (and the
checks that span groups beside the group they guard); each raises ValueError naming the key.

Called once, when a :class:`~kvtierd.config.DaemonConfig` is built (its ``__post_init__``).
Pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
from typing import Any, get_args

from kvtierd.config.groups import (
    GROUP_OF,
    ClusterTierConfig,
    ClusterWritePolicy,
    EventsConfig,
    GrpcConfig,
    HostTierConfig,
    MetricsConfig,
    NvmeTierConfig,
    RequestsConfig,
    SessionsConfig,
    TenancyConfig,
    TransportsConfig,
    VerifyStore,
)
from kvtierd.policies import PolicyName, WritePolicyName

# Annotation (a string, see the __future__ import) -> accepted runtime types; bool is never an int.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
}


def need(cond: bool, name: str, msg: str) -> None:
    """ValueError ``name: msg`` unless ``cond``."""
    if not cond:
        raise ValueError(f"{name}: {msg}")


def types(group: Any) -> None:
    """Every field of ``group`` of its annotated type: a config file can hold anything, and a
    str where an int belongs must be a ValueError naming the field, not a TypeError below."""
    for f in dataclasses.fields(group):
        kinds = _FIELD_TYPES.get(str(f.type))
        value = getattr(group, f.name)
        if kinds is not None:
            need(
                isinstance(value, kinds) and (f.type == "bool" or not isinstance(value, bool)),
                f.name,
                f"expected {f.type}, got {type(value).__name__} {value!r}",
            )


def host_tier(c: HostTierConfig) -> None:
    need(
        c.slot_align_bytes > 0 and c.slot_align_bytes & (c.slot_align_bytes - 1) == 0,
        "slot_align_bytes",
        "must be a power of two",
    )
    need(
        c.slab_bytes >= c.slot_align_bytes and c.slab_bytes % c.slot_align_bytes == 0,
        "slab_bytes",
        "must be a positive multiple of slot_align_bytes",
    )
    need(c.host_bytes >= c.slab_bytes, "host_bytes", "must hold at least one slab")
    need(c.eviction_policy in get_args(PolicyName), "eviction_policy", "must be 'lru', 'arc' or 'prefix'")


def sessions(c: SessionsConfig) -> None:
    need(c.min_lease_ttl_s > 0, "min_lease_ttl_s", "must be > 0")
    need(c.max_lease_ttl_s >= c.min_lease_ttl_s, "max_lease_ttl_s", "must be >= min_lease_ttl_s")
    need(
        c.min_lease_ttl_s <= c.lease_ttl_s <= c.max_lease_ttl_s,
        "lease_ttl_s",
        "must satisfy min_lease_ttl_s <= lease_ttl_s <= max_lease_ttl_s",
    )
    need(c.lease_sweep_s > 0, "lease_sweep_s", "must be > 0")
    need(c.max_sessions >= 1, "max_sessions", "must be >= 1")
    need(c.max_namespaces >= 1, "max_namespaces", "must be >= 1")
    need(c.namespace_idle_s >= 0, "namespace_idle_s", "must be >= 0 (0: never)")


def requests(c: RequestsConfig) -> None:
    need(c.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
    need(1 <= c.max_batch_blocks <= 1 << 16, "max_batch_blocks", "must be in [1, 65536]")
    need(c.max_inflight_rpcs >= 1, "max_inflight_rpcs", "must be >= 1")


def transports(c: TransportsConfig, g: GrpcConfig) -> None:
    """The transports' bounds; a non-loopback data channel needs TLS (the gRPC listener's)."""
    need(c.handshake_timeout_s > 0, "handshake_timeout_s", "must be > 0")
    need(c.data_idle_timeout_s > 0, "data_idle_timeout_s", "must be > 0")
    need(c.data_max_connections >= 1, "data_max_connections", "must be >= 1")
    need(c.data_max_queued_bytes >= 0, "data_max_queued_bytes", "must be >= 0")
    need(c.shm_max_connections >= 1, "shm_max_connections", "must be >= 1")
    need(c.shm_handshakes_per_uid >= 1, "shm_handshakes_per_uid", "must be >= 1")
    need(c.data_max_unauthenticated >= 1, "data_max_unauthenticated", "must be >= 1")
    need(
        0 <= c.data_max_connections_per_tenant <= c.data_max_connections,
        "data_max_connections_per_tenant",
        "must be in [0, data_max_connections] (0: half)",
    )
    need(c.publish_index_idle_s >= 0, "publish_index_idle_s", "must be >= 0")
    need(c.verify_store in get_args(VerifyStore), "verify_store", "must be 'client' or 'daemon'")
    host_port("data_listen", c.data_listen)
    if not g.allow_plaintext_remote:
        need(
            not c.data_listen or bool(g.tls_cert) or is_loopback(c.data_listen),
            "data_listen",
            f"{c.data_listen} is not a loopback address: serve TLS there "
            "(tls_cert, tls_key: the data channel uses the gRPC listener's) or set "
            "allow_plaintext_remote = true (--allow-plaintext-remote)",
        )


def grpc(c: GrpcConfig) -> None:
    """The listeners (a Unix socket or TCP), their addresses, TLS and reflection."""
    need(bool(c.socket_path or c.listen), "listen", "need a Unix socket or a TCP listener")
    need(
        0o600 <= c.socket_mode <= 0o777 and c.socket_mode & 0o600 == 0o600,
        "socket_mode",
        f"expected a file mode with the owner's read and write, 0o600..0o777 (e.g. 0o600, "
        f"0o660), got {c.socket_mode!r}",
    )
    host_port("listen", c.listen)
    host_port("health_listen", c.health_listen)
    need(bool(c.tls_cert) == bool(c.tls_key), "tls_key", "tls_cert and tls_key go together")
    need(not c.tls_client_ca or bool(c.tls_cert), "tls_client_ca", "needs tls_cert/tls_key")
    need(
        not c.tls_require_client_cert or bool(c.tls_client_ca),
        "tls_require_client_cert",
        "needs tls_client_ca",
    )
    # gRPC asks a client for a certificate only when it requires one: with an optional one, a
    # client's certificate would never reach the daemon and its mtls_names tenant never match
    need(
        not c.tls_client_ca or c.tls_require_client_cert,
        "tls_client_ca",
        "gRPC does not ask for optional client certificates (they would be ignored): set "
        "tls_require_client_cert = true for mTLS, or leave tls_client_ca out and use tokens",
    )
    need(c.reflection in ("unix", "all", "off"), "reflection", "must be 'unix', 'all' or 'off'")
    if not c.allow_plaintext_remote:
        need(
            not c.listen or bool(c.tls_cert) or is_loopback(c.listen),
            "listen",
            f"{c.listen} is not a loopback address: serve TLS there (tls_cert, tls_key) or "
            "set allow_plaintext_remote = true (--allow-plaintext-remote)",
        )


def network_clients(g: GrpcConfig, t: TransportsConfig, tn: TenancyConfig) -> None:
    """A listener off loopback (``listen``, ``data_listen``) authenticates its clients: a
    tenants file (tokens, mTLS names) or required client certificates. TLS alone proves the
    daemon to its clients, not them to it; plaintext (``allow_plaintext_remote``) is another
    question, asked by :func:`grpc` and :func:`transports`."""
    if tn.tenants_file or g.tls_require_client_cert:
        return
    for name, value in (("listen", g.listen), ("data_listen", t.data_listen)):
        need(
            not value or is_loopback(value),
            name,
            f"{value} is not a loopback address and nothing authenticates its clients: every "
            "client that reaches it reads and writes every block (a TLS certificate proves the "
            "daemon to them, not them to it). Add a tenants file (tenants_file, --tenants-file: "
            "tokens per tenant, docs/security.md) or require client certificates (tls_client_ca "
            "and tls_require_client_cert = true, --tls-client-ca --tls-require-client-cert), or "
            "bind a loopback address",
        )


def metrics(c: MetricsConfig, g: GrpcConfig) -> None:
    """/metrics: a port or -1; plaintext HTTP off loopback only when allowed. (The scrape
    token it then needs with tenants: kvtierd.tenancy.exposure, once the tenants file is read.)"""
    need(-1 <= c.metrics_port <= 65535, "metrics_port", "must be -1 (off) or a port")
    need(
        c.metrics_port < 0
        or c.metrics_plaintext_remote
        or g.allow_plaintext_remote
        or is_loopback(f"{c.metrics_host}:{c.metrics_port}"),
        "metrics_host",
        f"{c.metrics_host} is not a loopback address and /metrics is plaintext HTTP: set "
        "metrics_plaintext_remote = true (--allow-plaintext-metrics; with tenants, scrape tokens "
        "only), or allow_plaintext_remote = true (--allow-plaintext-remote: every token, and "
        'plaintext gRPC), or bind it to loopback (metrics_host = "127.0.0.1")',
    )


def nvme_tier(c: NvmeTierConfig, h: HostTierConfig) -> None:
    a = c.io_align_bytes
    need(512 <= a <= 65536 and a & (a - 1) == 0, "io_align_bytes", "must be a power of two in [512, 65536]")
    need(
        c.write_policy in get_args(WritePolicyName),
        "write_policy",
        "must be 'write-back', 'write-through' or 'selective'",
    )
    need(c.write_after_hits >= 1, "write_after_hits", "must be >= 1")
    need(0.0 < c.flush_watermark <= 1.0, "flush_watermark", "must be in (0, 1]")
    need(1 <= c.io_threads <= 64, "io_threads", "must be in [1, 64]")
    need(c.probe_interval_s > 0, "probe_interval_s", "must be > 0")
    if c.disk_dir:
        need(c.disk_bytes > 0, "disk_bytes", "must be > 0 with disk_dir")
        need(c.disk_file_bytes >= h.slab_bytes, "disk_file_bytes", "must hold a slab")


def cluster_tier(c: ClusterTierConfig, t: TenancyConfig) -> None:
    """The cluster's URL, fleet key file (read here) and realm when configured, and its bounds."""
    if c.cluster:
        try:
            from kvtierd.tiers.cluster.settings import parse_url

            parse_url(c.cluster)
        except ValueError as e:
            raise ValueError(str(e)) from None
        from kvtierd.tiers.cluster.keys import check_realm_name, read_fleet_key

        read_fleet_key(c.cluster_fleet_key_file)  # ValueError naming cluster_fleet_key_file
        need(
            bool(c.cluster_realm) or bool(t.tenants_file),
            "cluster_realm",
            "required with cluster without a tenants_file: the name of this deployment's trust "
            "domain (e.g. its namespace and name); daemons of one fleet key and realm serve each "
            "other's values, so give every deployment whose engines do not trust each other its "
            "own (docs/cluster.md)",
        )
        need(
            not (c.cluster_realm and t.tenants_file),
            "cluster_realm",
            "not with a tenants_file: each tenant is its own realm in the cluster",
        )
        if c.cluster_realm:
            check_realm_name(c.cluster_realm)  # ValueError naming cluster_realm
    need(
        c.cluster_write_policy in get_args(ClusterWritePolicy),
        "cluster_write_policy",
        "must be 'commit' or 'evict'",
    )
    need(c.cluster_ttl_s >= 0.001, "cluster_ttl_s", "must be >= 0.001")
    for name in ("cluster_lookup_timeout_ms", "cluster_fetch_timeout_ms", "cluster_write_timeout_ms"):
        need(getattr(c, name) > 0, name, "must be > 0")
    need(c.cluster_queue_bytes >= 0, "cluster_queue_bytes", "must be >= 0")
    need(c.cluster_inflight_bytes >= 1 << 20, "cluster_inflight_bytes", "must be >= 1MiB")
    need(c.cluster_breaker_s > 0, "cluster_breaker_s", "must be > 0")


def tenancy(c: TenancyConfig) -> None:
    need(c.tenant_arena_bytes > 0, "tenant_arena_bytes", "must be > 0")


def events(c: EventsConfig, g: GrpcConfig, t: TenancyConfig) -> None:
    """The ``events_*`` settings (the endpoints' syntax; binding them is the daemon's)."""
    need(c.events_buffer_batches >= 1, "events_buffer_batches", "must be >= 1")
    need(c.events_queue_blocks >= 1, "events_queue_blocks", "must be >= 1")
    _events_bounds(c)
    for name in ("events_endpoint", "events_replay_endpoint"):
        _node_events_endpoint(name, getattr(c, name), g)
    need(
        not c.events_replay_endpoint or bool(c.events_endpoint),
        "events_replay_endpoint",
        "needs events_endpoint",
    )
    for name in ("events_tenant_endpoint", "events_tenant_replay_endpoint"):
        value = getattr(c, name)
        need(
            not value or value.startswith("ipc://") and "{tenant}" in value,
            name,
            f"expected ipc://PATH with {{tenant}} in it, got {value!r}",
        )
    need(
        not c.events_tenant_endpoint or bool(t.tenants_file), "events_tenant_endpoint", "needs a tenants_file"
    )
    need(
        not c.events_tenant_replay_endpoint or bool(c.events_tenant_endpoint),
        "events_tenant_replay_endpoint",
        "needs events_tenant_endpoint",
    )


def _events_bounds(c: EventsConfig) -> None:
    """The bytes, queues and connections the publisher may hold (docs/events.md §4)."""
    need(
        c.events_block_hashes in ("int64", "bytes"),
        "events_block_hashes",
        f'expected "int64" or "bytes", got {c.events_block_hashes!r}',
    )
    h = c.events_heartbeat_s
    need(h == 0 or 0.05 <= h <= 3600, "events_heartbeat_s", f"must be 0 (never) or 0.05..3600, got {h!r}")
    m = c.events_max_message_bytes
    need(16 << 10 <= m <= 16 << 20, "events_max_message_bytes", "must be in 16KiB..16MiB")
    need(
        c.events_stream_buffer_bytes >= m,
        "events_stream_buffer_bytes",
        f"must be >= events_max_message_bytes ({m})",
    )
    need(
        c.events_buffer_bytes >= c.events_stream_buffer_bytes,
        "events_buffer_bytes",
        f"must be >= events_stream_buffer_bytes ({c.events_stream_buffer_bytes})",
    )
    need(c.events_replay_max_bytes >= 1 << 10, "events_replay_max_bytes", "must be >= 1KiB")
    need(c.events_send_queue_messages >= 2, "events_send_queue_messages", "must be >= 2")
    need(c.events_max_connections >= 1, "events_max_connections", "must be >= 1")
    need(
        0o600 <= c.events_socket_mode <= 0o777 and c.events_socket_mode & 0o600 == 0o600,
        "events_socket_mode",
        f"expected an octal mode with the owner's rw bits (0o600), got {c.events_socket_mode!r}",
    )


def _node_events_endpoint(name: str, value: str, g: GrpcConfig) -> None:
    """A node-wide event stream's endpoint ``name`` ("" = off): ipc://, or tcp:// only with
    ``allow_plaintext_remote`` (loopback too: every local user reaches it)."""
    if not value:
        return
    need(
        value.startswith(("tcp://", "ipc://")), name, f"expected ipc://PATH or tcp://HOST:PORT, got {value!r}"
    )
    need(
        not value.startswith("tcp://") or g.allow_plaintext_remote,
        name,
        f"{value}: ZMQ events are plaintext and unauthenticated, and a tcp:// endpoint (loopback "
        "too) reaches every local user or the network; they carry every tenant's block keys and "
        "token ids: use ipc:// (owner-only by default), or set allow_plaintext_remote = true "
        "(--allow-plaintext-remote; docs/events.md §5)",
    )


def unknown_keys(extra: dict[str, Any]) -> None:
    """No unknown key (a file's, or an override's): ValueError naming the first, with the
    setting it was probably meant to be (difflib), and the others."""
    if not extra:
        return
    first, *others = sorted(extra)
    more = f"; also unknown: {', '.join(others)}" if others else ""
    raise ValueError(f"{first}: unknown setting ({nearest_key(first)}){more}")


def nearest_key(name: str) -> str:
    """What an unknown key ``name`` (``key`` or ``section.key``) was probably meant to be."""
    section, _, key = name.rpartition(".")
    if section and key in GROUP_OF:
        return f"{key} belongs in [{GROUP_OF[key]}], or unsectioned"
    close = difflib.get_close_matches(key, list(GROUP_OF), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    return "docs/configuration.md and kvtierd serve --help list the settings"


def host_port(name: str, value: str) -> None:
    """``value`` ("" = off) is HOST:PORT with a port in 0..65535."""
    if value:
        host, sep, port = value.rpartition(":")
        need(
            bool(sep and host) and port.isdigit() and int(port) <= 65535,
            name,
            f"expected HOST:PORT with a port in 0..65535 (0: the OS picks one), got {value!r}",
        )


def is_loopback(hostport: str) -> bool:
    """Whether HOST:PORT binds a loopback address only: "localhost" or a literal loopback
    address (127.0.0.0/8, ::1); a host name that merely starts with "127." is not one."""
    host = hostport.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

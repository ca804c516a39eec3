"""Daemon configuration: data, validated once.

``DaemonConfig()`` is the embedded default that ``make serve`` runs (1 GiB host tier, gRPC on an
owner-only Unix socket under ./run/ and no TCP gRPC listener, the data channel on 127.0.0.1,
Prometheus metrics). Only the CLI reads files and
the environment; it builds a ``DaemonConfig`` with :func:`load_config` and :func:`with_overrides`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from kvtier_contract import defaults
from kvtier_contract.units import parse_bytes
from kvtierd.policies import PolicyName, WritePolicyName

ClusterWritePolicy = Literal["commit", "evict"]
VerifyStore = Literal["client", "daemon"]

_SIZE_FIELDS = ("host_bytes", "slab_bytes", "slot_align_bytes", "disk_bytes", "io_align_bytes",
                "disk_file_bytes", "data_max_queued_bytes", "cluster_queue_bytes",
                "cluster_inflight_bytes", "tenant_arena_bytes")
# Annotation (a string, see the __future__ import) -> accepted runtime types; bool is never an int.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "bool": (bool,), "str": (str,),
}


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon needs; defaults are the embedded configuration."""

    host_bytes: int = 1 << 30
    """Size of the host tier (one memfd arena). Rounded down to a whole number of slabs."""
    allow_host_bytes_over_available: bool = False
    """Start even when the arenas (host_bytes plus the tenants') exceed the memory available
    less 256 MiB (MemAvailable, the memory cgroup's headroom); off: refused at start."""
    slab_bytes: int = 64 << 20
    """Arena unit handed to a size class; the largest block a namespace may have."""
    slot_align_bytes: int = 4096
    """Every slot starts on this alignment (page-aligned for GPU registration and O_DIRECT)."""
    eviction_policy: PolicyName = "lru"
    """Host-tier eviction order: "lru" or "arc"."""
    prefault: bool = True
    """Allocate the arena's pages at start (fallocate) so that the first copies do not fault."""
    socket_path: str = defaults.SOCKET_PATH
    """gRPC Unix socket for same-host clients ("" disables). The shm fd socket sits beside it;
    ``<socket>.lock`` beside both is held while the daemon runs (one daemon per socket)."""
    socket_mode: int = 0o600
    """Mode of the Unix sockets (gRPC and shm; created owner-only, then set to this): 0o600 lets
    only the daemon's user connect. 0o660 lets its group in too (engines running as other uids:
    the Kubernetes manifests), with a tenants file to tell them apart (docs/security.md)."""
    listen: str = defaults.LISTEN
    """gRPC TCP listener HOST:PORT ("" disables, the default: TCP reaches every local user,
    the Unix socket only its owner; port 0 picks a free port)."""
    data_listen: str = "127.0.0.1:0"
    """TCP data channel HOST:PORT (port 0 picks a free port; advertised in OpenSession)."""
    shm_enabled: bool = True
    """Hand the arena fd to same-host clients (the shm transport)."""
    handshake_timeout_s: float = 5.0
    """A data connection must send HELLO, and an shm fd request its handshake, within this;
    otherwise it is closed."""
    data_idle_timeout_s: float = 300.0
    """A data connection that receives no frame and whose peer takes no queued reply byte for
    this long is closed (its queued replies dropped, their pins released)."""
    data_max_connections: int = 1024
    """Most open data connections; one more is answered ERROR and closed at once (but a
    connection still waiting for its HELLO is closed to make room: see below)."""
    data_max_unauthenticated: int = 64
    """Most data connections that have not yet sent a valid HELLO; one more closes the oldest of
    them (ERROR), as does a new connection when ``data_max_connections`` are open and some are
    still waiting: connections that prove no session never keep a client out."""
    data_max_connections_per_tenant: int = 0
    """Most data connections (control connections included) bound to the sessions of one tenant
    (a daemon with a tenants file); one more is answered ERROR at its HELLO. 0: half of
    ``data_max_connections``. A single-tenant daemon has no per-tenant cap."""
    data_max_queued_bytes: int = 16 << 20
    """A data connection stops reading while more reply bytes than this wait to be sent."""
    shm_max_connections: int = 128
    """Most shm fd handshakes in progress at once; one more is closed at once."""
    shm_handshakes_per_uid: int = 16
    """Most shm socket handshakes in progress at once from one peer uid (SO_PEERCRED), within
    ``shm_max_connections``; one more is refused at once, so one local user's half-open
    connections never lock another's handshakes out."""
    control_channel: bool = True
    """Serve sessions' control calls (Prepare*/Complete*, Lookup, Heartbeat...) as framed
    protobufs besides gRPC, on the shm socket and on the TCP data port (docs/shm_transport.md
    "The control channel", docs/tcp_data_channel.md "Control connections")."""
    publish_index: bool = True
    """Publish a namespace's index read-only in shared memory once a same-host client asks for
    it (over the shm socket): its lookups then need no round trip (docs/published_index.md).
    Costs 16-32 bytes of shared memory per block of such a namespace and ~1 µs of daemon
    time per block committed or evicted there. Needs shm_enabled."""
    publish_index_idle_s: float = 30.0
    """A published index that no client's index channel has read for this long is retired
    (and built anew on the next request)."""
    cuda_ipc: bool = False
    """Offer the cuda_ipc transport: the daemon opens clients' CUDA buffers by IPC handle and
    copies between them and the arena itself. Needs cupy (the daemon's ``kvtierd[cuda]`` extra)
    and a visible GPU; the arena is page-locked at start. Off: the daemon never touches CUDA."""
    verify_bytes: bool = True
    """Bytes verified end to end (docs/security.md): every block gets an xxh3_64 digest at its
    commit, sent with every load for the client to check (a mismatch is a miss, counted in
    ``corrupt_blocks``, and the block is dropped) and written as its NVMe payload checksum."""
    verify_store: VerifyStore = "client"
    """Who hashes an shm store: "client" (the SDK hashes each block as it copies it into its
    slot and sends the digests in CompleteStore; a client without them falls back to
    "daemon") or "daemon" (the daemon hashes the slots at CompleteStore, off the event loop;
    0.60-0.71x of the unverified shm put here: docs/benchmarks.md §18). tcp stores are hashed
    by the daemon as they arrive, cuda_ipc stores at CompleteStore."""
    metrics_host: str = "127.0.0.1"
    """Prometheus /metrics bind address (0.0.0.0 to be scraped from other hosts: /metrics is
    plaintext HTTP, so a non-loopback one needs ``metrics_plaintext_remote``)."""
    metrics_port: int = 9464
    """Prometheus /metrics port (-1 disables, 0 picks a free port)."""
    lease_ttl_s: float = 10.0
    """Default session lease; a session silent for longer loses its reservations and pins."""
    min_lease_ttl_s: float = 0.2
    """Shortest lease a client may ask for (shorter requests are raised to this)."""
    max_lease_ttl_s: float = 300.0
    """Longest lease a client may ask for (longer requests are lowered to this)."""
    lease_sweep_s: float = 0.1
    """How often expired leases are collected."""
    max_batch_blocks: int = 4096
    """Most keys in one Lookup / PrepareStore / PrepareLoad (more is RESOURCE_EXHAUSTED)."""
    max_sessions: int = 4096
    """Most open sessions; one more OpenSession is RESOURCE_EXHAUSTED."""
    max_namespaces: int = 1024
    """Most registered namespaces; one more RegisterNamespace is RESOURCE_EXHAUSTED."""
    namespace_idle_s: float = 3600.0
    """A namespace that holds no block and that no RPC (and no published-index reader) has
    named for this long is forgotten, freeing its place in the table (a client that names it
    again is told NOT_FOUND and registers it again; the SDK does so by itself). 0: never."""
    max_inflight_rpcs: int = 64
    """Most Kvtier requests in progress at once (those waiting on NVMe flushes, promotions or
    CUDA copies); one more is RESOURCE_EXHAUSTED at once. Health is never refused."""
    drain_timeout_s: float = 5.0
    """On SIGTERM: how long in-flight jobs may take to finish before the daemon exits anyway."""
    disk_dir: str = ""
    """NVMe tier directory ("" disables the tier). Block files, journal and checkpoint live here."""
    disk_optional: bool = False
    """Start with the host tier alone when the NVMe tier cannot be opened (the tier opens once
    it can, see probe_interval_s); off: such a start is refused."""
    disk_bytes: int = 0
    """NVMe tier size (preallocated block files); required with disk_dir."""
    io_align_bytes: int = 4096
    """NVMe slot alignment and header size (power of two, 512..65536; 16 KiB works too)."""
    disk_file_bytes: int = 1 << 30
    """Size of one block file (the tier is split into files of this size, at most)."""
    write_policy: WritePolicyName = "write-back"
    """When blocks reach NVMe: "write-back" (before host eviction; default), "write-through"
    (every stored block), "selective" (at its write_after_hits-th hit)."""
    write_after_hits: int = 2
    """selective write-through: hits before a block is written to NVMe."""
    flush_watermark: float = 0.8
    """write-back: host occupancy above which the coldest blocks are written to NVMe."""
    io_threads: int = 4
    """Threads doing NVMe reads and writes (the event loop never blocks on disk)."""
    probe_interval_s: float = 2.0
    """While the NVMe tier is degraded (disk full, I/O error): how often it tries to recover."""
    cluster: str = ""
    """Cluster tier: ``redis://HOST:PORT[,HOST:PORT…]`` (``rediss://`` for TLS) of a Redis or
    Valkey Cluster shared by the daemons of many nodes ("" disables; docs/cluster.md)."""
    cluster_username: str = ""
    """ACL user for the cluster ("" = the default user)."""
    cluster_password_file: str = ""
    """File holding the cluster password (first line; "" = none). Never logged."""
    cluster_fleet_key_file: str = ""
    """File holding the fleet key, as hex (at least 32 bytes: ``openssl rand -hex 32``), that the
    daemons of one fleet share: every value written to the cluster carries a MAC under it (per
    tenant, a key derived from it), and a value whose MAC fails is a miss. Required with
    ``cluster`` (a daemon refuses to start without it). Never logged (docs/cluster.md)."""
    cluster_tls_ca: str = ""
    """rediss://: CA bundle to verify the cluster's certificates ("" = the system's)."""
    cluster_tls_cert: str = ""
    """rediss://: client certificate, when the cluster requires one."""
    cluster_tls_key: str = ""
    """rediss://: the client certificate's key."""
    cluster_write_policy: ClusterWritePolicy = "commit"
    """Which blocks are written to the cluster: "commit" (every stored block, after the local
    commit) or "evict" (a block leaving the host tier that the cluster does not hold yet)."""
    cluster_ttl_s: float = 86400.0
    """Expiry of a block in the cluster (``SET … PX``); the cluster's LRU may drop it earlier."""
    cluster_lookup_timeout_ms: float = 30.0
    """The cluster part of a lookup (pipelined EXISTS): an answer not there in time is a miss."""
    cluster_fetch_timeout_ms: float = 500.0
    """Reading blocks found only in the cluster into the host tier: late ones are misses."""
    cluster_write_timeout_ms: float = 2000.0
    """One batch of writes to the cluster; late ones are dropped (counted)."""
    cluster_queue_bytes: int = 256 << 20
    """Bytes waiting to be written to the cluster at most (and at most a quarter of
    host_bytes); more is dropped (counted). With the "commit" policy these blocks stay in the
    host tier (pinned) until written or dropped."""
    cluster_inflight_bytes: int = 64 << 20
    """Bytes read or written to the cluster at once (one round of pipelines), at most."""
    cluster_breaker_s: float = 1.0
    """A cluster node that fails or answers late is skipped (its keys miss) for this long,
    doubling while it keeps failing (at most 8x)."""
    tls_cert: str = ""
    """PEM certificate (chain) of the gRPC TCP listener: with ``tls_key``, ``listen`` serves
    TLS only (docs/security.md)."""
    tls_key: str = ""
    """PEM private key of ``tls_cert``."""
    tls_client_ca: str = ""
    """PEM CA bundle: client certificates it signed are verified, and their identities
    (common name, DNS names) may be tenants' credentials (``mtls_names``). "" = none asked."""
    tls_require_client_cert: bool = False
    """mTLS: a TLS client without a certificate signed by ``tls_client_ca`` is refused."""
    allow_plaintext_remote: bool = False
    """Bind ``listen`` or ``data_listen`` on a non-loopback address without TLS (the data
    channel has no TLS yet). Off: such a configuration is refused at start; on: a warning at
    every start."""
    metrics_plaintext_remote: bool = False
    """Serve /metrics (plaintext HTTP) on a non-loopback ``metrics_host``. With tenants, only
    scrape tokens (the tenants file's ``metrics_tokens_sha256``) are accepted there. Off (and
    ``allow_plaintext_remote`` off): such a ``metrics_host`` is refused at start."""
    health_listen: str = ""
    """HOST:PORT of a listener serving only the gRPC health service, plaintext (kubelet
    ``grpc:`` probes reach the pod IP and speak no TLS); "" = none."""
    reflection: str = "unix"
    """gRPC server reflection: "unix" (on the Unix socket only), "all", or "off"."""
    tenants_file: str = ""
    """Tenants file (TOML: tenants, their token digests, Unix peers and quotas;
    docs/security.md). "" = single-tenant: no credential asked. Re-read on SIGHUP."""
    tenant_arena_bytes: int = 256 << 20
    """Size of the host arena of its own that each tenant allowed shm or cuda_ipc gets, when
    the tenants file names neither its ``arena_bytes`` nor a ``host_bytes`` quota (rounded down
    to whole slabs, at least one). The host tier holds ``host_bytes`` (the shared arena:
    single-tenant daemons and tcp-only tenants) plus every tenant's arena."""
    events_endpoint: str = ""
    """KV events (docs/events.md): the ZMQ PUB endpoint of the operator stream, every tenant's
    blocks (``tcp://127.0.0.1:5557``, ``ipc:///run/kvtier/events.sock``); "" = off (the
    default). Needs the ``events`` extra (pyzmq, msgpack)."""
    events_replay_endpoint: str = ""
    """ZMQ ROUTER endpoint answering replay requests of the operator stream ("" = none)."""
    events_tenant_endpoint: str = ""
    """Per-tenant PUB endpoints: an ``ipc://`` path with ``{tenant}`` in it, e.g.
    ``ipc:///run/kvtier/events-{tenant}.sock``; a tenant's stream carries its blocks only. ""
    = none."""
    events_tenant_replay_endpoint: str = ""
    """Per-tenant replay endpoints (``ipc://`` with ``{tenant}``); needs events_tenant_endpoint."""
    events_topic: str = ""
    """The topic frame of every event message (vLLM's default: "")."""
    events_buffer_batches: int = 10_000
    """Messages (batches) each stream keeps for replay. >= 1."""
    events_queue_blocks: int = 1 << 20
    """Blocks waiting to be published, at most; past it a record is dropped (counted in
    ``kvtier_event_blocks_dropped_total``) rather than slowing a request. >= 1."""
    run_dir: str = "run"
    """Directory of the shm fd socket when the gRPC Unix socket is disabled."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Unknown keys are rejected; this stays empty (reserved for forward compatibility)."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def shm_socket_path(self) -> str:
        """Unix socket that hands the arena fd to shm clients (beside the gRPC socket)."""
        base = self.socket_path or str(Path(self.run_dir) / "kvtier.sock")
        return base + ".shm"


def validate(cfg: DaemonConfig) -> None:
    """Raise ValueError naming the field for any inconsistent value."""

    def need(cond: bool, name: str, msg: str) -> None:
        if not cond:
            raise ValueError(f"{name}: {msg}")

    # Types first: a config file can hold anything, and a str where an int belongs must be a
    # ValueError naming the field, not a TypeError from a comparison below.
    for f in dataclasses.fields(cfg):
        kinds = _FIELD_TYPES.get(str(f.type))
        value = getattr(cfg, f.name)
        if kinds is not None:
            need(isinstance(value, kinds) and (f.type == "bool" or not isinstance(value, bool)),
                 f.name, f"expected {f.type}, got {type(value).__name__} {value!r}")
    need(cfg.slot_align_bytes > 0 and cfg.slot_align_bytes & (cfg.slot_align_bytes - 1) == 0,
         "slot_align_bytes", "must be a power of two")
    need(cfg.slab_bytes >= cfg.slot_align_bytes and cfg.slab_bytes % cfg.slot_align_bytes == 0,
         "slab_bytes", "must be a positive multiple of slot_align_bytes")
    need(cfg.host_bytes >= cfg.slab_bytes, "host_bytes", "must hold at least one slab")
    need(cfg.tenant_arena_bytes > 0, "tenant_arena_bytes", "must be > 0")
    need(cfg.eviction_policy in get_args(PolicyName), "eviction_policy", "must be 'lru' or 'arc'")
    need(cfg.min_lease_ttl_s > 0, "min_lease_ttl_s", "must be > 0")
    need(cfg.max_lease_ttl_s >= cfg.min_lease_ttl_s, "max_lease_ttl_s",
         "must be >= min_lease_ttl_s")
    need(cfg.min_lease_ttl_s <= cfg.lease_ttl_s <= cfg.max_lease_ttl_s,
         "lease_ttl_s", "must satisfy min_lease_ttl_s <= lease_ttl_s <= max_lease_ttl_s")
    need(cfg.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
    need(cfg.lease_sweep_s > 0, "lease_sweep_s", "must be > 0")
    need(1 <= cfg.max_batch_blocks <= 1 << 16, "max_batch_blocks", "must be in [1, 65536]")
    need(cfg.max_sessions >= 1, "max_sessions", "must be >= 1")
    need(cfg.max_namespaces >= 1, "max_namespaces", "must be >= 1")
    need(cfg.namespace_idle_s >= 0, "namespace_idle_s", "must be >= 0 (0: never)")
    need(cfg.handshake_timeout_s > 0, "handshake_timeout_s", "must be > 0")
    need(cfg.data_idle_timeout_s > 0, "data_idle_timeout_s", "must be > 0")
    need(cfg.data_max_connections >= 1, "data_max_connections", "must be >= 1")
    need(cfg.data_max_queued_bytes >= 0, "data_max_queued_bytes", "must be >= 0")
    need(cfg.shm_max_connections >= 1, "shm_max_connections", "must be >= 1")
    need(cfg.shm_handshakes_per_uid >= 1, "shm_handshakes_per_uid", "must be >= 1")
    need(cfg.data_max_unauthenticated >= 1, "data_max_unauthenticated", "must be >= 1")
    need(0 <= cfg.data_max_connections_per_tenant <= cfg.data_max_connections,
         "data_max_connections_per_tenant", "must be in [0, data_max_connections] (0: half)")
    need(cfg.publish_index_idle_s >= 0, "publish_index_idle_s", "must be >= 0")
    need(cfg.max_inflight_rpcs >= 1, "max_inflight_rpcs", "must be >= 1")
    need(-1 <= cfg.metrics_port <= 65535, "metrics_port", "must be -1 (off) or a port")
    need(bool(cfg.socket_path or cfg.listen), "listen", "need a Unix socket or a TCP listener")
    need(0o600 <= cfg.socket_mode <= 0o777 and cfg.socket_mode & 0o600 == 0o600, "socket_mode",
         f"expected a file mode with the owner's read and write, 0o600..0o777 (e.g. 0o600, "
         f"0o660), got {cfg.socket_mode!r}")
    need(not cfg.extra, "extra", f"unknown keys {sorted(cfg.extra)}")
    a = cfg.io_align_bytes
    need(512 <= a <= 65536 and a & (a - 1) == 0, "io_align_bytes",
         "must be a power of two in [512, 65536]")
    need(cfg.write_policy in get_args(WritePolicyName), "write_policy",
         "must be 'write-back', 'write-through' or 'selective'")
    need(cfg.write_after_hits >= 1, "write_after_hits", "must be >= 1")
    need(0.0 < cfg.flush_watermark <= 1.0, "flush_watermark", "must be in (0, 1]")
    need(1 <= cfg.io_threads <= 64, "io_threads", "must be in [1, 64]")
    need(cfg.probe_interval_s > 0, "probe_interval_s", "must be > 0")
    if cfg.cluster:
        try:
            from kvtierd.tiers.cluster.settings import parse_url

            parse_url(cfg.cluster)
        except ValueError as e:
            raise ValueError(str(e)) from None
        from kvtierd.tiers.cluster.keys import read_fleet_key

        read_fleet_key(cfg.cluster_fleet_key_file)  # ValueError naming cluster_fleet_key_file
    need(cfg.verify_store in get_args(VerifyStore), "verify_store",
         "must be 'client' or 'daemon'")
    need(cfg.cluster_write_policy in get_args(ClusterWritePolicy), "cluster_write_policy",
         "must be 'commit' or 'evict'")
    need(cfg.cluster_ttl_s >= 0.001, "cluster_ttl_s", "must be >= 0.001")
    for name in ("cluster_lookup_timeout_ms", "cluster_fetch_timeout_ms",
                 "cluster_write_timeout_ms"):
        need(getattr(cfg, name) > 0, name, "must be > 0")
    need(cfg.cluster_queue_bytes >= 0, "cluster_queue_bytes", "must be >= 0")
    need(cfg.cluster_inflight_bytes >= 1 << 20, "cluster_inflight_bytes", "must be >= 1MiB")
    need(cfg.cluster_breaker_s > 0, "cluster_breaker_s", "must be > 0")
    _validate_events(cfg, need)
    if cfg.disk_dir:
        need(cfg.disk_bytes > 0, "disk_bytes", "must be > 0 with disk_dir")
        need(cfg.disk_file_bytes >= cfg.slab_bytes, "disk_file_bytes", "must hold a slab")
    for name in ("listen", "data_listen", "health_listen"):
        value = getattr(cfg, name)
        if value:
            host, sep, port = value.rpartition(":")
            need(bool(sep and host) and port.isdigit() and int(port) <= 65535, name,
                 f"expected HOST:PORT with a port in 0..65535 (0: the OS picks one), got {value!r}")
    need(bool(cfg.tls_cert) == bool(cfg.tls_key), "tls_key", "tls_cert and tls_key go together")
    need(not cfg.tls_client_ca or bool(cfg.tls_cert), "tls_client_ca", "needs tls_cert/tls_key")
    need(not cfg.tls_require_client_cert or bool(cfg.tls_client_ca), "tls_require_client_cert",
         "needs tls_client_ca")
    # gRPC asks a client for a certificate only when it requires one: with an optional one, a
    # client's certificate would never reach the daemon and its mtls_names tenant never match
    need(not cfg.tls_client_ca or cfg.tls_require_client_cert, "tls_client_ca",
         "gRPC does not ask for optional client certificates (they would be ignored): set "
         "tls_require_client_cert = true for mTLS, or leave tls_client_ca out and use tokens")
    need(cfg.reflection in ("unix", "all", "off"), "reflection", "must be 'unix', 'all' or 'off'")
    if not cfg.allow_plaintext_remote:
        need(not cfg.listen or bool(cfg.tls_cert) or is_loopback(cfg.listen), "listen",
             f"{cfg.listen} is not a loopback address: serve TLS there (tls_cert, tls_key) or "
             "set allow_plaintext_remote = true (--allow-plaintext-remote)")
        need(not cfg.data_listen or bool(cfg.tls_cert) or is_loopback(cfg.data_listen),
             "data_listen", f"{cfg.data_listen} is not a loopback address: serve TLS there "
             "(tls_cert, tls_key: the data channel uses the gRPC listener's) or set "
             "allow_plaintext_remote = true (--allow-plaintext-remote)")
    need(cfg.metrics_port < 0 or cfg.metrics_plaintext_remote or cfg.allow_plaintext_remote
         or is_loopback(f"{cfg.metrics_host}:{cfg.metrics_port}"), "metrics_host",
         f"{cfg.metrics_host} is not a loopback address and /metrics is plaintext HTTP: set "
         "metrics_plaintext_remote = true (--allow-plaintext-metrics; with tenants, scrape tokens "
         "only), or allow_plaintext_remote = true (--allow-plaintext-remote: every token, and "
         "plaintext gRPC), or bind it to loopback (metrics_host = \"127.0.0.1\")")
    # (the scrape token /metrics then needs with tenants: kvtierd.tenancy.exposure, once the
    # tenants file is read)


def _validate_events(cfg: DaemonConfig, need: Any) -> None:
    """The ``events_*`` settings (the endpoints' syntax; binding them is the daemon's)."""
    need(cfg.events_buffer_batches >= 1, "events_buffer_batches", "must be >= 1")
    need(cfg.events_queue_blocks >= 1, "events_queue_blocks", "must be >= 1")
    for name in ("events_endpoint", "events_replay_endpoint"):
        value = getattr(cfg, name)
        if not value:
            continue
        need(value.startswith(("tcp://", "ipc://")), name,
             f"expected tcp://HOST:PORT or ipc://PATH, got {value!r}")
        if value.startswith("tcp://") and not cfg.allow_plaintext_remote:
            need(is_loopback(value.removeprefix("tcp://")), name,
                 f"{value} is not a loopback address and ZMQ events are plaintext, unauthenticated"
                 " and carry every tenant's block keys: use ipc:// or loopback, or set "
                 "allow_plaintext_remote = true (docs/security.md)")
    need(not cfg.events_replay_endpoint or bool(cfg.events_endpoint), "events_replay_endpoint",
         "needs events_endpoint")
    for name in ("events_tenant_endpoint", "events_tenant_replay_endpoint"):
        value = getattr(cfg, name)
        need(not value or value.startswith("ipc://") and "{tenant}" in value, name,
             f"expected ipc://PATH with {{tenant}} in it, got {value!r}")
    need(not cfg.events_tenant_endpoint or bool(cfg.tenants_file), "events_tenant_endpoint",
         "needs a tenants_file")
    need(not cfg.events_tenant_replay_endpoint or bool(cfg.events_tenant_endpoint),
         "events_tenant_replay_endpoint", "needs events_tenant_endpoint")


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


def _coerce(raw: dict[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(DaemonConfig)} - {"extra"}
    out: dict[str, Any] = {}
    unknown: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key not in known:
            unknown[key] = value
        elif key in _SIZE_FIELDS:
            out[key] = parse_bytes(value, field=key)
        else:
            out[key] = value
    if unknown:
        out["extra"] = unknown
    return out


def load_config(path: str | Path | None) -> DaemonConfig:
    """The embedded default, or a TOML/JSON file's values over it (sizes may be "1GiB")."""
    if path is None:
        return DaemonConfig()
    p = Path(path)
    text = p.read_text()
    raw = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: expected a table of DaemonConfig fields, got {type(raw).__name__}")
    if "kvtierd" in raw and isinstance(raw["kvtierd"], dict):
        raw = raw["kvtierd"]
    return DaemonConfig(**_coerce(raw))


def with_overrides(cfg: DaemonConfig, **overrides: Any) -> DaemonConfig:
    """A copy with the non-None overrides applied (and validated)."""
    values = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(cfg, **_coerce(values))

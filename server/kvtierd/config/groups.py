"""The daemon's settings, one frozen dataclass per component (data only; checked by
:mod:`kvtierd.config.checks` when a :class:`~kvtierd.config.DaemonConfig` is built).

Each field keeps the name of its key in a config file and its flag (``host_bytes``,
``--host-bytes``): a flat file names every key once, whatever its group (:data:`GROUP_OF`).
Immutable; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from kvtier_contract import defaults
from kvtierd.policies import PolicyName, WritePolicyName

ClusterWritePolicy = Literal["commit", "evict"]
VerifyStore = Literal["client", "daemon"]

SIZE_FIELDS = (
    "host_bytes",
    "slab_bytes",
    "slot_align_bytes",
    "disk_bytes",
    "io_align_bytes",
    "disk_file_bytes",
    "data_max_queued_bytes",
    "cluster_queue_bytes",
    "cluster_inflight_bytes",
    "tenant_arena_bytes",
    "events_stream_buffer_bytes",
    "events_buffer_bytes",
    "events_max_message_bytes",
    "events_replay_max_bytes",
)
"""Keys whose values may be written as sizes ("1GiB") in files and overrides."""


@dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    """The host tier: the shared memfd arena, its slabs and slots, its eviction order."""

    host_bytes: int = 1 << 30
    """Size of the host tier (one memfd arena). Rounded down to a whole number of slabs."""
    allow_host_bytes_over_available: bool = False
    """Start even when the arenas (host_bytes plus the tenants') exceed the memory available
    less 256 MiB (MemAvailable, the memory cgroup's headroom); off: refused at start."""
    slab_bytes: int = 64 << 20
    """Arena unit handed to a size class; the largest block a namespace may have."""
    slot_align_bytes: int = 4096
    """Every slot starts on this alignment (page-aligned for GPU registration and O_DIRECT)."""
    eviction_policy: PolicyName = "prefix"
    """Host-tier eviction order: "prefix" (LRU that keeps key chains whole: a chain's tail goes
    before its head, orphaned blocks first), "lru" or "arc". The NVMe tier evicts copies
    prefix-aware with "prefix", by LRU otherwise."""
    prefault: bool = True
    """Allocate the arena's pages at start (fallocate) so that the first copies do not fault."""


@dataclass(frozen=True, kw_only=True)
class NvmeTierConfig:
    """The NVMe tier: its directory, size, layout, write policy and I/O threads."""

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


@dataclass(frozen=True, kw_only=True)
class ClusterTierConfig:
    """The cluster tier (a Redis or Valkey Cluster shared by a fleet; docs/cluster.md)."""

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
    cluster_realm: str = ""
    """Without a tenants file: the name of this daemon's trust domain in the cluster (e.g. the
    Kubernetes namespace and Deployment, ``ml-prod.llama-70b``; letters, digits, ``.``, ``_``,
    ``-``). Daemons of one fleet key share values only within one realm: every engine that
    reaches a daemon of a realm can write values that all its daemons serve. Required with
    ``cluster`` when there is no tenants file; refused with one (each tenant is its own realm;
    docs/cluster.md)."""
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


@dataclass(frozen=True, kw_only=True)
class GrpcConfig:
    """The gRPC server: its Unix socket and TCP listeners, TLS, reflection, the health listener;
    ``allow_plaintext_remote`` also governs the data channel, /metrics and KV events."""

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
    health_listen: str = ""
    """HOST:PORT of a listener serving only the gRPC health service, plaintext (kubelet
    ``grpc:`` probes reach the pod IP and speak no TLS); "" = none."""
    reflection: str = "unix"
    """gRPC server reflection: "unix" (on the Unix socket only), "all", or "off"."""
    run_dir: str = "run"
    """Directory of the shm fd socket when the gRPC Unix socket is disabled."""


@dataclass(frozen=True, kw_only=True)
class TransportsConfig:
    """The data transports (tcp data channel, shm, cuda_ipc), the control channel, the
    published index and end-to-end byte verification."""

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


@dataclass(frozen=True, kw_only=True)
class SessionsConfig:
    """Sessions and namespaces: leases, how many, when an idle namespace is forgotten."""

    lease_ttl_s: float = 10.0
    """Default session lease; a session silent for longer loses its reservations and pins."""
    min_lease_ttl_s: float = 0.2
    """Shortest lease a client may ask for (shorter requests are raised to this)."""
    max_lease_ttl_s: float = 300.0
    """Longest lease a client may ask for (longer requests are lowered to this)."""
    lease_sweep_s: float = 0.1
    """How often expired leases are collected."""
    max_sessions: int = 4096
    """Most open sessions; one more OpenSession is RESOURCE_EXHAUSTED."""
    max_namespaces: int = 1024
    """Most registered namespaces; one more RegisterNamespace is RESOURCE_EXHAUSTED."""
    namespace_idle_s: float = 3600.0
    """A namespace that holds no block and that no RPC (and no published-index reader) has
    named for this long is forgotten, freeing its place in the table (a client that names it
    again is told NOT_FOUND and registers it again; the SDK does so by itself). 0: never."""


@dataclass(frozen=True, kw_only=True)
class RequestsConfig:
    """Requests: batch size, how many at once, how long a drain waits for them."""

    max_batch_blocks: int = 4096
    """Most keys in one Lookup / PrepareStore / PrepareLoad (more is RESOURCE_EXHAUSTED)."""
    max_inflight_rpcs: int = 64
    """Most Kvtier requests in progress at once (those waiting on NVMe flushes, promotions or
    CUDA copies); one more is RESOURCE_EXHAUSTED at once. Health is never refused."""
    drain_timeout_s: float = 5.0
    """On SIGTERM: how long in-flight jobs may take to finish before the daemon exits anyway."""


@dataclass(frozen=True, kw_only=True)
class TenancyConfig:
    """Tenants: the tenants file and the size of a tenant's own arena."""

    tenants_file: str = ""
    """Tenants file (TOML: tenants, their token digests, Unix peers and quotas;
    docs/security.md). "" = single-tenant: no credential asked. Re-read on SIGHUP."""
    tenant_arena_bytes: int = 256 << 20
    """Size of the host arena of its own that each tenant allowed shm or cuda_ipc gets, when
    the tenants file names neither its ``arena_bytes`` nor a ``host_bytes`` quota (rounded down
    to whole slabs, at least one). The host tier holds ``host_bytes`` (the shared arena:
    single-tenant daemons and tcp-only tenants) plus every tenant's arena."""


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Prometheus /metrics."""

    metrics_host: str = "127.0.0.1"
    """Prometheus /metrics bind address (0.0.0.0 to be scraped from other hosts: /metrics is
    plaintext HTTP, so a non-loopback one needs ``metrics_plaintext_remote``)."""
    metrics_port: int = 9464
    """Prometheus /metrics port (-1 disables, 0 picks a free port)."""
    metrics_plaintext_remote: bool = False
    """Serve /metrics (plaintext HTTP) on a non-loopback ``metrics_host``. With tenants, only
    scrape tokens (the tenants file's ``metrics_tokens_sha256``) are accepted there. Off (and
    ``allow_plaintext_remote`` off): such a ``metrics_host`` is refused at start."""


@dataclass(frozen=True, kw_only=True)
class EventsConfig:
    """KV events (docs/events.md): ZMQ endpoints of the operator's and tenants' streams."""

    events_endpoint: str = ""
    """KV events (docs/events.md): the ZMQ PUB endpoint of the operator stream, every tenant's
    blocks (``ipc:///run/kvtier-events/events.sock``); "" = off (the default). A ``tcp://``
    one, loopback included, reaches every local user: refused unless
    ``allow_plaintext_remote``. Needs the ``events`` extra (pyzmq, msgpack)."""
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
    events_block_hashes: Literal["int64", "bytes"] = "int64"
    """How block keys go on the wire: ``int64``, each key's low 64 bits as an unsigned integer
    (what vLLM sends by default and what routers' indexers decode: Dynamo's refuses ``bin``
    hashes), or ``bytes``, the whole 32-byte key (a subscriber that asks the daemon about
    keys)."""
    events_heartbeat_s: float = 2.0
    """A stream with nothing to send for this long sends its last seq again with no events
    (not buffered): a router that joined or reconnected since, or follows a restarted daemon,
    sees its gap and replays within this time, not at the next store. 0: never; else
    0.05..3600."""
    events_buffer_batches: int = 10_000
    """Messages (batches) each stream keeps for replay, at most (the bytes below bound it
    first). >= 1."""
    events_stream_buffer_bytes: int = 4 << 20
    """Bytes each stream's replay buffer keeps, at most (a tenant's stream: at most its
    ``buffered_bytes`` quota too); past it the oldest messages are dropped (counted).
    >= events_max_message_bytes."""
    events_buffer_bytes: int = 64 << 20
    """Bytes all replay buffers keep together, at most; past it the stream holding the most
    drops its oldest messages first (counted). >= events_stream_buffer_bytes."""
    events_max_message_bytes: int = 128 << 10
    """Largest message (batch) sent: batches are split by bytes (a chain of blocks in two where
    it must). 16KiB..16MiB."""
    events_replay_max_bytes: int = 1 << 20
    """Largest replay answer (the messages from the seq asked; at least one): a subscriber asks
    again from where it stopped. >= 1KiB."""
    events_send_queue_messages: int = 16
    """Messages queued for one subscriber or replay requester, at most (ZMQ's send
    high-water mark); a subscriber that falls further behind loses messages and replays them.
    >= 2."""
    events_max_connections: int = 8
    """Connections each event socket (a stream's PUB, its replay ROUTER) takes at once; one
    more is refused at its handshake (counted). >= 1."""
    events_socket_mode: int = 0o600
    """Mode of the ``ipc://`` event sockets (made private, then set to this before they
    appear). With a tenants file, a mode that lets the engines' group (the daemon's gRPC
    socket's) or every user connect is refused where they can enter the directory."""
    events_queue_blocks: int = 1 << 20
    """Blocks waiting to be published, at most; past it a record is dropped (counted in
    ``kvtier_event_blocks_dropped_total``) rather than slowing a request. >= 1."""


GROUPS: dict[str, type] = {
    "host_tier": HostTierConfig,
    "nvme_tier": NvmeTierConfig,
    "cluster_tier": ClusterTierConfig,
    "grpc": GrpcConfig,
    "transports": TransportsConfig,
    "sessions": SessionsConfig,
    "requests": RequestsConfig,
    "tenancy": TenancyConfig,
    "metrics": MetricsConfig,
    "events": EventsConfig,
}
"""DaemonConfig's group attribute -> its dataclass, in DaemonConfig's order."""
GROUP_OF: dict[str, str] = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
"""Flat key (a field of one group) -> the group that holds it."""

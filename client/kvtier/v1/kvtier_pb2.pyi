from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_TCP: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_NONE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATUS_UNSPECIFIED: _ClassVar[StoreStatus]
    STORE_RESERVED: _ClassVar[StoreStatus]
    STORE_ALREADY_PRESENT: _ClassVar[StoreStatus]
    STORE_REJECTED: _ClassVar[StoreStatus]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_TCP: Transport
TRANSPORT_CUDA_IPC: Transport
TIER_NONE: Tier
TIER_HOST: Tier
TIER_NVME: Tier
STORE_STATUS_UNSPECIFIED: StoreStatus
STORE_RESERVED: StoreStatus
STORE_ALREADY_PRESENT: StoreStatus
STORE_REJECTED: StoreStatus

class NamespaceSpec(_message.Message):
    __slots__ = ("model_id", "model_revision", "tokenizer_digest", "kv_dtype", "layout", "tokens_per_block", "num_layers", "num_kv_heads", "head_dim", "tp_size", "tp_rank", "pp_size", "pp_rank", "adapter_id", "adapter_revision", "cache_salt", "tenant")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    tokenizer_digest: str
    kv_dtype: str
    layout: str
    tokens_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    adapter_id: str
    adapter_revision: str
    cache_salt: str
    tenant: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., tokens_per_block: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., adapter_id: _Optional[str] = ..., adapter_revision: _Optional[str] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("spec", "digest")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    digest: bytes
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class RegisterNamespaceReply(_message.Message):
    __slots__ = ("boot_epoch", "namespace_id", "block_bytes", "digest")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    namespace_id: int
    block_bytes: int
    digest: bytes
    def __init__(self, boot_epoch: _Optional[int] = ..., namespace_id: _Optional[int] = ..., block_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "lease_ttl_ms", "transport")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    lease_ttl_ms: int
    transport: Transport
    def __init__(self, client_name: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("boot_epoch", "session_id", "lease_ttl_ms", "shm_socket", "data_port", "data_host", "arena_bytes", "max_batch_blocks")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    session_id: int
    lease_ttl_ms: int
    shm_socket: str
    data_port: int
    data_host: str
    arena_bytes: int
    max_batch_blocks: int
    def __init__(self, boot_epoch: _Optional[int] = ..., session_id: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., shm_socket: _Optional[str] = ..., data_port: _Optional[int] = ..., data_host: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., max_batch_blocks: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("boot_epoch", "lease_ttl_ms")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    lease_ttl_ms: int
    def __init__(self, boot_epoch: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("boot_epoch",)
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    def __init__(self, boot_epoch: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "pin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    namespace_id: int
    keys: bytes
    pin: bool
    def __init__(self, session_id: _Optional[int] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., pin: _Optional[bool] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("boot_epoch", "hit_blocks", "tiers", "job_id", "offsets")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    hit_blocks: int
    tiers: bytes
    job_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, boot_epoch: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., tiers: _Optional[bytes] = ..., job_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "transport")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    namespace_id: int
    keys: bytes
    transport: Transport
    def __init__(self, session_id: _Optional[int] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class PrepareStoreReply(_message.Message):
    __slots__ = ("boot_epoch", "job_id", "status", "offsets")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    job_id: int
    status: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, boot_epoch: _Optional[int] = ..., job_id: _Optional[int] = ..., status: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CompleteStoreRequest(_message.Message):
    __slots__ = ("session_id", "job_id", "ok", "item_ok")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ITEM_OK_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    job_id: int
    ok: bool
    item_ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, session_id: _Optional[int] = ..., job_id: _Optional[int] = ..., ok: _Optional[bool] = ..., item_ok: _Optional[_Iterable[bool]] = ...) -> None: ...

class CompleteStoreReply(_message.Message):
    __slots__ = ("boot_epoch", "committed", "aborted")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    committed: int
    aborted: int
    def __init__(self, boot_epoch: _Optional[int] = ..., committed: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("session_id", "namespace_id", "keys", "transport")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    namespace_id: int
    keys: bytes
    transport: Transport
    def __init__(self, session_id: _Optional[int] = ..., namespace_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class PrepareLoadReply(_message.Message):
    __slots__ = ("boot_epoch", "job_id", "found", "offsets", "tiers")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    job_id: int
    found: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    tiers: bytes
    def __init__(self, boot_epoch: _Optional[int] = ..., job_id: _Optional[int] = ..., found: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class CompleteLoadRequest(_message.Message):
    __slots__ = ("session_id", "job_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    job_id: int
    def __init__(self, session_id: _Optional[int] = ..., job_id: _Optional[int] = ...) -> None: ...

class CompleteLoadReply(_message.Message):
    __slots__ = ("boot_epoch",)
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    def __init__(self, boot_epoch: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Counters(_message.Message):
    __slots__ = ("lookups", "blocks_requested", "blocks_hit_host", "blocks_hit_nvme", "blocks_missed", "tokens_requested", "tokens_hit", "tokens_missed", "stores_accepted", "stores_already_present", "stores_rejected", "stores_dropped", "loads", "evictions", "bytes_in_shm", "bytes_out_shm", "bytes_in_tcp", "bytes_out_tcp", "resident_blocks", "resident_bytes")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HIT_HOST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HIT_NVME_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_MISSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_HIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MISSED_FIELD_NUMBER: _ClassVar[int]
    STORES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STORES_ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    STORES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    STORES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_SHM_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_SHM_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_TCP_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_TCP_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    blocks_requested: int
    blocks_hit_host: int
    blocks_hit_nvme: int
    blocks_missed: int
    tokens_requested: int
    tokens_hit: int
    tokens_missed: int
    stores_accepted: int
    stores_already_present: int
    stores_rejected: int
    stores_dropped: int
    loads: int
    evictions: int
    bytes_in_shm: int
    bytes_out_shm: int
    bytes_in_tcp: int
    bytes_out_tcp: int
    resident_blocks: int
    resident_bytes: int
    def __init__(self, lookups: _Optional[int] = ..., blocks_requested: _Optional[int] = ..., blocks_hit_host: _Optional[int] = ..., blocks_hit_nvme: _Optional[int] = ..., blocks_missed: _Optional[int] = ..., tokens_requested: _Optional[int] = ..., tokens_hit: _Optional[int] = ..., tokens_missed: _Optional[int] = ..., stores_accepted: _Optional[int] = ..., stores_already_present: _Optional[int] = ..., stores_rejected: _Optional[int] = ..., stores_dropped: _Optional[int] = ..., loads: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in_shm: _Optional[int] = ..., bytes_out_shm: _Optional[int] = ..., bytes_in_tcp: _Optional[int] = ..., bytes_out_tcp: _Optional[int] = ..., resident_blocks: _Optional[int] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model_id", "model_revision", "block_bytes", "counters")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    model_id: str
    model_revision: str
    block_bytes: int
    counters: Counters
    def __init__(self, namespace_id: _Optional[int] = ..., model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., block_bytes: _Optional[int] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("boot_epoch", "uptime_s", "total", "namespaces", "host_capacity_bytes", "host_used_bytes", "sessions", "leases_expired", "pinned_blocks", "writing_blocks", "eviction_policy")
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    boot_epoch: int
    uptime_s: float
    total: Counters
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    host_capacity_bytes: int
    host_used_bytes: int
    sessions: int
    leases_expired: int
    pinned_blocks: int
    writing_blocks: int
    eviction_policy: str
    def __init__(self, boot_epoch: _Optional[int] = ..., uptime_s: _Optional[float] = ..., total: _Optional[_Union[Counters, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., host_capacity_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., leases_expired: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., writing_blocks: _Optional[int] = ..., eviction_policy: _Optional[str] = ...) -> None: ...

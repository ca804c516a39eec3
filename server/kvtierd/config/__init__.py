"""The daemon's configuration as data: :class:`DaemonConfig`, one frozen dataclass per
component (:mod:`~kvtierd.config.groups`), checked once per group
(:mod:`~kvtierd.config.checks`) when built; :mod:`~kvtierd.config.daemon` reads files (flat or
sectioned) and flat overrides into one. Immutable; any thread.
"""

from kvtierd.config.checks import is_loopback
from kvtierd.config.daemon import DaemonConfig, flat_field, flat_keys, load_config, validate, with_overrides
from kvtierd.config.groups import (
    GROUP_OF,
    GROUPS,
    SIZE_FIELDS,
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

__all__ = [
    "GROUPS",
    "GROUP_OF",
    "SIZE_FIELDS",
    "ClusterTierConfig",
    "ClusterWritePolicy",
    "DaemonConfig",
    "EventsConfig",
    "GrpcConfig",
    "HostTierConfig",
    "MetricsConfig",
    "NvmeTierConfig",
    "RequestsConfig",
    "SessionsConfig",
    "TenancyConfig",
    "TransportsConfig",
    "VerifyStore",
    "flat_field",
    "flat_keys",
    "is_loopback",
    "load_config",
    "validate",
    "with_overrides",
]

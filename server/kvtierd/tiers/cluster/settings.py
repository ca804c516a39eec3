"""Settings of the cluster tier, and what its callers need without importing redis-py.

``parse_url`` validates a ``cluster`` URL (the daemon's config does, at load); ``FETCH_*`` are
the per-key answers of ``ClusterTier.fetch``. Pure data, thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtierd.tiers.base import FETCH_CORRUPT, FETCH_MISS, FETCH_OK

__all__ = ["FETCH_CORRUPT", "FETCH_MISS", "FETCH_OK", "ClusterSettings", "Credentials", "parse_url"]


@dataclass(frozen=True)
class Credentials:
    """How to reach the cluster: user, password, TLS files ("" = not used)."""

    username: str = ""
    password: str = ""
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    connect_timeout_s: float = 0.5


@dataclass(frozen=True)
class ClusterSettings:
    """Config of the cluster tier (built from DaemonConfig's ``cluster_*`` fields)."""

    seeds: tuple[str, ...]
    fleet_key: bytes = field(default=b"", repr=False)
    """The fleet key (kvtierd.tiers.cluster.keys; at least 32 bytes, the tier refuses less).
    Never logged."""
    tenanted: bool = False
    """The daemon has a tenants file: a namespace's values are in its tenant's realm (without
    one, every namespace's are in the untenanted realm of ``realm``, whatever ``tenant`` it
    names)."""
    realm: str = ""
    """Without tenants: the ``cluster_realm``, the trust domain whose daemons share values."""
    creds: Credentials = field(default_factory=Credentials)
    write_policy: str = "commit"
    ttl_s: float = 86400.0
    lookup_timeout_s: float = 0.03
    fetch_timeout_s: float = 0.5
    write_timeout_s: float = 2.0
    queue_bytes: int = 256 << 20
    inflight_bytes: int = 64 << 20
    breaker_s: float = 1.0
    refresh_s: float = 2.0


def parse_url(url: str) -> tuple[tuple[str, ...], bool]:
    """``redis://h:p[,h:p…]`` or ``rediss://…`` (TLS) -> (seed addresses, tls)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise ValueError(f"cluster: expected redis://HOST:PORT[,HOST:PORT…] or rediss://…, got {url!r}")
    seeds = []
    for part in rest.rstrip("/").split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster: expected HOST:PORT, got {part!r} in {url!r}")
        seeds.append(f"{host}:{int(port)}")
    return tuple(seeds), scheme == "rediss"

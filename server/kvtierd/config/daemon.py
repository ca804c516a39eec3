"""The daemon's configuration: :class:`DaemonConfig`, its groups (:mod:`kvtierd.config.groups`),
validated once when built, and how files and overrides become one.

``DaemonConfig()`` is the embedded default that ``make serve`` runs (1 GiB host tier, gRPC on an
owner-only Unix socket under ./run/ and no TCP gRPC listener, the data channel on 127.0.0.1,
Prometheus metrics). Only the CLI reads files and the environment; it builds a
``DaemonConfig`` with :func:`load_config` and :func:`with_overrides`. A file names its keys flat
(``host_bytes = "2GiB"``, as ever) or in sections named after the groups (``[host_tier]``,
``host_bytes = "2GiB"``), or both (each key once). Immutable; any thread.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_contract.units import parse_bytes
from kvtierd.config import checks as check
from kvtierd.config.groups import (
    GROUP_OF,
    GROUPS,
    SIZE_FIELDS,
    ClusterTierConfig,
    EventsConfig,
    GrpcConfig,
    HostTierConfig,
    MetricsConfig,
    NvmeTierConfig,
    RequestsConfig,
    SessionsConfig,
    TenancyConfig,
    TransportsConfig,
)


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon needs, one group per component; defaults are the embedded
    configuration. Build one from flat keys with :meth:`from_flat` or :func:`with_overrides`."""

    host_tier: HostTierConfig = field(default_factory=HostTierConfig)
    nvme_tier: NvmeTierConfig = field(default_factory=NvmeTierConfig)
    cluster_tier: ClusterTierConfig = field(default_factory=ClusterTierConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    transports: TransportsConfig = field(default_factory=TransportsConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    requests: RequestsConfig = field(default_factory=RequestsConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Unknown keys are rejected; this stays empty (reserved for forward compatibility)."""

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_flat(cls, **values: Any) -> DaemonConfig:
        """The defaults with flat keys (``host_bytes=…``) set, each in its group (values as
        given: no size parsing); TypeError for a key no group has."""
        unknown = sorted(set(values) - set(GROUP_OF) - {"extra"})
        if unknown:
            raise TypeError(f"DaemonConfig has no field {unknown[0]!r} ({check.nearest_key(unknown[0])})")
        return dataclasses.replace(cls(), **_grouped(cls(), values))

    @property
    def shm_socket_path(self) -> str:
        """Unix socket that hands the arena fd to shm clients (beside the gRPC socket)."""
        base = self.grpc.socket_path or str(Path(self.grpc.run_dir) / "kvtier.sock")
        return base + ".shm"


def validate(cfg: DaemonConfig) -> None:
    """Raise ValueError naming the field for any inconsistent value (the types of every group
    first, then each group's checks)."""
    check.unknown_keys(cfg.extra)  # a misspelt key first: the rest may follow from it
    for name in GROUPS:
        check.types(getattr(cfg, name))
    check.host_tier(cfg.host_tier)
    check.tenancy(cfg.tenancy)
    check.sessions(cfg.sessions)
    check.requests(cfg.requests)
    check.grpc(cfg.grpc)
    check.transports(cfg.transports, cfg.grpc)
    check.network_clients(cfg.grpc, cfg.transports, cfg.tenancy)
    check.metrics(cfg.metrics, cfg.grpc)
    check.nvme_tier(cfg.nvme_tier, cfg.host_tier)
    check.cluster_tier(cfg.cluster_tier, cfg.tenancy)
    check.events(cfg.events, cfg.grpc, cfg.tenancy)


def flat_keys() -> list[str]:
    """Every key a flat file (or an override) may name, in the groups' order."""
    return list(GROUP_OF)


def flat_field(name: str) -> dataclasses.Field[Any] | None:
    """The dataclass field of flat key ``name`` (its default, its type), or None."""
    group = GROUP_OF.get(name)
    if group is None:
        return None
    return next(f for f in dataclasses.fields(GROUPS[group]) if f.name == name)


def _grouped(cfg: DaemonConfig, values: dict[str, Any]) -> dict[str, Any]:
    """DaemonConfig's keyword arguments: ``cfg``'s groups with the flat ``values`` set (and
    ``extra``, when ``values`` holds it)."""
    per_group: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "extra":
            out["extra"] = value
        else:
            per_group.setdefault(GROUP_OF[key], {})[key] = value
    for group, changes in per_group.items():
        out[group] = dataclasses.replace(getattr(cfg, group), **changes)
    return out


def _coerce(raw: dict[str, Any]) -> dict[str, Any]:
    """Flat keys (dashes allowed) -> field values (sizes parsed); unknown ones under "extra"."""
    out: dict[str, Any] = {}
    unknown: dict[str, Any] = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key not in GROUP_OF:
            unknown[key] = value
        elif key in SIZE_FIELDS:
            out[key] = parse_bytes(value, field=key)
        else:
            out[key] = value
    if unknown:
        out["extra"] = unknown
    return out


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """A file's table with its sections (``[host_tier]``...) flattened; a key of another group
    in a section is unknown (``section.key``), a key given twice a ValueError."""
    pairs: list[tuple[str, Any]] = []
    for key, value in raw.items():
        section = key.replace("-", "_")
        if section in GROUPS and isinstance(value, dict):
            for name, item in value.items():
                name = name.replace("-", "_")
                pairs.append((name if GROUP_OF.get(name) == section else f"{section}.{name}", item))
        else:
            pairs.append((section, value))
    flat: dict[str, Any] = {}
    for name, item in pairs:
        if name in flat:
            raise ValueError(f"{name}: given twice")
        flat[name] = item
    return flat


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
    cfg = DaemonConfig()
    return dataclasses.replace(cfg, **_grouped(cfg, _coerce(_flatten(raw))))


def with_overrides(cfg: DaemonConfig, **overrides: Any) -> DaemonConfig:
    """A copy with the non-None flat overrides applied (and validated)."""
    values = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(cfg, **_grouped(cfg, _coerce(values)))

"""The tenants file: who the tenants are, how each is known and what each may hold (read at
start and re-read on SIGHUP; the model it builds is :mod:`kvtierd.tenants`).

A tenants file (TOML; config as data; re-read on SIGHUP) names every tenant (docs/security.md)::

    [[tenant]]
    name = "team-a"
    tokens_sha256 = ["<64 hex: sha256 of a bearer token>", ...]   # several: rotation
    unix_uids = [1000]          # shm handshakes only from these uids/gids ([] = any)
    unix_gids = []
    unix_login = false          # true: a Unix peer with one of these uids/gids is this tenant
                                # without a token (it logs in on the shm socket: SO_PEERCRED)
    mtls_names = ["team-a.kvtier"]   # client certificates (CN or DNS name) that are this tenant
    operator = false            # an operator sees and may act on every tenant's namespaces
    transports = ["tcp"]        # transports its sessions may use (default: all)
    arena_bytes = "8GiB"        # a tenant allowed shm or cuda_ipc gets a host arena of its
                                # own, the only memory its engines map (default: its
                                # host_bytes quota, else the daemon's tenant_arena_bytes);
                                # tcp-only tenants live in the shared arena, mapped by no one
    max_lease_s = 30.0          # longest lease its sessions get (default: the daemon's
                                # max_lease_ttl_s): how long a dead engine's pins can linger
    [tenant.quotas]             # absent: the daemon's default, a fair share (docs/security.md)
    sessions = 64
    namespaces = 16
    open_jobs = 256             # store and load jobs (pinned lookups included) of all sessions
    session_open_jobs = 64      # ... of one session
    host_bytes = "8GiB"         # its resident blocks in the host tier (over it: its own
                                # coldest blocks are evicted first)
    pinned_bytes = "2GiB"       # blocks held by its open loads and pinned lookups
    nvme_bytes = "100GiB"       # its blocks in the NVMe tier (over it: its own coldest copies
                                # there are evicted first, else the block is not written down)
    buffered_bytes = "32MiB"    # control frames received and not yet answered, replies unread
    control_channels = 64       # open control channels, all its sessions

groups of tenants, each the owner of the namespaces that name it (``Namespace.group``: a
system prompt its tenants share, stored once; docs/hashing.md §7)::

    [[group]]
    name = "acme-shared"        # no tenant's name
    publishers = ["team-a"]     # the only tenants that store into its namespaces
    members = ["team-b"]        # look them up and load their blocks (publishers do too)
    arena_bytes = "2GiB"        # when a reader maps memory (shm, cuda_ipc): the group's host
                                # arena, which its readers map read-only (default: its
                                # host_bytes quota, else the daemon's tenant_arena_bytes)
    [group.quotas]              # only namespaces, host_bytes, nvme_bytes: charged to the
    host_bytes = "1GiB"         # group, not to its readers (absent: a tenant's fair share)

and, at the top (before the first ``[[tenant]]``), the scrape-only tokens::

    metrics_tokens_sha256 = ["<64 hex>", ...]   # /metrics only (several: rotation)

A scrape token is no tenant's: /metrics answers it with every figure (what the operator's token
sees, ``process_*`` included; never keys or bytes), and everything else (every gRPC call, so no
session and no handshake) refuses it exactly like an unknown token. A digest is either a scrape
token's or a tenant's, never both.
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, TypeGuard

from kvtier_contract import wire
from kvtier_contract.units import parse_bytes
from kvtierd.tenants import MAPPING_TRANSPORTS, TRANSPORTS, Quotas, Tenant, Tenants

__all__ = ["GROUP_QUOTAS", "MAX_NAME_CHARS", "MIN_BUFFERED_BYTES", "NAME_RULE", "is_name", "load_tenants"]

MAX_NAME_CHARS = 128
NAME_RULE = f"a non-empty string of at most {MAX_NAME_CHARS} characters"
"""What a tenant's or a group's name is (a published prefix's name too: kvtierd.tenancy.prefixes)."""

_QUOTAS = (
    "sessions",
    "namespaces",
    "open_jobs",
    "session_open_jobs",
    "host_bytes",
    "pinned_bytes",
    "nvme_bytes",
    "buffered_bytes",
    "control_channels",
)
_BYTE_QUOTAS = ("host_bytes", "pinned_bytes", "nvme_bytes", "buffered_bytes")
GROUP_QUOTAS = ("namespaces", "host_bytes", "nvme_bytes")
"""The quotas a group can reach (its namespaces and their blocks); the rest are its members'."""
_TENANT_KEYS = {
    "name",
    "tokens_sha256",
    "unix_uids",
    "unix_gids",
    "operator",
    "quotas",
    "transports",
    "mtls_names",
    "max_lease_s",
    "arena_bytes",
    "unix_login",
}
MIN_BUFFERED_BYTES = wire.CONTROL_MAX_BYTES + wire.CALL.size
"""The least ``buffered_bytes`` quota: one whole control frame."""


def load_tenants(path: str | Path) -> Tenants:
    """Parse and validate a tenants file; ValueError naming the field at fault."""
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"tenants_file: cannot read {p}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"tenants_file: {p} is not valid TOML: {e}") from None
    _no_unknown(raw, {"tenant", "group", "metrics_tokens_sha256"}, "tenants_file")
    entries = raw.get("tenant", [])
    if not isinstance(entries, list) or not entries:
        raise ValueError("tenant: expected at least one [[tenant]] table")
    seen_tokens: set[bytes] = set()
    scrape = _digests(raw.get("metrics_tokens_sha256", []), "metrics_tokens_sha256", seen_tokens)
    tenants: list[Tenant] = []
    for i, entry in enumerate(entries):
        tenants.append(_tenant(entry, f"tenant[{i}]", seen_tokens))
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"tenant: names must be unique, got {names}")
    login_uids: dict[int, str] = {}
    for i, t in enumerate(tenants):
        for u in t.unix_uids if t.unix_login else ():
            if u in login_uids:
                raise ValueError(f"tenant[{i}].unix_uids: uid {u} already logs in as tenant {login_uids[u]}")
            login_uids[u] = t.name
    return Tenants(tenants + _groups(raw.get("group", []), names), str(p), tuple(scrape))


def is_name(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a name as the file takes one: :data:`NAME_RULE`."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS


def _groups(entries: Any, tenants: list[str]) -> list[Tenant]:
    """The ``[[group]]`` tables: each a name no tenant or other group has, its publishers and
    members (tenants of this file; a publisher reads too) and its quotas (only those a group
    can reach: it has namespaces and blocks, never a session)."""
    if not isinstance(entries, list):
        raise ValueError("group: expected [[group]] tables")
    taken, out = set(tenants), []
    for i, entry in enumerate(entries):
        where = f"group[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a table")
        _no_unknown(entry, {"name", "members", "publishers", "quotas", "arena_bytes"}, where)
        name = entry.get("name")
        if not is_name(name):
            raise ValueError(f"{where}.name: expected {NAME_RULE}")
        if name in taken:
            raise ValueError(f"{where}.name: {name!r} is already a tenant's or a group's name")
        taken.add(name)
        publishers = _tenant_names(entry, where, "publishers", tenants)
        members = _tenant_names(entry, where, "members", tenants)
        if not publishers:
            raise ValueError(f"{where}.publishers: at least one tenant (the only ones that store its blocks)")
        quotas = entry.get("quotas", {})
        if isinstance(quotas, dict):
            _no_unknown(quotas, set(GROUP_QUOTAS), f"{where}.quotas")
        arena = _arena_bytes(entry, where)
        out.append(
            Tenant(
                name,
                quotas=_quotas(quotas, f"{where}.quotas"),
                transports=frozenset({"tcp"}),
                group=True,
                members=members | publishers,
                publishers=publishers,
                arena_bytes=arena,
            )
        )
    return out


def _tenant_names(entry: dict[str, Any], where: str, role: str, tenants: list[str]) -> frozenset[str]:
    listed = entry.get(role, [])
    if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
        raise ValueError(f"{where}.{role}: expected a list of tenant names")
    unknown = sorted(set(listed) - set(tenants))
    if unknown:
        raise ValueError(f"{where}.{role}: no tenant named {', '.join(map(repr, unknown))}")
    return frozenset(listed)


def _digests(raw: Any, where: str, seen: set[bytes]) -> list[bytes]:
    """A list of token digests (64 hex digits each), none seen before (``seen`` grows)."""
    if not isinstance(raw, list):
        raise ValueError(f"{where}: expected a list of 64-hex-digit digests (`kvtierd hash-token`)")
    digests: list[bytes] = []
    for j, h in enumerate(raw):
        try:
            d = bytes.fromhex(h) if isinstance(h, str) else b""
        except ValueError:
            d = b""
        if len(d) != 32:
            raise ValueError(
                f"{where}[{j}]: expected 64 hex digits (sha256 of the token: `kvtierd hash-token`)"
            )
        if d in seen:
            raise ValueError(
                f"{where}[{j}]: the same token twice (a token is one tenant's, or "
                "a scrape token: metrics_tokens_sha256, never both)"
            )
        seen.add(d)
        digests.append(d)
    return digests


def _tenant(entry: Any, where: str, seen_tokens: set[bytes]) -> Tenant:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a table")
    if "metrics_tokens_sha256" in entry:
        raise ValueError(
            f"{where}.metrics_tokens_sha256: scrape tokens are no tenant's: write "
            "the list at the top of the file, before the first [[tenant]]"
        )
    _no_unknown(entry, _TENANT_KEYS, where)
    name = entry.get("name")
    if not is_name(name):
        raise ValueError(f"{where}.name: expected {NAME_RULE}")
    digests = _digests(entry.get("tokens_sha256", []), f"{where}.tokens_sha256", seen_tokens)
    ids, operator, names, unix_login = _credentials(entry, where, digests)
    transports, max_lease, arena = _allowances(entry, where)
    return Tenant(
        name,
        tuple(digests),
        ids["unix_uids"],
        ids["unix_gids"],
        operator,
        _quotas(entry.get("quotas", {}), f"{where}.quotas"),
        frozenset(transports),
        frozenset(names),
        None if max_lease is None else float(max_lease),
        arena,
        unix_login,
    )


def _credentials(
    entry: dict[str, Any], where: str, digests: list[bytes]
) -> tuple[dict[str, frozenset[int]], bool, list[str], bool]:
    """How a tenant is known besides its token digests: its Unix peers, whether it is the
    operator, its mTLS names, whether its Unix peers log in without a token; at least one."""
    ids: dict[str, frozenset[int]] = {}
    for key in ("unix_uids", "unix_gids"):
        values = entry.get(key, [])
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
        ):
            raise ValueError(f"{where}.{key}: expected a list of non-negative integers")
        ids[key] = frozenset(values)
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise ValueError(f"{where}.operator: expected true or false")
    names = entry.get("mtls_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{where}.mtls_names: expected a list of non-empty strings")
    unix_login = entry.get("unix_login", False)
    if not isinstance(unix_login, bool):
        raise ValueError(f"{where}.unix_login: expected true or false")
    if unix_login and not ids["unix_uids"] and not ids["unix_gids"]:
        raise ValueError(
            f"{where}.unix_login: needs unix_uids or unix_gids (the peers that log in as this tenant)"
        )
    if not digests and not names and not unix_login:
        raise ValueError(
            f"{where}.tokens_sha256: at least one token, mtls_names entry or "
            "unix_login (a tenant is known only by its credential)"
        )
    return ids, operator, names, unix_login


def _allowances(entry: dict[str, Any], where: str) -> tuple[list[str], Any, int | None]:
    """What a tenant may use besides its quotas: its transports, its longest lease, the size
    of its own arena (only for a tenant allowed shm or cuda_ipc)."""
    transports = entry.get("transports", list(TRANSPORTS))
    if not isinstance(transports, list) or not transports or not all(t in TRANSPORTS for t in transports):
        raise ValueError(f"{where}.transports: expected a non-empty list of {', '.join(TRANSPORTS)}")
    max_lease = entry.get("max_lease_s")
    if max_lease is not None and (
        not isinstance(max_lease, (int, float)) or isinstance(max_lease, bool) or not 0 < max_lease <= 86400
    ):
        raise ValueError(f"{where}.max_lease_s: expected seconds in (0, 86400]")
    arena = _arena_bytes(entry, where)
    if arena is not None:
        if not MAPPING_TRANSPORTS & set(transports):
            raise ValueError(
                f"{where}.arena_bytes: only for a tenant allowed shm or cuda_ipc "
                "(a tcp-only tenant's blocks live in the shared arena)"
            )
    return transports, max_lease, arena


def _arena_bytes(entry: dict[str, Any], where: str) -> int | None:
    """A tenant's or group's ``arena_bytes``: a positive size, or None when absent."""
    arena = entry.get("arena_bytes")
    if arena is None:
        return None
    size = parse_bytes(arena, field=f"{where}.arena_bytes")
    if size <= 0:
        raise ValueError(f"{where}.arena_bytes: expected a positive size")
    return size


def _no_unknown(table: dict[str, Any], known: set[str], where: str) -> None:
    """ValueError naming ``table``'s unknown keys, each with the known key it was probably
    meant to be (a misspelt quota must not pass for no quota)."""
    unknown = sorted(set(table) - known)
    if unknown:
        guesses = [(k, difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)) for k in unknown]
        said = ", ".join(f"{k!r} (did you mean {g[0]!r}?)" if g else repr(k) for k, g in guesses)
        raise ValueError(f"{where}: unknown keys {said}")


def _quotas(raw: Any, where: str) -> Quotas:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table")
    _no_unknown(raw, set(_QUOTAS), where)
    values: dict[str, int] = {}
    for key, v in raw.items():
        if key in _BYTE_QUOTAS:
            v = parse_bytes(v, field=f"{where}.{key}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{where}.{key}: expected a non-negative integer")
        if key == "buffered_bytes" and v < MIN_BUFFERED_BYTES:
            raise ValueError(
                f"{where}.{key}: at least one whole control frame "
                f"({MIN_BUFFERED_BYTES} bytes: 4 MiB and its 9-byte head), or every "
                "large call would close its channel"
            )
        values[key] = v
    return Quotas(**values)

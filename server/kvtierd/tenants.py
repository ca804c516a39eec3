"""Tenants: who a caller is, from credentials only, and what each tenant may hold.

The tenants file that names them is read by :mod:`kvtierd.tenants_file` (its format is there).

A caller presents ``authorization: Bearer <token>`` metadata on every Kvtier RPC, or a client
certificate verified by the TLS listener whose common name or a DNS name is in a tenant's
``mtls_names`` (a token wins when both are there), or a token the daemon minted for its Unix
peer (:class:`UnixLogins`: grpcio does not show a Unix socket's peer credentials to a handler,
so a same-host client proves its uid/gid on the shm socket, where SO_PEERCRED is read, and
presents the token it got there on the gRPC socket); the daemon
keeps only SHA-256 digests and compares them with ``hmac.compare_digest`` against every
tenant's (no early exit), so neither the file nor a timing tells a token. Without a tenants
file the daemon is single-tenant (no credential asked, as before).

Ownership: :class:`Tenants` is immutable; a reload builds a new one and swaps it in (event-loop
thread). Pure data otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from kvtierd.unix_logins import UnixLogins

__all__ = ["MAPPING_TRANSPORTS", "TRANSPORTS", "Quotas", "Tenant", "Tenants", "UnixLogins", "token_digest"]

MAPPING_TRANSPORTS = frozenset({"shm", "cuda_ipc"})
"""Transports whose clients map host memory: their tenants get an arena of their own."""
TRANSPORTS = ("shm", "tcp", "cuda_ipc")


@dataclass(frozen=True)
class Quotas:
    """Per tenant (``session_open_jobs``: per session of it), as the file has them; None = not
    set: the daemon's default applies (kvtierd.tenancy.Tenancy.quota)."""

    sessions: int | None = None
    namespaces: int | None = None
    open_jobs: int | None = None
    session_open_jobs: int | None = None
    host_bytes: int | None = None
    pinned_bytes: int | None = None
    nvme_bytes: int | None = None
    buffered_bytes: int | None = None
    control_channels: int | None = None


@dataclass(frozen=True)
class Tenant:
    """A tenant of the file, or a **group** of its tenants (``group``: a ``[[group]]`` table).
    A group owns namespaces (``Namespace.group``, docs/hashing.md §7) and is charged for their
    blocks as a tenant is for its own, but it is no caller: it has no credential and no
    session; when one of its readers maps memory its blocks live in an arena of its own, which
    they map read-only (else in the shared arena, served over tcp). Its
    ``members`` look its namespaces up and load their blocks; its ``publishers`` (members
    too) are the only tenants that store into them."""

    name: str
    token_sha256: tuple[bytes, ...] = ()
    unix_uids: frozenset[int] = frozenset()
    unix_gids: frozenset[int] = frozenset()
    operator: bool = False
    quotas: Quotas = field(default_factory=Quotas)
    transports: frozenset[str] = frozenset(TRANSPORTS)
    mtls_names: frozenset[str] = frozenset()
    max_lease_s: float | None = None
    arena_bytes: int | None = None  # asked for in the file (see ``maps_memory``)
    unix_login: bool = False  # its unix_uids / unix_gids are a credential (UnixLogins)
    group: bool = False
    members: frozenset[str] = frozenset()  # a group's readers (its publishers among them)
    publishers: frozenset[str] = frozenset()  # a group's writers

    @property
    def maps_memory(self) -> bool:
        """Whether its engines map host memory (shm, cuda_ipc): it then has an arena of its
        own, and none of its sessions is ever handed another."""
        return bool(self.transports & MAPPING_TRANSPORTS)

    def arena_size(self, default: int) -> int:
        """Bytes of its own arena: ``arena_bytes``, else its ``host_bytes`` quota, else
        ``default`` (the daemon's ``tenant_arena_bytes``)."""
        if self.arena_bytes is not None:
            return self.arena_bytes
        return self.quotas.host_bytes if self.quotas.host_bytes is not None else default

    def allows_peer(self, uid: int, gid: int) -> bool:
        """Whether a Unix peer with these credentials may act for this tenant (no list: any)."""
        if not self.unix_uids and not self.unix_gids:
            return True
        return uid in self.unix_uids or gid in self.unix_gids


class Tenants:
    """The tenants of one file; see the module docstring."""

    def __init__(
        self, tenants: list[Tenant], source: str = "", metrics_tokens: tuple[bytes, ...] = ()
    ) -> None:
        self.source = source
        self.metrics_digests = metrics_tokens
        """SHA-256 digests of the scrape-only tokens (``metrics_tokens_sha256``)."""
        self.by_name = {t.name: t for t in tenants}
        self._digests = [(d, t) for t in tenants for d in t.token_sha256]
        self._mtls = {n: t for t in tenants for n in t.mtls_names}
        logins = [t for t in tenants if t.unix_login]
        self._login_uids = {u: t for t in logins for u in t.unix_uids}
        self._login_gids: dict[int, Tenant | None] = {}
        for t in logins:
            for g in t.unix_gids:  # a gid two tenants log in by: neither (ambiguous)
                self._login_gids[g] = None if g in self._login_gids else t

    def __len__(self) -> int:
        return len(self.by_name)

    def maps_memory(self, t: Tenant) -> bool:
        """Whether ``t`` has a host arena of its own: a tenant allowed shm or cuda_ipc, or a
        group one of whose readers is (they map its arena read-only)."""
        if not t.group:
            return t.maps_memory
        return any(m in self.by_name and self.by_name[m].maps_memory for m in t.members)

    def groups_of(self, tenant: str) -> frozenset[str]:
        """The groups ``tenant`` is a member of."""
        return frozenset(g.name for g in self.by_name.values() if g.group and tenant in g.members)

    def reads(self, viewer: str | None, owner: str | None) -> bool:
        """Whether tenant ``viewer`` is a member of group ``owner``."""
        group = self.by_name.get(owner or "")
        return group is not None and group.group and viewer in group.members

    def writes(self, viewer: str | None, owner: str | None) -> bool:
        """Whether tenant ``viewer`` is a publisher of group ``owner``."""
        group = self.by_name.get(owner or "")
        return group is not None and group.group and viewer in group.publishers

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant whose token this is, or None."""
        if not token:
            return None
        return self.by_token_digest(hashlib.sha256(token.encode()).digest())

    def by_token_digest(self, digest: bytes) -> Tenant | None:
        """The tenant whose token has this SHA-256, or None."""
        found: Tenant | None = None
        for d, t in self._digests:  # every one compared: the time does not say which matched
            if hmac.compare_digest(d, digest):
                found = t
        return found

    def is_metrics_token(self, token: str | None) -> bool:
        """Whether ``token`` is a scrape-only token (/metrics, every figure; nothing else)."""
        if not token:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        found = False
        for d in self.metrics_digests:  # every one compared, like by_token_digest
            found |= hmac.compare_digest(d, digest)
        return found

    def by_unix_peer(self, uid: int, gid: int) -> Tenant | None:
        """The ``unix_login`` tenant a Unix peer is (its uid listed, else its gid), or None."""
        t = self._login_uids.get(uid)
        return t if t is not None else self._login_gids.get(gid)

    def by_certificate(self, names: list[str]) -> Tenant | None:
        """The tenant of a verified client certificate (its CN and DNS names), or None."""
        for n in names:
            t = self._mtls.get(n)
            if t is not None:
                return t
        return None


def token_digest(token: str) -> str:
    """What a tenants file holds for ``token`` (``kvtierd hash-token``)."""
    return hashlib.sha256(token.encode()).hexdigest()

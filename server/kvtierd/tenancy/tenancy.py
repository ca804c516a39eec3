"""Tenancy: the one place that decides who a caller is and what its tenant may hold.

Primitives (every entry of the daemon asks these, none decides on its own):

* ``authenticate(token, cert_names)`` -> (tenant, the credential that proved it) or None;
  ``caller_of(token)`` for callers without certificates (/metrics), and
  ``is_metrics_token(token)``, a scrape-only token that /metrics alone accepts;
  ``unix_login(uid, gid)`` mints a token for a Unix peer that logs in (shm socket);
* ``tenant(name)`` (as the current file has it: a removed tenant is None),
  ``allows_peer(tenant, uid, gid)`` (SO_PEERCRED of a handshake against the tenant's Unix ids),
  ``may_see(viewer, owner)`` (a tenant sees its own objects, an operator everyone's);
* ``quota(tenant, name)``: the file's value, else the daemon's default (:meth:`default`):
  quotas are on by default, sized so that no tenant takes more than its share;
  ``check(tenant, name, after)`` refuses (RESOURCE_EXHAUSTED naming the quota) what would pass
  it — the entries count what is held (sessions, jobs, pins: their tables), this decides;
* ``count_refusal(tenant, quota)``: every entry that refuses something by a quota (the gRPC and
  control-channel calls, a control channel's own ``control_channels`` and ``buffered_bytes``,
  a block the NVMe tier does not write for ``nvme_bytes``) counts it here, by the quota's name
  (the error's ``quota`` attribute, never its text); ``refusals(tenant, quota)`` reads it;
* ``reload(tenants)`` swaps the file; ``revoked(sessions)`` names the sessions whose credential
  the current file no longer honours (a removed tenant, a removed token, certificate name or
  Unix login) or whose transport it no longer allows: the daemon closes them, and with them
  their channels, at once.

What a tenant holds is never counted here: the cache's admission (kvtierd.cache.admission) reads
it from its owners' tables, or keeps it where none does (control channels and their bytes, in a
:class:`Ledger` of its own, below), and asks ``check``.

Without a tenants file the daemon is single-tenant: every caller is the one owner (None), no
credential is asked, and only the daemon-wide bounds and ``buffered_bytes`` apply.

Ownership: the daemon (kvtierd.app) owns the one Tenancy; the service, the transports and the
tiers hold it. Event-loop thread, except ``caller_of``, ``is_metrics_token`` and ``tenant``, which
/metrics threads call: they read the current immutable :class:`~kvtierd.tenants.Tenants`,
swapped in one assignment.

:class:`Ledger`: per holder, how much of a bounded resource it holds now, for resources that no
index or table counts already: the cache's admission counts each tenant's control channels and
the bytes they hold (a tenant of None is the single-tenant daemon's one owner); the shm socket
counts handshakes per peer uid, the data port connections per tenant, each in a ledger of its own.
``take(holder, resource, n, limit)`` adds ``n`` if the holder's total stays within ``limit``
(None: no limit) and says True, or changes nothing (False); ``give(holder, resource, n)``
returns them. Owned by whoever made it (the admission, a transport server); event-loop thread
only (``held`` may be read from /metrics threads: a dict read of ints).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtier_contract.errors import FailedPrecondition, PermissionDenied, ResourceExhausted
from kvtierd.domain import Transport
from kvtierd.tenancy.credential import Credential
from kvtierd.tenants import Quotas, Tenant, Tenants, UnixLogins


class Holder(Protocol):
    """What ``revoked`` reads of a session (kvtierd.sessions.Session)."""

    @property
    def tenant(self) -> str | None: ...
    @property
    def credential(self) -> Credential: ...
    @property
    def transport(self) -> Transport: ...


H = TypeVar("H", bound=Holder)

QUOTA_NAMES = tuple(f.name for f in dataclasses.fields(Quotas))
DEFAULT_OPEN_JOBS = 1024
"""Open store and load jobs of one tenant when its file sets none (pins and reservations are
bounded by the byte quotas; this bounds the job table)."""
DEFAULT_SESSION_OPEN_JOBS = 256
DEFAULT_CONTROL_CHANNELS = 64
"""Open control channels of one tenant (the SDK opens at most 4 a session, 1-2 in practice)."""
DEFAULT_BUFFERED_BYTES = 64 << 20
"""Bytes of control frames received but not yet whole, all channels of one tenant (a frame is
at most 4 MiB: 16 channels mid-frame at once)."""


@dataclass(frozen=True)
class Shares:
    """What the daemon shares among its tenants (from DaemonConfig), for the default quotas."""

    max_sessions: int = 4096
    max_namespaces: int = 1024
    shared_arena_bytes: int = 1 << 30
    disk_bytes: int = 0
    tenant_arena_bytes: int = 256 << 20


class Ledger:
    """What each holder holds of bounded resources (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[tuple[Hashable, str], int] = {}

    def take(self, holder: Hashable, resource: str, n: int, limit: int | None) -> bool:
        """Count ``n`` more of ``resource`` against ``holder`` unless that passes ``limit``."""
        assert n >= 0
        key = (holder, resource)
        now = self._held.get(key, 0)
        if limit is not None and now + n > limit:
            return False
        self._held[key] = now + n
        return True

    def give(self, holder: Hashable, resource: str, n: int) -> None:
        """Return ``n`` of ``resource`` that ``holder`` took."""
        key = (holder, resource)
        left = self._held.get(key, 0) - n
        assert left >= 0, (key, n)
        if left:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def held(self, holder: Hashable, resource: str) -> int:
        return self._held.get((holder, resource), 0)

    def total(self, resource: str) -> int:
        return sum(v for (_, r), v in list(self._held.items()) if r == resource)


class Tenancy:
    """See the module docstring."""

    def __init__(self, tenants: Tenants | None, shares: Shares | None = None) -> None:
        self.shares = shares or Shares()
        self.logins = UnixLogins()
        """Tokens minted for Unix peers (the shm socket's login)."""
        self._refusals: dict[tuple[str, str], int] = {}  # (tenant, quota name) -> count
        self._group_refusals: dict[str, int] = {}  # tenant -> stores refused in groups' namespaces
        self._cut_off: set[str] = set()  # tenants the last reload took out of a group
        self._tenants = tenants
        self._defaults: dict[str, dict[str, int | None]] = {}
        if tenants is not None:
            self.reload(tenants)

    @property
    def tenants(self) -> Tenants | None:
        """The current tenants file (None: a single-tenant daemon)."""
        return self._tenants

    # -- who -------------------------------------------------------------------------------------

    def authenticate(
        self, token: str | None, cert_names: Sequence[str] = ()
    ) -> tuple[Tenant, Credential] | None:
        """The tenant a bearer token (a token wins) or a verified client certificate is."""
        tenants = self._tenants
        assert tenants is not None
        if token is not None and token.startswith(UnixLogins.PREFIX):
            minted = self.logins.authenticate(token)
            if minted is None:
                return None
            who = tenants.by_unix_peer(minted[1], minted[2])
            if who is None or who.name != minted[0]:
                return None  # a reload changed who that peer is: no credential any more
            return who, Credential("unix", uid=minted[1], gid=minted[2])
        if token:
            digest = hashlib.sha256(token.encode()).digest()
            found = tenants.by_token_digest(digest)
            if found is not None:
                return found, Credential("token", digest)
        for name in cert_names:
            t = tenants.by_certificate([name])
            if t is not None:
                return t, Credential("cert", name=name)
        return None

    def caller_of(self, token: str | None) -> Tenant | None:
        """The tenant of a bearer token (file or Unix login), or None."""
        found = self.authenticate(token)
        return None if found is None else found[0]

    def is_metrics_token(self, token: str | None) -> bool:
        """Whether ``token`` is a scrape-only token of the current file (``metrics_tokens_sha256``):
        /metrics answers it with every figure; ``authenticate`` never knows it (every gRPC
        call and handshake refuses it as an unknown token)."""
        tenants = self._tenants
        return tenants is not None and tenants.is_metrics_token(token)

    def unix_login(self, uid: int, gid: int) -> str:
        """A token for the tenant that Unix peer ``uid``/``gid`` logs in as (shm socket)."""
        if self._tenants is None:
            raise FailedPrecondition("this daemon has no tenants: no credential is needed", field="login")
        who = self._tenants.by_unix_peer(uid, gid)
        if who is None:
            raise PermissionDenied(f"no tenant logs in Unix peer uid {uid} gid {gid}", field="login")
        return self.logins.login(who.name, uid, gid)

    def tenant(self, name: str | None) -> Tenant | None:
        """The tenant of that name in the current file (None: removed, or single-tenant)."""
        tenants = self._tenants
        return None if tenants is None else tenants.by_name.get(name or "")

    def allows_peer(self, tenant: str | None, uid: int, gid: int) -> bool:
        """Whether a Unix peer (SO_PEERCRED of a handshake) may act for ``tenant``'s session:
        any peer on a single-tenant daemon (the socket's mode decides), else one of the
        tenant's ``unix_uids`` / ``unix_gids`` (none listed: any) of a tenant still in the file."""
        if self._tenants is None:
            return True
        who = self.tenant(tenant)
        return who is not None and who.allows_peer(uid, gid)

    def may_see(self, viewer: str | None, owner: str | None) -> bool:
        """Whether a session of tenant ``viewer`` may use objects of tenant ``owner``: its own,
        a group's it is a member of (look up, load), everything for the operator."""
        return self._may(viewer, owner, Tenants.reads)

    def may_store(self, viewer: str | None, owner: str | None) -> bool:
        """Whether a session of tenant ``viewer`` may store blocks of tenant ``owner``: its
        own, a group's it publishes, everyone's for the operator (a member only reads)."""
        return self._may(viewer, owner, Tenants.writes)

    def _may(
        self,
        viewer: str | None,
        owner: str | None,
        in_group: Callable[[Tenants, str | None, str | None], bool],
    ) -> bool:
        tenants = self._tenants
        if tenants is None or viewer == owner:
            return True
        who = self.tenant(viewer)
        return who is not None and (who.operator or in_group(tenants, viewer, owner))

    def count_group_store_refusal(self, tenant: str) -> None:
        """Count one store of ``tenant`` into a group's namespace it does not publish."""
        self._group_refusals[tenant] = self._group_refusals.get(tenant, 0) + 1

    def group_store_refusals(self, tenant: str) -> int:
        return self._group_refusals.get(tenant, 0)

    # -- reload and revocation -------------------------------------------------------------------

    def reload(self, tenants: Tenants) -> None:
        """Swap in a new tenants file (validated by its loader) and size the defaults for it;
        note the tenants it takes out of a group (``revoked`` closes their sessions)."""
        old = self._tenants
        self._defaults = {t.name: self._default_quotas(t, tenants) for t in tenants.by_name.values()}
        self._tenants = tenants
        self._cut_off = (
            set() if old is None else {t for t in old.by_name if not old.groups_of(t) <= tenants.groups_of(t)}
        )

    def revoked(self, sessions: Iterable[H]) -> list[H]:
        """The sessions whose credential the current file no longer honours for their tenant,
        or whose transport it no longer allows that tenant, or whose tenant the last reload
        took out of a group (what the session was handed of the group's, a published index
        mapped among it, goes with the session; the client opens a new one)."""
        if self._tenants is None:
            return []
        return [
            s
            for s in sessions
            if not self.honours(s.tenant, s.credential)
            or not self._allows_transport(s.tenant, s.transport)
            or s.tenant in self._cut_off
        ]

    def _allows_transport(self, tenant: str | None, transport: Transport) -> bool:
        who = self.tenant(tenant)
        return who is not None and transport.label in who.transports

    def honours(self, tenant: str | None, cred: Credential) -> bool:
        """Whether ``cred`` still proves ``tenant`` under the current file."""
        tenants = self._tenants
        if tenants is None:
            return True
        who = self.tenant(tenant)
        if who is None:
            return False
        if cred.kind == "token":
            return cred.token_sha256 in who.token_sha256
        if cred.kind == "unix":
            peer = tenants.by_unix_peer(cred.uid, cred.gid)
            return peer is not None and peer.name == who.name
        if cred.kind == "cert":
            return cred.name in who.mtls_names
        return False

    # -- quotas ----------------------------------------------------------------------------------

    def quota(self, tenant: Tenant | str | None, name: str) -> int | None:
        """``tenant``'s quota ``name``: its file's value, else the default; None: unlimited
        (the single-tenant daemon's owner, and the quotas it has no default for)."""
        assert name in QUOTA_NAMES, name
        if isinstance(tenant, str):
            tenant = self.tenant(tenant)
        if tenant is None:
            return DEFAULT_BUFFERED_BYTES if name == "buffered_bytes" else None
        value: int | None = getattr(tenant.quotas, name)
        if value is not None:
            return value
        defaults = self._defaults.get(tenant.name)
        if defaults is None:  # a Tenant object of an older file: the same rule, sized now
            assert self._tenants is not None
            defaults = self._default_quotas(tenant, self._tenants)
        return defaults[name]

    def check(self, tenant: Tenant | None, name: str, after: int, holder: str = "") -> None:
        """ResourceExhausted (field ``quota``) when ``tenant`` would hold ``after`` of quota
        ``name`` and that passes it; ``holder`` names who reached it (default: the tenant)."""
        quota = self.quota(tenant, name)
        if quota is not None and after > quota:
            who = holder or f"tenant {tenant.name if tenant is not None else '(owner)'}"
            raise ResourceExhausted(f"quota {name} ({quota}) reached by {who}", field="quota", quota=name)

    def count_refusal(self, tenant: Tenant | str | None, quota: str) -> None:
        """Count one refusal by quota ``quota`` against ``tenant`` (a tenant of the file; the
        single-tenant daemon's owner, None, has no figures and counts nothing)."""
        assert quota in QUOTA_NAMES, quota
        name = tenant.name if isinstance(tenant, Tenant) else tenant
        if name is not None and self._tenants is not None:
            key = (name, quota)
            self._refusals[key] = self._refusals.get(key, 0) + 1

    def refusals(self, tenant: str, quota: str) -> int:
        """How many times quota ``quota`` refused ``tenant`` since the daemon started."""
        return self._refusals.get((tenant, quota), 0)

    def shared_share(self, tenant: Tenant | None) -> int | None:
        """``host_bytes`` of a tenant's blocks in the shared arena when its quota says none: a
        tenant given an arena of its own by a reload keeps the namespaces it registered before
        in the shared arena, and they get a tcp-only tenant's share (None: single-tenant)."""
        tenants = self._tenants
        if tenant is None or tenants is None:
            return None
        shared = _sharers(tenants) + (1 if tenants.maps_memory(tenant) else 0)
        return self.shares.shared_arena_bytes // max(1, shared)

    def default(self, tenant: str, name: str) -> int | None:
        """The default of quota ``name`` for ``tenant`` (what applies when its file sets none)."""
        return self._defaults.get(tenant, {}).get(name)

    def _default_quotas(self, t: Tenant, tenants: Tenants) -> dict[str, int | None]:
        """A fair share of what the daemon shares: sessions, namespaces and disk split evenly
        among the tenants that are not operators (an operator reads figures and acts for
        others: it gets a tenant's share without shrinking the others'); a tenant in the shared
        arena (tcp only) gets its share of that arena for its blocks (reserved ones included)
        and pins; a tenant with an arena of its own is bounded there by that arena, which
        nobody else uses."""
        n = max(1, sum(1 for o in tenants.by_name.values() if not o.operator))
        shared = max(1, _sharers(tenants))
        sh = self.shares
        mapped = tenants.maps_memory(t)  # (a group: when a reader of it maps memory)
        host = None if mapped else sh.shared_arena_bytes // shared
        own = t.arena_size(sh.tenant_arena_bytes) if mapped else host
        return {
            "sessions": max(1, sh.max_sessions // n),
            "namespaces": max(1, sh.max_namespaces // n),
            "open_jobs": DEFAULT_OPEN_JOBS,
            "session_open_jobs": DEFAULT_SESSION_OPEN_JOBS,
            "host_bytes": host,
            "pinned_bytes": own,
            "nvme_bytes": sh.disk_bytes // n if sh.disk_bytes else None,
            "buffered_bytes": DEFAULT_BUFFERED_BYTES,
            "control_channels": DEFAULT_CONTROL_CHANNELS,
        }


def _sharers(tenants: Tenants) -> int:
    """Tenants and groups whose blocks live in the shared arena (no arena of their own),
    operators left out."""
    return sum(1 for o in tenants.by_name.values() if not tenants.maps_memory(o) and not o.operator)

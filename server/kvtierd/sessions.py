"""Sessions: one per client connection, each with a lease.

Lifecycle: ``open`` -> (any request or ``heartbeat`` renews the lease) -> ``close`` or expiry.
On close or expiry the owner's release callback frees the session's reservations and pins.
Session ids are random 63-bit numbers, so an id from a previous daemon boot is simply unknown.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier_contract.errors import NotFound, ResourceExhausted
from kvtier_contract.wire import DATA_SECRET_BYTES
from kvtierd.domain import Transport
from kvtierd.tenancy.credential import NO_CREDENTIAL, Credential


@dataclass(eq=False)
class Session:
    id: int
    client_name: str
    ttl_s: float
    deadline: float
    transport: Transport = Transport.SHM
    tenant: str | None = None  # who opened it (None: a single-tenant daemon)
    store_jobs: set[int] = field(default_factory=set)
    load_jobs: set[int] = field(default_factory=set)
    expired: bool = False  # set when the lease lapsed (not closed): its writers may still be alive
    released: bool = False  # closed or expired: no new jobs may be attached to it
    data_secret: bytes = field(default_factory=lambda: secrets.token_bytes(DATA_SECRET_BYTES), repr=False)
    """Credential of its TCP data connections (HELLO), handed out only in OpenSessionReply."""
    credential: Credential = NO_CREDENTIAL
    """What proved its tenant at OpenSession: a reload that no longer honours it closes the
    session (kvtierd.tenancy.Tenancy.revoked)."""
    arenas: tuple[int, ...] | None = None
    """The arenas (host pools) its client maps, in the order its offsets count them, fixed at
    its first shm handshake (its own first, then its groups'); None: none handed yet."""


class SessionTable:
    """Owns every Session. Event-loop thread only; no locks."""

    def __init__(
        self,
        *,
        max_sessions: int,
        default_ttl_s: float,
        min_ttl_s: float,
        max_ttl_s: float,
        on_release: Callable[[Session], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions: dict[int, Session] = {}
        self._max = max_sessions
        self._default_ttl = default_ttl_s
        self._min_ttl = min_ttl_s
        self._max_ttl = max_ttl_s
        self._on_release = on_release
        self._clock = clock
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(
        self,
        client_name: str,
        ttl_s: float | None,
        transport: Transport = Transport.SHM,
        tenant: str | None = None,
        ceiling_s: float | None = None,
        credential: Credential = NO_CREDENTIAL,
    ) -> Session:
        """A new session; its lease is the asked ``ttl_s`` (or the default) within the daemon's
        bounds and at most ``ceiling_s`` (the tenant's ``max_lease_s``; never below the
        daemon's minimum)."""
        if len(self._sessions) >= self._max:
            self.sweep()  # lapsed leases the sweeper has not collected yet do not count
        if len(self._sessions) >= self._max:
            raise ResourceExhausted(f"too many sessions (max {self._max})", field="session")
        ttl = self._default_ttl if not ttl_s else min(max(ttl_s, self._min_ttl), self._max_ttl)
        if ceiling_s is not None:
            ttl = min(ttl, max(ceiling_s, self._min_ttl))
        sid = secrets.randbits(63) or 1
        s = Session(
            sid, client_name[:128], ttl, self._clock() + ttl, transport, tenant, credential=credential
        )
        self._sessions[sid] = s
        return s

    def get(self, session_id: int, tenant: str | None = None) -> Session:
        """The live session, its lease renewed; NotFound when unknown or expired, or (with
        ``tenant``) another tenant's: the same answer, so an id tells nothing."""
        s = self._sessions.get(session_id)
        now = self._clock()
        if s is not None and tenant is not None and s.tenant != tenant:
            s = None
        if s is None or s.deadline < now:
            if s is not None:
                self._drop(s, expired=True)
            raise NotFound(f"unknown or expired session {session_id}", field="session_id")
        s.deadline = now + s.ttl_s
        return s

    def clamp(self, s: Session, ceiling_s: float) -> None:
        """A reload lowered its tenant's lease ceiling: its lease is at most that long from now
        on (never below the daemon's minimum), the current one cut short to match."""
        ttl = min(s.ttl_s, max(ceiling_s, self._min_ttl))
        if ttl < s.ttl_s:
            s.ttl_s = ttl
            s.deadline = min(s.deadline, self._clock() + ttl)

    def with_secret(self, session_id: int, secret: bytes) -> Session | None:
        """The live session whose data secret ``secret`` is, its lease renewed; else None (an
        unknown or expired session and a wrong secret alike). A wrong secret renews nothing:
        a stranger holding only a session id cannot keep a dead engine's pins alive."""
        s = self._sessions.get(session_id)
        if s is None or s.deadline < self._clock() or not hmac.compare_digest(secret, s.data_secret):
            return None
        return self.get(session_id)

    def close(self, session_id: int, tenant: str | None = None) -> None:
        s = self._sessions.get(session_id)
        if s is not None and tenant is not None and s.tenant != tenant:
            s = None
        if s is None:
            raise NotFound(f"unknown or expired session {session_id}", field="session_id")
        self._drop(s, expired=False)

    def of_tenant(self, tenant: str) -> list[Session]:
        return [s for s in self._sessions.values() if s.tenant == tenant]

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    def sweep(self) -> int:
        """Expire every session past its deadline; returns how many."""
        now = self._clock()
        due = [s for s in self._sessions.values() if s.deadline < now]
        for s in due:
            self._drop(s, expired=True)
        return len(due)

    def close_all(self) -> None:
        for s in list(self._sessions.values()):
            self._drop(s, expired=False)

    def _drop(self, s: Session, *, expired: bool) -> None:
        del self._sessions[s.id]
        s.released = True
        if expired:
            self.expired_total += 1
            s.expired = True
        self._on_release(s)

"""Bearer tokens minted for Unix peers that log in on the shm socket without a token (a
tenant's ``unix_login``; kvtierd.tenants): grpcio does not show a Unix socket's peer credentials
to a handler, so the shm socket (SO_PEERCRED) mints a token the client then sends on gRPC.

Owned by the daemon's Tenancy (kvtierd.tenancy.tenancy); thread-safe (one lock).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class UnixLogins:
    """Bearer tokens minted for Unix peers that logged in on the shm socket (``login``), and
    their tenants (``authenticate``).

    A token is 32 random bytes (``unix.`` + base64url), kept as its SHA-256 only. It is the
    tenant's while it is used: one unused for ``idle_s`` is forgotten (a heartbeat keeps a
    live client's), and each tenant holds at most ``per_tenant`` (a new login replaces that
    tenant's least recently used, never another tenant's), so the table is bounded and one
    tenant logging in without end costs the others nothing. Tokens live in memory only: a
    restarted daemon knows none, and clients log in again when they reconnect.

    Thread-safety: one lock (gRPC handlers on the loop, /metrics on its threads).
    """

    PREFIX = "unix."

    def __init__(
        self, *, idle_s: float = 900.0, per_tenant: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.idle_s, self.per_tenant = idle_s, per_tenant
        self._clock = clock
        self._lock = threading.Lock()
        # tenant -> token digest -> last use, least recently used first
        self._by_tenant: dict[str, OrderedDict[bytes, float]] = {}
        self._tenant_of: dict[bytes, tuple[str, int, int]] = {}  # -> tenant, peer uid, gid
        self.logins = 0

    def login(self, tenant: str, uid: int, gid: int) -> str:
        """A new token for ``tenant``, logged in by Unix peer ``uid``/``gid`` (the caller
        checked that the peer is that tenant: Tenants.by_unix_peer)."""
        raw = secrets.token_bytes(32)
        token = self.PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")
        digest = hashlib.sha256(token.encode()).digest()
        with self._lock:
            mine = self._by_tenant.setdefault(tenant, OrderedDict())
            while len(mine) >= self.per_tenant:
                old, _ = mine.popitem(last=False)
                del self._tenant_of[old]
            mine[digest] = self._clock()
            self._tenant_of[digest] = (tenant, uid, gid)
            self.logins += 1
        return token

    def authenticate(self, token: str | None) -> tuple[str, int, int] | None:
        """The tenant and Unix peer of a live minted token (its use renews it), or None."""
        if not token or not token.startswith(self.PREFIX):
            return None
        digest = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        with self._lock:
            who = self._tenant_of.get(digest)
            if who is None:
                return None
            mine = self._by_tenant[who[0]]
            if now - mine[digest] > self.idle_s:
                del mine[digest], self._tenant_of[digest]
                return None
            mine[digest] = now
            mine.move_to_end(digest)
            return who

    def __len__(self) -> int:
        with self._lock:
            return len(self._tenant_of)

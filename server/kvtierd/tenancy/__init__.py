"""Tenancy: who a caller is, what it may see, which Unix peers and arena are its, what it may hold.

One component answers those questions for every entry of the daemon (gRPC, control channels, the
data channel, the shm and index handshakes, /metrics, the tiers' quotas), so that a reload's
revocation and every quota are decided in one place (docs/security.md):

* :class:`~kvtierd.tenancy.tenancy.Tenancy`: the current tenants file, the Unix logins, who a
  credential is, which sessions a reload revokes, every quota with its default;
* :class:`~kvtierd.tenancy.tenancy.Ledger` (beside it): what each holder holds of a resource
  that has no owner object of its own to count it; its users keep their own (the cache's
  admission: each tenant's control channels and the bytes they hold; the transports: handshakes
  per peer uid, data-port connections per tenant).
* :mod:`~kvtierd.tenancy.exposure`: which tokens /metrics takes off loopback (plaintext HTTP),
  and when a daemon with tenants may serve it there at all.

The tenants file's format stays in :mod:`kvtierd.tenants` (parsing and validation only).
"""

from kvtierd.tenancy.credential import NO_CREDENTIAL, Credential
from kvtierd.tenancy.tenancy import QUOTA_NAMES, Ledger, Shares, Tenancy

__all__ = ["NO_CREDENTIAL", "QUOTA_NAMES", "Credential", "Ledger", "Shares", "Tenancy"]

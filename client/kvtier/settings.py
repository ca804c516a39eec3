"""ClientSettings: what a :class:`kvtier.Client` (its :class:`kvtier.session.Session`) is told, as data.

One frozen value per client: the timeouts, the lease, the transport, pipelining, the lookup
paths, the heartbeat, the breaker's backoff, TLS and the credential. ``Client.connect(address,
transport, **kwargs)`` builds one from its keyword arguments (each a field here, same name and
default); the engine integrations build theirs from their own configuration. The client
hands this one value to the parts that read it (``client.settings`` is the session's and its
connection's; none copies a field): what changes at run time is not here but named state of the
part that changes it (``Session.pipeline_bytes``, from ``pipeline_bytes``). What is not data (a
:class:`kvtier.breaker.Breaker` shared by the clients of one engine worker, a clock) is given to
the connection beside its settings.

Validation happens at construction (``__post_init__``): a bad value raises
:class:`kvtier_contract.errors.InvalidArgument` whose ``field`` names the field. Files (a token
file, TLS certificates) are read when the gRPC channel is made, not here.

Thread-safety: immutable; share freely.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvtier_contract import errors
from kvtier_contract.protoutil import TRANSPORT_NAMES, TransportName


@dataclass(frozen=True)
class ClientSettings:
    """See the module docstring. Every field has its default; ``replace`` / ``with_`` derive one."""

    transport: TransportName = "shm"
    """The data transport: ``shm`` (same host), ``tcp`` or ``cuda_ipc``."""
    timeout_s: float = 1.0
    """Each RPC's deadline (cut to what is left of a caller's ``deadline``)."""
    lease_ttl_s: float = 10.0
    """Session lease: the daemon frees this client's reservations this long after it went silent
    (the heartbeat runs every third of it)."""
    client_name: str = ""
    """The name the daemon knows the session by (default ``pid<N>``)."""
    heartbeat: bool = True
    """Run the heartbeat thread (keeps the lease, brings the daemon's tier figures)."""
    backoff_s: tuple[float, float] = (0.05, 1.0)
    """The probe interval of the client's own breaker, doubling from the first to the second
    (unused when a shared breaker is given)."""
    tenant_key: bytes | None = field(default=None, repr=False)
    """The tenant's key mixed into block keys (``NamespaceHandle.block_keys``)."""
    probe_timeout_s: float | None = None
    """Each probe RPC's deadline (None or 0: ``min(timeout_s, 0.5)``)."""
    op_timeout_s: float = 30.0
    """The bound on one operation without a deadline of its own (all its batches and rounds)."""
    local_lookups: bool = True
    """Answer ``lookup`` from the daemon's published index when it is on this host
    (:mod:`kvtier.local_index`)."""
    token: str | None = field(default=None, repr=False)
    """The bearer token of this client's tenant, sent with every RPC (docs/security.md).
    Never logged (left out of the repr, as ``tenant_key`` is)."""
    token_file: str | None = None
    """A file whose first line is the token (read when the session is made)."""
    tls_ca: str | None = None
    """PEM CA of a daemon whose TCP listener (and so its TCP data channel) serves TLS; on a Unix
    socket address gRPC stays plaintext and the files only verify the data channel."""
    tls_cert: str | None = None
    """This client's certificate, for mTLS (with ``tls_key``)."""
    tls_key: str | None = None
    """The key of ``tls_cert``."""
    unix_login: bool = False
    """No token: this process's Unix user logs in on the daemon's socket at every session open
    and gets its tenant's token (:mod:`kvtier.login`; a Unix socket address only)."""
    verify_bytes: bool = True
    """Hash each block an shm put copies (sent with CompleteStore) and check every block
    ``get_into`` loads against its digest, a mismatch being a miss; off only to measure it."""
    control_channel: bool = True
    """Make the control calls on control channels instead of gRPC (:mod:`kvtier.control`; gRPC
    when the daemon refuses them)."""
    pipeline_bytes: int = 0
    """Pipelining (:mod:`kvtier.batches`): a put or get of more than this many bytes is cut into
    jobs of at most this size whose RPCs overlap the copies of the others. 0 = off (the
    default: on the 2-vCPU development host it took more than it hid, docs/benchmarks.md §14).
    The starting value of ``Session.pipeline_bytes``, which ``Client.pipeline_bytes`` sets."""

    def __post_init__(self) -> None:
        names = tuple(TRANSPORT_NAMES.values())
        if self.transport not in names:
            raise errors.InvalidArgument(
                f"unknown transport {self.transport!r} (expected one of {', '.join(names)})",
                field="transport",
            )
        for name in ("timeout_s", "lease_ttl_s", "op_timeout_s"):
            if not getattr(self, name) > 0:
                raise errors.InvalidArgument(f"{name} must be positive", field=name)
        if self.probe_timeout_s is not None and self.probe_timeout_s < 0:
            raise errors.InvalidArgument("probe_timeout_s must not be negative", field="probe_timeout_s")
        low, high = self.backoff_s
        if not 0 < low <= high:
            raise errors.InvalidArgument(
                "backoff_s is (first, most) seconds, 0 < first <= most", field="backoff_s"
            )
        if self.pipeline_bytes < 0:
            raise errors.InvalidArgument("pipeline_bytes must not be negative", field="pipeline_bytes")

    @property
    def probe_s(self) -> float:
        """The probe RPCs' deadline in effect."""
        return self.probe_timeout_s or min(self.timeout_s, 0.5)

    def with_(self, **changes: Any) -> ClientSettings:
        """A copy with ``changes`` (field names; TypeError for an unknown one)."""
        return replace(self, **changes)

    @classmethod
    def of(cls, transport: TransportName = "shm", **kwargs: Any) -> ClientSettings:
        """From ``Client.connect``'s keyword arguments; an unknown one raises TypeError naming it,
        as an unknown keyword argument did."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise TypeError(f"unexpected keyword argument {name!r}")
        return cls(transport=transport, **kwargs)

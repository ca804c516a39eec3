"""One error hierarchy for kvtier, shared by the client SDK and the daemon.

Expected outcomes (a miss, a rejected store) are values, never exceptions. These exceptions are for
bad requests and environment failures, raised inside a component and caught at the boundary: the
daemon's service maps each class to one gRPC status code with ``GRPC_STATUS`` below, and the client
maps a status code back to the same class with ``from_grpc_code``.

Every error carries ``field`` when it is about one named field of a request, so that a message
always names what was wrong (``"namespace.model_revision: required"``).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class. ``field`` names the request field at fault, when there is one."""

    code_name = "UNKNOWN"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(KvtierError):
    """A request is malformed: a missing identity field, a wrong size, a bad key length."""

    code_name = "INVALID_ARGUMENT"


class NotFound(KvtierError):
    """A namespace id, session id or job id the daemon does not know (or no longer knows)."""

    code_name = "NOT_FOUND"


class FailedPrecondition(KvtierError):
    """The request is well formed but the state does not allow it (job already completed...)."""

    code_name = "FAILED_PRECONDITION"


class ResourceExhausted(KvtierError):
    """A batch larger than the configured limits, or more sessions than allowed. ``quota``
    names the tenant quota that refused it (``sessions``, ``host_bytes``...), None for any
    other limit; the daemon counts refusals by it (the message is for people)."""

    code_name = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, field: str | None = None, quota: str | None = None) -> None:
        self.quota = quota
        super().__init__(message, field=field)


OVERLOADED = "daemon overloaded"
"""How the message of a RESOURCE_EXHAUSTED begins when the daemon sheds load (too many requests
in progress): the request may simply be tried later, unlike a batch over a limit. Clients treat
it as a miss or a dropped store and trip nothing."""


class PermissionDenied(KvtierError):
    """A session tries to use a job or namespace it does not own."""

    code_name = "PERMISSION_DENIED"


class Unauthenticated(KvtierError):
    """No valid credential: the daemon has tenants and the call carried no token of one
    (docs/security.md)."""

    code_name = "UNAUTHENTICATED"


class Unavailable(KvtierError):
    """The daemon cannot be reached, is draining, or did not answer within the deadline."""

    code_name = "UNAVAILABLE"


class TransportError(KvtierError):
    """A data-plane failure (socket closed mid-transfer, mapping failed)."""

    code_name = "UNAVAILABLE"


class Aborted(KvtierError):
    """A transfer failed on the daemon's side (a CUDA error in a cuda_ipc copy): that job was
    aborted (store entries freed, load pins released), nothing else."""

    code_name = "ABORTED"


class Internal(KvtierError):
    """A bug: an invariant was violated. Logged with a traceback by the daemon."""

    code_name = "INTERNAL"


# The one table from error class to gRPC status code name (grpc.StatusCode.<name>).
GRPC_STATUS: dict[type[KvtierError], str] = {
    cls: cls.code_name
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Unavailable,
        TransportError,
        Aborted,
        Internal,
    )
}

_BY_CODE: dict[str, type[KvtierError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "FAILED_PRECONDITION": FailedPrecondition,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "PERMISSION_DENIED": PermissionDenied,
    "UNAUTHENTICATED": Unauthenticated,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": Unavailable,
    "ABORTED": Aborted,
    "INTERNAL": Internal,
}


def from_grpc_code(code_name: str, message: str) -> KvtierError:
    """Rebuild the error class for a gRPC status code name (client side)."""
    return _BY_CODE.get(code_name, KvtierError)(message)

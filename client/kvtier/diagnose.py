"""Why a client cannot use its daemon, in words that name the address, the cause and the fix.

gRPC reports most mistakes in C-core words ("failed to connect to all addresses", "Socket
closed"); the client turns each into one :mod:`kvtier_contract.errors` error here:

* ``explain_rpc(peer, method, code, details)``: a failed RPC (OpenSession at connect, any call
  that trips the breaker later) -> ``Diagnosis`` (a short ``cause`` key and the error); with
  ``reach=`` (what :func:`kvtier.reach.reach` found at the address) whether anything is there is
  taken from the socket, not from gRPC's words, which can be an earlier attempt's;
* ``explain_reached(peer, method, code, details, timeout_s)``: the same, the address asked
  first (within ``timeout_s``) where the code says it was not reached: what an open uses;
* ``explain_attach(peer, error)``: the data transport could not attach; ``explain_login``: the
  Unix peer login failed;
* ``CauseLog``: one WARNING per cause, then at most one per ``interval_s`` (engines that must not
  fail learn why their lookups miss without a line per call).

Pure functions of their arguments except ``explain_reached`` (one socket, :mod:`kvtier.reach`)
and ``CauseLog`` (its lock). Thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.addresses import grpc_host, socket_path
from kvtier.reach import Reach, reach
from kvtier_contract import errors

log = logging.getLogger("kvtier.client")

START = (
    "is kvtierd running? Start it with `make serve` (socket run/kvtier.sock under the "
    "checkout) or `kvtierd serve --socket PATH`, or fix the address"
)
SECURITY = "docs/security.md"


@dataclass(frozen=True)
class Peer:
    """What the client was told about its daemon (no secret: only which credential it has)."""

    address: str  # the gRPC target (kvtier.addresses.address_target)
    transport: str = "shm"
    tls: bool = False  # the gRPC channel is TLS (tls_ca/tls_cert given and a TCP address)
    ca: bool = False  # tls_ca given
    client_cert: bool = False  # tls_cert/tls_key given
    token: bool = False  # token/token_file given
    unix_login: bool = False
    timeout_s: float = 1.0

    @property
    def unix(self) -> bool:
        return self.address.startswith("unix:")


@dataclass(frozen=True)
class Diagnosis:
    """A failure explained: ``cause`` is a short stable key (one WARNING per key), ``error`` the
    error to raise, whose message names the address, the cause and the fix."""

    cause: str
    error: errors.KvtierError
    rpc: tuple[str, str, str] | None = None  # the failed RPC: (method, code name, details)
    # the address answers now and gRPC's words were an earlier attempt's (its connection still
    # backing off): the next try may well work; kept in last_error, never a WARNING
    transient: bool = False


def explain_rpc(
    peer: Peer,
    method: str,
    code: str,
    details: str,
    *,
    tls_probe: bool | None = None,
    reach: Reach | None = None,
) -> Diagnosis:
    """A failed RPC ``method`` (gRPC status ``code`` name and ``details``) explained.
    ``tls_probe``: whether the port answered a TLS handshake (:func:`kvtier.reach.speaks_tls`);
    ``reach``: what was at the address when asked (:func:`kvtier.reach.reach`), when known."""
    d = _explain_rpc(peer, method, code, details, tls_probe, reach)
    return dataclasses.replace(d, rpc=(method, code, details))


UNREACHED = ("UNAVAILABLE", "UNKNOWN", "CANCELLED")  # codes of an address maybe not reached


def explain_reached(peer: Peer, method: str, code: str, details: str, timeout_s: float) -> Diagnosis:
    """``explain_rpc``, the address asked first (:func:`kvtier.reach.reach`, within
    ``timeout_s``; a Unix socket never waits) when ``code`` is one of ``UNREACHED``: whether a
    socket is there and listens is what the socket says now, not gRPC's last error (a
    subchannel shared with another channel still backing off reports that channel's attempt)."""
    seen = reach(peer.address, timeout_s) if code in UNREACHED else None
    return explain_rpc(peer, method, code, details, reach=seen)


def _explain_rpc(
    peer: Peer, method: str, code: str, details: str, tls_probe: bool | None, seen: Reach | None
) -> Diagnosis:
    at = f"daemon at {peer.address}"
    if code == "UNAUTHENTICATED":
        return _unauthenticated(peer, at, details)
    if code == "PERMISSION_DENIED":
        return Diagnosis("permission", errors.PermissionDenied(f"{at}: {method}: {details}"))
    if code == "UNIMPLEMENTED":  # the first call already: not the Kvtier service there
        return _down("health-port", f"{at}: {_not_kvtier(method, details)}")
    if code not in (*UNREACHED, "DEADLINE_EXCEEDED"):
        return Diagnosis(code.lower(), errors.from_grpc_code(code, f"{at}: {method}: {details}"))
    if code == "DEADLINE_EXCEEDED" or "Deadline Exceeded" in details:
        why = "a wrong host, a firewall, or a daemon too busy; check the address (timeout_s= for a slow link)"
        return _down("silent", f"{at}: no answer within {peer.timeout_s:g} s: {why}")
    return _unreachable(peer, at, details, tls_probe, seen)


HEALTH_ONLY = "this address answers only health checks"


def _not_kvtier(method: str, details: str) -> str:
    """Why a daemon answered UNIMPLEMENTED to ``method``: its health-only listener (which says
    where its gRPC port is; grpc's "Method not found!" from an older daemon's or another server)."""
    if details.startswith(HEALTH_ONLY):
        return details
    return (
        f"{HEALTH_ONLY} or is not kvtierd ({method}: {details}): kvtierd's health port "
        "(--health-listen; 50052 in the container image) serves gRPC health only; connect to its "
        "gRPC port (--listen; 127.0.0.1:50051 in the image) or its Unix socket"
    )


def _down(cause: str, message: str, field: str = "address") -> Diagnosis:
    return Diagnosis(cause, errors.Unavailable(message, field=field))


def _unauthenticated(peer: Peer, at: str, details: str) -> Diagnosis:
    if peer.unix_login:
        why = "refused the token its Unix login gave (revoked since?)"
        return Diagnosis("login-token", errors.Unauthenticated(f"{at} {why}", field="unix_login"))
    if peer.token:
        return Diagnosis(
            "token",
            errors.Unauthenticated(
                f"{at} refused the token: no tenant of its tenants file has it (tokens_sha256), or "
                f"it was revoked; check token=/token_file= ({SECURITY})",
                field="token",
            ),
        )
    if peer.client_cert:
        return Diagnosis(
            "cert-name",
            errors.Unauthenticated(
                f"{at} did not take the client certificate as a credential: the daemon does not "
                "ask for client certificates (that needs tls_client_ca with "
                "tls_require_client_cert = true), or no tenant lists its name in mtls_names; "
                f"fix either, or pass a tenant's token= ({SECURITY})",
                field="tls_cert",
            ),
        )
    return Diagnosis(
        "no-token",
        errors.Unauthenticated(
            f"{at} has tenants and this client gave no credential: pass token= or token_file= of a "
            f"tenant, unix_login=True on its Unix socket, or a tenant's client certificate "
            f"({SECURITY}; the daemon said: {details})",
            field="token",
        ),
    )


def _unreachable(peer: Peer, at: str, details: str, tls_probe: bool | None, seen: Reach | None) -> Diagnosis:
    if details.startswith("daemon is draining"):  # it answered: told to stop (a restart?)
        return _down(
            "draining",
            f"{at} is draining (told to stop: a restart or a shutdown) and takes no new "
            "session or store; retry once it is back (a lazy client reconnects by itself)",
        )
    path = socket_path(peer.address)
    if path is not None:
        return _unix_unreachable(at, path, details, seen)
    said_dns, said_refused = _said_dns(details), "Connection refused" in details
    if seen == "listening" and (said_dns or said_refused):
        return _answers_now(at, "its port", details)
    if seen == "unresolved" or (seen is None and said_dns):
        return _down("dns", f"{at}: cannot resolve host {grpc_host(peer.address)!r}: check the address")
    if seen == "refused" or (seen is None and said_refused):
        return _down(
            "refused",
            f"{at}: nothing listens there (connection refused): is kvtierd "
            "running with --listen on that port? (`make serve` listens on its Unix "
            "socket only) Or fix the address",
        )
    tls = _tls_trap(peer, at, details, tls_probe)
    return tls if tls is not None else _down("unreachable", f"{at}: {details}: {START}")


def _said_dns(details: str) -> bool:
    return "resolv" in details or "Domain name not found" in details or "DNS" in details


_SAID_UNIX: dict[str, Reach] = {
    "No such file": "missing",
    "Connection refused": "refused",
    "Permission denied": "permission",
}


def _said_unix(details: str) -> Reach | None:
    """What gRPC's words say of a Unix socket (which may be an earlier attempt's)."""
    return next((r for w, r in _SAID_UNIX.items() if w in details), None)


def _answers_now(at: str, where: str, details: str) -> Diagnosis:
    now = f"{at}: {where} accepts connections now, though gRPC still reports an earlier attempt"
    retry = "a daemon that was just starting; retry (a lazy client does by itself)"
    error = errors.Unavailable(f"{now} ({details}): {retry}", field="address")
    return Diagnosis("answers-now", error, transient=True)


def _unix_unreachable(at: str, path: str, details: str, seen: Reach | None) -> Diagnosis:
    """A Unix socket not reached: by what its file says (``seen``), else by gRPC's words."""
    said = _said_unix(details)
    if seen == "listening" and said in ("missing", "refused"):
        return _answers_now(at, f"its socket {path}", details)
    seen = said if seen is None else seen  # not asked: gRPC's words
    if seen == "missing":
        return _down("no-socket", f"{at}: no socket file {path}: {START}")
    if seen == "refused":
        return _down(
            "stale-socket",
            f"{at}: nothing listens on {path} (a daemon that "
            "exited left its socket behind?): restart kvtierd, or fix the address",
        )
    if seen == "permission":
        return Diagnosis(
            "socket-permission",
            errors.PermissionDenied(
                f"{at}: permission denied on {path}: the daemon's socket is private to its "
                f"owner; run as that user, or use a tenant with unix_login ({SECURITY})",
                field="address",
            ),
        )
    if seen == "not-socket":
        return _down("not-socket", f"{at}: {path} is not a socket (a file of another kind): fix the address")
    return _down("unreachable", f"{at}: {details}: {START}")


def _tls_trap(peer: Peer, at: str, details: str, tls_probe: bool | None) -> Diagnosis | None:
    """The TLS mistakes gRPC reports as a handshake failure or a closed socket."""
    if "WRONG_VERSION_NUMBER" in details:
        return _tls_on_plaintext(at)
    if "CERTIFICATE_VERIFY_FAILED" in details:
        given = "the CA given (tls_ca=)" if peer.ca else "the system's CAs (no tls_ca= given)"
        return _down(
            "tls-unknown-ca",
            f"{at}: TLS: the daemon's certificate is not signed by "
            f"{given}; pass tls_ca= the CA that signed its tls_cert",
            "tls_ca",
        )
    if "Hostname Verification" in details or "Peer name" in details:
        return _down(
            "tls-hostname",
            f"{at}: TLS: the daemon's certificate does not name host "
            f"{grpc_host(peer.address)!r}; connect by a name its subjectAltName lists, "
            "or reissue the certificate",
            "address",
        )
    if "Socket closed" not in details and "reset" not in details.lower():
        return None
    return _closed(peer, at, tls_probe)


def _closed(peer: Peer, at: str, tls_probe: bool | None) -> Diagnosis | None:
    """The daemon closed a TCP connection during the handshake: a TLS port that a plaintext
    client reached, a plaintext port that a TLS client reached, or a client certificate it
    requires or refuses (``tls_probe``: whether the port answered a TLS handshake, when known)."""
    if not peer.tls:
        if tls_probe is False:
            return None
        sure = "" if tls_probe else " (a plaintext client on a TLS port?)"
        return _down(
            "plaintext-on-tls",
            f"{at}: the daemon closed the connection{sure}: its "
            "port serves TLS; pass tls_ca= (the CA of its certificate), and tls_cert=/"
            "tls_key= if it requires client certificates",
            "tls_ca",
        )
    if tls_probe is False:
        return _tls_on_plaintext(at)
    unsure = "" if tls_probe else " (unless the port does not serve TLS: then drop tls_ca=/tls_cert=)"
    if not peer.client_cert:
        return _down(
            "tls-cert-required",
            f"{at}: the daemon closed the TLS handshake: it "
            "requires a client certificate (tls_require_client_cert); pass tls_cert= and "
            f"tls_key= of one signed by its tls_client_ca{unsure}",
            "tls_cert",
        )
    return _down(
        "tls-cert-refused",
        f"{at}: the daemon closed the TLS handshake: it refused the "
        f"client certificate (not signed by its tls_client_ca? expired?){unsure}",
        "tls_cert",
    )


def _tls_on_plaintext(at: str) -> Diagnosis:
    return _down(
        "tls-on-plaintext",
        f"{at}: TLS handshake failed: a TLS client on a "
        "plaintext port (the daemon has no tls_cert there); drop tls_ca=/tls_cert= "
        "or use the daemon's TLS listener",
        "tls_ca",
    )


def explain_attach(peer: Peer, error: errors.KvtierError) -> Diagnosis:
    """The data transport failed to attach after OpenSession (the daemon answered gRPC)."""
    at = f"daemon at {peer.address}"
    text = str(error)
    if "certificate verify failed" in text or "CERTIFICATE_VERIFY_FAILED" in text:
        given = "the CA given (tls_ca=)" if peer.ca else "the system's CAs (no tls_ca= given)"
        return _down(
            "data-tls-ca",
            f"{at}: the TLS data channel's certificate is not signed by "
            f"{given}: pass tls_ca= the CA of the daemon's tls_cert ({text})",
            "tls_ca",
        )
    hint = ""
    if peer.transport in ("shm", "cuda_ipc"):
        hint = (
            f"; {peer.transport} maps the daemon's memory and needs it on this host "
            "(transport='tcp' for a remote daemon)"
        )
    return _down(
        f"attach-{peer.transport}",
        f"{at}: the {peer.transport} data channel did not attach: {text}{hint}",
        "transport",
    )


def explain_login(peer: Peer, error: errors.KvtierError) -> Diagnosis:
    """The Unix peer login on the daemon's shm socket failed."""
    at = f"daemon at {peer.address}"
    if isinstance(error, errors.PermissionDenied):
        return Diagnosis(
            "login-refused",
            errors.PermissionDenied(
                f"{at} refused the Unix login: {error} (its tenants file must list this uid or gid "
                f"under a tenant with unix_login = true; {SECURITY})",
                field="unix_login",
            ),
        )
    return _down("login-unreachable", f"{at}: Unix login failed: {error}; {START}", "unix_login")


class CauseLog:
    """WARNING once per cause, then at most once per ``interval_s`` for that cause (saying how
    many reports were left out meanwhile). Shared by the sessions of one breaker.
    Thread-safety: any thread (one lock, never held while logging)."""

    def __init__(
        self,
        interval_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def report(self, cause: str, message: str) -> bool:
        """Log ``message`` at WARNING unless ``cause`` was logged less than ``interval_s``
        ago; True when it was logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self.interval_s:
                self._left_out[cause] = self._left_out.get(cause, 0) + 1
                return False
            self._last[cause] = now
            left_out = self._left_out.pop(cause, 0)
        more = f" ({left_out} more times since the last warning)" if left_out else ""
        self._log.warning("kvtier: %s%s", message, more)
        return True

    def seen(self) -> list[str]:
        """The causes logged so far."""
        with self._lock:
            return sorted(self._last)

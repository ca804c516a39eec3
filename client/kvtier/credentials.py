"""Credentials of a session: the tenant's bearer token, TLS for the gRPC and data channels.

Pure helpers, no state of their own: :func:`bearer_metadata` (a token, or a token file's first
line, as ``authorization`` metadata), :func:`tls_credentials` / :func:`data_tls_context` (the
files read now; a bad file raises ``InvalidArgument`` naming the setting) and the interceptor that
adds the credential to every call of a channel (read per call: a Unix login renews it at each
session open). Thread-safety: the interceptor reads its source on the calling thread.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import grpc

from kvtier_contract import errors


def tls_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS for the gRPC channel (files read and checked now: each must be what its setting
    names, a PEM certificate or key, and the key that of the certificate), or None for a
    plaintext one."""
    if not ca and not cert:
        return None
    if bool(cert) != bool(key):
        raise errors.InvalidArgument("tls_cert and tls_key go together", field="tls_key")
    ca_pem = _read("tls_ca", ca) if ca else None
    if ca and ca_pem is not None:
        _check_certificate("tls_ca", ca, ca_pem)
    cert_pem = key_pem = None
    if cert and key:
        cert_pem, key_pem = _read("tls_cert", cert), _read("tls_key", key)
        _check_certificate("tls_cert", cert, cert_pem)
        _check_key(cert, key)
    return grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read {path}: {e.strerror}", field=name) from None


def _check_certificate(name: str, path: str, pem: bytes) -> None:
    """InvalidArgument naming ``name`` and ``path`` unless ``pem`` holds a PEM certificate
    (gRPC would only fail at the first connection, in words about a handshake)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise errors.InvalidArgument(
            f"{path} is not a PEM certificate (-----BEGIN CERTIFICATE-----): {_reason(e)}", field=name
        ) from None


def _check_key(cert: str, key: str) -> None:
    """InvalidArgument naming tls_key unless ``key`` is a PEM private key of ``cert``."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
    except ssl.SSLError as e:
        why = (
            f"{key} is not the key of tls_cert {cert}"
            if "KEY_VALUES_MISMATCH" in str(e)
            else f"{key} is not a PEM private key (-----BEGIN PRIVATE KEY-----)"
        )
        raise errors.InvalidArgument(why, field="tls_key") from None
    except OSError as e:
        raise errors.InvalidArgument(f"cannot read {key}: {e.strerror}", field="tls_key") from None


def _reason(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "not text"
    return str(getattr(e, "reason", None) or e).split(" (_ssl.c")[0]


def data_tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """TLS for the data channel: the gRPC channel's CA (the system's without one) and client
    certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert and key:
            ctx.load_cert_chain(cert, key)
    except OSError as e:
        raise errors.TransportError(f"data channel TLS: {e}") from None
    return ctx


def bearer_metadata(token: str | None, token_file: str | None) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` metadata for a tenant's token (given, or the first line of a
    file); empty without one. Whitespace around the token (a file's or a variable's trailing
    newline) is dropped; a token with any other character a gRPC header cannot carry (a control
    character, non-ASCII) is refused naming the setting, before any RPC (gRPC would fail every
    call with "Invalid metadata")."""
    field = "token"
    if token_file:
        field = "token_file"
        try:
            with open(token_file) as f:
                token = f.readline()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not text"
            raise errors.InvalidArgument(f"cannot read the token file: {why}", field=field) from None
        if not token.strip():
            raise errors.InvalidArgument("the token file is empty", field=field)
    if token is None:
        return ()
    token = token.strip()
    bad = next((i for i, ch in enumerate(token) if not " " <= ch <= "~"), None)
    if bad is not None:  # (the token itself is never shown: a secret)
        ch = token[bad]
        what = (
            f"control character U+{ord(ch):04X}"
            if ord(ch) < 0x20 or ord(ch) == 0x7F
            else "non-ASCII character"
        )
        raise errors.InvalidArgument(
            f"the token has a {what} at position {bad}, which a gRPC header cannot carry: a "
            "bearer token is printable ASCII (whitespace around it is dropped)",
            field=field,
        )
    return (("authorization", f"Bearer {token}"),) if token else ()


class WithMetadata(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds the credential to every unary call of a channel."""

    def __init__(self, metadata: Callable[[], tuple[tuple[str, str], ...]]) -> None:
        self._metadata = metadata  # read per call: a Unix login renews it at each session open

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        md = tuple(details.metadata or ()) + self._metadata()
        return continuation(
            _Details(
                details.method,
                details.timeout,
                md,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: Any,
        credentials: Any,
        wait_for_ready: Any,
        compression: Any,
    ) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready, compression)

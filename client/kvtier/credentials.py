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
    """TLS for the gRPC channel (files read now), or None for a plaintext one."""
    if not ca and not cert:
        return None
    if bool(cert) != bool(key):
        raise errors.InvalidArgument("tls_cert and tls_key go together", field="tls_key")

    def read(name: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise errors.InvalidArgument(f"cannot read {path}: {e.strerror}", field=name) from None

    return grpc.ssl_channel_credentials(read("tls_ca", ca), read("tls_key", key), read("tls_cert", cert))


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
    file); empty without one."""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.readline().strip()
        except OSError as e:
            raise errors.InvalidArgument(
                f"cannot read the token file: {e.strerror}", field="token_file"
            ) from None
        if not token:
            raise errors.InvalidArgument("the token file is empty", field="token_file")
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

"""GrpcChannel: the gRPC channel of one connection to its daemon, and what it presents on it.

Owns the channel and its stub, the credentials read from the settings (a bearer token, or the
socket of a Unix login and the token that login got; the TLS files), and the
:class:`kvtier.diagnose.Peer` the diagnoses describe (no secret). Lifecycle::

    made (files read: InvalidArgument naming the setting) --open--> OPEN
    OPEN --login (a Unix login: a fresh token for every later call)--> OPEN
    OPEN --close--> made (opened again by the next open)

A part of :class:`kvtier.connection.Connection`, which is handed it. Thread-safety: ``open``,
``login`` and ``close`` run under the connection's lock; ``stub`` is used by any thread (each
call reads the current token through :class:`kvtier.credentials.WithMetadata`).
"""

from __future__ import annotations

from typing import Any

import grpc

from kvtier.addresses import address_target
from kvtier.calls import Away
from kvtier.credentials import WithMetadata, bearer_metadata, tls_credentials
from kvtier.diagnose import Peer, explain_login
from kvtier.login import shm_socket_of, unix_login
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc


class GrpcChannel:
    """See the module docstring. ``address`` (the gRPC target), ``peer`` and ``tls_files`` are
    fixed at construction; ``stub`` is the Kvtier stub while open, else None."""

    def __init__(self, address: str, settings: ClientSettings) -> None:
        """Files (token file, TLS) are read now: InvalidArgument naming the setting."""
        self.address = address_target(address)
        s = settings
        self._metadata = bearer_metadata(s.token, s.token_file)
        self._login_path = ""
        if s.unix_login:
            if self._metadata:
                raise errors.InvalidArgument(
                    "give a token or log in as the Unix peer, not both", field="unix_login"
                )
            self._login_path = shm_socket_of(self.address)
        self._tls = tls_credentials(s.tls_ca, s.tls_cert, s.tls_key)
        self.tls_files = (s.tls_ca, s.tls_cert, s.tls_key)  # for a TLS data channel
        self.peer = Peer(  # what the diagnoses know of the credentials: no secret
            self.address,
            s.transport,
            tls=self._tls is not None and not self.address.startswith("unix:"),
            ca=bool(s.tls_ca),
            client_cert=bool(s.tls_cert),
            token=bool(self._metadata),
            unix_login=s.unix_login,
            timeout_s=s.timeout_s,
        )
        self._channel: grpc.Channel | None = None
        self.stub: Any = None

    @property
    def logs_in(self) -> bool:
        """A Unix login: ``login`` gets a fresh token for every session."""
        return bool(self._login_path)

    def login(self, timeout: float) -> None:
        """A Unix login's fresh token for every later call (the caller holds the connection's
        lock); Away when the daemon refuses or cannot be reached (the engine recomputes)."""
        try:
            token = unix_login(self._login_path, timeout)
        except errors.KvtierError as e:
            raise Away(f"Unix login: {e}", explain_login(self.peer, e)) from None
        self._metadata = (("authorization", f"Bearer {token}"),)

    def open(self) -> None:
        if self._channel is None:
            options = [("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 << 20)]
            if self._tls is not None and not self.address.startswith("unix:"):
                # (the Unix socket never serves TLS; the files still verify a TLS data channel)
                self._channel = grpc.secure_channel(self.address, self._tls, options=options)
            else:
                self._channel = grpc.insecure_channel(self.address, options=options)
            channel = self._channel
            if self._metadata or self._login_path:
                channel = grpc.intercept_channel(channel, WithMetadata(lambda: self._metadata))
            self.stub = pb_grpc.KvtierStub(channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self.stub = None

"""GrpcChannel: the gRPC channel of one session to its daemon, and what the session presents on it.

Owns the channel and its stub, the credentials read from the settings (a bearer token, or the
socket of a Unix login and the token that login got; the TLS files), and the
:class:`kvtier.diagnose.Peer` the diagnoses describe (no secret). Lifecycle::

    made (files read: InvalidArgument naming the setting) --_channel_open--> OPEN
    OPEN --_login (a Unix login: a fresh token for every later call)--> OPEN
    OPEN --_channel_close--> made (opened again by the next _channel_open)

The base of :class:`kvtier.connection.Connection`. Thread-safety: ``_channel_open``, ``_login``
and ``_channel_close`` run under the connection's ``_conn_lock``; the stub is used by any thread
(each call reads the current token through :class:`kvtier.credentials.WithMetadata`).
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
    """See the module docstring."""

    def __init__(self, address: str, settings: ClientSettings) -> None:
        """Files (token file, TLS) are read now: InvalidArgument naming the setting."""
        self.address = address_target(address)
        self._take_credentials(settings)
        self._channel: grpc.Channel | None = None
        self._stub: Any = None

    def _take_credentials(self, s: ClientSettings) -> None:
        """The token (or the Unix login's socket), the TLS files read, and what the diagnoses
        know of them (``_peer``: no secret)."""
        self._metadata = bearer_metadata(s.token, s.token_file)
        self._login_path = ""
        if s.unix_login:
            if self._metadata:
                raise errors.InvalidArgument(
                    "give a token or log in as the Unix peer, not both", field="unix_login"
                )
            self._login_path = shm_socket_of(self.address)
        self._tls = tls_credentials(s.tls_ca, s.tls_cert, s.tls_key)
        self._tls_files = (s.tls_ca, s.tls_cert, s.tls_key)  # for a TLS data channel
        self._peer = Peer(
            self.address,
            s.transport,
            tls=self._tls is not None and not self.address.startswith("unix:"),
            ca=bool(s.tls_ca),
            client_cert=bool(s.tls_cert),
            token=bool(self._metadata),
            unix_login=s.unix_login,
            timeout_s=s.timeout_s,
        )

    def _login(self, timeout: float) -> None:
        """A Unix login's fresh token for every later call (caller holds ``_conn_lock``); Away
        when the daemon refuses or cannot be reached (the engine recomputes meanwhile)."""
        try:
            token = unix_login(self._login_path, timeout)
        except errors.KvtierError as e:
            raise Away(f"Unix login: {e}", explain_login(self._peer, e)) from None
        self._metadata = (("authorization", f"Bearer {token}"),)

    def _channel_open(self) -> None:
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
            self._stub = pb_grpc.KvtierStub(channel)

    def _channel_close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

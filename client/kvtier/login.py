"""Unix peer login: a same-host client proves its uid/gid to the daemon and gets a bearer token.

grpcio shows a handler nothing of a Unix socket's peer, so the daemon reads the peer's
credentials (SO_PEERCRED) on its shm socket instead (``<gRPC socket>.shm``), where a tenant of its
tenants file with ``unix_login = true`` and the peer's uid or gid in its ``unix_uids`` /
``unix_gids`` gets a token minted for it; the client presents that token on the gRPC socket like
any other (docs/security.md). Wire format: :mod:`kvtier_contract.wire` (``LOGIN_*``).
"""

from __future__ import annotations

import socket

from kvtier_contract import errors, wire


def shm_socket_of(address: str) -> str:
    """The shm socket beside the gRPC Unix socket at ``address`` (``unix:///path``)."""
    if not address.startswith("unix://"):
        raise errors.InvalidArgument(
            f"{address!r}: a Unix peer logs in on the daemon's Unix socket (unix:///path)", field="unix_login"
        )
    return address[len("unix://") :] + ".shm"


def unix_login(path: str, timeout_s: float) -> str:
    """Log in on the shm socket at ``path``: the bearer token of the tenant this process's Unix
    user is. PermissionDenied (or the daemon's other refusal) when none; TransportError when the
    socket cannot be reached or answers nonsense."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            s.sendall(wire.SHM_REQUEST.pack(wire.LOGIN_MAGIC, 0))
            data = b""
            while True:
                chunk = s.recv(wire.LOGIN_REPLY.size + wire.LOGIN_MAX_TOKEN_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise errors.TransportError(f"Unix login on {path}: {e}") from None
    if data[:4] == wire.SHM_REFUSED:
        message = data[4:].decode(errors="replace")
        field, sep, rest = message.partition(": ")
        raise errors.PermissionDenied(rest if sep else message, field=field if sep else "login")
    if len(data) < wire.LOGIN_REPLY.size or data[:4] != wire.LOGIN_MAGIC:
        raise errors.TransportError(f"Unix login on {path}: not a kvtier login reply")
    _, n = wire.LOGIN_REPLY.unpack_from(data)
    token = data[wire.LOGIN_REPLY.size :]
    if n > wire.LOGIN_MAX_TOKEN_BYTES or len(token) != n:
        raise errors.TransportError(f"Unix login on {path}: a token of {len(token)} bytes, announced {n}")
    return token.decode("ascii")

"""The warnings every start logs about a configuration the checks accept but that is seldom
meant: settings that let more users in than the owner-only default, a network listener whose
data channel stays on loopback, a certificate no TCP gRPC listener serves, a size rounded down.

``start_warnings(cfg)`` returns them as lines (kvtierd.app logs each at WARNING, beside the
startup checks' own); each is a function of its own. Pure functions of the configuration;
any thread.
"""

from __future__ import annotations

from kvtier_contract.units import format_bytes
from kvtierd.config import DaemonConfig, is_loopback


def start_warnings(cfg: DaemonConfig) -> list[str]:
    """Every warning that ``cfg`` calls for, in the order of the settings."""
    found = [
        socket_mode_warning(cfg),
        loopback_listen_warning(cfg),
        data_channel_warning(cfg),
        unused_tls_warning(cfg),
        host_bytes_warning(cfg),
    ]
    return [w for w in found if w]


def socket_mode_warning(cfg: DaemonConfig) -> str:
    """A ``socket_mode`` that lets every local user connect, on a daemon without tenants."""
    mode = cfg.grpc.socket_mode
    if (
        not mode & 0o007
        or cfg.tenancy.tenants_file
        or not (cfg.grpc.socket_path or cfg.transports.shm_enabled)
    ):
        return ""
    return (
        f"socket_mode {mode:04o} (--socket-mode) lets every local user connect to the Unix "
        "sockets, and without a tenants file each of them reads and writes every block: use "
        "0600 (the daemon's user) or 0660 (its group too), or add a tenants file "
        "(--tenants-file, docs/security.md)"
    )


def loopback_listen_warning(cfg: DaemonConfig) -> str:
    """A loopback TCP gRPC listener on a daemon without tenants: unlike the owner-only Unix
    socket, it takes every local user."""
    listen = cfg.grpc.listen
    if not listen or not is_loopback(listen) or cfg.tenancy.tenants_file or cfg.grpc.tls_require_client_cert:
        return ""
    return (
        f"listen {listen} (--listen) lets every local user (any uid on this host, any "
        "container of this pod) call the daemon with no credential and read and write every "
        "block, unlike the owner-only Unix socket: drop it (--listen '') or add a tenants "
        "file (--tenants-file, docs/security.md)"
    )


def data_channel_warning(cfg: DaemonConfig) -> str:
    """gRPC reachable from other hosts while the tcp data channel is on loopback: remote
    clients open sessions, then fail every tcp transfer."""
    listen, data = cfg.grpc.listen, cfg.transports.data_listen
    if not listen or is_loopback(listen) or not data or not is_loopback(data):
        return ""
    return (
        f"listen {listen} (--listen) reaches other hosts but the tcp data channel, data_listen "
        f"{data} (--data-listen), only this one: remote clients cannot use the tcp transport "
        "(their puts store nothing, their gets miss); set --data-listen "
        f"{listen.rpartition(':')[0]}:PORT too (docs/tcp_data_channel.md)"
    )


def unused_tls_warning(cfg: DaemonConfig) -> str:
    """A certificate with no TCP gRPC listener to serve it."""
    g = cfg.grpc
    if not g.tls_cert or g.listen:
        return ""
    data = cfg.transports.data_listen
    what = (
        f"it serves only the tcp data channel (data_listen {data}), whose clients then need tls_ca"
        if data
        else "it is unused"
    )
    return (
        f"tls_cert {g.tls_cert} (--tls-cert) is set but there is no TCP gRPC listener "
        f"(listen is ''): {what}; add --listen HOST:PORT to serve gRPC over TLS"
    )


def host_bytes_warning(cfg: DaemonConfig) -> str:
    """A ``host_bytes`` that is not a whole number of slabs (``1gb`` = 10^9 bytes with 64 MiB
    slabs: 896 MiB): the tier is smaller than the figure given."""
    h = cfg.host_tier
    held = h.host_bytes // h.slab_bytes * h.slab_bytes
    if held == h.host_bytes:
        return ""
    return (
        f"host_bytes {h.host_bytes} (--host-bytes) is not a whole number of "
        f"{format_bytes(h.slab_bytes)} slabs: the host tier holds {format_bytes(held)}, rounded "
        "down (sizes: KB, MB, GB are powers of 1000, 1GB = 10^9 bytes; KiB, MiB, GiB powers of "
        "1024, 1GiB = 2^30)"
    )

"""The daemon's listeners: its gRPC servers (the Unix socket with reflection by default, the TCP
listener with TLS when configured, a health-only one), the /metrics server, the TLS of the
gRPC listener and of the data channel, and the locks, umask and fd limit around binding them.

Owned by the Daemon; built in its ``__init__``, bound and started by ``Daemon.start`` on the
event loop, stopped by its drain (or by ``abort_start``). A port taken since the startup
checks is a :class:`~kvtierd.preflight.StartupError` naming the setting and its flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from kvtierd import preflight
from kvtierd.cache import TieredCache
from kvtierd.config import DaemonConfig, is_loopback
from kvtierd.lockfile import OwnerLock
from kvtierd.metrics import MetricsServer
from kvtierd.preflight import StartupError, bind_refusal
from kvtierd.sessions import Session, SessionTable
from kvtierd.socket_dirs import socket_dir_refusal
from kvtierd.tenancy.exposure import metrics_scrape_only
from kvtierd.tenants import Tenant
from kvtierd.transports.control import ControlChannel
from kvtierd.transports.tcp import DataChannelLimits, DataChannelServer

ControlFactory = Callable[[Session, Callable[[ControlChannel], None]], ControlChannel]

log = logging.getLogger("kvtierd")
MAX_SOCKET_PATH_BYTES = 107
"""The longest path a Unix socket may be bound at (``sun_path`` is 108 bytes, NUL included)."""


class Listeners:
    """The gRPC servers of one daemon and the addresses they (and the transports and /metrics,
    which add theirs) bound. Event-loop thread only."""

    def __init__(
        self,
        cfg: DaemonConfig,
        health_servicer: health.aio.HealthServicer,
        grpc_server: Callable[[bool], grpc.aio.Server],
    ) -> None:
        self.cfg = cfg
        self.health = health_servicer
        self._grpc_server = grpc_server  # (reflect) -> a server with the Kvtier service on it
        self.server: grpc.aio.Server | None = None  # the Unix socket's
        self.tcp_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.addresses: dict[str, Any] = {}

    def servers(self) -> list[grpc.aio.Server]:
        return [s for s in (self.server, self.tcp_server, self.health_server) if s is not None]

    def bind(self) -> None:
        """One server per kind of listener: the Unix socket (reflection by default), the TCP
        listener (TLS when configured; no reflection unless "all"), a health-only one."""
        g = self.cfg.grpc
        if g.socket_path:
            self.server = self._grpc_server(g.reflection in ("unix", "all"))
            path = self.socket_path()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead daemon's (this one holds the socket's lock)
            with private_umask():  # created owner-only: no window before the chmod
                self.server.add_insecure_port(f"unix://{path}")
            os.chmod(path, g.socket_mode)
            self.addresses["unix"] = f"unix://{path}"
        if g.listen:
            self.tcp_server = self._grpc_server(g.reflection == "all")
            creds = _tls_credentials(self.cfg) if g.tls_cert else None
            port = _add_port(self.tcp_server, "listen", g.listen, creds)
            if creds is None and not is_loopback(g.listen):
                log.warning(
                    "gRPC listens on %s in plaintext (allow_plaintext_remote): "
                    "tokens and figures cross the network unencrypted",
                    g.listen,
                )
            self.addresses["grpc"] = f"{g.listen.rpartition(':')[0]}:{port}"
        if g.health_listen:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_server.add_generic_rpc_handlers((HealthOnly(self._grpc_addresses),))
            port = _add_port(self.health_server, "health_listen", g.health_listen, None)
            self.addresses["health"] = f"{g.health_listen.rpartition(':')[0]}:{port}"

    async def start(self) -> None:
        for server in self.servers():
            await server.start()

    async def stop(self, grace: float | None) -> None:
        for server in self.servers():
            await server.stop(grace)

    def _grpc_addresses(self) -> str:
        """Where the Kvtier service answers, in words (for HealthOnly's refusals)."""
        where = [
            f"{what} ({self.addresses[key]})"
            for key, what in (("grpc", "the gRPC port"), ("unix", "the Unix socket"))
            if key in self.addresses
        ]
        return " or ".join(where) or "the daemon's gRPC port (--listen) or Unix socket"

    def socket_path(self) -> str:
        path = self.cfg.grpc.socket_path
        return os.path.abspath(path) if path else ""

    def unlink_sockets(self, *keys: str) -> None:
        """Remove the Unix socket files bound under ``keys`` (the caller holds their lock)."""
        for key in keys:
            path = str(self.addresses.get(key, "")).removeprefix("unix://")
            if path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


class HealthOnly(grpc.GenericRpcHandler):  # type: ignore[misc]
    """The health-only listener's answer to any method but gRPC health: UNIMPLEMENTED in words
    that send the caller to the daemon's gRPC addresses (``where``, read per call), instead of
    grpc's "Method not found!" (a client pointed at the port the image exposes). Stateless."""

    HEALTH = "/grpc.health.v1.Health/"

    def __init__(self, where: Callable[[], str]) -> None:
        self._where = where

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if str(details.method).startswith(self.HEALTH):
            return None  # (the health servicer's)
        why = (
            "this address answers only health checks (the health port, --health-listen); "
            f"connect to {self._where()}"
        )

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, why)
            return b""  # (not reached: abort raises)

        return grpc.unary_unary_rpc_method_handler(refuse)


def start_metrics(
    cfg: DaemonConfig,
    addresses: dict[str, Any],
    snapshot: Callable[[Tenant | None], dict[str, Any]],
    authorize: Callable[[str | None], tuple[bool, Tenant | None]],
) -> MetricsServer:
    """The /metrics server, started (its address in ``addresses``)."""
    m = cfg.metrics
    metrics = MetricsServer(
        m.metrics_host, m.metrics_port, asyncio.get_running_loop(), snapshot, authorize=authorize
    )
    try:
        metrics.start()
    except OSError as e:
        raise StartupError(bind_refusal("metrics_port", m.metrics_host, m.metrics_port, e)) from None
    addresses["metrics"] = f"http://{m.metrics_host}:{metrics.port}/metrics"
    if cfg.tenancy.tenants_file and not is_loopback(f"{m.metrics_host}:{metrics.port}"):
        log.warning(
            "/metrics listens on %s in plaintext HTTP: the bearer tokens of its "
            "scrapes travel in the clear (%s)",
            addresses["metrics"],
            "scrape tokens only: figures, no keys or bytes"
            if metrics_scrape_only(cfg)
            else "every token is accepted there, tenants' and the operator's too: allow_plaintext_remote",
        )
    return metrics


async def start_data_channel(
    cfg: DaemonConfig,
    cache: TieredCache,
    sessions: SessionTable,
    control: ControlFactory,
    addresses: dict[str, Any],
) -> DataChannelServer:
    """The tcp data channel, started (its address in ``addresses``); control connections get
    ``control``'s channels when ``control_channel`` is on."""
    data_listen = cfg.transports.data_listen
    if not cfg.grpc.tls_cert and not is_loopback(data_listen):
        log.warning("the data channel listens on %s in plaintext (allow_plaintext_remote)", data_listen)
    host, _, port_s = data_listen.rpartition(":")
    data = DataChannelServer(
        host,
        int(port_s),
        cache,
        sessions,
        data_channel_limits(cfg),
        ssl_context=data_tls(cfg) if cfg.grpc.tls_cert else None,
        control=control if cfg.transports.control_channel else None,
    )
    try:
        await data.start()
    except OSError as e:
        raise StartupError(bind_refusal("data_listen", host, int(port_s), e)) from None
    addresses["data"] = f"{host}:{data.port}"
    return data


def data_channel_limits(cfg: DaemonConfig) -> DataChannelLimits:
    """What the data channel allows its connections."""
    t = cfg.transports
    return DataChannelLimits(
        hello_timeout_s=t.handshake_timeout_s,
        idle_timeout_s=t.data_idle_timeout_s,
        max_connections=t.data_max_connections,
        max_queued_bytes=t.data_max_queued_bytes,
        max_unauthenticated=t.data_max_unauthenticated,
        per_tenant=t.data_max_connections_per_tenant or max(1, t.data_max_connections // 2),
    )


def lock_sockets(cfg: DaemonConfig) -> OwnerLock | None:
    """The lock of the daemon's Unix sockets (``<socket>.lock``: the gRPC socket and the shm
    socket beside it), its directory made (0700 when new); None when it has neither. A socket
    path too long to bind is a StartupError first."""
    if not cfg.grpc.socket_path and not cfg.transports.shm_enabled:
        return None
    check_socket_paths(cfg)  # before anything is made
    base = os.path.abspath(cfg.shm_socket_path.removesuffix(".shm"))
    os.makedirs(os.path.dirname(base), mode=0o700, exist_ok=True)
    check_socket_dirs(cfg)  # before the lock file is made there
    return OwnerLock.take(base + ".lock")


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """umask 0177 (sockets and files owner-only) around a bind: the mode is then widened, if
    configured, by a chmod; never narrowed after others could connect."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def _add_port(server: grpc.aio.Server, name: str, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Bind ``address`` (setting ``name``) on ``server``; the port bound. StartupError (one
    line) when it cannot be bound: the preflight found it free, someone took it since."""
    try:
        port = int(
            server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpcio >= 1.50 raises where older ones returned 0
        port = 0
    if port == 0:
        host, _, port_s = address.rpartition(":")
        raise StartupError(bind_refusal(name, host, int(port_s), preflight.try_bind(host, int(port_s))))
    return port


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: every bound on connections (data, shm, index
    channels one per session, metrics) is the daemon's own, not a default soft limit of 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d: %s", soft, e)


def check_tls_files(cfg: DaemonConfig) -> None:
    """The TLS files load as what they are meant to be (gRPC itself would only fail to bind):
    ``tls_cert`` a certificate, ``tls_key`` its unencrypted key, ``tls_client_ca`` CA
    certificates; ValueError naming the setting otherwise."""
    g = cfg.grpc
    if not g.tls_cert:
        return
    for name, path in (("tls_cert", g.tls_cert), ("tls_key", g.tls_key), ("tls_client_ca", g.tls_client_ca)):
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ValueError(f"{name}: cannot read {path} (not a file this user may read)")
    _certificates("tls_cert", g.tls_cert)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(g.tls_cert, g.tls_key, password=lambda: b"")
    except ssl.SSLError as e:
        why = (
            f"is not the key of the certificate in {g.tls_cert} (tls_cert): give the key that "
            "certificate was made with, or the certificate of this key"
            if e.reason == "KEY_VALUES_MISMATCH"
            else "holds no unencrypted PEM private key" + (f" ({e.reason})" if e.reason else "")
        )
        raise ValueError(f"tls_key: {g.tls_key} {why}") from None
    if g.tls_client_ca:
        _certificates("tls_client_ca", g.tls_client_ca)


def _certificates(name: str, path: str) -> None:
    """``path`` (setting ``name``) holds at least one PEM certificate; ValueError otherwise."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except ssl.SSLError as e:
        why = f" ({e.reason})" if e.reason else ""
        raise ValueError(f"{name}: {path} holds no PEM certificate{why}") from None


def check_socket_dirs(cfg: DaemonConfig) -> None:
    """No other user than the daemon's can replace its Unix sockets (and their lock): their
    directory and those above it are not writable by others without the sticky bit, and theirs
    belongs to the daemon's user or root (:mod:`kvtierd.socket_dirs`); StartupError naming the
    setting, the directory and the fix otherwise."""
    for setting, path in _unix_sockets(cfg):
        why = socket_dir_refusal(setting, path)
        if why:
            raise StartupError(why)


def _unix_sockets(cfg: DaemonConfig, *, lock: bool = True) -> list[tuple[str, str]]:
    """(the setting, in words with its flag; the path) of every Unix socket the daemon binds
    and (``lock``) the lock file it makes."""
    g = cfg.grpc
    setting = f"socket_path (--socket {g.socket_path})" if g.socket_path else f"run_dir {g.run_dir}"
    paths = [g.socket_path] if g.socket_path else []
    if cfg.transports.shm_enabled:
        paths.append(cfg.shm_socket_path)
    if paths and lock:
        paths.append(cfg.shm_socket_path.removesuffix(".shm") + ".lock")
    return [(setting, path) for path in paths]


def check_socket_paths(cfg: DaemonConfig) -> None:
    """Every Unix socket path the daemon binds (absolute: it is advertised to clients) fits a
    Unix socket address (:data:`MAX_SOCKET_PATH_BYTES`); StartupError naming it otherwise."""
    for setting, path in _unix_sockets(cfg, lock=False):
        full = os.path.abspath(path)
        size = len(os.fsencode(full))
        if size > MAX_SOCKET_PATH_BYTES:
            raise StartupError(
                f"{setting}: the Unix socket {full} is {size} bytes long, more than the "
                f"{MAX_SOCKET_PATH_BYTES} a Unix socket path may have: choose a shorter --socket "
                "(e.g. --socket /tmp/kvtier-$USER/kvtier.sock; `make serve SERVE_ARGS='--socket "
                "...'`, clients then --address unix:///tmp/kvtier-$USER/kvtier.sock), or start "
                "the daemon from a shorter directory (relative paths are resolved from it)"
            )


def _tls_credentials(cfg: DaemonConfig) -> grpc.ServerCredentials:
    """The TCP listener's TLS (mTLS with ``tls_client_ca``); files read here, at start."""
    check_tls_files(cfg)

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"{name}: cannot read {path}: {e.strerror}") from None

    g = cfg.grpc
    ca = read("tls_client_ca", g.tls_client_ca) if g.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read("tls_key", g.tls_key), read("tls_cert", g.tls_cert))],
        root_certificates=ca,
        require_client_auth=g.tls_require_client_cert,
    )


def data_tls(cfg: DaemonConfig) -> ssl.SSLContext:
    """The data channel's TLS: the gRPC listener's certificate and key (TLS 1.2+); client
    certificates are asked for exactly as the gRPC listener asks (a connection still binds to a
    session only with that session's data secret)."""
    g = cfg.grpc
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(g.tls_cert, g.tls_key)
        if g.tls_client_ca:
            ctx.load_verify_locations(g.tls_client_ca)
    except OSError as e:
        raise ValueError(f"tls_cert/tls_key/tls_client_ca: cannot read: {e.strerror}") from None
    ctx.verify_mode = (
        ssl.CERT_REQUIRED
        if g.tls_require_client_cert
        else ssl.CERT_OPTIONAL
        if g.tls_client_ca
        else ssl.CERT_NONE
    )
    return ctx

"""The ``kvtierd`` command (also ``python -m kvtierd``): ``serve`` and ``fsck``.

The daemon's only place (with kvtierd.app's log level) that reads the environment and files:
it builds a :class:`~kvtierd.config.DaemonConfig` from the embedded defaults, an optional config
file and the flags, then hands it to :func:`kvtierd.app.run`. ``kvtier serve`` and ``kvtier fsck``
are aliases that start this command as a new process (the SDK never imports the daemon).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtier_contract.units import exact_bytes, parse_bytes
from kvtier_contract.version import __version__

if TYPE_CHECKING:
    from kvtierd.config import DaemonConfig


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mode(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an octal mode such as 600 or 0660, got {text!r}"
        ) from None


class _ConfigDefaults(argparse.HelpFormatter):
    """``kvtierd serve --help``: each flag's help ends with its default, the DaemonConfig field
    of its ``dest`` (the flags' own defaults are None: "not set", the file or default wins).
    kvtierd.config is imported only when help is shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = config_default(action.dest)
        if default is None:
            return text
        return f"{text} (default: {default.replace('%', '%%')})".lstrip()


def config_default(name: str) -> str | None:
    """The embedded default of DaemonConfig field ``name`` as a person writes it (``1GiB``,
    ``0600``, ``none``), or None: no such field."""
    import dataclasses

    from kvtierd.config import SIZE_FIELDS, flat_field

    field = flat_field(name)
    if field is None or field.default is dataclasses.MISSING:
        return None
    value = field.default
    if isinstance(value, bool):
        return f"{name} = {str(value).lower()}"
    if name in SIZE_FIELDS and isinstance(value, int):
        return exact_bytes(value) if value else "0"
    if name in ("socket_mode", "events_socket_mode"):
        return f"{value:04o}"
    return "none" if value == "" else str(value)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: a flag is spelt whole, so a deployment's list of flags it sets itself
    # (the chart's daemon.extraArgs check) cannot be passed with a prefix (--liste 0.0.0.0:1).
    p = argparse.ArgumentParser(
        prog="kvtierd",
        description="kvtier daemon: host and NVMe tiers of KV-cache blocks",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run the kvtierd daemon (embedded defaults, overridable)",
        formatter_class=_ConfigDefaults,
        description="Run the kvtierd daemon. Every flag overrides the DaemonConfig "
        "field of its name (docs/configuration.md); the defaults shown are the "
        "embedded ones, which --config FILE may change. Startup checks refuse, "
        "in one line and with exit status 2, a host tier larger than the memory "
        "available, a port in use and an unusable --disk-dir.",
    )
    _host_flags(s)
    _listener_flags(s)
    _storage_flags(s)
    _tenant_and_event_flags(s)
    _security_flags(s)

    _other_commands(sub)
    return p


def _other_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fsck`` and ``hash-token`` (flags spelt whole, as ``serve``'s)."""
    from kvtierd.tiers.nvme.fsck import FSCK_DESCRIPTION, add_fsck_arguments  # fsck's own

    f = sub.add_parser(
        "fsck",
        allow_abbrev=False,
        help="verify an NVMe tier directory offline (every slot; refused while a daemon uses it)",
        description=FSCK_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fsck_arguments(f)

    sub.add_parser(
        "hash-token",
        help="print the tokens_sha256 entry of a bearer token read "
        "from stdin (first line), for a tenants file",
    )


def _host_flags(s: argparse.ArgumentParser) -> None:
    """``serve``: the config file, the host tier, leases, cuda_ipc."""
    s.add_argument("--config", help="TOML or JSON file with DaemonConfig fields")
    s.add_argument("--host-bytes", type=_size, help="host tier size, e.g. 1GiB (GiB = 2^30 bytes, GB = 10^9)")
    s.add_argument(
        "--allow-host-bytes-over-available",
        dest="allow_host_bytes_over_available",
        action="store_const",
        const=True,
        help="start even when the host tier (and "
        "tenant arenas) exceed the memory available (warned at start)",
    )
    s.add_argument("--slab-bytes", type=_size, help="slab size (largest block), e.g. 64MiB")
    s.add_argument("--eviction-policy", choices=["lru", "arc", "prefix"], help="host tier eviction order")
    s.add_argument("--lease-ttl-s", type=float, help="default session lease in seconds")
    s.add_argument(
        "--no-prefault",
        dest="prefault",
        action="store_const",
        const=False,
        help="do not allocate the arena's pages at start",
    )
    s.add_argument(
        "--cuda-ipc",
        dest="cuda_ipc",
        action="store_const",
        const=True,
        help="offer the cuda_ipc transport (needs cupy and a GPU)",
    )


def _listener_flags(s: argparse.ArgumentParser) -> None:
    """``serve``: the Unix sockets, the TCP listeners, /metrics, health and reflection."""
    s.add_argument("--socket", dest="socket_path", help="gRPC Unix socket path ('' disables)")
    s.add_argument(
        "--socket-mode",
        type=_mode,
        help="mode of the Unix sockets, octal (600: the daemon's user only; 660: its group too)",
    )
    s.add_argument(
        "--listen",
        help="gRPC TCP HOST:PORT ('' disables); off loopback it needs --tenants-file or "
        "--tls-require-client-cert (and TLS)",
    )
    s.add_argument("--data-listen", help="TCP data channel HOST:PORT (off loopback: as --listen)")
    s.add_argument("--metrics-port", type=int, help="Prometheus port (-1 disables, 0 picks one)")
    s.add_argument("--metrics-host", help="Prometheus bind address")
    s.add_argument(
        "--health-listen", help="HOST:PORT serving only gRPC health, plaintext (kubelet grpc probes)"
    )
    s.add_argument(
        "--reflection", choices=["unix", "all", "off"], help="where gRPC server reflection is served"
    )


def _storage_flags(s: argparse.ArgumentParser) -> None:
    """``serve``: the NVMe and cluster tiers."""
    s.add_argument("--disk-dir", help="NVMe tier directory (enables the tier)")
    s.add_argument(
        "--disk-optional",
        dest="disk_optional",
        action="store_const",
        const=True,
        help="start with the host tier alone when --disk-dir cannot be used (the "
        "tier opens once it can); without it such a start is refused",
    )
    s.add_argument("--disk-bytes", type=_size, help="NVMe tier size, e.g. 100GiB; required with --disk-dir")
    s.add_argument(
        "--io-align", dest="io_align_bytes", type=_size, help="NVMe slot alignment (16KiB works too)"
    )
    s.add_argument(
        "--write-policy",
        choices=["write-back", "write-through", "selective"],
        help="when blocks are written to NVMe",
    )
    s.add_argument(
        "--cluster",
        help="cluster tier: redis://HOST:PORT[,HOST:PORT...] of a Redis "
        "or Valkey Cluster shared by the daemons of many nodes (rediss:// for TLS)",
    )
    s.add_argument(
        "--cluster-write-policy", choices=["commit", "evict"], help="which blocks are written to the cluster"
    )
    s.add_argument(
        "--cluster-fleet-key-file",
        help="the fleet key (hex, >= 32 bytes) that "
        "authenticates cluster values; required with --cluster (docs/cluster.md)",
    )
    s.add_argument(
        "--cluster-realm",
        help="without --tenants-file: this deployment's trust domain in the cluster "
        "(daemons share values only within one realm); required with --cluster then",
    )


def _tenant_and_event_flags(s: argparse.ArgumentParser) -> None:
    """``serve``: the tenants file, KV events."""
    s.add_argument(
        "--tenants-file",
        help="tenants, their token digests and quotas (TOML; docs/security.md); re-read on SIGHUP",
    )
    s.add_argument(
        "--events-endpoint",
        help="publish KV events (vLLM's wire format) on this ZMQ PUB endpoint, e.g. "
        "ipc:///run/kvtier-events/events.sock (tcp:// needs --allow-plaintext-remote; docs/events.md)",
    )
    s.add_argument(
        "--events-replay-endpoint", help="ZMQ ROUTER endpoint answering replay requests of --events-endpoint"
    )
    s.add_argument(
        "--events-tenant-endpoint", help="per-tenant event streams: ipc://PATH with {tenant} in it"
    )
    s.add_argument(
        "--events-tenant-replay-endpoint", help="per-tenant replay endpoints: ipc://PATH with {tenant} in it"
    )
    s.add_argument(
        "--events-block-hashes",
        choices=("int64", "bytes"),
        help="block keys on the wire: int64 (vLLM's default form, what routers decode) or whole 32-byte keys",
    )
    s.add_argument("--events-buffer-batches", type=int, help="messages kept for replay, per stream")
    s.add_argument("--events-stream-buffer-bytes", type=_size, help="bytes kept for replay, per stream")
    s.add_argument("--events-buffer-bytes", type=_size, help="bytes kept for replay, all streams")
    s.add_argument(
        "--events-socket-mode", type=_mode, help="mode of the ipc:// event sockets, octal (600: owner only)"
    )


def _security_flags(s: argparse.ArgumentParser) -> None:
    """``serve``: TLS, plaintext exposure, byte verification."""
    s.add_argument("--tls-cert", help="PEM certificate: the TCP gRPC listener (--listen) serves TLS")
    s.add_argument("--tls-key", help="PEM key of --tls-cert")
    s.add_argument("--tls-client-ca", help="PEM CA verifying client certificates (mTLS)")
    s.add_argument(
        "--tls-require-client-cert",
        dest="tls_require_client_cert",
        action="store_const",
        const=True,
        help="refuse TLS clients without one",
    )
    s.add_argument(
        "--allow-plaintext-remote",
        dest="allow_plaintext_remote",
        action="store_const",
        const=True,
        help="allow a non-loopback listen/data-listen without TLS (warned at start; it still "
        "needs --tenants-file)",
    )
    s.add_argument(
        "--allow-plaintext-metrics",
        dest="metrics_plaintext_remote",
        action="store_const",
        const=True,
        help="serve /metrics in plaintext off loopback; with tenants, only scrape tokens are accepted there",
    )
    s.add_argument(
        "--no-verify-bytes",
        dest="verify_bytes",
        action="store_const",
        const=False,
        help="give blocks no digest (loads unverified; for measuring its cost)",
    )
    s.add_argument("--verify-store", choices=["client", "daemon"], help="who hashes an shm store")


def main(argv: list[str] | None = None) -> int:
    try:
        return _command(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # Ctrl-C before the daemon's own handlers: its imports, its checks
        print("kvtierd: interrupted", file=sys.stderr)
        return 130


def _command(args: argparse.Namespace) -> int:
    """Run the subcommand ``args`` names."""
    if args.command == "hash-token":
        from kvtierd.tenants import token_digest

        token = sys.stdin.readline().strip()
        if not token:
            print("kvtierd hash-token: no token on stdin", file=sys.stderr)
            return 2
        print(token_digest(token))
        return 0
    if args.command == "fsck":
        from kvtierd.tiers.nvme.fsck import main as fsck_main

        return fsck_main(
            [
                args.directory,
                "--max-problems",
                str(args.max_problems),
                "--progress-interval",
                str(args.progress_interval),
            ]
        )
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from kvtierd.app import run

    try:
        cfg = _config(args)
        _check_files(cfg)
    except (ValueError, OSError) as e:
        why = str(e)
        if isinstance(e, OSError) and e.filename:
            why = f"cannot read {e.filename}: {e.strerror}"
            if e.filename == args.config:
                why = f"config: {why}"
        print(f"kvtierd serve: configuration error: {with_flag(why)}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


_NOT_FIELDS = ("command", "config")
"""The entries of a parsed ``serve`` that are no DaemonConfig field: every flag's ``dest`` is the
field it sets (a flag not given is None: the file's value or the default stays)."""


def _config(args: argparse.Namespace) -> DaemonConfig:
    """The embedded defaults, the --config file over them, the flags given over both."""
    from kvtierd.config import load_config, with_overrides

    cfg = load_config(args.config)
    return with_overrides(cfg, **{k: v for k, v in vars(args).items() if k not in _NOT_FIELDS})


def _check_files(cfg: DaemonConfig) -> None:
    """The files and packages the config names, refused here with the field rather than at
    start: the tenants file (and /metrics' exposure with it), the cluster's password file,
    the events' packages, the TLS files."""
    from kvtierd.app import cluster_settings
    from kvtierd.app.listeners import check_tls_files

    check_tls_files(cfg)  # a key that is not the certificate's: named here, not "cannot bind"
    if cfg.tenancy.tenants_file:
        from kvtierd.tenancy.exposure import check_metrics_exposure
        from kvtierd.tenants_file import load_tenants

        tenants = load_tenants(cfg.tenancy.tenants_file)  # refused here, with the field, not at start
        check_metrics_exposure(cfg, len(tenants.metrics_digests))
    if cfg.cluster_tier.cluster:
        cluster_settings(cfg)  # reads the password file: refused here, not at start
    if cfg.events.events_endpoint or cfg.events.events_tenant_endpoint:
        from kvtierd.events.publisher import check_dependencies

        check_dependencies()  # pyzmq and msgpack: refused here, naming events_endpoint


def with_flag(message: str) -> str:
    """``field: why`` errors of the config name the field's flag too: ``field: why (--flag)``."""
    field, sep, rest = message.partition(": ")
    if not sep or "(--" in field:
        return message
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]
    flags = {a.dest: a.option_strings[0] for a in serve._actions if a.option_strings}
    flag = flags.get(field)
    return f"{message} ({flag})" if flag and flag not in rest else message

"""What every ``kvtier`` command that talks to a daemon takes (``stats``, ``prefix``): the
address and credential flags (:func:`add_daemon_flags`), the client they make
(:func:`daemon_client`: a tcp client that opens no session until a call needs one), one call
through it with the errors said on stderr (:func:`call_daemon`), and the SDK's keyword
arguments in its errors said as those flags (:func:`as_flags`).

Part of the ``kvtier`` command (:mod:`kvtier.cli`): it reads the environment
(``KVTIER_TOKEN_FILE``). Plain functions; no state.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtier_contract import defaults

if TYPE_CHECKING:  # (grpc: imported when a command makes a client, not for --help)
    from kvtier.client import Client

__all__ = ["add_daemon_flags", "as_flags", "call_daemon", "daemon_client"]


def add_daemon_flags(p: argparse.ArgumentParser, call: str) -> None:
    """``--address``, ``--timeout-s`` (of the connect and of ``call``), ``--token-file``,
    ``--unix-login`` and the TLS files."""
    p.add_argument(
        "--address",
        default=None,
        help="unix:///abs/path, unix:rel/path or HOST:PORT (default: "
        f"{defaults.ADDRESS}, the socket `make serve` makes under this directory)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=2.0,
        help=f"deadline of the connect and of the {call} call, seconds (default 2)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding this tenant's bearer token (a daemon with tenants; an "
        "operator's token sees every namespace); or KVTIER_TOKEN_FILE",
    )
    p.add_argument(
        "--unix-login",
        action="store_true",
        help="no token: log in as this Unix user (a tenant with unix_login; a Unix socket address)",
    )
    p.add_argument("--tls-ca", help="PEM CA of a daemon whose TCP listener serves TLS")
    p.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    p.add_argument("--tls-key", help="PEM key of --tls-cert")


def daemon_client(args: argparse.Namespace) -> Client:
    """A client of the daemon the flags name (no session opened: the sessionless calls need
    none); InvalidArgument naming the SDK's argument (``as_flags`` says it as the flag)."""
    from kvtier.client import Client
    from kvtier.settings import ClientSettings

    return Client(
        args.address or defaults.default_address(),
        settings=ClientSettings(
            transport="tcp",
            timeout_s=args.timeout_s,
            heartbeat=False,
            token_file=None if args.unix_login else args.token_file or os.environ.get("KVTIER_TOKEN_FILE"),
            unix_login=args.unix_login,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ),
    )


# The SDK's errors name its keyword arguments (token=, tls_ca=, ...); the commands say their flags.
_SDK_ARGS = {
    "token_file": "--token-file",
    "token": "--token-file",
    "tls_ca": "--tls-ca",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "unix_login": "--unix-login",
    "timeout_s": "--timeout-s",
    "address": "--address",
}


def call_daemon(what: str, args: argparse.Namespace, call: Callable[[Client], Any]) -> tuple[int, Any]:
    """``call`` on :func:`daemon_client`'s client, closed after: (0, its answer), or the exit
    status with the error said on stderr as ``what: ...`` (2: no client, 1: the call)."""
    from kvtier_contract.errors import KvtierError

    try:
        client = daemon_client(args)
    except KvtierError as e:
        print(f"{what}: {as_flags(str(e))}", file=sys.stderr)
        return 2, None
    try:
        return 0, call(client)
    except KvtierError as e:
        print(f"{what}: {as_flags(str(e))}", file=sys.stderr)
        return 1, None
    finally:
        client.close()


def as_flags(message: str) -> str:
    """``message`` with the SDK's ``name=`` spellings (``unix_login=True`` too) replaced by the
    commands' flags."""
    flags = re.sub(
        r"\b(token_file|token|tls_ca|tls_cert|tls_key|unix_login|timeout_s|address)=(?:True\b)?",
        lambda m: _SDK_ARGS[m.group(1)],
        message,
    )
    return re.sub(r"(--[a-z-]+)(?:\s*(?:or|/)\s*\1)+", r"\1", flags)  # token= or token_file=

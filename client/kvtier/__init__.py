"""kvtier: client SDK for the kvtier daemon (kvtierd).

The SDK half of the project: it imports the shared contract (:mod:`kvtier_contract`: errors,
identity, wire formats, protobuf), never the daemon. ``kvtier.errors`` is the contract's error
module, re-exported for callers.

``import kvtier`` is cheap: it imports neither torch, cupy nor vLLM.

    client = kvtier.Client.connect("unix:///path/run/kvtier.sock", transport="shm")
    ns = client.register(kvtier.Namespace(...))
    keys = ns.block_keys(token_ids); n = ns.lookup(keys)

What a client is told is a :class:`ClientSettings` (``Client.connect``'s keyword arguments are its
fields): ``Client.connect(address, settings=kvtier.ClientSettings(transport="tcp", ...))``.

gRPC's own C-core log lines (``I1206 ... ssl_transport_security.cc``) stay out of the engine's
logs: importing kvtier sets ``GRPC_VERBOSITY=ERROR`` unless it is set already (an operator's
``GRPC_VERBOSITY=INFO`` still wins). grpc reads it when it is first imported: in a process
that imported grpc before kvtier, set it there (docs/troubleshooting.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before the first `import grpc` (below)

from kvtier import aio  # noqa: E402
from kvtier.client import Client, NamespaceHandle, PutResult  # noqa: E402
from kvtier.settings import ClientSettings  # noqa: E402
from kvtier_contract import errors  # noqa: E402
from kvtier_contract.errors import KvtierError  # noqa: E402
from kvtier_contract.identity import Namespace, block_keys, namespace_digest  # noqa: E402
from kvtier_contract.version import __version__ as __version__  # noqa: E402

__all__ = [
    "aio",
    "errors",
    "Client",
    "ClientSettings",
    "KvtierError",
    "Namespace",
    "NamespaceHandle",
    "PutResult",
    "block_keys",
    "namespace_digest",
]

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
"""

from __future__ import annotations

from kvtier import aio
from kvtier.client import Client, NamespaceHandle, PutResult
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.errors import KvtierError
from kvtier_contract.identity import Namespace, block_keys, namespace_digest
from kvtier_contract.version import __version__ as __version__

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

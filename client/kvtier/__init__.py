"""kvtier: client SDK for the kvtier daemon (kvtierd).

``import kvtier`` is cheap: it imports neither torch, cupy nor vLLM.

    client = kvtier.Client.connect("unix:///path/run/kvtier.sock", transport="shm")
    ns = client.register(kvtier.Namespace(...))
    keys = ns.block_keys(token_ids); n = ns.lookup(keys)
"""

from __future__ import annotations

from kvtier import aio
from kvtier.client import Client, NamespaceHandle, PutResult
from kvtier.errors import KvtierError
from kvtier.identity import Namespace, block_keys, namespace_digest

__version__ = "0.1.0"
__all__ = ["aio", "Client", "KvtierError", "Namespace", "NamespaceHandle", "PutResult", "block_keys",
           "namespace_digest"]

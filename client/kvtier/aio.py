"""asyncio flavour of the client SDK.

``AsyncClient`` has the sync :class:`kvtier.Client`'s API with coroutines: every call runs the
sync implementation on a small thread pool owned by the client, so the caller's event loop never
blocks on gRPC or on a copy, and the resilience rules (deadlines, misses and drops while the
daemon is away, reconnection) are the same code::

    async with await kvtier.aio.AsyncClient.connect(address, transport="tcp") as client:
        ns = await client.register(kvtier.Namespace(...))
        n = await ns.lookup(ns.block_keys(tokens))

Concurrency: coroutines may call one client concurrently; transfers are serialized as in the
sync client.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvtier.client import Client, NamespaceHandle, PublishedPrefix, PutResult, TransportName
from kvtier_contract.identity import Namespace

T = TypeVar("T")


class AsyncClient:
    """Owns a sync Client and the executor that runs it."""

    def __init__(self, client: Client, workers: int = 4) -> None:
        self.sync = client
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-aio")

    @classmethod
    async def connect(cls, address: str, transport: TransportName = "shm", **kwargs: Any) -> AsyncClient:
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(
            None, functools.partial(Client.connect, address, transport, **kwargs)
        )
        return cls(client)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def register(self, namespace: Namespace) -> AsyncNamespace:
        return AsyncNamespace(self, await self._run(self.sync.register, namespace))

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.sync.stats)

    async def publish_prefix(self, group: str, name: str, token_ids: Sequence[int]) -> PublishedPrefix:
        return await self._run(self.sync.publish_prefix, group, name, token_ids)

    async def withdraw_prefix(self, group: str, name: str) -> bool:
        return await self._run(self.sync.withdraw_prefix, group, name)

    async def published_prefixes(self) -> list[PublishedPrefix]:
        return await self._run(self.sync.published_prefixes)

    @property
    def counters(self) -> Any:
        return self.sync.counters

    @property
    def tenant(self) -> str | None:
        """``Client.tenant``: the tenant the credential proved (namespaces without one take it)."""
        return self.sync.tenant

    @property
    def events(self) -> bool:
        """``Client.events``: the daemon publishes KV events of this client's blocks."""
        return self.sync.events

    async def close(self) -> None:
        await self._run(self.sync.close)
        self._pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncNamespace:
    """Coroutine twin of :class:`kvtier.client.NamespaceHandle`."""

    def __init__(self, client: AsyncClient, handle: NamespaceHandle) -> None:
        self.client = client
        self.handle = handle
        self.block_bytes = handle.block_bytes
        self.namespace_id = handle.namespace_id

    def block_keys(self, token_ids: Sequence[int], **kwargs: Any) -> list[bytes]:
        return self.handle.block_keys(token_ids, **kwargs)  # pure hashing: no I/O

    async def lookup(self, keys: Sequence[bytes]) -> int:
        return await self.client._run(self.handle.lookup, keys)

    async def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> PutResult:
        return await self.client._run(self.handle.put, keys, blocks)

    async def get(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """``NamespaceHandle.get`` (block views of one buffer; its lifetime rules)."""
        return await self.client._run(self.handle.get, keys)

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        return await self.client._run(self.handle.get_into, keys, buffers)

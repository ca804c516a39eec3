"""NamespaceHandle: a registered namespace on one :class:`kvtier.Client` (re-exported by
:mod:`kvtier.client`): hashing plus the batch operations, their arguments checked here; the RPCs
and transfers are :mod:`kvtier.batches`, over the client's session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from kvtier import batches
from kvtier.buffers import byte_view
from kvtier.calls import SessionPort
from kvtier.get_buffers import GetBuffers
from kvtier.results import ClientCounters, LookupResult, PinnedEach, PinnedLookup, PutResult
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.identity import Namespace

_MAPPED = ("shm", "cuda_ipc")  # transports that map the arena (direct put_blocks/get_blocks)


class HandleOwner(Protocol):
    """What a handle needs of its :class:`kvtier.Client` (which is one)."""

    @property
    def session(self) -> SessionPort: ...

    @property
    def settings(self) -> ClientSettings: ...

    @property
    def tenant_key(self) -> bytes | None: ...

    @property
    def counters(self) -> ClientCounters: ...


class NamespaceHandle:
    """A registered namespace on one Client: hashing plus the batch operations.

    ``lookup`` -> longest ready prefix; ``put`` -> PutResult; ``get`` -> list of memoryview or
    None; ``get_into`` fills caller buffers and returns which keys were found. Checks its
    arguments here; the RPCs and transfers are :mod:`kvtier.batches`. Thread-safe as the Client
    is.
    """

    def __init__(self, client: HandleOwner, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.namespace_id = namespace.namespace_id
        self.registered_epoch = 0
        self.register_retry_at = 0.0
        self.get_buffers = GetBuffers()  # the memory of ``get`` (kept for reuse)

    def take_tenant(self, tenant: str) -> None:
        """The namespace, when it names no tenant, takes ``tenant``: the tenant the client's
        credential proved (``OpenSessionReply.tenant``), given by the session before it registers
        the namespace; the id and the block keys are then those of the tenant's namespace. A
        group's namespace (``Namespace.group``) stays the group's."""
        if self.namespace.tenant is None and self.namespace.group is None and tenant:
            self.namespace = replace(self.namespace, tenant=tenant)
            self.namespace_id = self.namespace.namespace_id

    def block_keys(
        self, token_ids: Sequence[int], *, parent: bytes | None = None, extras: Sequence[bytes] | None = None
    ) -> list[bytes]:
        return self.namespace.block_keys(
            token_ids, parent=parent, extras=extras, tenant_key=self.client.tenant_key
        )

    def lookup(self, keys: Sequence[bytes]) -> int:
        return batches.lookup(self.client.session, self, keys)

    def lookup_local(self, keys: Sequence[bytes], *, count: bool = True) -> int | None:
        """The hit prefix from the daemon's published index, or None when it cannot answer
        (another host, not mapped yet, daemon away or frozen): never a round trip. ``count``
        False: left out of the lookup counts (a probe that a counted lookup follows)."""
        return batches.lookup_local(self.client.session, self, keys, count=count)

    def lookup_detail(self, keys: Sequence[bytes]) -> LookupResult:
        """Like lookup, with the tier of each hit and whether NVMe holds it durably."""
        return batches.lookup_detail(self.client.session, self, keys)

    def lookup_tiers(self, keys: Sequence[bytes]) -> LookupResult:
        """``lookup_detail`` that answers a miss without a round trip when it can: the daemon's
        published index is asked first (:mod:`kvtier.local_index`); only a hit, or an index that
        cannot answer, goes to the daemon for each block's tier. Counted once either way. For
        callers that decide per tier whether to load (:mod:`kvtier.adaptive`)."""
        local = self.lookup_local(keys, count=False)
        if local == 0:
            self.lookup_local(keys)  # count the miss (the index answers again; no round trip)
            return LookupResult(0, [], [])
        return self.lookup_detail(keys)

    def lookup_pinned(self, keys: Sequence[bytes], *, promote: bool = True) -> PinnedLookup:
        """Like lookup_detail (at most one batch of keys), and the hits stay pinned against
        eviction until ``client.release(result.pin, result.epoch)``. The daemon starts
        promoting hits held only below the host tier (and importing cluster hits) at once;
        ``promote`` False holds them only, for a caller that may decide not to load them (the
        load that does promotes them then)."""
        return batches.lookup_pinned(self.client.session, self, keys, promote=promote)

    def lookup_each_pinned(self, keys: Sequence[bytes]) -> PinnedEach:
        """One answer per key, not a prefix (at most one batch of keys): the keys ready in the
        host tier, or promoted into it now, are found and stay pinned until
        ``client.release(result.pin, result.epoch)``. Releasing counts their blocks as loaded
        in the daemon's figures (the pin is a load job); prefer ``lookup_pinned`` for a chain."""
        return batches.lookup_each_pinned(self.client.session, self, keys)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the daemon to promote the NVMe-resident blocks of the ready prefix ahead of a
        get; returns how many promotions it started (0 when the daemon is away)."""
        return batches.prefetch(self.client.session, self, keys)

    def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[Any],
        *,
        deadline: float | None = None,
        token_ids: Sequence[int] | None = None,
        parent: bytes | None = None,
    ) -> PutResult:
        """Store ``blocks`` under ``keys``. ``token_ids`` (every key's tokens, in order) and
        ``parent`` (the key before ``keys[0]``) are optional: the daemon publishes them in its
        KV events for cache-aware routers (docs/events.md)."""
        return batches.put(
            self.client.session,
            self,
            keys,
            self._views(keys, blocks, "block"),
            deadline=deadline,
            token_ids=token_ids,
            parent=parent,
        )

    def put_blocks(
        self,
        keys: Sequence[bytes],
        layout: Any,
        block_ids: Sequence[int],
        *,
        deadline: float | None = None,
        guard: batches.CopyGuard | None = None,
        token_ids: Sequence[int] | None = None,
        parent: bytes | None = None,
    ) -> PutResult:
        """Store engine blocks ``block_ids`` of a paged cache (a ``kvtier.layouts`` layout) under
        ``keys``: one gather kernel into a staging tensor, then one batched put. ``guard``: the
        engine's say over when the engine blocks may be read (``batches.CopyGuard``).
        ``token_ids`` and ``parent``: optional, as for :meth:`put` (the daemon's KV events)."""
        if self.client.settings.transport in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return batches.put_blocks(
                self.client.session,
                self,
                keys,
                layout,
                block_ids,
                deadline=deadline,
                guard=guard,
                token_ids=token_ids,
                parent=parent,
            )
        batches.check_origin(self, keys, token_ids, parent)  # before the copy out
        staging = self._staging(layout, keys, block_ids)
        try:  # the copy out of the engine blocks, before any RPC
            staging = batches.guarded_gather(layout, block_ids, staging, guard)
        except batches.CopyRevoked:
            self.client.counters.puts_dropped += len(keys)
            return PutResult(dropped=len(keys))
        return self.put(keys, list(staging), deadline=deadline, token_ids=token_ids, parent=parent)

    def get_blocks(
        self,
        keys: Sequence[bytes],
        layout: Any,
        block_ids: Sequence[int],
        *,
        deadline: float | None = None,
        host_only: bool = False,
    ) -> list[bool]:
        """Load ``keys`` into engine blocks ``block_ids`` (one batched get, then one scatter
        kernel); blocks not found are left untouched. Returns which were loaded. ``deadline``:
        no RPC starts after it (the blocks not loaded by then are misses). ``host_only``: load
        only what the daemon's host tier holds now, never waiting on a promotion (a block that
        left the host tier is a miss at once; ``PrepareLoadRequest.host_only``)."""
        if self.client.settings.transport in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return batches.get_blocks(
                self.client.session, self, keys, layout, block_ids, deadline=deadline, host_only=host_only
            )
        staging = self._staging(layout, keys, block_ids)
        found = self.get_into(keys, list(staging), deadline=deadline, host_only=host_only)
        hit = [i for i, f in enumerate(found) if f]
        if hit:
            ids = [block_ids[i] for i in hit]
            layout.scatter(ids, staging[hit] if len(hit) < len(found) else staging)
        return found

    def _staging(self, layout: Any, keys: Sequence[bytes], block_ids: Sequence[int]) -> Any:
        self._check_layout(layout, keys, block_ids)
        return layout.staging(len(keys))

    def _check_layout(self, layout: Any, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        if layout.block_bytes != self.block_bytes:
            raise errors.InvalidArgument(
                f"layout blocks have {layout.block_bytes} bytes, namespace blocks {self.block_bytes}",
                field="layout",
            )
        if len(block_ids) != len(keys):
            raise errors.InvalidArgument(
                f"{len(block_ids)} block ids for {len(keys)} keys", field="block_ids"
            )
        layout.check_ids(block_ids)

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[memoryview | None]:
        """Load ``keys``: one writable block-long ``memoryview`` per key found, None per miss.
        The views of one call are cut from one buffer (``kvtier.get_buffers``): the caller's
        while it holds any of them (or anything over their memory), reused by a later get only
        once nothing holds it; ``bytes(view)`` for a copy of one's own."""
        bufs = self.get_buffers.take(len(keys), self.block_bytes)
        found = self.get_into(keys, bufs, deadline=deadline)
        return [b if f else None for b, f in zip(bufs, found, strict=True)]

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any],
        *,
        deadline: float | None = None,
        host_only: bool = False,
    ) -> list[bool]:
        """Load ``keys`` into ``buffers`` (one block each); which were loaded. ``host_only``:
        as ``get_blocks``."""
        views = self._views(keys, buffers, "buffer", writable=True)
        return batches.get_into(
            self.client.session, self, keys, views, deadline=deadline, host_only=host_only
        )

    def _views(
        self, keys: Sequence[bytes], objs: Sequence[Any], what: str, *, writable: bool = False
    ) -> list[memoryview]:
        """Byte views of the blocks to put (``what`` = "block") or the buffers to fill
        ("buffer"): one per key, each exactly one block long."""
        name = f"{what}s"
        if len(keys) != len(objs):
            raise errors.InvalidArgument(f"{len(objs)} {name} for {len(keys)} keys", field=name)
        views = [byte_view(b, writable=writable, field=name) for b in objs]
        for i, v in enumerate(views):
            if len(v) != self.block_bytes:
                raise errors.InvalidArgument(
                    f"{what} {i} has {len(v)} bytes, namespace blocks have {self.block_bytes}", field=name
                )
        return views

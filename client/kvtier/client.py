"""kvtier.Client: the engine's handle on a kvtierd daemon (sync flavour; kvtier.aio wraps it).

Lifecycle::

    client = Client.connect("unix:///run/kvtier.sock", transport="shm")   # raises if it cannot
    ns = client.register(Namespace(...))                                # (lazy=True: never)
    keys = ns.block_keys(token_ids); n = ns.lookup(keys)
    ns.put(keys, blocks); ns.get(keys); ns.get_into(keys, buffers)
    client.close()                       # or `with Client.connect(...) as client:`

Never hang the engine: every RPC has a deadline (``timeout_s``), and a put or get may take an
overall ``deadline`` (a ``time.monotonic()`` value, e.g. the end of an engine step's budget; by
default ``op_timeout_s`` from its start). ``Client.connect`` opens the session at once and raises
one error naming the address, the cause and the fix when it cannot (no daemon there, a refused
or missing token, a TLS mistake: :mod:`kvtier.diagnose`); with ``lazy=True`` (what the engine
integrations use) it never raises for that: the cause is logged once at WARNING and the client
connects by itself once the daemon is there. When the daemon is down, silent or restarting, lookups
answer 0, gets answer misses and puts are dropped, each counted in ``client.counters``; a
circuit breaker (which several clients may share: ``breaker=``) then answers every call at once
until its probe thread has seen the daemon again and reopened the session, re-registered the
namespaces and reattached the transport (also when a reply shows a new boot epoch). Caller
mistakes (wrong block size, bad namespace) still raise
:class:`kvtier_contract.errors.InvalidArgument`.

Where the parts live: the session, the breaker and the data transport in :mod:`kvtier.session`
(a ``Client`` uses one: ``client.session``); what it is told in :mod:`kvtier.settings`; the
batched, two-phase operations behind ``NamespaceHandle`` in :mod:`kvtier.batches`; address
handling in :mod:`kvtier.addresses`; the result types in :mod:`kvtier.results`. This module
keeps the public API and argument checks.

Thread-safety: a Client may be shared by threads; control calls run concurrently, transfers on
the data channel are serialized by a lock, reconnects by another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import batches
from kvtier.addresses import address_target
from kvtier.breaker import Breaker
from kvtier.buffers import byte_view
from kvtier.results import (
    ClientCounters,
    LookupResult,
    PinnedEach,
    PinnedLookup,
    PutResult,
    SlicesLookup,
    TierFigure,
)
from kvtier.session import Away, Session
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.identity import Namespace
from kvtier_contract.protoutil import TransportName, to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb

__all__ = ["Client", "ClientCounters", "ClientSettings", "LookupResult", "NamespaceHandle", "PinnedLookup",
           "PutResult", "SlicesLookup", "TransportName", "address_target"]

_MAPPED = ("shm", "cuda_ipc")  # transports that map the arena (direct put_blocks/get_blocks)


class Client:
    """See the module docstring. Owns its :class:`kvtier.session.Session` (``session``: the gRPC
    channel, the daemon session, the data transport; its docstring states the states and the
    locking) and the handles it made; the public verbs and their argument checks are here."""

    def __init__(self, address: str, transport: TransportName | None = None, *,
                 settings: ClientSettings | None = None, breaker: Breaker | None = None,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        """A client for ``address``, its session not opened yet (``connect`` opens it).
        ``settings`` (a :class:`kvtier.settings.ClientSettings`), or ``transport`` and
        ``kwargs`` (its fields: ``timeout_s``, ``lease_ttl_s``, ``token_file``...; TypeError for
        another name); not both (``transport`` default: ``"shm"``). ``breaker``: one shared with
        other clients (an engine worker's); ``clock``: the deadlines' (``time.monotonic``)."""
        if settings is None:
            settings = ClientSettings.of(transport or "shm", **kwargs)
        elif kwargs or transport not in (None, settings.transport):
            raise TypeError("give settings or keyword arguments, not both")
        self.session = Session(address, settings, breaker=breaker, clock=clock)

    @classmethod
    def connect(cls, address: str, transport: TransportName | None = None, *, lazy: bool = False,
                **kwargs: Any) -> Client:
        """A client for ``address`` (``kwargs``: ``__init__``'s: ``settings``, ``breaker``,
        ``clock``, or :class:`kvtier.settings.ClientSettings`' fields), its session opened now,
        every step within one deadline ``timeout_s`` from now: the daemon answered and took
        the credential.

        Raises, the client closed, when it cannot: ``Unavailable`` (no daemon there, a TLS
        mistake), ``Unauthenticated`` (no token, or one refused), ``PermissionDenied`` (a
        private socket, a refused Unix login), each naming the address, the cause and the fix
        (``field``: the argument to change); ``InvalidArgument`` for a malformed address or
        option. ``lazy=True`` (an engine that must not fail): never raises for the daemon; the
        cause is logged once at WARNING (and kept in ``counters.last_error``; no TLS probe on
        the caller's thread, so a closed connection's cause is a likely one), calls miss and
        drop, and the client connects by itself once the daemon is there."""
        client = cls(address, transport, **kwargs)
        try:
            diagnosis = client.session.first_open(strict=not lazy)
        except BaseException:
            client.close()
            raise
        if diagnosis is not None and not lazy:
            client.close()
            raise diagnosis.error
        return client

    # -- what the session knows (read-only unless said) ---------------------------------------------

    @property
    def settings(self) -> ClientSettings:
        return self.session.settings

    @property
    def address(self) -> str:
        return self.session.address

    @property
    def transport_name(self) -> TransportName:
        return self.session.transport_name

    @property
    def tenant_key(self) -> bytes | None:
        return self.session.tenant_key

    @property
    def timeout_s(self) -> float:
        return self.session.timeout_s

    @property
    def op_timeout_s(self) -> float:
        return self.session.op_timeout_s

    @property
    def pipeline_bytes(self) -> int:
        """``ClientSettings.pipeline_bytes`` in effect; settable per client."""
        return self.session.pipeline_bytes

    @pipeline_bytes.setter
    def pipeline_bytes(self, value: int) -> None:
        self.session.pipeline_bytes = value

    @property
    def counters(self) -> ClientCounters:
        return self.session.counters

    @property
    def breaker(self) -> Breaker:
        return self.session.breaker

    @property
    def connected(self) -> bool:
        return self.session.connected

    @property
    def boot_epoch(self) -> int:
        return self.session.boot_epoch

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self.session.max_batch

    def tier_figures(self) -> dict[str, TierFigure]:
        """The daemon's latest per-tier load figures (``Session.tier_figures``). Any thread."""
        return self.session.tier_figures()

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now, on this client's clock."""
        return self.session.deadline(timeout_s)

    # -- the verbs -------------------------------------------------------------------------------------

    def register(self, namespace: Namespace, *, deadline: float | None = None) -> NamespaceHandle:
        """A handle for ``namespace`` (validated here; registered now if the session is open and
        the breaker closed, within ``timeout_s`` and ``deadline``; else on the next (re)open)."""
        if not isinstance(namespace, Namespace):
            raise errors.InvalidArgument("expected a kvtier.Namespace", field="namespace")
        handle = NamespaceHandle(self, namespace)
        self.session.add_namespace(handle, deadline)
        return handle

    def stats(self) -> dict[str, Any]:
        """The daemon's Stats figures as a dict; raises the error naming the cause and the fix
        when the daemon cannot be reached or refuses (as ``connect`` does)."""
        return to_dict(self.session.stats())

    def lookup_slices(self, handles: Sequence[NamespaceHandle],
                      chains: Sequence[Sequence[bytes]], *, promote: bool = True) -> SlicesLookup:
        """A pinned lookup of ``chains[i]`` in ``handles[i]``'s namespace for each parallel slice
        of an engine (one namespace per TP rank), in one round trip: the hit is the prefix every
        slice holds (each slice's keys are cut at the hit so far; it stops at a slice with no
        hit). Release each slice's pin (``SlicesLookup.slices[i].pin``). A daemon that does not
        serve it (older than this SDK) gets one pinned lookup per slice, same answer.
        ``promote`` False: hold the hits only (``lookup_pinned``)."""
        return batches.lookup_slices(self.session, handles, chains, promote=promote)

    def release(self, pin: int, epoch: int = 0) -> bool:
        """Unpin what ``lookup_pinned`` pinned. Never raises: a pin the daemon no longer knows
        (restart, lease expiry) is already released. Returns whether the daemon confirmed."""
        if not pin or (epoch and epoch != self.session.boot_epoch):
            return False
        try:
            self.session.call("CompleteLoad", pb.CompleteLoadRequest(job_id=pin),
                              reconnect=False)
        except (Away, errors.KvtierError):
            return False
        return True

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NamespaceHandle:
    """A registered namespace on one Client: hashing plus the batch operations.

    ``lookup`` -> longest ready prefix; ``put`` -> PutResult; ``get`` -> list of bytearray or
    None; ``get_into`` fills caller buffers and returns which keys were found. Checks its
    arguments here; the RPCs and transfers are :mod:`kvtier.batches`. Thread-safe as the Client
    is.
    """

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.namespace_id = namespace.namespace_id
        self.registered_epoch = 0
        self.register_retry_at = 0.0

    def block_keys(self, token_ids: Sequence[int], *, parent: bytes | None = None,
                   extras: Sequence[bytes] | None = None) -> list[bytes]:
        return self.namespace.block_keys(token_ids, parent=parent, extras=extras,
                                         tenant_key=self.client.tenant_key)

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

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any], *,
            deadline: float | None = None, token_ids: Sequence[int] | None = None,
            parent: bytes | None = None) -> PutResult:
        """Store ``blocks`` under ``keys``. ``token_ids`` (every key's tokens, in order) and
        ``parent`` (the key before ``keys[0]``) are optional: the daemon publishes them in its
        KV events for cache-aware routers (docs/events.md)."""
        return batches.put(self.client.session, self, keys, self._views(keys, blocks, "block"),
                           deadline=deadline, token_ids=token_ids, parent=parent)

    def put_blocks(self, keys: Sequence[bytes], layout: Any, block_ids: Sequence[int], *,
                   deadline: float | None = None, guard: batches.CopyGuard | None = None,
                   token_ids: Sequence[int] | None = None, parent: bytes | None = None
                   ) -> PutResult:
        """Store engine blocks ``block_ids`` of a paged cache (a ``kvtier.layouts`` layout) under
        ``keys``: one gather kernel into a staging tensor, then one batched put. ``guard``: the
        engine's say over when the engine blocks may be read (``batches.CopyGuard``).
        ``token_ids`` and ``parent``: optional, as for :meth:`put` (the daemon's KV events)."""
        if self.client.transport_name in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return batches.put_blocks(self.client.session, self, keys, layout, block_ids,
                                      deadline=deadline, guard=guard, token_ids=token_ids,
                                      parent=parent)
        batches.check_origin(self, keys, token_ids, parent)  # before the copy out
        staging = self._staging(layout, keys, block_ids)
        try:  # the copy out of the engine blocks, before any RPC
            staging = batches.guarded_gather(layout, block_ids, staging, guard)
        except batches.CopyRevoked:
            self.client.counters.puts_dropped += len(keys)
            return PutResult(dropped=len(keys))
        return self.put(keys, list(staging), deadline=deadline, token_ids=token_ids,
                        parent=parent)

    def get_blocks(self, keys: Sequence[bytes], layout: Any, block_ids: Sequence[int], *,
                   deadline: float | None = None, host_only: bool = False) -> list[bool]:
        """Load ``keys`` into engine blocks ``block_ids`` (one batched get, then one scatter
        kernel); blocks not found are left untouched. Returns which were loaded. ``deadline``:
        no RPC starts after it (the blocks not loaded by then are misses). ``host_only``: load
        only what the daemon's host tier holds now, never waiting on a promotion (a block that
        left the host tier is a miss at once; ``PrepareLoadRequest.host_only``)."""
        if self.client.transport_name in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return batches.get_blocks(self.client.session, self, keys, layout, block_ids,
                                      deadline=deadline, host_only=host_only)
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
            raise errors.InvalidArgument(f"layout blocks have {layout.block_bytes} bytes, namespace "
                                         f"blocks {self.block_bytes}", field="layout")
        if len(block_ids) != len(keys):
            raise errors.InvalidArgument(f"{len(block_ids)} block ids for {len(keys)} keys",
                                         field="block_ids")
        layout.check_ids(block_ids)

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None
            ) -> list[bytearray | None]:
        bufs = [bytearray(self.block_bytes) for _ in keys]
        found = self.get_into(keys, bufs, deadline=deadline)
        return [b if f else None for b, f in zip(bufs, found, strict=True)]

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any], *,
                 deadline: float | None = None, host_only: bool = False) -> list[bool]:
        """Load ``keys`` into ``buffers`` (one block each); which were loaded. ``host_only``:
        as ``get_blocks``."""
        views = self._views(keys, buffers, "buffer", writable=True)
        return batches.get_into(self.client.session, self, keys, views, deadline=deadline,
                                host_only=host_only)

    def _views(self, keys: Sequence[bytes], objs: Sequence[Any], what: str, *,
               writable: bool = False) -> list[memoryview]:
        """Byte views of the blocks to put (``what`` = "block") or the buffers to fill
        ("buffer"): one per key, each exactly one block long."""
        name = f"{what}s"
        if len(keys) != len(objs):
            raise errors.InvalidArgument(f"{len(objs)} {name} for {len(keys)} keys", field=name)
        views = [byte_view(b, writable=writable, field=name) for b in objs]
        for i, v in enumerate(views):
            if len(v) != self.block_bytes:
                raise errors.InvalidArgument(
                    f"{what} {i} has {len(v)} bytes, namespace blocks have {self.block_bytes}",
                    field=name)
        return views

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

Where the parts live: the calls in :mod:`kvtier.session` (a ``Client`` holds one:
``client.session``), the daemon session it holds, the breaker and the data transport in
:mod:`kvtier.connection` (``client.session.connection``); what it is told in
:mod:`kvtier.settings` (``client.settings``, one frozen value); the
batched, two-phase operations behind ``NamespaceHandle`` in :mod:`kvtier.batches`; address
handling in :mod:`kvtier.addresses`; the result types in :mod:`kvtier.results`. This module
keeps the public API and argument checks.

Thread-safety: a Client may be shared by threads; control calls run concurrently, transfers on
the data channel are serialized by a lock, reconnects by another.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier import batches
from kvtier.addresses import address_target
from kvtier.breaker import Breaker
from kvtier.connection import Connection
from kvtier.grpc_channel import GrpcChannel
from kvtier.handle import NamespaceHandle
from kvtier.local_index import LocalIndexes
from kvtier.prefixes import PublishedPrefix, prefix_digest
from kvtier.results import ClientCounters, LookupResult, PinnedLookup, PutResult, SlicesLookup, TierFigure
from kvtier.session import Away, Session
from kvtier.settings import ClientSettings
from kvtier_contract import errors
from kvtier_contract.identity import Namespace
from kvtier_contract.prefixes import MAX_PREFIX_TOKENS
from kvtier_contract.protoutil import TransportName, to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb

__all__ = [
    "Client",
    "ClientCounters",
    "ClientSettings",
    "LookupResult",
    "NamespaceHandle",
    "PinnedLookup",
    "PublishedPrefix",
    "PutResult",
    "SlicesLookup",
    "TransportName",
    "address_target",
]


class Client:
    """See the module docstring. The SDK's composition root: builds and owns its
    :class:`kvtier.session.Session` (``session``, holding its
    :class:`kvtier.connection.Connection`: the gRPC channel, the daemon session, the data
    transport; their docstrings state the states and the locking), each part handed the one
    :class:`kvtier.settings.ClientSettings` (``settings``, frozen) it reads; and the handles it
    made. The public verbs and their argument checks are here."""

    def __init__(
        self,
        address: str,
        transport: TransportName | None = None,
        *,
        settings: ClientSettings | None = None,
        breaker: Breaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        """A client for ``address``, its session not opened yet (``connect`` opens it).
        ``settings`` (a :class:`kvtier.settings.ClientSettings`), or ``transport`` and
        ``kwargs`` (its fields: ``timeout_s``, ``lease_ttl_s``, ``token_file``...; TypeError for
        another name); not both (``transport`` default: ``"shm"``). ``breaker``: one shared with
        other clients (an engine worker's); ``clock``: the deadlines' (``time.monotonic``)."""
        if settings is None:
            settings = ClientSettings.of(transport or "shm", **kwargs)
        elif kwargs or transport not in (None, settings.transport):
            raise TypeError("give settings or keyword arguments, not both")
        self.settings = settings
        if breaker is None:
            breaker = Breaker(settings.backoff_s)  # its own, probing at ``backoff_s``
        connection = Connection(GrpcChannel(address, settings), settings, breaker, clock)
        self.session = Session(connection)

    @classmethod
    def connect(
        cls, address: str, transport: TransportName | None = None, *, lazy: bool = False, **kwargs: Any
    ) -> Client:
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
            diagnosis = client.session.connection.first_open(strict=not lazy)
        except BaseException:
            client.close()
            raise
        if diagnosis is not None and not lazy:
            client.close()
            raise diagnosis.error
        return client

    # -- what the client knows (read-only unless said) --------------------------------------------
    # Its settings are ``settings`` (the one ClientSettings: ``client.settings.timeout_s``...);
    # of them only ``tenant_key`` (the engine integrations') and ``pipeline_bytes`` (settable)
    # are read here. The rest is the session's connection's (``session.connection``).

    @property
    def address(self) -> str:
        """The daemon's gRPC target (:func:`kvtier.addresses.address_target`)."""
        return self.session.connection.channel.address

    @property
    def tenant_key(self) -> bytes | None:
        """``settings.tenant_key``: the tenant's key mixed into block keys."""
        return self.settings.tenant_key

    @property
    def pipeline_bytes(self) -> int:
        """The pipelining threshold in effect (``Session.pipeline_bytes``: from
        ``settings.pipeline_bytes``); settable per client."""
        return self.session.pipeline_bytes

    @pipeline_bytes.setter
    def pipeline_bytes(self, value: int) -> None:
        self.session.pipeline_bytes = value

    @property
    def local(self) -> LocalIndexes | None:
        """The daemon's published index, when this client answers lookups from it."""
        return self.session.connection.local

    @property
    def counters(self) -> ClientCounters:
        return self.session.connection.counters

    @property
    def breaker(self) -> Breaker:
        return self.session.connection.breaker

    @property
    def connected(self) -> bool:
        return self.session.connection.connected

    @property
    def boot_epoch(self) -> int:
        return self.session.connection.boot_epoch

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self.session.connection.max_batch

    def tier_figures(self) -> dict[str, TierFigure]:
        """The daemon's latest per-tier load figures (tier name -> ``TierFigure``, its age grown
        by the time since it arrived); from the OpenSession reply and every heartbeat reply, empty
        until one brought some (the daemon has read no tier below the host tier yet). Any thread."""
        return self.session.connection.figures.now()

    def deadline(self, timeout_s: float | None = None) -> float:
        """The deadline ``timeout_s`` (default ``op_timeout_s``) from now, on this client's clock."""
        return self.session.deadline(timeout_s)

    # -- the verbs -------------------------------------------------------------------------------------

    def register(self, namespace: Namespace, *, deadline: float | None = None) -> NamespaceHandle:
        """A handle for ``namespace`` (validated here; registered now if the session is open and
        the breaker closed, within ``timeout_s`` and ``deadline``; else on the next (re)open).
        A namespace without ``tenant=`` takes the tenant of the client's credential (``tenant``)
        when it is registered; one naming another tenant is refused by the daemon."""
        if not isinstance(namespace, Namespace):
            raise errors.InvalidArgument("expected a kvtier.Namespace", field="namespace")
        handle = NamespaceHandle(self, namespace)
        self.session.add_namespace(handle, deadline)
        return handle

    @property
    def tenant(self) -> str | None:
        """The tenant the daemon took this client's credential for (token, Unix login or client
        certificate); None on a daemon without tenants, or before a session was opened."""
        return self.session.connection.tenant

    def reaches_group(self, group: str) -> bool:
        """Whether this client moves ``group``'s blocks (docs/security.md § Groups, "Group
        arenas"): over tcp, on a daemon without tenants, or where the daemon handed that group's
        arena at the shm handshake (read-only). Not where it did not: a daemon that predates
        group arenas, a group whose arena could not be made, one joined after the session
        opened, past the 16 a session maps. True before a session was opened (as ``tenant`` is
        None then)."""
        if self.tenant is None or self.settings.transport == "tcp":
            return True
        try:
            data = self.session.data()
        except errors.TransportError:
            return False
        return group in getattr(data, "mapped_groups", ())

    @property
    def events(self) -> bool:
        """Whether the daemon publishes KV events of this client's blocks (docs/events.md): then
        a store's ``token_ids`` reach the routers that follow them. False before a session was
        opened (``lazy=True`` and the daemon away)."""
        return self.session.connection.events

    def stats(self) -> dict[str, Any]:
        """The daemon's Stats figures as a dict; raises the error naming the cause and the fix
        when the daemon cannot be reached or refuses (as ``connect`` does)."""
        return to_dict(self.session.connection.stats())

    # -- published prefixes (docs/security.md § Groups) ------------------------------------------------

    def publish_prefix(self, group: str, name: str, token_ids: Sequence[int]) -> PublishedPrefix:
        """Publish ``token_ids`` (a system prompt the group's tenants' requests begin with) for
        ``group`` under ``name``: the daemon keeps its length and digest
        (:func:`kvtier.prefixes.prefix_digest`, computed here; never the tokens) and lists it to
        every member; republishing a name replaces it. Returns it as listed. InvalidArgument
        (field ``token_ids``) before anything is sent for no ids, more than
        ``MAX_PREFIX_TOKENS``, or one outside 0..2**32-1; the daemon's refusal in its words
        (``group: ...``: not a group this credential publishes; ``name: ...``, a bound); raises
        like ``stats`` when the daemon cannot be reached or refuses the credential."""
        group, name = _text(group, "group"), _text(name, "name")
        n = len(token_ids)
        if not 0 < n <= MAX_PREFIX_TOKENS:
            raise errors.InvalidArgument(
                f"expected 1..{MAX_PREFIX_TOKENS} token ids, got {n}", field="token_ids"
            )
        try:
            digest = prefix_digest(token_ids)
        except struct.error:
            raise errors.InvalidArgument(
                "every token id must be an integer in 0..2**32-1", field="token_ids"
            ) from None
        request = pb.PublishPrefixRequest(group=group, name=name, tokens=n, digest=digest)
        self.session.connection.sessionless("PublishPrefix", request, answered=True)
        return PublishedPrefix(group, name, n, digest, publisher=True)

    def withdraw_prefix(self, group: str, name: str) -> bool:
        """Withdraw the prefix ``name`` of ``group`` (a publisher of it); whether it was there
        (withdrawing one that is not is no error). Raises as ``publish_prefix`` does."""
        request = pb.PublishPrefixRequest(
            group=_text(group, "group"), name=_text(name, "name"), withdraw=True
        )
        return bool(self.session.connection.sessionless("PublishPrefix", request, answered=True).existed)

    def published_prefixes(self) -> list[PublishedPrefix]:
        """The prefixes published for every group this client's tenant is a member of (every
        group for the operator and on a daemon without tenants), by group and name, each saying
        whether this tenant publishes into its group (for a :class:`kvtier.prefixes.PrefixMatcher`).
        Raises like ``stats``; FailedPrecondition from a daemon older than published prefixes."""
        reply = self.session.connection.sessionless("ListPrefixes", pb.ListPrefixesRequest(), answered=True)
        return [
            PublishedPrefix(p.group, p.name, p.tokens, bytes(p.digest), p.publisher) for p in reply.prefixes
        ]

    def lookup_slices(
        self, handles: Sequence[NamespaceHandle], chains: Sequence[Sequence[bytes]], *, promote: bool = True
    ) -> SlicesLookup:
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
        if not pin or (epoch and epoch != self.session.connection.boot_epoch):
            return False
        try:
            self.session.call("CompleteLoad", pb.CompleteLoadRequest(job_id=pin), reconnect=False)
        except (Away, errors.KvtierError):
            return False
        return True

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(value: object, field: str) -> str:
    """``value``, a string, or InvalidArgument naming ``field``."""
    if not isinstance(value, str):
        raise errors.InvalidArgument(f"expected a string, got {type(value).__name__}", field=field)
    return value

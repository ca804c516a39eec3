"""The daemon as the connector's scheduler half sees it: hash, pinned lookup, release.

``DaemonBackend`` runs on the planner's lookup thread only (never the scheduler thread). It opens
its ``kvtier.Client`` on the lookup thread's first task (``warmup``), so building the connector
never waits for the daemon and the first request does not pay for the session; a daemon
that is away answers every lookup as a miss at once (the breaker this process's workers share,
``kvtier.integrations.vllm.breaker.shared_breaker``), and pins of a daemon that restarted are already gone.
A request that begins with a prefix published by one of the tenant's groups is keyed in the
group's scope up to it (``kvtier.prefixes``, docs/vllm.md "Shared prefixes").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.vllm.breaker import shared_breaker
from kvtier.integrations.vllm.connector.config import BASE, ConnectorConfig, EngineIdentity, Variant
from kvtier.integrations.vllm.connector.lookup_thread import KeyChain, LookupOutcome, Pin, SharedScope
from kvtier.prefixes import PublishedPrefix, SharedPrefixes
from kvtier.results import TierFigure
from kvtier.settings import ClientSettings
from kvtier_contract.errors import FailedPrecondition, NotFound, PermissionDenied
from kvtier_contract.scopes import Region, scoped_block_keys

log = logging.getLogger("vllm.kvtier")


class DaemonBackend:
    """Owns one Client, one NamespaceHandle per (variant, tp rank) and the watch of the
    groups' published prefixes. Single-threaded."""

    def __init__(
        self, identity: EngineIdentity, cfg: ConnectorConfig, *, client_name: str = "vllm-scheduler"
    ) -> None:
        self.identity = identity
        self.cfg = cfg
        self.client_name = client_name
        self._client: Client | None = None
        self._handles: dict[tuple[Variant, int], NamespaceHandle] = {}
        self._rules: SharedPrefixes | None = None  # the groups' published prefixes (lazy)
        self.local_misses = 0  # lookups the published index answered as misses (no RPC)

    @property
    def _shared(self) -> SharedPrefixes:
        if self._rules is None:
            self._rules = SharedPrefixes(self.client, self.cfg.prefix_refresh_ms / 1000)
        return self._rules

    @property
    def client(self) -> Client:
        if self._client is None:
            # A lookup answered after lookup_timeout_ms is a miss anyway: no RPC waits longer.
            timeout_ms = min(self.cfg.request_timeout_ms, self.cfg.lookup_timeout_ms)
            self._client = Client.connect(  # lazy: away is a miss, logged once per cause
                self.cfg.address,
                lazy=True,
                breaker=shared_breaker(self.cfg.address),
                settings=ClientSettings(
                    transport=self.cfg.transport,
                    timeout_s=timeout_ms / 1000,
                    lease_ttl_s=self.cfg.lease_ttl_ms / 1000,
                    client_name=self.client_name,
                    probe_timeout_s=self.cfg.probe_timeout_ms / 1000,
                    token_file=self.cfg.token_file,
                    unix_login=self.cfg.unix_login,
                ),
            )
        return self._client

    def handle(self, variant: Variant, tp_rank: int) -> NamespaceHandle:
        h = self._handles.get((variant, tp_rank))
        if h is None:
            h = self.client.register(self.identity.namespace(variant, tp_rank))
            self._handles[(variant, tp_rank)] = h
        return h

    def tier_figures(self) -> dict[str, TierFigure]:
        """The daemon's per-tier load figures from this session's heartbeats (any thread, no
        RPC; empty before the session is open)."""
        client = self._client
        return client.tier_figures() if client is not None else {}

    def events(self) -> bool:
        """Whether the daemon publishes KV events of this engine's blocks (``Client.events``;
        any thread, no RPC; False before the session is open)."""
        client = self._client
        return client.events if client is not None else False

    def warmup(self) -> None:
        """Open the session and register the base namespaces before the first request."""
        for r in range(self.identity.tp_size):
            self.handle(BASE, r)
        self._shared_prefix(BASE, ())  # the published prefixes' first fetch

    def lookup(self, variant: Variant, token_ids: Sequence[int], *, promote: bool = True) -> LookupOutcome:
        """Keys of every tp slice, then one pinned lookup of them all; the hit is the shortest.
        A slice that the published index says has no hit at all ends it with no round trip
        (a new prompt, the common case, costs the daemon nothing). A request that begins with
        a prefix one of the tenant's groups published (``kvtier.prefixes``) is keyed in the
        group's scope up to it and in its own after (``kvtier_contract.scopes``): the group's
        blocks are looked up first, the request's own only when every shared one hit."""
        handles = [self.handle(variant, r) for r in range(self.identity.tp_size)]
        match = self._shared_prefix(variant, token_ids)
        groups = None if match is None else self._group_handles(variant.shared(match.group))
        if match is None or groups is None:
            keys = [h.block_keys(token_ids) for h in handles]
            hits, tiers, pins = self._pinned(handles, keys, promote)
            return LookupOutcome(keys, hits, tiers, pins, self._chain(handles))
        keys = [self._scoped(g, h, match.tokens, token_ids) for g, h in zip(groups, handles, strict=True)]
        shared = min(match.tokens // self.identity.tokens_per_block, len(keys[0]))
        try:
            hits, tiers, pins = self._pinned(groups, [k[:shared] for k in keys], promote)
        except (FailedPrecondition, NotFound, PermissionDenied) as e:
            # the daemon will not move this group's blocks for this engine (a namespace of it in
            # an arena its session does not map; membership taken away): keyed in its own scope,
            # the group set aside until the list is fetched again
            self._shared.refuse(variant.shared(match.group), match.group, e)
            keys = [h.block_keys(token_ids) for h in handles]
            hits, tiers, pins = self._pinned(handles, keys, promote)
            return LookupOutcome(keys, hits, tiers, pins, self._chain(handles))
        if hits == shared and len(keys[0]) > shared:
            try:
                more, more_tiers, more_pins = self._pinned(handles, [k[shared:] for k in keys], promote)
            except Exception:
                self.release(pins)  # (the group's: held by nothing else)
                raise
            hits, tiers, pins = hits + more, tiers + more_tiers, pins + more_pins
        scope = SharedScope(shared, variant.shared(match.group), match.publisher)
        return LookupOutcome(keys, hits, tiers, pins, self._chain(handles, groups, match.tokens), scope)

    def _group_handles(self, scope: Variant) -> list[NamespaceHandle] | None:
        """The group's namespace of every slice, or None while the daemon refuses it
        (``SharedPrefixes.open``: meanwhile the request is keyed in its own scope)."""
        assert scope.group is not None
        return self._shared.open(
            scope, scope.group, lambda: [self.handle(scope, r) for r in range(self.identity.tp_size)]
        )

    def _shared_prefix(self, variant: Variant, token_ids: Sequence[int]) -> PublishedPrefix | None:
        """The published prefix of one of the tenant's groups that the request begins with
        (``shared_prefixes``; the list fetched every ``prefix_refresh_ms``;
        ``kvtier.prefixes.SharedPrefixes``' rules)."""
        if not self.cfg.shared_prefixes or variant.group is not None:
            return None
        return self._shared.match(token_ids, self.identity.tokens_per_block)

    def _pinned(
        self, handles: list[NamespaceHandle], keys: list[list[bytes]], promote: bool
    ) -> tuple[int, list[str], list[Pin]]:
        """The pinned lookup of ``keys[r]`` in ``handles[r]`` for every slice: hit blocks,
        their tiers (slice 0), the pins (none asked: none found)."""
        if not keys[0]:
            return 0, [], []
        n_max = self.client.max_batch
        for r, h in enumerate(handles):
            # (uncounted: a hit is counted by the pinned lookup that follows, a miss here)
            if h.lookup_local(keys[r][:n_max], count=False) == 0:
                h.lookup_local(keys[r][:n_max])
                self.local_misses += 1
                return 0, [], []
        # One round trip for every slice (LookupSlices): the hit every slice holds, pinned.
        got = self.client.lookup_slices(handles, [k[:n_max] for k in keys], promote=promote)
        pins = [(r, res.pin, res.epoch) for r, res in enumerate(got.slices) if res.pin]
        tiers = got.slices[0].tiers if got.slices else []
        return got.hits, tiers[: got.hits], pins

    def _scoped(
        self, group: NamespaceHandle, own: NamespaceHandle, shared: int, token_ids: Sequence[int]
    ) -> list[bytes]:
        """One slice's keys: the first ``shared`` tokens in the group's scope (no key: every
        member hashes them alike), the rest in the tenant's own, chained on."""
        regions = [Region(0, group.namespace)]
        if shared < len(token_ids):
            regions.append(Region(shared, own.namespace, self.client.tenant_key))
        return scoped_block_keys(regions, token_ids)

    def _chain(
        self, handles: list[NamespaceHandle], groups: list[NamespaceHandle] | None = None, shared: int = 0
    ) -> KeyChain:
        """Each slice's key chain, hashed the way ``block_keys`` hashes a prompt (same namespace
        digest and tenant key), without the handles: safe on the scheduler thread. With
        ``groups``: the first ``shared`` tokens were the group's, so a block that spans that
        boundary (a prompt that ended inside it, completed by generated tokens) is hashed as
        the next turn's lookup will hash it (``_scoped``)."""
        namespaces = [h.namespace for h in handles]
        scopes = [g.namespace for g in groups or ()]
        tenant_key = self.client.tenant_key

        def chain(rank: int, parent: bytes | None, token_ids: Sequence[int], start: int) -> list[bytes]:
            if scopes and start < shared < start + len(token_ids):
                regions = [Region(0, scopes[rank]), Region(shared - start, namespaces[rank], tenant_key)]
                return scoped_block_keys(regions, token_ids, parent=parent)
            return namespaces[rank].block_keys(token_ids, parent=parent, tenant_key=tenant_key)

        return chain

    def release(self, pins: Sequence[Pin]) -> None:
        for _rank, pin, epoch in pins:
            self.client.release(pin, epoch)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

"""Shared scopes for an integration that hashes its own keys from token ids (issue 43).

A request that begins with a prefix one of the client's groups published
(:mod:`kvtier.prefixes`) is keyed in two scopes (docs/hashing.md §7): the prefix in the group's
namespace (the integration's namespace with no salt, no tenant, the group), the rest in the
integration's own, chained on. :class:`SharedScopes` answers, for one request, its keys and the
**parts** they fall in: which namespace handle holds blocks ``start:end``, and whether this
client stores into it (a member of a group only reads it: a publisher stores its blocks). A
lookup, a load or a store walks the parts in order; a lookup stops at the first part that does
not hit whole.

The vLLM connector has its own split (its keys cross processes in the connector's plans:
``kvtier.integrations.vllm.connector.backend``); the Transformers prefix cache uses this one.

Rules, the connector's too: :class:`kvtier.prefixes.SharedPrefixes` (a prefix shorter than one
block is not used; a client that cannot move its groups' blocks keys every request in its own
scope; a group whose namespace the daemon refuses is set aside until the list is fetched again).

Lifecycle: ``SharedScopes(client, refresh_s)`` -> ``keys(own_handle, token_ids)`` per request.
Owns its :class:`~kvtier.prefixes.SharedPrefixes` and the group handles it registered; not
thread-safe (one per thread that hashes requests, as the integration's cache is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvtier.client import Client, NamespaceHandle
from kvtier.prefixes import SharedPrefixes
from kvtier_contract.identity import Namespace
from kvtier_contract.scopes import Region, scoped_block_keys

__all__ = ["Part", "ScopedKeys", "SharedScopes", "group_namespace"]


@dataclass(frozen=True)
class Part:
    """Blocks ``start:end`` of a request live in ``handle``'s namespace; ``stores``: this
    client stores them (False: a group it only reads)."""

    handle: NamespaceHandle
    start: int
    end: int
    stores: bool = True


@dataclass(frozen=True)
class ScopedKeys:
    """One request's block keys and the parts they fall in, in order, covering them all."""

    keys: list[bytes]
    parts: list[Part]

    @property
    def shared(self) -> int:
        """Leading blocks in a group's scope (0: none)."""
        return self.parts[0].end if len(self.parts) > 1 else 0

    def cut(self, start: int, end: int) -> list[Part]:
        """The parts of blocks ``start:end``, each cut to them (empty ones left out)."""
        out = []
        for p in self.parts:
            a, b = max(p.start, start), min(p.end, end)
            if a < b:
                out.append(Part(p.handle, a, b, p.stores))
        return out


def group_namespace(own: Namespace, group: str) -> Namespace:
    """The group's scope of an integration's namespace: no salt, no tenant, the group."""
    return replace(own, cache_salt=None, tenant=None, group=group)


class SharedScopes:
    """See the module docstring. ``shared``: the group's namespace of the integration's own
    (``group_namespace`` unless its ``cache_salt`` holds more than the salt: the Transformers
    cache keeps its model config's digest there, which the group's scope must keep too)."""

    def __init__(
        self,
        client: Client,
        refresh_s: float = 5.0,
        *,
        enabled: bool = True,
        shared: Callable[[Namespace, str], Namespace] = group_namespace,
    ) -> None:
        self.client = client
        self.shared = shared
        self.enabled = enabled
        self._rules = SharedPrefixes(client, refresh_s)
        self._groups: dict[tuple[int, str], NamespaceHandle] = {}  # (own id, group) -> handle

    def keys(self, own: NamespaceHandle, token_ids: Sequence[int]) -> ScopedKeys:
        """The keys of ``token_ids``' full blocks and their parts (one part, ``own``, unless
        the request begins with a prefix one of the client's groups published)."""
        found = self._group_of(own, token_ids)
        if found is None:
            keys = own.block_keys(token_ids)
            return ScopedKeys(keys, [Part(own, 0, len(keys))])
        group, tokens, publisher = found
        regions = [Region(0, group.namespace)]
        if tokens < len(token_ids):
            regions.append(Region(tokens, own.namespace, self.client.tenant_key))
        keys = scoped_block_keys(regions, token_ids)
        shared = min(tokens // own.namespace.tokens_per_block, len(keys))
        return ScopedKeys(keys, [Part(group, 0, shared, publisher), Part(own, shared, len(keys))])

    def _group_of(
        self, own: NamespaceHandle, token_ids: Sequence[int]
    ) -> tuple[NamespaceHandle, int, bool] | None:
        """The group handle, prefix length and publisher flag of the published prefix the
        request begins with, or None (``kvtier.prefixes.SharedPrefixes``' rules)."""
        match = self._rules.match(token_ids, own.namespace.tokens_per_block) if self.enabled else None
        if match is None:
            return None
        at = (own.namespace_id, match.group)
        handle = self._groups.get(at)
        if handle is None:
            spec = self.shared(own.namespace, match.group)
            handle = self._rules.open(at, match.group, lambda: self.client.register(spec))
            if handle is not None:
                self._groups[at] = handle
        return None if handle is None else (handle, match.tokens, match.publisher)

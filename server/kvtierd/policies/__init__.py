"""Policies: they only order and choose, never move bytes or write the index.

* Eviction (which resident block goes first): ``make_policy("lru" | "arc" | "prefix", ghost_capacity)``;
  primitives, iteration contract and the default (LRU) in :mod:`kvtierd.policies.base`;
  ``"prefix"`` keeps key chains whole (:mod:`kvtierd.policies.prefix`). ``link_policy``: the
  storage tiers' copy order that goes with a host tier's policy.
* Writing down the chain (when a host block is copied to a storage tier):
  ``make_write_policy("write-back" | "write-through" | "selective", …)``; hooks in
  :mod:`kvtierd.policies.write`.
"""

from __future__ import annotations

from typing import Literal

from kvtierd.policies.arc import ArcPolicy
from kvtierd.policies.base import EvictionPolicy, K, LruPolicy
from kvtierd.policies.prefix import PrefixPolicy
from kvtierd.policies.write import (
    Selective,
    WriteBack,
    WritePolicy,
    WritePolicyName,
    WriteThrough,
    make_write_policy,
)

__all__ = [
    "ArcPolicy",
    "EvictionPolicy",
    "LruPolicy",
    "PolicyName",
    "PrefixPolicy",
    "Selective",
    "WriteBack",
    "WritePolicy",
    "WritePolicyName",
    "WriteThrough",
    "link_policy",
    "make_policy",
    "make_write_policy",
]

PolicyName = Literal["lru", "arc", "prefix"]


def make_policy(name: PolicyName, ghost_capacity: int) -> EvictionPolicy[K]:
    """Build the policy called ``name`` (the host tier's ``eviction_policy``); ``ghost_capacity``
    is used by ARC only.

    Raises ``ValueError`` naming the field at fault: ``eviction_policy`` for an unknown
    name, ``ghost_capacity`` when it is negative.
    """
    if ghost_capacity < 0:
        raise ValueError(f"ghost_capacity: must be >= 0, got {ghost_capacity}")
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy(ghost_capacity)
    if name == "prefix":
        return PrefixPolicy()
    raise ValueError(f"eviction_policy: unknown policy {name!r}; expected 'lru', 'arc' or 'prefix'")


def link_policy(host_policy: EvictionPolicy[K]) -> EvictionPolicy[K]:
    """A fresh copy order for a storage tier below a host tier evicting by ``host_policy``:
    prefix-aware below a prefix-aware host tier, LRU otherwise (ARC's history is the host's)."""
    return PrefixPolicy() if host_policy.wants_parents else LruPolicy()

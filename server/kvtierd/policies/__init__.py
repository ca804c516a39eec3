"""Eviction policies, chosen by name: ``make_policy("lru" | "arc", ghost_capacity)``.

See :mod:`kvtierd.policies.base` for the primitives and the iteration contract.
"""

from __future__ import annotations

from typing import Literal

from kvtierd.policies.arc import ArcPolicy
from kvtierd.policies.base import EvictionPolicy, K
from kvtierd.policies.lru import LruPolicy

__all__ = ["ArcPolicy", "EvictionPolicy", "LruPolicy", "PolicyName", "make_policy"]

PolicyName = Literal["lru", "arc"]


def make_policy(name: PolicyName, ghost_capacity: int) -> EvictionPolicy[K]:
    """Build the policy called ``name``; ``ghost_capacity`` is used by ARC only.

    Raises ``ValueError`` naming the field at fault: ``eviction_policy`` for an unknown
    name, ``ghost_capacity`` when it is negative.
    """
    if ghost_capacity < 0:
        raise ValueError(f"ghost_capacity: must be >= 0, got {ghost_capacity}")
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy(ghost_capacity)
    raise ValueError(f"eviction_policy: unknown policy {name!r}; expected 'lru' or 'arc'")

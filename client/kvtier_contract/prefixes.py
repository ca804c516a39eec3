"""Published prefixes' bounds, stated once for both halves (docs/security.md § Groups).

A publisher of a group publishes a prefix under a name: the daemon keeps its length in tokens
and its digest, SHA-256 of the token ids packed as u32le (``kvtier.prefixes.prefix_digest``),
never its tokens. The SDK checks a prefix against these before it sends it; the daemon
(``kvtierd.tenancy.prefixes``) refuses what passes them.
"""

from __future__ import annotations

__all__ = ["MAX_PREFIXES_PER_GROUP", "MAX_PREFIX_GROUPS", "MAX_PREFIX_TOKENS", "PREFIX_DIGEST_BYTES"]

MAX_PREFIX_TOKENS = 1 << 20
"""Tokens of one published prefix, at most (longer than any model's context)."""
PREFIX_DIGEST_BYTES = 32
"""A published prefix's digest: SHA-256."""
MAX_PREFIXES_PER_GROUP = 16
"""Names one group publishes at once, at most (republishing a name replaces it)."""
MAX_PREFIX_GROUPS = 16
"""Groups a daemon without a tenants file keeps prefixes of, at most (with one, its
``[[group]]`` tables bound them)."""

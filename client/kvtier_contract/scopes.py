"""Salt regions: one request's block keys across scopes (issue 43; spec: docs/hashing.md §7).

A multi-tenant fleet keys each tenant's blocks in its own namespace (``Namespace.tenant``), so no
tenant can read or probe another's prefixes; a system prompt that a group of tenants shares would
then be stored once per tenant. A **scope** is a namespace that belongs to a tenant or to a group
of tenants (``Namespace.group``), with the key its blocks are hashed under (a tenant's keyed-
hashing secret, a group's, or none). A request names its **regions**, ``[(token_offset,
scope)]``: from each offset on, its blocks are keyed in that region's scope. Keys chain across
the change (the first private block's parent is the last shared key), so the shared part of two
tenants' prompts has the same keys and their private parts never do.

Primitives:

* :class:`Region`: ``(offset, namespace, key)``.
* :func:`scoped_block_keys`: the keys of one request's full blocks over its regions. One region
  at offset 0 hashes exactly as :func:`~kvtier_contract.identity.block_keys` (every key ever
  stored keeps its value); a region that begins inside a block makes that block the later
  scope's, with a typed, length-prefixed *boundary record* after its extra bytes.

Pure functions of their arguments, as :mod:`kvtier_contract.identity`; thread-safe.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace, block_key, block_keys

__all__ = ["MAX_REGIONS", "OWNER_FIELDS", "Region", "scoped_block_keys"]

MAX_REGIONS = 64
"""Regions of one request, at most (vLLM's ``salt_regions`` has a handful: a system prompt, a
tool schema, the tenant's own part)."""

OWNER_FIELDS = ("cache_salt", "tenant", "group")
"""The only namespace fields in which the regions of one request may differ: every other field
names the model, its slice or the KV layout, and a chain cannot continue in other KV."""

BOUNDARY_RECORD = 1
"""Type byte of the boundary record hashed after a block's extra (docs/hashing.md §7)."""

_RECORD_HEADER = struct.Struct("<BI")  # type, length of the body
_BOUNDARY = struct.Struct("<I")  # a boundary's offset inside its block, then the scope's digest


@dataclass(frozen=True)
class Region:
    """From token ``offset`` on (until the next region's), a request's blocks are keyed in
    ``namespace`` under ``key``: the keyed-hashing secret of the tenant or group that owns it
    (``tenant_key`` of :func:`~kvtier_contract.identity.block_keys`), or None."""

    offset: int
    namespace: Namespace
    key: bytes | None = None


def scoped_block_keys(
    regions: Sequence[Region],
    token_ids: Sequence[int],
    *,
    parent: bytes | None = None,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chained 32-byte keys, one per full block of ``token_ids``, block ``i`` keyed in the scope
    of the region that holds its last token.

    ``regions``: 1..``MAX_REGIONS``, the first at offset 0, offsets strictly increasing and each
    below ``len(token_ids)`` (0 when there are none); namespaces equal in every field but
    ``OWNER_FIELDS``. A block with region offsets strictly inside it hashes, after
    ``u32le(len(extra_i)) ‖ extra_i``, the record ``u8 1 ‖ u32le(36 n) ‖ (u32le(offset - iB) ‖
    digest)…`` of those n regions. ``parent``, ``extras`` and the token ids as ``block_keys``.
    Raises ``InvalidArgument`` naming the bad argument (``regions[i].offset``, …).
    """
    offsets = _check_regions(regions, token_ids)
    first = regions[0]
    if len(regions) == 1:  # the flat case: exactly today's keys
        return first.namespace.block_keys(token_ids, parent=parent, extras=extras, tenant_key=first.key)
    B = first.namespace.tokens_per_block
    tokens = _tokens(token_ids)
    n_full = len(tokens) // B
    block_keys(first.namespace.digest, tokens[n_full * B :], B)  # the partial tail's ids: checked
    if extras is not None and (isinstance(extras, (bytes, bytearray)) or len(extras) != n_full):
        raise InvalidArgument(f"must have one entry per full block ({n_full})", field="extras")
    if parent is not None and (not isinstance(parent, (bytes, bytearray)) or len(parent) != 32):
        raise InvalidArgument("must be exactly 32 bytes", field="parent")
    return _chain(regions, offsets, tokens, parent, extras)


def _chain(
    regions: Sequence[Region],
    offsets: list[int],
    tokens: list[int],
    parent: bytes | None,
    extras: Sequence[bytes] | None,
) -> list[bytes]:
    """The keys of ``scoped_block_keys`` (its arguments checked): a run of whole blocks of one
    region in one ``block_keys`` call, a block split by a boundary alone."""
    B = regions[0].namespace.tokens_per_block
    n_full = len(tokens) // B
    keys: list[bytes] = []
    prev, i = parent, 0
    while i < n_full:
        r = _region_of(offsets, (i + 1) * B - 1)
        ns, key = regions[r].namespace, regions[r].key
        record = _boundary_record(regions, i * B, (i + 1) * B)
        if record:
            extra = b"" if extras is None else bytes(extras[i])
            keys.append(
                block_key(
                    ns.digest, prev, tokens[i * B : (i + 1) * B], extra=extra, record=record, tenant_key=key
                )
            )
            end = i + 1
        else:
            end = n_full if r + 1 == len(offsets) else min(n_full, offsets[r + 1] // B)
            ex = None if extras is None else extras[i:end]
            keys += ns.block_keys(tokens[i * B : end * B], parent=prev, extras=ex, tenant_key=key)
        prev, i = keys[-1], end
    return keys


def _check_regions(regions: Sequence[Region], token_ids: Sequence[int]) -> list[int]:
    """The regions' offsets; InvalidArgument naming the first bad region."""
    if isinstance(regions, (str, bytes)) or not isinstance(regions, Sequence):
        raise InvalidArgument("must be a sequence of Region", field="regions")
    if not 1 <= len(regions) <= MAX_REGIONS:
        raise InvalidArgument(f"must hold 1..{MAX_REGIONS} regions, got {len(regions)}", field="regions")
    n = len(_tokens(token_ids))
    offsets: list[int] = []
    first: Namespace | None = None
    for i, r in enumerate(regions):
        if not isinstance(r, Region):
            raise InvalidArgument(f"must be a Region, got {type(r).__name__}", field=f"regions[{i}]")
        off = r.offset
        if isinstance(off, bool) or not isinstance(off, int):
            raise InvalidArgument("must be an int", field=f"regions[{i}].offset")
        if i == 0 and off != 0:
            raise InvalidArgument(f"the first region starts at token 0, got {off}", field="regions[0].offset")
        if i and off <= offsets[-1]:
            raise InvalidArgument(
                f"offsets must increase: {off} after {offsets[-1]}", field=f"regions[{i}].offset"
            )
        if i and off >= n:
            raise InvalidArgument(f"{off} is past the last token ({n} tokens)", field=f"regions[{i}].offset")
        if not isinstance(r.namespace, Namespace):
            raise InvalidArgument("must be a Namespace", field=f"regions[{i}].namespace")
        if r.key is not None and (not isinstance(r.key, (bytes, bytearray)) or not r.key):
            raise InvalidArgument("must be None or non-empty bytes", field=f"regions[{i}].key")
        if first is None:
            first = r.namespace
        else:
            for f in fields(Namespace):
                if f.name not in OWNER_FIELDS and getattr(r.namespace, f.name) != getattr(first, f.name):
                    raise InvalidArgument(
                        f"differs from regions[0]'s; regions may differ only in {', '.join(OWNER_FIELDS)}",
                        field=f"regions[{i}].namespace.{f.name}",
                    )
        offsets.append(off)
    return offsets


def _boundary_record(regions: Sequence[Region], lo: int, hi: int) -> bytes:
    """The boundary record of the block of tokens ``[lo, hi)``: empty unless regions start
    strictly inside it."""
    inside = [r for r in regions if lo < r.offset < hi]
    if not inside:
        return b""
    body = b"".join(_BOUNDARY.pack(r.offset - lo) + r.namespace.digest for r in inside)
    return _RECORD_HEADER.pack(BOUNDARY_RECORD, len(body)) + body


def _region_of(offsets: list[int], token: int) -> int:
    """Index of the region holding ``token``: the last one starting at or before it."""
    i = 0
    while i + 1 < len(offsets) and offsets[i + 1] <= token:
        i += 1
    return i


def _tokens(token_ids: Sequence[int]) -> list[int]:
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise InvalidArgument("must be a sequence of ints", field="token_ids")
    tolist = getattr(token_ids, "tolist", None)
    out = tolist() if callable(tolist) else token_ids
    return out if isinstance(out, list) else list(out)

"""A store's origin: the token ids and the parent key a client may send with its keys, which
the KV events carry (docs/events.md) so that a router can hash the tokens itself.

* :func:`check_origin`: the request's token ids and parent key, checked before anything changes
  (INVALID_ARGUMENT naming the field);
* :func:`keep_origins`: each reserved entry keeps its parent and packed token ids, within
  ``TOKEN_SHARE_OF_SLOT`` of its slot (what the quotas count bounds what is kept).

Pure functions over the entries they are handed; event-loop thread (the cache's).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier_contract.errors import InvalidArgument
from kvtierd.events.wire import pack_tokens
from kvtierd.index import Entry, NamespaceState

# A block keeps its token ids (4 bytes each, for its KV events) only while they take at most this
# share of its slot: a client's namespace of tiny blocks and many tokens per block cannot make
# the daemon hold more for its blocks than the quotas it is held to count (host_bytes, nvme_bytes).
TOKEN_SHARE_OF_SLOT = 64


def check_origin(
    ns: NamespaceState, keys: Sequence[bytes], token_ids: Sequence[int], parent: bytes | None
) -> None:
    """A store's optional token ids (exactly ``tokens_per_block`` per key) and parent key (32
    bytes): InvalidArgument naming the field otherwise."""
    if token_ids and len(token_ids) != len(keys) * ns.spec.tokens_per_block:
        raise InvalidArgument(
            f"has {len(token_ids)} token ids for {len(keys)} keys of "
            f"{ns.spec.tokens_per_block} tokens (expected {len(keys) * ns.spec.tokens_per_block}"
            " or none)",
            field="token_ids",
        )
    if parent is not None and len(parent) != 32:
        raise InvalidArgument(
            f"must be 32 bytes (a block key) or empty, got {len(parent)}", field="parent_key"
        )


def keep_origins(
    ns: NamespaceState,
    keys: Sequence[bytes],
    items: dict[int, Entry],
    token_ids: Sequence[int],
    parent: bytes | None,
) -> None:
    """Each reserved entry (``items``: batch index -> entry) keeps its parent key and packed
    token ids for its KV events; token ids past their share of the slot are not kept."""
    span = 4 * ns.spec.tokens_per_block  # one block's packed token ids
    packed = pack_tokens(token_ids) if token_ids and span * TOKEN_SHARE_OF_SLOT <= ns.slot_bytes else b""
    for i, e in items.items():
        e.origin = (keys[i - 1] if i else parent, packed[i * span : (i + 1) * span])

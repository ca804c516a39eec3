"""From the cache's records to events: what one record says, per tenant, and how a stream's
pending events absorb it.

Primitives: :func:`events_of` (the events of one record, per tenant: stores as one
``BlockStored`` per chain, removals as one ``BlockRemoved`` per tenant), :func:`append_events`
(a stream's pending list, a removal joining the removal before it).

``extra_keys`` follow vLLM's rule (``generate_block_hash_extra_keys``): the adapter id on every
block, the cache salt only where a chain starts without a parent (vLLM: a prompt's first block;
the parent chain carries it from there). A block's salt is in its key already (the namespace
digest), so a block with a parent needs it nowhere else, and a long salt is not repeated on
every block of every message.

Pure functions over entries that never change after their reservation (``key``, ``ns.spec``,
``origin``); the publisher thread calls them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtierd.events.wire import Event, Removed, Stored, unpack_tokens

if TYPE_CHECKING:
    from kvtierd.index import Entry


def append_events(out: list[Event], evs: list[Event]) -> None:
    """``out += evs``, a removal joining the removal before it (same medium and tenant): one
    eviction is one record, and a burst of them one event."""
    for ev in evs:
        last = out[-1] if out else None
        if (
            isinstance(ev, Removed)
            and isinstance(last, Removed)
            and last.medium == ev.medium
            and last.tenant == ev.tenant
        ):
            out[-1] = Removed([*last.keys, *ev.keys], ev.medium, ev.tenant)
        else:
            out.append(ev)


def events_of(kind: str, medium: Any, entries: list[Entry]) -> Iterator[tuple[str | None, list[Event]]]:
    """The events of one record, per tenant: removals as one list per tenant; stores as one
    ``BlockStored`` per chain (a block whose parent is the block before it joins it)."""
    if kind == "removed":
        by_tenant: dict[str | None, list[bytes]] = {}
        for e in entries:
            by_tenant.setdefault(e.ns.spec.owner, []).append(e.key)
        for tenant, keys in by_tenant.items():
            yield tenant, [Removed(keys, medium, tenant)]
        return
    run: list[Entry] = []
    for e in entries:
        origin = e.origin
        if run and not (origin is not None and origin[0] == run[-1].key and e.ns is run[-1].ns):
            yield run[0].ns.spec.owner, [stored_event(run, medium)]
            run = []
        run.append(e)
    if run:
        yield run[0].ns.spec.owner, [stored_event(run, medium)]


def stored_event(run: list[Entry], medium: Any) -> Stored:
    """The ``BlockStored`` of one chain of entries (each one's parent the one before it)."""
    spec = run[0].ns.spec
    tpb = spec.tokens_per_block
    origin = run[0].origin
    parent = origin[0] if origin is not None else None
    tokens: list[int] = []
    if all(e.origin is not None and len(e.origin[1]) == 4 * tpb for e in run):
        for e in run:
            tokens.extend(unpack_tokens(e.origin[1]))  # type: ignore[index]  # (checked above)
    adapter: tuple[str, ...] = (spec.adapter_id,) if spec.adapter_id else ()
    first = adapter + ((spec.cache_salt,) if spec.cache_salt and parent is None else ())
    extra: list[tuple[str, ...] | None] | None = None
    if first or adapter:
        extra = [first or None, *[adapter or None] * (len(run) - 1)]
    return Stored(
        keys=[e.key for e in run],
        parent=parent,
        token_ids=tokens,
        block_size=tpb,
        medium=medium,
        lora_name=spec.adapter_id,
        extra_keys=extra,
        tenant=spec.owner,
    )

"""The batch operations behind :class:`kvtier.client.NamespaceHandle`, over one Session.

Where the parts live: the lookups here; puts in :mod:`kvtier.batch_store`, gets in
:mod:`kvtier.batch_load`, what they share (job cutting, starting and completing jobs, the
transfer of one job, ``CopyGuard``) in :mod:`kvtier.batch_jobs`, all re-exported here. They use
only the :class:`kvtier.calls.SessionPort` of a session (its docstring: the lifecycle of an
operation on it), never the session's internals.

Keys travel at most ``session.max_batch`` per RPC. A lookup answers the longest ready prefix
(batch after batch while each one is all hits). A put or get is a two-phase job per batch::

    PrepareStore -> write the reserved slots (transport) -> CompleteStore(ok)
    PrepareLoad  -> read the pinned slots (transport)    -> CompleteLoad

one batch after the other, every RPC on the caller's thread. With pipelining on
(``session.pipeline_bytes`` > 0; off by default, docs/benchmarks.md §14) a call of more than
that many bytes is cut into jobs of at most that size (the first and the last smaller), the
Prepare* of the next ``PREPARES_AHEAD`` jobs is in flight, on the session's RPC threads, while
one job's bytes are copied, and each job's Complete* is collected later, every one of them
before the call returns: a call waits for one round trip before its first copy and one after its
last, not two per batch. Either way every job the daemon prepared is completed, also after a
failure (an abort frees its slots or pins at once).

A load streams in rounds: the daemon pins what its host tier holds or can place now and marks
the rest of what it has below (NVMe) as deferred (``found`` 0, ``tiers`` naming the tier); the
client loads those again after CompleteLoad, round after round while each one serves something,
so a get larger than the daemon's free host tier still returns every block it has.

Every put and get has an overall ``deadline`` (the caller's, e.g. an engine step's budget, else
``settings.op_timeout_s`` from its start): no RPC, batch or load round starts after it (what is
left is a miss or a drop), and each RPC's own deadline is cut to it; only a completion, which
frees daemon state, still gets ``MIN_RPC_S``.

A put of engine blocks may carry a ``CopyGuard``: the engine's fence decides, under the guard,
whether the copy out of its blocks may still read them (or reads a snapshot the engine took
instead), so that the fence waits for copies, never for RPCs.

A job is completed also when its transfer failed, so the daemon aborts its reservations at once
instead of when the lease ends. A daemon that is away (:class:`kvtier.session.Away`) turns into
misses and drops, counted in ``session.counters``; a failed transfer trips the breaker (the
transport is reattached on the next call), a failed copy (e.g. a CUDA error) fails that job only.
A load is trusted only once CompleteLoad confirmed that its pins held during the copy: a job's
blocks count as found when its CompleteLoad is collected, never before. Bytes verified end to end
(docs/security.md): a put's copy returns the digests it computed (shm; CompleteStore carries
them), a get's copy checks the bytes against ``PrepareLoadReply.digests``; a block that differs
is a miss, as is every later block of the get, and CompleteLoad names it (``corrupt``).

Arguments arrive validated by the handle. Thread-safety: as the Session's (transfers hold its
data lock).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.batch_jobs import TIER_NAMES, CopyGuard, CopyRevoked, guarded_gather, make_transport_value
from kvtier.batch_load import get_blocks, get_into
from kvtier.batch_store import check_origin, put, put_blocks
from kvtier.calls import Away, Registered, SessionPort
from kvtier.results import LookupResult, PinnedEach, PinnedLookup, SlicesLookup
from kvtier_contract import errors
from kvtier_contract.protoutil import KEY_BYTES, pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb

__all__ = [
    "CopyGuard",
    "CopyRevoked",
    "SessionPort",
    "check_origin",
    "get_blocks",
    "get_into",
    "guarded_gather",
    "lookup",
    "lookup_detail",
    "lookup_each_pinned",
    "lookup_local",
    "lookup_pinned",
    "lookup_slices",
    "prefetch",
    "put",
    "put_blocks",
]


def lookup(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> int:
    session.counters.lookups += 1
    packed = pack_keys(keys)
    if keys:
        local = session.local_lookup(handle, packed, len(keys))
        if local is not None:
            return local
    try:
        total = 0
        for start in range(0, len(keys), session.max_batch):
            chunk = packed[start * KEY_BYTES : (start + session.max_batch) * KEY_BYTES]
            reply = session.call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id, keys=chunk))
            total += reply.hit_blocks
            if reply.hit_blocks < len(chunk) // KEY_BYTES:
                break
        return total
    except Away:
        session.counters.lookups_failed += 1
        return 0


def lookup_local(
    session: SessionPort, handle: Registered, keys: Sequence[bytes], *, count: bool = True
) -> int | None:
    if not keys:
        return 0
    hit = session.local_lookup(handle, pack_keys(keys), len(keys), count=count)
    if hit is not None and count:
        session.counters.lookups += 1
    return hit


def lookup_detail(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> LookupResult:
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per detailed lookup", field="keys")
    try:
        reply = session.call(
            "Lookup", pb.LookupRequest(namespace_id=handle.namespace_id, keys=pack_keys(keys))
        )
    except Away:
        session.counters.lookups_failed += 1
        return LookupResult(0, [], [])
    return LookupResult(
        reply.hit_blocks,
        [TIER_NAMES.get(t, "?") for t in reply.tiers],
        [bool(d) for d in reply.durable] or [False] * reply.hit_blocks,
    )


def lookup_pinned(
    session: SessionPort, handle: Registered, keys: Sequence[bytes], *, promote: bool = True
) -> PinnedLookup:
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per pinned lookup", field="keys")
    session.counters.lookups += 1
    try:
        reply = session.call(
            "Lookup",
            pb.LookupRequest(
                namespace_id=handle.namespace_id, keys=pack_keys(keys), pin=True, hold_only=not promote
            ),
        )
    except Away:
        session.counters.lookups_failed += 1
        return PinnedLookup(0, [], 0, 0)
    return PinnedLookup(
        reply.hit_blocks, [TIER_NAMES.get(t, "?") for t in reply.tiers], reply.job_id, reply.boot_epoch
    )


def lookup_each_pinned(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> PinnedEach:
    """One answer per key (PrepareLoad's ``found``), the found ones pinned as one load job that
    moves no bytes until released (CompleteLoad)."""
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per pinned lookup", field="keys")
    session.counters.lookups += 1
    try:
        reply = session.call(
            "PrepareLoad",
            pb.PrepareLoadRequest(
                namespace_id=handle.namespace_id,
                keys=pack_keys(keys),
                transport=make_transport_value(session.settings.transport),
            ),
        )
    except Away:
        session.counters.lookups_failed += 1
        return PinnedEach([False] * len(keys), 0, 0)
    return PinnedEach([bool(b) for b in reply.found], reply.job_id, reply.boot_epoch)


def lookup_slices(
    session: SessionPort,
    handles: Sequence[Registered],
    chains: Sequence[Sequence[bytes]],
    *,
    promote: bool = True,
) -> SlicesLookup:
    """``lookup_pinned`` in every slice's namespace, in one round trip (LookupSlices) where the
    daemon serves it, else one lookup per slice with the same rules: each slice's keys cut at
    the hit so far, stopping at a slice with no hit."""
    if len(handles) != len(chains) or not handles:
        raise errors.InvalidArgument(
            f"{len(handles)} namespaces and {len(chains)} key chains: one chain per namespace, at least one",
            field="chains",
        )
    if any(len(keys) > session.max_batch for keys in chains):
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per slice", field="chains")
    session.counters.lookups += 1
    try:
        session.ensure()  # (the open tells whether the daemon serves LookupSlices)
    except Away:
        session.counters.lookups_failed += 1
        return SlicesLookup(0, [])
    if not session.lookup_slices_served:  # an older daemon
        return _lookup_each(session, handles, chains, promote=promote)
    return _lookup_at_once(session, handles, chains, promote=promote)


def _lookup_at_once(
    session: SessionPort, handles: Sequence[Registered], chains: Sequence[Sequence[bytes]], *, promote: bool
) -> SlicesLookup:
    """``lookup_slices`` from a daemon that serves it: one LookupSlices (a miss when the daemon
    is away)."""
    try:
        reply = session.call(
            "LookupSlices",
            pb.LookupSlicesRequest(
                namespace_ids=[h.namespace_id for h in handles],
                keys=[pack_keys(keys) for keys in chains],
                pin=True,
                hold_only=not promote,
            ),
        )
    except Away:
        session.counters.lookups_failed += 1
        return SlicesLookup(0, [])
    return SlicesLookup(
        reply.hit_blocks,
        [
            PinnedLookup(r.hit_blocks, [TIER_NAMES.get(t, "?") for t in r.tiers], r.job_id, reply.boot_epoch)
            for r in reply.slices
        ],
    )


def _lookup_each(
    session: SessionPort, handles: Sequence[Registered], chains: Sequence[Sequence[bytes]], *, promote: bool
) -> SlicesLookup:
    """``lookup_slices`` from a daemon that does not serve LookupSlices: one ``lookup_pinned``
    per slice (not counted again), each slice's keys cut at the hit so far, stopping at a slice
    with no hit."""
    out: list[PinnedLookup] = []
    hit: int | None = None
    for handle, keys in zip(handles, chains, strict=True):
        got = lookup_pinned(session, handle, keys if hit is None else keys[:hit], promote=promote)
        session.counters.lookups -= 1  # (counted once, by lookup_slices)
        out.append(got)
        hit = got.hits if hit is None else min(hit, got.hits)
        if not hit:
            break
    return SlicesLookup(hit or 0, out)


def prefetch(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> int:
    try:
        reply = session.call(
            "Prefetch", pb.PrefetchRequest(namespace_id=handle.namespace_id, keys=pack_keys(keys))
        )
    except Away:
        return 0
    return int(reply.promoting)


# -- stores -----------------------------------------------------------------------------------------

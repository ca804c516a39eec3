"""Handlers of transfers: PrepareStore, CompleteStore, PrepareLoad, CompleteLoad. Each checks
the caller's session, namespace and transport (:class:`~kvtierd.service.scope.Scope`), hands the
request and its caller to the cache (which admits it: kvtierd.cache.admission; a store's room
is ``TieredCache.prepare_store``'s) and translates the answer into a reply (offsets relative to
the arena the session maps).

The two completions hash, around the cache's primitives (the cache stays the index's only
writer):

* :func:`complete_store_hashed`: the digest of each reserved key's block (docs/security.md
  "Bytes verified end to end"): an shm client's own (``verify_store = "client"``; a wrong one
  makes only its own tenant's block a miss at its next load), else hashed here from the slots;
  a tcp job's were hashed as its bytes arrived. The job is checked once before (its digests'
  count, no CUDA copy in flight) and, when hashing awaited, found again after; then committed.
* :func:`complete_load_verified`: a client's claims that blocks it loaded are corrupt are
  rehashed (a client cannot drop blocks that are fine), the job completed, and the blocks that
  differ dropped.

Hashing runs off the event loop in the loop's default executor (xxhash releases the GIL), up to
a whole job's bytes, while the job's reservations or pins hold the slots, cut into one part per
core (``hashed_on_cores``): the client waits for the answer meanwhile, so its core is free.
Everything else runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from kvtier_contract.cores import usable_cores
from kvtier_contract.digests import block_digests
from kvtier_contract.errors import KvtierError, NotFound, Unavailable
from kvtier_contract.protoutil import split_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.jobs import LoadJob, StoreJob
from kvtierd.cache.staging import copy_staged, zero_staged
from kvtierd.domain import StoreStatus, Transport
from kvtierd.index import Entry
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.sessions import Session

log = logging.getLogger("kvtierd.service")


class TransferHandlers:
    """PrepareStore, CompleteStore, PrepareLoad, CompleteLoad (see the module docstring)."""

    def __init__(self, scope: Scope, settings: ServiceSettings, cache: TieredCache) -> None:
        self.scope = scope
        self.settings = settings
        self.cache = cache

    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        transport = self.scope.job_transport(s, request.transport)
        base = self.scope.arena_base(s, ns)
        if self.settings.draining:
            raise Unavailable("daemon is draining: stores are not admitted")
        job, status, offsets = await self.cache.prepare_store(
            s,
            ns,
            keys,
            transport,
            token_ids=list(request.token_ids),
            parent=request.parent_key or None,
            caller=self.scope.caller(),
        )
        # a group's arena its client maps read-only: an shm job is staged in its own (a cuda_ipc
        # job's bytes are the daemon's to move, into the group's slots themselves)
        own = self.scope.staging_arena(s, ns) if transport is Transport.SHM else None
        if job is not None and own is not None:
            base = self.cache.host.pool_bases[own]
            staged = await stage_zeroed(self.cache, s, job, own)
            offsets = [staged.get(i, o) for i, o in enumerate(offsets)]
        if base and job is not None:
            offsets = [
                o - base if st == StoreStatus.RESERVED else 0 for o, st in zip(offsets, status, strict=True)
            ]
        return pb.PrepareStoreReply(
            boot_epoch=self.settings.boot_epoch, job_id=job.id if job else 0, status=status, offsets=offsets
        )

    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        committed, aborted = await complete_store_hashed(
            self.cache,
            s,
            request.job_id,
            request.ok,
            list(request.item_ok),
            list(request.digests),
            trust_client=self.settings.verify_store == "client",
        )
        return pb.CompleteStoreReply(
            boot_epoch=self.settings.boot_epoch, committed=committed, aborted=aborted
        )

    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        """found[i] = 1: key i is pinned at offsets[i]. found[i] = 0 with tiers[i] = a storage
        tier: present there but not placed in the host tier this round (ask again after
        CompleteLoad); with tiers[i] = TIER_NONE: absent."""
        s = self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        transport = self.scope.job_transport(s, request.transport)
        base = self.scope.arena_base(s, ns)
        caller = self.scope.caller()
        # never let the caller's deadline pass waiting on a slow tier (the caller would take
        # a live daemon for one that is away): answer by then with what the host tier holds
        answer_by = AnswerBy.for_deadline(context.time_remaining())
        job, deferred = await self.cache.prepare_load(
            s, ns, keys, transport, host_only=request.host_only, answer_by=answer_by, caller=caller
        )
        if job is not None:
            left = context.time_remaining()
            if left is not None and left <= 0:  # (the loop itself was late): pin nothing
                self.cache.abort_job(s, job)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the load could be answered"
                )
            self.cache.admit_pins(caller, s, job)
        tiers = bytearray(len(keys))
        for i, tier in deferred.items():
            tiers[i] = tier
        return self._load_reply(job, len(keys), tiers, base, answer_by is not None and answer_by.cut)

    def _load_reply(
        self, job: LoadJob | None, n: int, tiers: bytearray, base: int, cut: bool
    ) -> pb.PrepareLoadReply:
        """PrepareLoad's reply: ``job``'s pinned blocks (found, offsets in the session's
        mapping, their digests when bytes are verified; 0: none known, the client checks
        nothing), the deferred ones' tiers, and whether the deadline cut the answer short."""
        found, offsets = bytearray(n), [0] * n
        if job is None:
            return pb.PrepareLoadReply(
                boot_epoch=self.settings.boot_epoch,
                found=bytes(found),
                offsets=offsets,
                tiers=bytes(tiers),
                deadline_cut=cut,
            )
        for i, e in job.items.items():
            found[i], offsets[i], tiers[i] = 1, e.offset - base, pb.TIER_HOST
        digests: list[int] = []
        if self.cache.verify_bytes:
            digests = [0] * n
            for i, e in job.items.items():
                digests[i] = e.digest or 0
        return pb.PrepareLoadReply(
            boot_epoch=self.settings.boot_epoch,
            job_id=job.id,
            found=bytes(found),
            offsets=offsets,
            tiers=bytes(tiers),
            digests=digests,
            deadline_cut=cut,
        )

    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        dropped, ns_id = await complete_load_verified(self.cache, s, request.job_id, list(request.corrupt))
        if dropped:
            log.warning("%d block(s) of namespace %d failed verification at a load: dropped", dropped, ns_id)
        return pb.CompleteLoadReply(boot_epoch=self.settings.boot_epoch, dropped=dropped)


async def complete_store_hashed(
    cache: TieredCache,
    session: Session,
    job_id: int,
    ok: bool,
    item_ok: Sequence[bool],
    given: Sequence[int],
    *,
    trust_client: bool,
) -> tuple[int, int]:
    """``complete_store`` with each committed block's digest (see the module docstring);
    ``given``: the client's digests (their count is checked first: INVALID_ARGUMENT, nothing
    changes); ``trust_client``: an shm client's own are taken. (committed, aborted)."""
    job = cache.stores.checked_job(session, job_id, item_ok, given)
    if job.staged:  # written into its own arena: copied into the group's first
        task = asyncio.get_running_loop().create_task(
            _complete_staged(cache, session, job, ok, item_ok, given, trust_client)
        )
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)
    digests, waited = await _store_digests(cache, job, ok, given, trust_client)
    if waited:  # the job again after the hashing: still live, and no CUDA copy begun meanwhile
        job = cache.jobs.get(session.id, job_id, StoreJob)
        cache.jobs.not_copying(job_id)
    return cache.stores.end_store(session, job, ok, item_ok, 0.0, digests)


async def stage_zeroed(cache: TieredCache, session: Session, job: StoreJob, pool: int) -> dict[int, int]:
    """``Stores.stage`` in arena ``pool`` (the session's own), the staging slots zeroed on the
    loop's executor before the client is told of them (the job marked copying meanwhile: a
    release holds the slots back); key index -> staging offset."""
    staged = await cache.stores.stage(session, job, pool)
    cache.jobs.copying.add(job.id)
    zero = asyncio.get_running_loop().run_in_executor(None, zero_staged, cache.residency, job)
    zero.add_done_callback(lambda _f: cache.jobs.copying.discard(job.id))
    await asyncio.shield(zero)
    return staged


async def _complete_staged(
    cache: TieredCache,
    session: Session,
    job: StoreJob,
    ok: bool,
    item_ok: Sequence[bool],
    given: Sequence[int],
    trust_client: bool,
) -> tuple[int, int]:
    """A staged job's CompleteStore, run to its end as a task of its own (even when the call
    is cancelled): the staging slots of the keys that commit copied into their entries' slots
    on the loop's executor (kvtierd.cache.staging), the digests, the commit. The job is marked
    copying throughout: no second CompleteStore or CUDA copy of it starts meanwhile, and a
    release of its session holds its slots back until the copy is over."""
    cache.jobs.copying.add(job.id)
    try:
        if ok:
            keep = {i for n, i in enumerate(sorted(job.items)) if not item_ok or item_ok[n]}
            await asyncio.get_running_loop().run_in_executor(None, copy_staged, cache.residency, job, keep)
        digests, _waited = await _store_digests(cache, job, ok, given, trust_client)
    finally:
        cache.jobs.copying.discard(job.id)
    if not cache.jobs.is_live(job):  # (its session was released meanwhile)
        raise NotFound(f"unknown or finished job {job.id}", field="job_id")
    return cache.stores.end_store(session, job, ok, item_ok, 0.0, digests)


def _retrieved(task: asyncio.Task[tuple[int, int]]) -> None:
    """A staged completion whose caller went away: its error is logged here, not lost."""
    error = None if task.cancelled() else task.exception()
    if error is not None and not isinstance(error, KvtierError):
        log.warning("a staged store's completion failed: %s", error)


async def _store_digests(
    cache: TieredCache, job: StoreJob, ok: bool, given: Sequence[int], trust_client: bool
) -> tuple[list[int], bool]:
    """The digests ``complete_store`` takes, and whether computing them awaited."""
    if not cache.verify_bytes or not ok:
        return [], False
    if given and job.transport is Transport.SHM and trust_client:
        return list(given), False
    items = sorted(job.items.items())
    out = [job.digests.get(i, 0) for i, _e in items]
    todo = [
        (n, e)
        for n, (i, e) in enumerate(items)
        if i not in job.digests and (not job.transport.daemon_moved or i in job.received)
    ]
    if not todo:
        return out, False
    nb, host = job.ns.block_bytes, cache.host
    views = [host.view(e.offset, nb) for _n, e in todo]
    hashed = await hashed_on_cores(views)
    for (n, _e), d in zip(todo, hashed, strict=True):
        out[n] = d
    return out, True


HASH_PART_BYTES = 4 << 20  # a part of a job's hashing at least this large (a hand-off: ~50 µs)


async def hashed_on_cores(views: Sequence[memoryview]) -> list[int]:
    """The digests of ``views`` in order, hashed off the loop in up to one part per core this
    process may use (``usable_cores``: a container's CPU quota, not the node's cores; each
    part at least ``HASH_PART_BYTES``)."""
    if not views:
        return []
    total = sum(len(v) for v in views)
    parts = max(1, min(usable_cores(), len(views), total // HASH_PART_BYTES))
    loop = asyncio.get_running_loop()
    step = -(-len(views) // parts)
    done = await asyncio.gather(
        *(loop.run_in_executor(None, block_digests, views[i : i + step]) for i in range(0, len(views), step))
    )
    return [d for part in done for d in part]


async def complete_load_verified(
    cache: TieredCache, session: Session, job_id: int, corrupt: Sequence[int]
) -> tuple[int, int]:
    """``complete_load``, the blocks at key indexes ``corrupt`` rehashed first (while the
    job's pins hold their slots) and those that differ from their digest dropped. (dropped,
    their namespace's id; 0 when none was)."""
    bad: list[Entry] = []
    claimed = cache.corrupt_claims(session, job_id, corrupt) if corrupt else []
    if claimed:  # rehashed off the loop (up to a whole job's bytes), the slots still pinned
        host = cache.host
        views = [host.view(e.offset, e.ns.block_bytes) for e in claimed]
        hashed = await hashed_on_cores(views)
        cache.jobs.get(session.id, job_id, LoadJob)  # pinned all along, or NotFound
        bad = [e for e, d in zip(claimed, hashed, strict=True) if d != e.digest]
    cache.complete_load(session, job_id)
    dropped = cache.drop_corrupt(bad) if bad else 0
    return dropped, bad[0].ns.id if dropped else 0

"""What a transfer's RPC asks of the cache beyond one primitive: the flows that hash off the
event loop (kvtierd.service.transfers translates them and nothing more; the store's room and
admission are ``TieredCache.prepare_store``'s).

* :func:`complete_store_hashed`: the digest of each reserved key's block (docs/security.md
  "Bytes verified end to end"): an shm client's own (``verify_store = "client"``; a wrong one
  makes only its own tenant's block a miss at its next load), else hashed here from the slots;
  a tcp job's were hashed as its bytes arrived. The job is checked once before (its digests'
  count, no CUDA copy in flight) and, when hashing awaited, found again after; then committed.
* :func:`complete_load_verified`: a client's claims that blocks it loaded are corrupt are
  rehashed (a client cannot drop blocks that are fine), the job completed, and the blocks that
  differ dropped.

Hashing runs off the event loop in the loop's default executor (xxhash releases the GIL), up to
a whole job's bytes, while the job's reservations or pins hold the slots. Everything else runs
on the event-loop thread; the cache stays the index's only writer (these call its primitives).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier_contract.digests import block_digests
from kvtierd.cache.cache import TieredCache
from kvtierd.cache.jobs import LoadJob, StoreJob
from kvtierd.domain import Transport
from kvtierd.index import Entry
from kvtierd.sessions import Session


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
    digests, waited = await _store_digests(cache, job, ok, given, trust_client)
    if waited:  # the job again after the hashing: still live, and no CUDA copy begun meanwhile
        job = cache.jobs.get(session.id, job_id, StoreJob)
        cache.jobs.not_copying(job_id)
    return cache.stores.end_store(session, job, ok, item_ok, 0.0, digests)


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
    hashed = await asyncio.get_running_loop().run_in_executor(None, block_digests, views)
    for (n, _e), d in zip(todo, hashed, strict=True):
        out[n] = d
    return out, True


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
        hashed = await asyncio.get_running_loop().run_in_executor(None, block_digests, views)
        cache.jobs.get(session.id, job_id, LoadJob)  # pinned all along, or NotFound
        bad = [e for e, d in zip(claimed, hashed, strict=True) if d != e.digest]
    cache.complete_load(session, job_id)
    dropped = cache.drop_corrupt(bad) if bad else 0
    return dropped, bad[0].ns.id if dropped else 0

"""The read side of the cache: lookups (and the holds they take) and loads.

:class:`Reads` is handed the cache's :class:`~kvtierd.cache.state.CacheState` by
:class:`~kvtierd.cache.TieredCache` and pins and holds its READY entries (kvtierd.cache.stores
reserves, commits and aborts them).

* ``lookup(ns, keys, options)`` (kvtierd.cache.lookup.LookupOptions): the longest READY prefix,
  each hit's tier and durability, counted; optionally the shared tier after the local prefix, a
  *hold* of the hit prefix (a job without bytes), or only a prefetch.
* ``prepare_load`` pins READY entries with a valid host slot, importing from the shared tier and
  promoting from the chain as many of the others as the host tier can place now; the rest are
  *deferred* (still present: ask again after ``complete_load``, so a load larger than the free
  host tier streams in rounds). ``complete_load`` ends the job.
* ``load_queued(job)`` / ``load_sent(job)``: a data connection holds views of a load job's slots
  that the kernel has not taken yet / no longer does; a job that ended meanwhile keeps its pins
  (and ``pinned_blocks``) until the last ``load_sent``.

Concurrency: event-loop thread only, no locks (the cache's).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.jobs import LoadJob, check_live
from kvtierd.cache.lookup import LOCAL, LookupOptions, LookupResult, count_hits, ready_prefix, tier_below
from kvtierd.cache.state import CacheState
from kvtierd.domain import Transport
from kvtierd.index import Entry, NamespaceState
from kvtierd.sessions import Session


class Reads:
    """The read part of :class:`~kvtierd.cache.TieredCache` over the cache's ``state`` (see
    the module docstring). Owns nothing of its own; event-loop thread only (the cache's)."""

    def __init__(self, state: CacheState) -> None:
        self.state = state

    # -- lookups ----------------------------------------------------------------------------------

    async def lookup(
        self, ns: NamespaceState, keys: Sequence[bytes], options: LookupOptions = LOCAL
    ) -> LookupResult:
        """The longest prefix of READY blocks of ``keys`` (hits touched in the policies and
        counted), and what ``options`` add (kvtierd.cache.lookup.LookupOptions): the shared
        tier after the local prefix, a hold of the hit prefix, promotions. Awaits only the
        shared tier (``shared``), so a lookup without one never suspends."""
        if options.prefetch:
            prefix = ready_prefix(ns, keys)
            below = [e for e in prefix if not e.in_host]
            started = sum(link.promotion.prefetch(below) for link in self.state.chain) if below else 0
            return LookupResult(len(prefix), promoting=started)
        fleet = self.state.fleet if options.shared else None
        if options.pin is None:
            hit, tiers, durable = count_hits(ns, keys, self.state.policy, self.state.chain)
            if fleet is not None and hit < len(keys):
                more = await fleet.extend(ns, keys[hit:])
                if more:
                    fleet.count_hits(ns, more, moved_from_host=False)
                    return LookupResult(
                        hit + more, tiers + bytes([fleet.tier.id]) * more, durable + bytes(more)
                    )
            return LookupResult(hit, tiers, durable)
        imported = await fleet.import_prefix(ns, keys) if fleet is not None and options.promote else []
        found = self._hold(options.pin, ns, keys, promote=options.promote)
        if imported and found.job is not None and fleet is not None:
            held = set(found.job.items.values())  # those counted as host hits just now
            n = sum(1 for e in imported if e in held)
            if n:
                fleet.count_hits(ns, n, moved_from_host=True)
        return found

    def _hold(
        self, session: Session, ns: NamespaceState, keys: Sequence[bytes], *, promote: bool
    ) -> LookupResult:
        """Lookup, then hold the hit prefix (released by complete_load or expiry).

        Answers without waiting on a disk: each hit's tier as it is now. A held block stays in
        the index (it keeps its last copy) but may still move between tiers, so holding a prefix
        larger than the host tier never blocks the load of it, which streams through the host
        tier in rounds. Blocks held only below start promoting in the background, unless
        ``promote`` is False (the client may not load them; the PrepareLoad that does promotes
        them then)."""
        hit, tiers, durable = count_hits(ns, keys, self.state.policy, self.state.chain)
        if hit == 0:
            return LookupResult(0)
        check_live(session)
        items = {i: ns.ready[keys[i]] for i in range(hit)}
        for e in items.values():
            e.holds += 1
        self.state.pinned_blocks += hit
        job = LoadJob(self.state.jobs.next_id(), session.id, ns, session.transport, items, moves_bytes=False)
        self.state.jobs.add(job)
        session.load_jobs.add(job.id)
        below = [e for e in items.values() if not e.in_host] if promote else []
        if below:
            for link in self.state.chain:
                link.promotion.prefetch(below)
        return LookupResult(hit, tiers, durable, job)

    # -- loads ------------------------------------------------------------------------------------

    async def prepare_load(
        self,
        session: Session,
        ns: NamespaceState,
        keys: Sequence[bytes],
        transport: Transport,
        *,
        host_only: bool = False,
        answer_by: AnswerBy | None = None,
    ) -> tuple[LoadJob | None, dict[int, int]]:
        """Pin the READY entries among ``keys`` that have (or now get) a host slot: the job, and
        the keys still present below but not placed this round (deferred: index -> the storage
        tier holding them). ``host_only``: only those in the host tier now; nothing is
        promoted or imported (the rest is deferred at once). ``answer_by``: imports and
        promotions are waited for until then only (the reads go on; what has not arrived is
        deferred, and ``answer_by.cut`` says so)."""
        if not host_only and self.state.fleet is not None and any(k not in ns.entries for k in keys):
            importing = self.state.fleet.import_(ns, keys, {e for e in map(ns.ready.get, keys) if e})
            await (importing if answer_by is None else answer_by.wait(importing))
            check_live(session)
        items: dict[int, Entry] = {}
        for i, k in enumerate(keys):
            e = ns.ready.get(k)
            if e is not None:
                items[i] = e
        items, deferred = await self._in_host(session, items, host_only, answer_by)
        for e in items.values():
            self.state.policy.touch(e)
        if not items:
            return None, deferred
        return self._new_load_job(session, ns, items, transport), deferred

    async def _in_host(
        self, session: Session, items: dict[int, Entry], host_only: bool, answer_by: AnswerBy | None
    ) -> tuple[dict[int, Entry], dict[int, int]]:
        """``items`` (index -> READY entry) split into those with a host slot now (promoted
        first, as many as fit, unless ``host_only``) and the deferred ones still present
        below (index -> the storage tier holding them); without a chain, all of ``items``."""
        if not (self.state.chain and items):
            return items, {}
        if host_only:
            deferred = {
                i: tier_below(self.state.chain, e) for i, e in items.items() if not e.in_host and e.copies
            }
            return {i: e for i, e in items.items() if e.in_host}, deferred
        kept = await self._promoted(session, items, answer_by)
        deferred = {
            i: tier_below(self.state.chain, e)
            for i, e in items.items()
            if i not in kept and e.copies and e.ns.ready.get(e.key) is e
        }
        for e in kept.values():
            e.pins -= 1  # _new_load_job takes the job's own pins
        return kept, deferred

    async def _promoted(
        self, session: Session, items: dict[int, Entry], answer_by: AnswerBy | None = None
    ) -> dict[int, Entry]:
        """Pin ``items``, promote those held only below (as many as fit, waiting until
        ``answer_by`` at most), unpin and drop those that are not in the host tier now.
        Returned entries stay pinned (once more)."""
        for e in items.values():
            e.pins += 1
        protect = set(items.values())
        try:
            for link in self.state.chain:
                need = [e for e in items.values() if not e.in_host and e.copy_in(link.level) is not None]
                if not need:
                    continue
                promoting = link.promotion.promote_many(need, protect)
                if answer_by is None:
                    await promoting
                elif await answer_by.wait(promoting) is None:
                    break  # out of time: what is in the host tier now
        except BaseException:  # cancelled (the RPC's deadline): the pins go, the reads go on
            for e in items.values():
                e.pins -= 1
            raise
        kept: dict[int, Entry] = {}
        for i in sorted(items):
            e = items[i]
            if e.in_host and not session.released:
                kept[i] = e
            else:
                e.pins -= 1
        return kept

    def complete_load(self, session: Session, job_id: int) -> int:
        job = self.state.jobs.get(session.id, job_id, LoadJob)
        self.state.jobs.not_copying(job_id)
        self.finish_load(session, job)
        if not job.moves_bytes:
            return len(job.items)
        c = job.ns.counters
        c.loads += len(job.items)
        name = f"bytes_out_{job.transport.label}"
        setattr(c, name, getattr(c, name) + len(job.items) * job.ns.block_bytes)
        return len(job.items)

    def _new_load_job(
        self, session: Session, ns: NamespaceState, items: dict[int, Entry], transport: Transport
    ) -> LoadJob:
        check_live(session)
        for e in items.values():
            e.pins += 1
        self.state.pinned_blocks += len(items)
        job = LoadJob(self.state.jobs.next_id(), session.id, ns, transport, items)
        self.state.jobs.add(job)
        session.load_jobs.add(job.id)
        return job

    def load_queued(self, job: LoadJob) -> None:
        """A data connection queued views of ``job``'s slots (DATA frames the kernel has not
        taken yet): the job's pins outlive its end until the matching ``load_sent``."""
        assert job.moves_bytes
        job.sending += 1

    def load_sent(self, job: LoadJob) -> None:
        """That connection's write buffer emptied, or the connection was lost and its views
        dropped. A job that ended meanwhile is unpinned once no connection holds its bytes."""
        assert job.sending > 0
        job.sending -= 1
        if not job.sending and job.ended:
            self._unpin(job)

    def finish_load(self, session: Session, job: LoadJob) -> None:
        self.state.jobs.remove(job)
        session.load_jobs.discard(job.id)
        job.ended = True
        if not job.sending:  # else the last load_sent unpins
            self._unpin(job)

    def _unpin(self, job: LoadJob) -> None:
        if job.moves_bytes:
            for e in job.items.values():
                assert e.pins > 0
                e.pins -= 1
        else:  # a pinned lookup's holds
            for e in job.items.values():
                assert e.holds > 0
                e.holds -= 1
        self.state.pinned_blocks -= len(job.items)

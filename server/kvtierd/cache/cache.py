"""TieredCache: the sole writer of the block index; decides where bytes go.

It answers with plain data (job ids, arena offsets) and never touches payload bytes: transports
move them (the client itself over shm, the data channel over tcp) and report completion.

Primitives (event-loop thread only; no locks). Each either fully succeeds or changes nothing:

* ``register_namespace(spec)`` -> NamespaceState (idempotent; id derived from the digest, so it
  is the same across daemon restarts and never names another namespace).
* ``lookup(ns, keys)`` -> longest prefix of READY blocks; ``pin_prefix`` also pins it as a load job.
* ``prepare_store`` -> per key RESERVED (entry WRITING) / ALREADY_PRESENT / REJECTED;
  ``complete_store(ok)`` -> WRITING entries become READY, or are freed.
* ``prepare_load`` pins READY entries; ``complete_load`` unpins.
* ``release_session`` aborts a session's stores and releases its pins (close or lease expiry).

Size: over the house limit because the entry state machine's transitions (store, load, evict,
limbo, promotion hand-off) are kept in one place; NVMe movement lives in kvtierd.tiering.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from kvtier_contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvtier_contract.identity import Namespace
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.policies import EvictionPolicy
from kvtierd.sessions import Session
from kvtierd.stats import Counters
from kvtierd.tiers import HostTier

RESERVED, PRESENT, REJECTED = pb.STORE_RESERVED, pb.STORE_ALREADY_PRESENT, pb.STORE_REJECTED
TIER_HOST, TIER_NVME = pb.TIER_HOST, pb.TIER_NVME
_HOST_TIERS = bytes([pb.TIER_HOST]) * 4096

if TYPE_CHECKING:
    from kvtierd.tiering import NvmeBridge
_TRANSPORT_NAMES = {pb.TRANSPORT_SHM: "shm", pb.TRANSPORT_TCP: "tcp",
                    pb.TRANSPORT_CUDA_IPC: "cuda_ipc"}
# Transports whose bytes the daemon moves itself: a store commits only what arrived.
_DAEMON_MOVED = frozenset({pb.TRANSPORT_TCP, pb.TRANSPORT_CUDA_IPC})


@dataclass(eq=False)
class StoreJob:
    id: int
    session_id: int
    ns: NamespaceState
    transport: int
    items: dict[int, Entry]  # key index in the request -> reserved entry
    received: set[int] = field(default_factory=set)  # tcp, cuda_ipc: keys whose bytes arrived


@dataclass(eq=False)
class LoadJob:
    id: int
    session_id: int
    ns: NamespaceState
    transport: int
    items: dict[int, Entry]  # key index in the request -> pinned entry
    moves_bytes: bool = True  # False for a pinned lookup: releasing it counts no load


J = TypeVar("J", StoreJob, LoadJob)


def _check_live(session: Session) -> None:
    """Jobs attach only to live sessions: a released one would never free them (its lease
    may lapse while a request awaits flushes or promotions)."""
    if session.released:
        raise NotFound(f"session {session.id} expired or closed", field="session_id")


class TieredCache:
    """Owns the index (entries of every namespace), the jobs and the eviction policy.

    Concurrency: event-loop thread only, no locks. Data-plane servers on the same loop call
    ``store_target`` / ``load_sources`` to learn where bytes go; they never change the index.
    """

    def __init__(self, host: HostTier, policy: EvictionPolicy[Entry], *, max_namespaces: int,
                 policy_name: str = "lru", clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self._clock = clock
        # Slots of stores aborted by lease expiry, held back until a deadline: the session's
        # process may be stalled, not dead, and still copying into them over shm.
        self._limbo: deque[tuple[float, int, int]] = deque()  # (free at, offset, slot_bytes)
        self.policy = policy
        self.policy_name = policy_name
        self.namespaces: dict[int, NamespaceState] = {}
        self._max_namespaces = max_namespaces
        self._jobs: dict[int, StoreJob | LoadJob] = {}
        self._job_ids = itertools.count(1)
        self.pinned_blocks = 0
        self.writing_blocks = 0
        # Jobs whose bytes the daemon is copying right now (cuda_ipc): their slots are never
        # handed out again before the copy is over.
        self.copying: set[int] = set()
        self.bridge: NvmeBridge | None = None  # set by the composition root when NVMe is on

    # -- namespaces -------------------------------------------------------------------------------

    def register_namespace(self, spec: Namespace) -> NamespaceState:
        ns = self.namespaces.get(spec.namespace_id)
        if ns is not None:
            if ns.spec.digest != spec.digest:  # 63-bit id collision: refuse, never alias
                raise FailedPrecondition("namespace id collision", field="namespace")
            return ns
        if len(self.namespaces) >= self._max_namespaces:
            raise ResourceExhausted(f"too many namespaces (max {self._max_namespaces})",
                                    field="namespace")
        block_bytes = spec.block_bytes
        if not self.host.fits(block_bytes):
            raise InvalidArgument(
                f"block of {block_bytes} bytes does not fit a slab of {self.host.slab_bytes} bytes"
                " (raise slab_bytes)", field="namespace.block_bytes")
        ns = NamespaceState(spec.namespace_id, spec, block_bytes,
                            self.host.slot_bytes_for(block_bytes))
        self.namespaces[ns.id] = ns
        return ns

    def namespace(self, namespace_id: int) -> NamespaceState:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id} (register it first)",
                           field="namespace_id")
        return ns

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, ns: NamespaceState, keys: Sequence[bytes]) -> int:
        """Longest prefix of READY blocks (hits are touched in the policy and counted)."""
        return self.lookup_tiers(ns, keys)[0]

    def lookup_tiers(self, ns: NamespaceState, keys: Sequence[bytes]) -> tuple[int, bytes]:
        """Longest prefix of READY blocks and the tier of each (one Tier byte per hit)."""
        hit, tiers, _ = self.lookup_detail(ns, keys)
        return hit, tiers

    def lookup_detail(self, ns: NamespaceState, keys: Sequence[bytes]) -> tuple[int, bytes, bytes]:
        """Longest READY prefix, the tier of each hit, and whether each has a durable NVMe copy."""
        found = list(map(ns.ready.get, keys))  # C-speed: ~40 µs for a 1,000-key chain
        try:
            hit = found.index(None)
        except ValueError:
            hit = len(found)
        hits: list[Entry] = found[:hit]  # type: ignore[assignment]  # no None before `hit`
        if self.bridge is None:
            self.policy.touch_many(hits)
            tiers = _HOST_TIERS[:hit] if hit <= len(_HOST_TIERS) else bytes([TIER_HOST]) * hit
            on_nvme = 0
            durable = bytes(hit)
        else:
            in_host = [e.in_host for e in hits]
            tiers = bytes(TIER_HOST if h else TIER_NVME for h in in_host)
            on_nvme = hit - sum(in_host)
            durable = bytes(e.nvme is not None for e in hits)
            self.policy.touch_many([e for e, h in zip(hits, in_host, strict=True) if h])
            self.bridge.policy.touch_many([e for e in hits if e.nvme is not None])
            self.bridge.on_hits(hits)
        c = ns.counters
        n, tpb = len(keys), ns.spec.tokens_per_block
        c.lookups += 1
        c.blocks_requested += n
        c.blocks_hit_host += hit - on_nvme
        c.blocks_hit_nvme += on_nvme
        c.blocks_missed += n - hit
        c.tokens_requested += n * tpb
        c.tokens_hit += hit * tpb
        c.tokens_missed += (n - hit) * tpb
        return hit, tiers, durable

    async def pin_prefix(self, session: Session, ns: NamespaceState,
                         keys: Sequence[bytes]) -> LoadJob | None:
        """Lookup, then pin the hit prefix as a load job (released by complete_load or expiry).
        NVMe-only blocks are promoted first; the prefix ends at the first that cannot be."""
        hit = self.lookup(ns, keys)
        if hit == 0:
            return None
        items = {i: ns.ready[keys[i]] for i in range(hit)}
        if self.bridge is not None:
            items = await self._promoted(session, items, prefix=True)
            if not items:
                return None
            job = self._job_for_pinned(session, ns, items, session.transport)
        else:
            job = self._new_load_job(session, ns, items, session.transport)
        job.moves_bytes = False
        return job

    # -- stores -----------------------------------------------------------------------------------

    def prepare_store(self, session: Session, ns: NamespaceState, keys: Sequence[bytes],
                      transport: int) -> tuple[StoreJob | None, bytes, list[int]]:
        _check_live(session)
        status = bytearray(len(keys))
        offsets = [0] * len(keys)
        items: dict[int, Entry] = {}
        protect: set[Entry] = set()  # READY keys of this batch: not evicted to make room for it
        for k in keys:
            e = ns.entries.get(k)
            if e is not None and e.state is EntryState.READY:
                protect.add(e)
        job_id = next(self._job_ids)
        full = False
        c = ns.counters
        for i, k in enumerate(keys):
            if k in ns.entries:
                status[i] = PRESENT
                c.stores_already_present += 1
                continue
            off = None if full else self.allocate_host(ns.slot_bytes, protect)
            if off is None:
                full = True  # nothing evictable for this class now: the rest cannot fit either
                status[i] = REJECTED
                c.stores_rejected += 1
                continue
            e = Entry(ns, k, off, job_id)
            ns.entries[k] = e
            items[i] = e
            status[i] = RESERVED
            offsets[i] = off
        if not items:
            return None, bytes(status), offsets
        job = StoreJob(job_id, session.id, ns, transport, items)
        self._jobs[job_id] = job
        session.store_jobs.add(job_id)
        self.writing_blocks += len(items)
        return job, bytes(status), offsets

    def complete_store(self, session: Session, job_id: int, ok: bool,
                       item_ok: Sequence[bool] = (), *, hold_until: float = 0.0) -> tuple[int, int]:
        job = self._job(session, job_id, StoreJob)
        if item_ok and len(item_ok) != len(job.items):
            raise InvalidArgument(f"has {len(item_ok)} values for {len(job.items)} reserved keys",
                                  field="item_ok")
        del self._jobs[job_id]
        session.store_jobs.discard(job_id)
        committed = aborted = 0
        ns, c = job.ns, job.ns.counters
        for n, (i, e) in enumerate(sorted(job.items.items())):
            good = ok and (item_ok[n] if item_ok else True)
            if job.transport in _DAEMON_MOVED and i not in job.received:
                good = False  # the daemon never received these bytes
            if good:
                e.state = EntryState.READY
                e.job = 0
                ns.ready[e.key] = e
                self.policy.insert(e)
                c.resident_blocks += 1
                c.resident_bytes += ns.block_bytes
                committed += 1
            else:
                self._free(e, hold_until)
                aborted += 1
        self.writing_blocks -= len(job.items)
        if self.bridge is not None and committed:
            self.bridge.on_committed([e for e in job.items.values() if e.state is EntryState.READY])
        c.stores_accepted += committed
        c.stores_dropped += aborted
        name = _TRANSPORT_NAMES.get(job.transport, "shm")
        setattr(c, f"bytes_in_{name}", getattr(c, f"bytes_in_{name}") + committed * ns.block_bytes)
        return committed, aborted

    # -- loads ------------------------------------------------------------------------------------

    async def prepare_load(self, session: Session, ns: NamespaceState, keys: Sequence[bytes],
                           transport: int) -> LoadJob | None:
        """Pin the READY entries among ``keys`` (promoting NVMe-only ones first)."""
        items: dict[int, Entry] = {}
        for i, k in enumerate(keys):
            e = ns.ready.get(k)
            if e is not None:
                items[i] = e
        if self.bridge is not None and items:
            items = await self._promoted(session, items, prefix=False)
            if not items:
                return None
            for e in items.values():
                self.policy.touch(e)
            return self._job_for_pinned(session, ns, items, transport)
        for e in items.values():
            self.policy.touch(e)
        if not items:
            return None
        return self._new_load_job(session, ns, items, transport)

    async def _promoted(self, session: Session, items: dict[int, Entry], *,
                        prefix: bool) -> dict[int, Entry]:
        """Pin ``items``, promote the NVMe-only ones, unpin and drop those that failed (and,
        with ``prefix``, everything after the first failure). Returned entries stay pinned."""
        assert self.bridge is not None
        for e in items.values():
            e.pins += 1
        protect = set(items.values())
        need = [e for e in items.values() if not e.in_host]
        promoted = await self.bridge.promote_many(need, protect) if need else set()
        results = {id(e): e in promoted for e in need}
        kept: dict[int, Entry] = {}
        failed = False
        for i in sorted(items):
            e = items[i]
            good = not failed and results.get(id(e), True) and e.in_host and not session.released
            failed = failed or (prefix and not good)
            if good:
                kept[i] = e
            else:
                e.pins -= 1
        return kept

    def complete_load(self, session: Session, job_id: int) -> int:
        job = self._job(session, job_id, LoadJob)
        self._finish_load(session, job)
        if not job.moves_bytes:
            return len(job.items)
        c = job.ns.counters
        c.loads += len(job.items)
        name = _TRANSPORT_NAMES.get(job.transport, "shm")
        n = len(job.items) * job.ns.block_bytes
        setattr(c, f"bytes_out_{name}", getattr(c, f"bytes_out_{name}") + n)
        return len(job.items)

    # -- sessions ---------------------------------------------------------------------------------

    def release_session(self, session: Session) -> None:
        """Abort the session's store jobs and release its pins (close or lease expiry).

        After an expiry the aborted slots stay out of use for one more lease period (limbo): a
        stalled shm writer that wakes up late then writes into a slot nobody else holds.
        """
        hold_until = self._clock() + session.ttl_s if session.expired else 0.0
        for job_id in list(session.store_jobs):
            # A daemon-side copy still writing into the slots holds them back as well.
            hold = self._clock() + session.ttl_s if job_id in self.copying else hold_until
            self.complete_store(session, job_id, ok=False, hold_until=hold)
        for job_id in list(session.load_jobs):
            job = self._jobs[job_id]
            assert isinstance(job, LoadJob)
            self._finish_load(session, job)

    def sweep_limbo(self) -> int:
        """Return held-back slots whose time has come to the tier; how many were returned."""
        now, n = self._clock(), 0
        while self._limbo and self._limbo[0][0] <= now:
            _, offset, slot_bytes = self._limbo.popleft()
            self.host.free(offset, slot_bytes)
            n += 1
        return n

    @property
    def limbo_blocks(self) -> int:
        return len(self._limbo)

    # -- data plane hooks -------------------------------------------------------------------------

    def store_target(self, session_id: int, job_id: int, index: int, nbytes: int) -> memoryview:
        """Where the bytes of key ``index`` of a store job go (tcp data channel)."""
        job = self._jobs.get(job_id)
        if not isinstance(job, StoreJob) or job.session_id != session_id:
            raise NotFound(f"no store job {job_id} for this session", field="job_id")
        e = job.items.get(index)
        if e is None:
            raise InvalidArgument(f"key {index} is not reserved in job {job_id}", field="index")
        if nbytes != job.ns.block_bytes:
            raise InvalidArgument(f"payload of {nbytes} bytes, block is {job.ns.block_bytes}",
                                  field="length")
        return self.host.arena.slot(e.offset, nbytes)

    def store_entry(self, job_id: int, index: int) -> Entry:
        job = self._jobs[job_id]
        assert isinstance(job, StoreJob)
        return job.items[index]

    def mark_received(self, session_id: int, job_id: int, index: int) -> None:
        job = self._jobs.get(job_id)
        if isinstance(job, StoreJob) and job.session_id == session_id and index in job.items:
            job.received.add(index)

    def load_sources(self, session_id: int, job_id: int) -> list[tuple[int, memoryview]]:
        """The pinned slots of a load job, in key order (tcp data channel)."""
        job = self._jobs.get(job_id)
        if not isinstance(job, LoadJob) or job.session_id != session_id:
            raise NotFound(f"no load job {job_id} for this session", field="job_id")
        nb = job.ns.block_bytes
        return [(i, self.host.arena.slot(e.offset, nb)) for i, e in sorted(job.items.items())]

    def copy_job(self, session: Session, job_id: int) -> StoreJob | LoadJob:
        """A live job of ``session`` prepared for the cuda_ipc transport (CudaCopy)."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"unknown or finished job {job_id}", field="job_id")
        if job.session_id != session.id:
            raise PermissionDenied(f"job {job_id} belongs to another session", field="job_id")
        if job.transport != pb.TRANSPORT_CUDA_IPC:
            name = _TRANSPORT_NAMES.get(job.transport, str(job.transport))
            raise FailedPrecondition(f"job {job_id} was prepared for transport {name}, not "
                                     "cuda_ipc", field="job_id")
        return job

    def mark_copied(self, job: StoreJob | LoadJob) -> None:
        """A CudaCopy moved every block of a store job into its slots (if still live)."""
        if isinstance(job, StoreJob) and self._jobs.get(job.id) is job:
            job.received.update(job.items)

    def abort_job(self, session: Session, job: StoreJob | LoadJob) -> None:
        """Its transfer failed: free a store's entries, unpin a load's (if still live)."""
        if self._jobs.get(job.id) is not job:
            return
        if isinstance(job, StoreJob):
            self.complete_store(session, job.id, ok=False)
        else:
            self._finish_load(session, job)

    # -- figures ----------------------------------------------------------------------------------

    def totals(self) -> Counters:
        total = Counters()
        for ns in self.namespaces.values():
            total.add(ns.counters)
        return total

    # -- internals --------------------------------------------------------------------------------

    def _job(self, session: Session, job_id: int, kind: type[J]) -> J:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"unknown or finished job {job_id}", field="job_id")
        if job.session_id != session.id:
            raise PermissionDenied(f"job {job_id} belongs to another session", field="job_id")
        if not isinstance(job, kind):
            raise FailedPrecondition(f"job {job_id} is not a {kind.__name__}", field="job_id")
        return job

    def _new_load_job(self, session: Session, ns: NamespaceState, items: dict[int, Entry],
                      transport: int) -> LoadJob:
        _check_live(session)
        for e in items.values():
            e.pins += 1
        self.pinned_blocks += len(items)
        job = LoadJob(next(self._job_ids), session.id, ns, transport, items)
        self._jobs[job.id] = job
        session.load_jobs.add(job.id)
        return job

    def _job_for_pinned(self, session: Session, ns: NamespaceState, items: dict[int, Entry],
                        transport: int) -> LoadJob:
        for e in items.values():
            e.pins -= 1  # _new_load_job takes the job's own pins
        return self._new_load_job(session, ns, items, transport)

    def _finish_load(self, session: Session, job: LoadJob) -> None:
        del self._jobs[job.id]
        session.load_jobs.discard(job.id)
        for e in job.items.values():
            assert e.pins > 0
            e.pins -= 1
        self.pinned_blocks -= len(job.items)

    def allocate_host(self, slot_bytes: int, protect: set[Entry]) -> int | None:
        """A free slot of ``slot_bytes``, evicting in policy order if needed; None if none can be.

        Walks victims in policy order and takes whichever comes first: an evictable entry of the
        same size class (its slot is reused), or a slab of another class whose every live slot
        holds an evictable entry (those entries are evicted and the slab moves to this class).
        So slabs follow demand instead of staying with the class that took them first, and a
        store that cannot be placed evicts nothing: pinned and WRITING entries keep their slabs.
        """
        off = self.host.alloc(slot_bytes)
        if off is not None:
            return off
        if self.bridge is not None and self.bridge.nvme.admitting:
            # write-back: evict blocks that NVMe already holds before losing any that it does not
            off = self._make_room(slot_bytes, protect, clean_only=True, max_scan=1024)
            if off is not None:
                return off
        return self._make_room(slot_bytes, protect, clean_only=False)

    def _make_room(self, slot_bytes: int, protect: set[Entry], *, clean_only: bool,
                   max_scan: int = 1 << 62) -> int | None:
        groups: dict[int, list[Entry]] = {}  # slab -> its evictable entries seen so far
        for n, e in enumerate(self.policy.victims()):
            if n >= max_scan:
                break
            if e.pins or e.flushing or e in protect or (clean_only and e.nvme is None):
                continue
            if e.ns.slot_bytes == slot_bytes:
                self._evict(e)
                return self.host.alloc(slot_bytes)
            slab = self.host.slab_of(e.offset)
            group = groups.setdefault(slab, [])
            group.append(e)
            if len(group) == self.host.live_slots(slab):
                for victim in group:
                    self._evict(victim)
                return self.host.alloc(slot_bytes)  # the emptied slab is back in the pool
        return None

    def _evict(self, e: Entry) -> None:
        assert e.evictable(), e
        self.policy.remove(e, evicted=True)
        e.ns.counters.evictions += 1
        if e.nvme is not None and self.bridge is not None:
            # Its NVMe copy stays: the entry remains READY, served from NVMe from now on.
            c = e.ns.counters
            c.resident_blocks -= 1
            c.resident_bytes -= e.ns.block_bytes
            self.host.free(e.offset, e.ns.slot_bytes)
            e.offset = -1
            self.bridge.on_host_evicted(e)
            return
        self._drop_ready(e)

    def _drop_ready(self, e: Entry) -> None:
        del e.ns.ready[e.key]
        c = e.ns.counters
        c.resident_blocks -= 1
        c.resident_bytes -= e.ns.block_bytes
        self._free(e)

    def _free(self, e: Entry, hold_until: float = 0.0) -> None:
        e.job = 0  # a data channel still holding this entry sees it is no longer its to write
        del e.ns.entries[e.key]
        if hold_until:
            self._limbo.append((hold_until, e.offset, e.ns.slot_bytes))
        else:
            self.host.free(e.offset, e.ns.slot_bytes)

"""The batch operations behind :class:`kvtier.client.NamespaceHandle`, over one Session.

Keys travel at most ``session.max_batch`` per RPC. A lookup answers the longest ready prefix
(batch after batch while each one is all hits). A put or get is a two-phase job per batch::

    PrepareStore -> write the reserved slots (transport) -> CompleteStore(ok)
    PrepareLoad  -> read the pinned slots (transport)    -> CompleteLoad

A load streams in rounds: the daemon pins what its host tier holds or can place now and marks
the rest of what it has below (NVMe) as deferred (``found`` 0, ``tiers`` naming the tier); the
client loads those again after CompleteLoad, round after round while each one serves something,
so a get larger than the daemon's free host tier still returns every block it has.

Every put and get has an overall ``deadline`` (the caller's, e.g. an engine step's budget, else
``session.op_timeout_s`` from its start): no RPC, batch or load round starts after it (what is
left is a miss or a drop), and each RPC's own deadline is cut to it; only a completion, which
frees daemon state, still gets ``MIN_RPC_S``.

A put of engine blocks may carry a ``CopyGuard``: the engine's fence decides, under the guard,
whether the copy out of its blocks may still read them (or reads a snapshot the engine took
instead), so that the fence waits for copies, never for RPCs.

A job is completed also when its transfer failed, so the daemon aborts its reservations at once
instead of when the lease ends. A daemon that is away (:class:`kvtier.session.Away`) turns into
misses and drops, counted in ``session.counters``; a failed transfer trips the breaker (the
transport is reattached on the next call), a failed copy (e.g. a CUDA error) fails that job only.
A load is trusted only once CompleteLoad confirmed that its pins held during the copy.

Arguments arrive validated by the handle. Thread-safety: as the Session's (transfers hold its
data lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.buffers import byte_view
from kvtier.results import LookupResult, PinnedLookup, PutResult
from kvtier.session import Away, OutOfTime, Registered, Session
from kvtier_contract import errors
from kvtier_contract.protoutil import KEY_BYTES, pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb

# (job_id, key indexes in the job, positions in the caller's lists, slot offsets)
Move = Callable[[int, list[int], list[int], list[int]], None]
TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme"}


class CopyRevoked(RuntimeError):
    """The engine took its blocks back before or during the copy: the batch is aborted."""


class CopyGuard(Protocol):
    """The engine's say over one put's reads of its blocks (the vLLM worker's store fence).

    ``begin()`` before each copy out of the engine blocks: None to read the engine blocks, or a
    ``[n, block_bytes]`` host tensor holding the snapshot of all n blocks of the put the engine
    took when it needed them back; raises ``CopyRevoked`` when it took them back with no
    snapshot. ``end(more)`` after that copy: False when the engine stopped waiting during it
    (the bytes may be torn: the batch is aborted); ``more``: whether later batches of this put
    will read the engine blocks again. Both are called on the thread making the put.
    """

    def begin(self) -> Any | None: ...

    def end(self, more: bool) -> bool: ...


def guarded_gather(layout: Any, block_ids: Sequence[int], staging: Any,
                   guard: CopyGuard | None) -> Any:
    """``layout.gather`` into ``staging`` under ``guard`` (the staging path: the copy out of the
    engine blocks comes before any RPC); returns the rows to put (the guard's snapshot, if any)."""
    source = guard.begin() if guard is not None else None
    intact = True
    try:
        if source is None:
            layout.gather(block_ids, staging)
    finally:
        if guard is not None:
            intact = guard.end(False)
    if not intact:
        raise CopyRevoked("the engine took its blocks back during the copy")
    return staging if source is None else source


def lookup(session: Session, handle: Registered, keys: Sequence[bytes]) -> int:
    session.counters.lookups += 1
    packed = pack_keys(keys)
    try:
        total = 0
        for start in range(0, len(keys), session._max_batch):
            chunk = packed[start * KEY_BYTES : (start + session._max_batch) * KEY_BYTES]
            reply = session._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                             keys=chunk))
            total += reply.hit_blocks
            if reply.hit_blocks < len(chunk) // KEY_BYTES:
                break
        return total
    except Away:
        session.counters.lookups_failed += 1
        return 0


def lookup_detail(session: Session, handle: Registered, keys: Sequence[bytes]) -> LookupResult:
    if len(keys) > session._max_batch:
        raise errors.ResourceExhausted(f"at most {session._max_batch} keys per detailed lookup",
                                       field="keys")
    try:
        reply = session._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                         keys=pack_keys(keys)))
    except Away:
        session.counters.lookups_failed += 1
        return LookupResult(0, [], [])
    return LookupResult(reply.hit_blocks, [TIER_NAMES.get(t, "?") for t in reply.tiers],
                        [bool(d) for d in reply.durable] or [False] * reply.hit_blocks)


def lookup_pinned(session: Session, handle: Registered, keys: Sequence[bytes]) -> PinnedLookup:
    if len(keys) > session._max_batch:
        raise errors.ResourceExhausted(f"at most {session._max_batch} keys per pinned lookup",
                                       field="keys")
    session.counters.lookups += 1
    try:
        reply = session._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                         keys=pack_keys(keys), pin=True))
    except Away:
        session.counters.lookups_failed += 1
        return PinnedLookup(0, [], 0, 0)
    return PinnedLookup(reply.hit_blocks, [TIER_NAMES.get(t, "?") for t in reply.tiers],
                        reply.job_id, reply.boot_epoch)


def prefetch(session: Session, handle: Registered, keys: Sequence[bytes]) -> int:
    try:
        reply = session._call("Prefetch", pb.PrefetchRequest(
            namespace_id=handle.namespace_id, keys=pack_keys(keys)))
    except Away:
        return 0
    return int(reply.promoting)


# -- stores -----------------------------------------------------------------------------------------

def put(session: Session, handle: Registered, keys: Sequence[bytes],
        views: list[memoryview], *, deadline: float | None = None) -> PutResult:
    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> None:
        session._data().write(job_id, [(i, off, views[p])
                                       for i, p, off in zip(idx, pos, offsets, strict=True)])

    return _store(session, handle, keys, write, deadline=deadline)


def put_blocks(session: Session, handle: Registered, keys: Sequence[bytes], layout: Any,
               block_ids: Sequence[int], *, deadline: float | None = None,
               guard: CopyGuard | None = None) -> PutResult:
    """put_blocks over a mapped arena: gather straight into the reserved slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies; under
    ``guard``, from the engine's snapshot when it took one (then a plain write into the slots).
    Over cuda_ipc the guarded copy includes the daemon's CudaCopy RPC: a fence that stops
    waiting for it aborts the batch."""
    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> None:
        source = guard.begin() if guard is not None else None
        intact = True
        try:
            if source is None:
                mover = session._data().mover(layout.device)  # type: ignore[attr-defined]
                mover.store(layout, [block_ids[p] for p in pos], offsets, job_id)
            else:
                session._data().write(job_id, [(i, off, byte_view(source[p])) for i, p, off
                                               in zip(idx, pos, offsets, strict=True)])
        finally:
            if guard is not None:
                intact = guard.end(pos[-1] + 1 < len(keys)) if pos else guard.end(True)
        if not intact:
            raise CopyRevoked("the engine took its blocks back during the copy")

    return _store(session, handle, keys, write, _blocks_transport(session, layout),
                  deadline=deadline)


def _store(session: Session, handle: Registered, keys: Sequence[bytes], write: Move,
           tp: int = 0, *, deadline: float | None = None) -> PutResult:
    tp = tp or make_transport_value(session.transport_name)
    deadline = session.deadline() if deadline is None else deadline
    packed = pack_keys(keys)
    result = PutResult()
    for start in range(0, len(keys), session._max_batch):
        end = min(start + session._max_batch, len(keys))
        try:
            result += _store_batch(session, handle, packed[start * KEY_BYTES : end * KEY_BYTES],
                                   start, write, tp, deadline)
        except Away:
            result.dropped += end - start
            session.counters.puts_dropped += end - start
    return result


def _store_batch(session: Session, handle: Registered, packed: bytes, base: int, write: Move,
                 tp: int, deadline: float) -> PutResult:
    prep = session._call("PrepareStore", pb.PrepareStoreRequest(
        namespace_id=handle.namespace_id, keys=packed, transport=tp), deadline=deadline)
    status = prep.status
    result = PutResult(already_present=status.count(pb.STORE_ALREADY_PRESENT),
                       rejected=status.count(pb.STORE_REJECTED))
    if not prep.job_id:
        return result
    idx = [i for i in range(len(status)) if status[i] == pb.STORE_RESERVED]
    items = [prep.offsets[i] for i in idx]
    pos = [base + i for i in idx]
    failure, trip = _transfer(session, "store", lambda: write(prep.job_id, idx, pos, items))
    try:
        # Also on failure: abort at once, so the keys do not stay reserved until the lease ends.
        done = session._call("CompleteStore", pb.CompleteStoreRequest(
            job_id=prep.job_id, ok=not failure), reconnect=False, deadline=deadline, floor=True)
    except (Away, errors.KvtierError):
        result.dropped += len(items)
        session.counters.puts_dropped += len(items)
        return result
    finally:
        if failure and trip:
            session._trip(failure)  # reattach the transport on the next call
    result.stored += done.committed
    result.dropped += done.aborted
    session.counters.puts_dropped += done.aborted
    session.counters.bytes_put += done.committed * handle.block_bytes
    return result


# -- loads ------------------------------------------------------------------------------------------

def get_into(session: Session, handle: Registered, keys: Sequence[bytes],
             views: list[memoryview], *, deadline: float | None = None) -> list[bool]:
    def read(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> None:
        session._data().read(job_id, [(i, off, views[p])
                                      for i, p, off in zip(idx, pos, offsets, strict=True)])

    return _load(session, handle, keys, read, deadline=deadline)


def get_blocks(session: Session, handle: Registered, keys: Sequence[bytes], layout: Any,
               block_ids: Sequence[int], *, deadline: float | None = None) -> list[bool]:
    """get_blocks over a mapped arena: scatter straight from the pinned slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies."""
    def read(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> None:
        mover = session._data().mover(layout.device)  # type: ignore[attr-defined]
        mover.load(layout, [block_ids[p] for p in pos], offsets, job_id)

    return _load(session, handle, keys, read, _blocks_transport(session, layout),
                 deadline=deadline)


def _load(session: Session, handle: Registered, keys: Sequence[bytes], read: Move,
          tp: int = 0, *, deadline: float | None = None) -> list[bool]:
    """Batch after batch, round after round, until ``deadline``: a round that would start
    after it does not (its keys are misses; what earlier rounds loaded stays loaded)."""
    tp = tp or make_transport_value(session.transport_name)
    deadline = session.deadline() if deadline is None else deadline
    packed = pack_keys(keys)
    found = [False] * len(keys)
    try:
        for start in range(0, len(keys), session._max_batch):
            todo = list(range(start, min(start + session._max_batch, len(keys))))
            while todo:  # rounds: what was deferred, while each round serves something
                served, todo = _load_batch(session, handle, packed, todo, found, read, tp,
                                           deadline)
                if not served:
                    break
    except OutOfTime:
        session.counters.gets_failed += 1
        return found  # every block marked found was confirmed by its CompleteLoad
    except Away:
        session.counters.gets_failed += 1
        return [False] * len(keys)
    return found


def _load_batch(session: Session, handle: Registered, packed: bytes, todo: list[int],
                found: list[bool], read: Move, tp: int, deadline: float
                ) -> tuple[int, list[int]]:
    """One PrepareLoad / transfer / CompleteLoad of the keys at positions ``todo`` (at most one
    batch): (blocks served, positions deferred to another round)."""
    prep = session._call("PrepareLoad", pb.PrepareLoadRequest(
        namespace_id=handle.namespace_id, keys=_keys_at(packed, todo), transport=tp),
        deadline=deadline)
    deferred = [todo[i] for i in range(len(todo))
                if not prep.found[i] and i < len(prep.tiers) and prep.tiers[i] != pb.TIER_NONE]
    if not prep.job_id:
        return 0, deferred
    idx = [i for i in range(len(todo)) if prep.found[i]]
    pos = [todo[i] for i in idx]
    offsets = [prep.offsets[i] for i in idx]
    failure, trip = _transfer(session, "load", lambda: read(prep.job_id, idx, pos, offsets))
    try:
        session._call("CompleteLoad", pb.CompleteLoadRequest(job_id=prep.job_id), reconnect=False,
                      deadline=deadline, floor=True)
    except (Away, errors.KvtierError) as e:
        # Only a completed load proves the pins held during the copy; if the lease lapsed
        # the slots may have been reused under us: the bytes are not trusted, all misses.
        # A daemon that answered (shed the call, or refused it) trips nothing more.
        away = isinstance(e, Away) and not isinstance(e, OutOfTime)
        trip = (bool(failure) and trip) or away
        failure = failure or f"load not confirmed: {e}"
    if failure:
        if trip:
            session._trip(failure)
        raise Away(failure)
    for p in pos:
        found[p] = True
    session.counters.bytes_got += len(idx) * handle.block_bytes
    return len(idx), deferred


def _keys_at(packed: bytes, positions: list[int]) -> bytes:
    """The packed keys at increasing ``positions``: one slice when they are contiguous (a first
    round), else joined (the deferred keys of a later round)."""
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):
        return packed[first * KEY_BYTES : (last + 1) * KEY_BYTES]
    return b"".join(packed[p * KEY_BYTES : (p + 1) * KEY_BYTES] for p in positions)


# -- the transfer of a job -------------------------------------------------------------------------

def _transfer(session: Session, what: str, move: Callable[[], None]) -> tuple[str, bool]:
    """Run one job's transfer holding the data channel -> (failure, trip): ``""`` when it went
    through; a transport failure trips the breaker, a failed copy (e.g. a CUDA error) fails this
    job only."""
    try:
        with session._transfer():
            move()
    except errors.TransportError as e:
        return f"{what} transfer: {e}", True
    except (RuntimeError, errors.KvtierError) as e:
        return f"{what} copy: {e}", False
    return "", True


def make_transport_value(name: str) -> int:
    """The transport of a job moving host buffers (a cuda_ipc session moves those over shm)."""
    return int(pb.TRANSPORT_TCP if name == "tcp" else pb.TRANSPORT_SHM)


def _blocks_transport(session: Session, layout: Any) -> int:
    """The transport value of a put_blocks/get_blocks job: cuda_ipc only for CUDA layouts
    on a cuda_ipc session (CPU layouts move over the mapped arena like shm)."""
    if session.transport_name == "cuda_ipc" and getattr(layout.device, "type", "") == "cuda":
        return int(pb.TRANSPORT_CUDA_IPC)
    return make_transport_value(session.transport_name)

"""The batch operations behind :class:`kvtier.client.NamespaceHandle`, over one Session.

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
A load is trusted only once CompleteLoad confirmed that its pins held during the copy: a job's
blocks count as found when its CompleteLoad is collected, never before. Bytes verified end to end
(docs/security.md): a put's copy returns the digests it computed (shm; CompleteStore carries
them), a get's copy checks the bytes against ``PrepareLoadReply.digests``; a block that differs
is a miss, as is every later block of the get, and CompleteLoad names it (``corrupt``).

Arguments arrive validated by the handle. Thread-safety: as the Session's (transfers hold its
data lock).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.buffers import byte_view
from kvtier.calls import (
    MIN_RPC_S,
    Away,
    OutOfTime,
    PendingCall,
    Registered,
    SessionPort,
    Unanswered,
)
from kvtier.results import LookupResult, PinnedEach, PinnedLookup, PutResult, SlicesLookup
from kvtier_contract import errors
from kvtier_contract.protoutil import KEY_BYTES, pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb

# (job_id, key indexes in the job, positions in the caller's lists, slot offsets) -> the digest
# of each block as written (None: the daemon hashes them)
Move = Callable[[int, list[int], list[int], list[int]], list[int] | None]
# (job_id, key indexes, positions, slot offsets, digests: one per block, or empty) -> the
# indexes into those lists of the blocks whose bytes did not match their digest
LoadMove = Callable[[int, list[int], list[int], list[int], list[int]], list[int]]
TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme", pb.TIER_CLUSTER: "cluster"}
PREPARES_AHEAD = 2  # jobs whose Prepare* is in flight while one job's bytes are copied
COMPLETES_BEHIND = 4  # jobs whose Complete* may be left uncollected while the call goes on


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
            reply = session.call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                             keys=chunk))
            total += reply.hit_blocks
            if reply.hit_blocks < len(chunk) // KEY_BYTES:
                break
        return total
    except Away:
        session.counters.lookups_failed += 1
        return 0


def lookup_local(session: SessionPort, handle: Registered, keys: Sequence[bytes], *,
                 count: bool = True) -> int | None:
    if not keys:
        return 0
    hit = session.local_lookup(handle, pack_keys(keys), len(keys), count=count)
    if hit is not None and count:
        session.counters.lookups += 1
    return hit


def lookup_detail(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> LookupResult:
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per detailed lookup",
                                       field="keys")
    try:
        reply = session.call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                         keys=pack_keys(keys)))
    except Away:
        session.counters.lookups_failed += 1
        return LookupResult(0, [], [])
    return LookupResult(reply.hit_blocks, [TIER_NAMES.get(t, "?") for t in reply.tiers],
                        [bool(d) for d in reply.durable] or [False] * reply.hit_blocks)


def lookup_pinned(session: SessionPort, handle: Registered, keys: Sequence[bytes], *,
                  promote: bool = True) -> PinnedLookup:
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per pinned lookup",
                                       field="keys")
    session.counters.lookups += 1
    try:
        reply = session.call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                         keys=pack_keys(keys), pin=True,
                                                         hold_only=not promote))
    except Away:
        session.counters.lookups_failed += 1
        return PinnedLookup(0, [], 0, 0)
    return PinnedLookup(reply.hit_blocks, [TIER_NAMES.get(t, "?") for t in reply.tiers],
                        reply.job_id, reply.boot_epoch)


def lookup_each_pinned(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> PinnedEach:
    """One answer per key (PrepareLoad's ``found``), the found ones pinned as one load job that
    moves no bytes until released (CompleteLoad)."""
    if len(keys) > session.max_batch:
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per pinned lookup",
                                       field="keys")
    session.counters.lookups += 1
    try:
        reply = session.call("PrepareLoad", pb.PrepareLoadRequest(
            namespace_id=handle.namespace_id, keys=pack_keys(keys),
            transport=make_transport_value(session.transport_name)))
    except Away:
        session.counters.lookups_failed += 1
        return PinnedEach([False] * len(keys), 0, 0)
    return PinnedEach([bool(b) for b in reply.found], reply.job_id, reply.boot_epoch)


def lookup_slices(session: SessionPort, handles: Sequence[Registered],
                  chains: Sequence[Sequence[bytes]], *, promote: bool = True) -> SlicesLookup:
    """``lookup_pinned`` in every slice's namespace, in one round trip (LookupSlices) where the
    daemon serves it, else one lookup per slice with the same rules: each slice's keys cut at
    the hit so far, stopping at a slice with no hit."""
    if len(handles) != len(chains) or not handles:
        raise errors.InvalidArgument(f"{len(handles)} namespaces and {len(chains)} key chains: "
                                     "one chain per namespace, at least one", field="chains")
    if any(len(keys) > session.max_batch for keys in chains):
        raise errors.ResourceExhausted(f"at most {session.max_batch} keys per slice",
                                       field="chains")
    session.counters.lookups += 1
    try:
        session.ensure()  # (the open tells whether the daemon serves LookupSlices)
    except Away:
        session.counters.lookups_failed += 1
        return SlicesLookup(0, [])
    if not session.lookup_slices_served:  # an older daemon
        out: list[PinnedLookup] = []
        hit: int | None = None
        for handle, keys in zip(handles, chains, strict=True):
            got = lookup_pinned(session, handle, keys if hit is None else keys[:hit],
                                promote=promote)
            session.counters.lookups -= 1  # (counted once, above)
            out.append(got)
            hit = got.hits if hit is None else min(hit, got.hits)
            if not hit:
                break
        return SlicesLookup(hit or 0, out)
    try:
        reply = session.call("LookupSlices", pb.LookupSlicesRequest(
            namespace_ids=[h.namespace_id for h in handles],
            keys=[pack_keys(keys) for keys in chains], pin=True, hold_only=not promote))
    except Away:
        session.counters.lookups_failed += 1
        return SlicesLookup(0, [])
    return SlicesLookup(reply.hit_blocks, [
        PinnedLookup(r.hit_blocks, [TIER_NAMES.get(t, "?") for t in r.tiers], r.job_id,
                     reply.boot_epoch) for r in reply.slices])


def prefetch(session: SessionPort, handle: Registered, keys: Sequence[bytes]) -> int:
    try:
        reply = session.call("Prefetch", pb.PrefetchRequest(
            namespace_id=handle.namespace_id, keys=pack_keys(keys)))
    except Away:
        return 0
    return int(reply.promoting)


# -- stores -----------------------------------------------------------------------------------------

def put(session: SessionPort, handle: Registered, keys: Sequence[bytes],
        views: list[memoryview], *, deadline: float | None = None,
        token_ids: Sequence[int] | None = None, parent: bytes | None = None) -> PutResult:
    """``token_ids`` (every key's tokens, ``tokens_per_block`` each) and ``parent`` (the key
    before ``keys[0]``): optional, sent with the store for the daemon's KV events
    (docs/events.md); InvalidArgument naming ``token_ids`` when the count is wrong."""
    origin = check_origin(handle, keys, token_ids, parent)

    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> list[int] | None:
        return session.data().write(job_id, [(i, off, views[p]) for i, p, off
                                              in zip(idx, pos, offsets, strict=True)],
                                     digest=session.verify_bytes)

    return _store(session, handle, keys, write, deadline=deadline, origin=origin)


def check_origin(handle: Registered, keys: Sequence[bytes], token_ids: Sequence[int] | None,
                 parent: bytes | None) -> tuple[Sequence[int], int, bytes] | None:
    """(token ids, tokens per block, parent key or b"") of a put, checked; None: neither."""
    if not token_ids and parent is None:
        return None
    tpb = handle.namespace.tokens_per_block
    if token_ids and len(token_ids) != len(keys) * tpb:
        raise errors.InvalidArgument(
            f"has {len(token_ids)} token ids for {len(keys)} keys of {tpb} tokens",
            field="token_ids")
    if parent is not None and len(parent) != KEY_BYTES:
        raise errors.InvalidArgument(f"must be {KEY_BYTES} bytes, got {len(parent)}",
                                     field="parent_key")
    return token_ids or (), tpb, parent or b""


def put_blocks(session: SessionPort, handle: Registered, keys: Sequence[bytes], layout: Any,
               block_ids: Sequence[int], *, deadline: float | None = None,
               guard: CopyGuard | None = None, token_ids: Sequence[int] | None = None,
               parent: bytes | None = None) -> PutResult:
    """put_blocks over a mapped arena: gather straight into the reserved slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies; under
    ``guard``, from the engine's snapshot when it took one (then a plain write into the slots).
    Over cuda_ipc the guarded copy includes the daemon's CudaCopy RPC: a fence that stops
    waiting for it aborts the batch. ``token_ids`` and ``parent``: as for :func:`put`."""
    tp, origin = _blocks_transport(session, layout), check_origin(handle, keys, token_ids, parent)

    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> list[int] | None:
        source = guard.begin() if guard is not None else None
        intact = True
        digests = None  # None: the daemon hashes the slots at CompleteStore
        try:
            if source is None:
                data = session.data()
                mover = data.mover(layout.device)  # type: ignore[attr-defined]
                ids = [block_ids[p] for p in pos]
                if session.verify_bytes and tp != pb.TRANSPORT_CUDA_IPC:
                    # The mover fills the slots group by group; each group is hashed on the
                    # helper thread while the next one is gathered.
                    digests = data.store_hashed(  # type: ignore[attr-defined]
                        offsets, layout.block_bytes,
                        lambda lo, hi: mover.store(layout, ids[lo:hi], offsets[lo:hi], job_id))
                else:  # (the daemon's cuda_ipc copies write the slots: it hashes them)
                    mover.store(layout, ids, offsets, job_id)
            else:
                digests = session.data().write(
                    job_id, [(i, off, byte_view(source[p])) for i, p, off
                             in zip(idx, pos, offsets, strict=True)], digest=session.verify_bytes)
        finally:
            if guard is not None:
                intact = guard.end(pos[-1] + 1 < len(keys)) if pos else guard.end(True)
        if not intact:
            raise CopyRevoked("the engine took its blocks back during the copy")
        return digests

    return _store(session, handle, keys, write, tp, deadline=deadline, origin=origin)


def _store(session: SessionPort, handle: Registered, keys: Sequence[bytes], write: Move,
           tp: int = 0, *, deadline: float | None = None,
           origin: tuple[Sequence[int], int, bytes] | None = None) -> PutResult:
    tp = tp or make_transport_value(session.transport_name)
    deadline = session.deadline() if deadline is None else deadline
    spans = _job_spans(session, handle, tp, len(keys))
    pipe = _StorePipe(session, handle, pack_keys(keys), write, tp, deadline,
                      _pipelined(session, spans))
    pipe.origin = origin
    return pipe.run(spans)


class _StorePipe:
    """One put's jobs, pipelined: while one job's bytes are copied, the PrepareStore of the
    next ``PREPARES_AHEAD`` jobs is in flight, and each job's CompleteStore is collected later
    (at most ``COMPLETES_BEHIND`` left uncollected), all of them before the put returns.

    Every job the daemon prepared gets a CompleteStore: ``ok`` after its copy went through,
    else an abort that frees its slots at once. A job whose PrepareStore is shed or refused
    is dropped, and the others still go. A job whose copy would start after the deadline is
    aborted, as is every later one. After a failed transfer, or a PrepareStore the daemon did
    not answer, no further job starts or copies, the jobs already prepared are aborted, and
    only then does the breaker trip (an open breaker would refuse their CompleteStore and leave
    their slots reserved until the lease ends). Caller mistakes the daemon reports (a kvtier
    error from a PrepareStore) still raise, after the same aborts. The put's thread only.
    """

    def __init__(self, session: SessionPort, handle: Registered, packed: bytes, write: Move,
                 tp: int, deadline: float, pipelined: bool) -> None:
        self.session, self.handle, self.packed = session, handle, packed
        self.write, self.tp, self.deadline = write, tp, deadline
        self.inline = not pipelined  # one RPC after the other, on the put's thread
        self.prepares_ahead = PREPARES_AHEAD if pipelined else 0
        self.completes_behind = COMPLETES_BEHIND if pipelined else 0
        self.result = PutResult()
        self.ahead: deque[tuple[int, int, Any, PendingCall | Away]] = deque()  # start, end,
        #   the PrepareStore request and its call
        self.behind: deque[tuple[int, PendingCall | Away]] = deque()  # reserved, complete
        self.stop = ""  # why no further job starts or copies (a failure, the deadline)
        self.trip = ""  # the daemon did not answer: trip the breaker once every job is closed
        self.origin: tuple[Sequence[int], int, bytes] | None = None  # (token ids, per block,
        #   parent key): sent with each job's PrepareStore (KV events), when the put has them

    def run(self, spans: list[tuple[int, int]]) -> PutResult:
        todo = deque(spans)
        try:
            while todo or self.ahead:
                while todo and not self.stop and len(self.ahead) <= self.prepares_ahead:
                    self._prepare(*todo.popleft())
                if not self.ahead:  # stopped by a failed transfer: the rest is dropped
                    self._drop(sum(end - start for start, end in todo))
                    break
                self._job(*self.ahead.popleft())
                while len(self.behind) > self.completes_behind:
                    self._collect(*self.behind.popleft())
            while self.behind:
                self._collect(*self.behind.popleft())
        finally:
            if self.ahead or self.behind:  # an error on the way out: abort what was prepared
                self.stop = self.stop or "put failed"
                _close(self.ahead, lambda job: self._job(*job))
                _close(self.behind, lambda job: self._collect(*job))
            if self.trip:
                self.session.trip(self.trip)  # reattach the transport on the next call
        return self.result

    def _prepare(self, start: int, end: int) -> None:
        request = pb.PrepareStoreRequest(namespace_id=self.handle.namespace_id,
                                         keys=self.packed[start * KEY_BYTES : end * KEY_BYTES],
                                         transport=self.tp)
        if self.origin is not None:
            tokens, tpb, parent = self.origin
            request.token_ids.extend(tokens[start * tpb : end * tpb])
            request.parent_key = self.packed[(start - 1) * KEY_BYTES : start * KEY_BYTES] \
                if start else parent
        call: PendingCall | Away
        try:
            call = self.session.start("PrepareStore", request, deadline=self.deadline,
                                       inline=self.inline)
        except Away as e:
            call = e
        self.ahead.append((start, end, request, call))

    def _job(self, start: int, end: int, request: Any, call: PendingCall | Away) -> None:
        """Wait for the job's PrepareStore, copy its reserved blocks (none once the put has
        failed), start its CompleteStore."""
        try:
            prep = _reply(call)
        except Away as e:
            self._drop(end - start)
            if isinstance(e, Unanswered):
                self.stop, self.trip = self.stop or e.why, self.trip or e.why
            return
        status = prep.status
        self.result.already_present += status.count(pb.STORE_ALREADY_PRESENT)
        self.result.rejected += status.count(pb.STORE_REJECTED)
        if not prep.job_id:
            return
        idx = [i for i in range(len(status)) if status[i] == pb.STORE_RESERVED]
        offsets = [prep.offsets[i] for i in idx]
        pos = [start + i for i in idx]
        if not self.stop and _late(self.session, self.deadline):
            self.stop = "deadline spent"
        failure, trip = self.stop, False
        digests: list[list[int] | None] = [None]  # the job's digests, as the copy made them
        if not self.stop:
            def move() -> None:
                digests[0] = self.write(prep.job_id, idx, pos, offsets)

            failure, trip = _transfer(self.session, "store", move)
        # Also on failure: abort at once, so the keys do not stay reserved until the lease ends.
        self.behind.append((len(idx), _complete(
            self.session, "CompleteStore",
            pb.CompleteStoreRequest(job_id=prep.job_id, ok=not failure,
                                    digests=(digests[0] or []) if not failure else []),
            request, self.deadline, self.inline)))
        if failure and trip:
            self.stop, self.trip = failure, self.trip or failure

    def _collect(self, reserved: int, call: PendingCall | Away) -> None:
        try:
            done = _reply(call)
        except (Away, errors.KvtierError) as e:
            self._drop(reserved)
            if isinstance(e, Unanswered):  # no answer even past its deadline
                self.trip = self.trip or e.why
            return
        self.result.stored += done.committed
        self._drop(done.aborted)
        self.session.counters.bytes_put += done.committed * self.handle.block_bytes

    def _drop(self, n: int) -> None:
        self.result.dropped += n
        self.session.counters.puts_dropped += n


# -- loads ------------------------------------------------------------------------------------------

def get_into(session: SessionPort, handle: Registered, keys: Sequence[bytes],
             views: list[memoryview], *, deadline: float | None = None,
             host_only: bool = False) -> list[bool]:
    def read(job_id: int, idx: list[int], pos: list[int], offsets: list[int],
             digests: list[int]) -> list[int]:
        return session.data().read(job_id, [(i, off, views[p]) for i, p, off
                                             in zip(idx, pos, offsets, strict=True)], digests)

    return _load(session, handle, keys, read, deadline=deadline, host_only=host_only)


def get_blocks(session: SessionPort, handle: Registered, keys: Sequence[bytes], layout: Any,
               block_ids: Sequence[int], *, deadline: float | None = None,
               host_only: bool = False) -> list[bool]:
    """get_blocks over a mapped arena: scatter straight from the pinned slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies."""
    def read(job_id: int, idx: list[int], pos: list[int], offsets: list[int],
             digests: list[int]) -> list[int]:
        data = session.data()
        mover = data.mover(layout.device)  # type: ignore[attr-defined]

        def copy() -> None:
            mover.load(layout, [block_ids[p] for p in pos], offsets, job_id)

        if not digests:
            copy()
            return []
        # The pinned slots are hashed while the mover (or the daemon's CUDA copy) reads them.
        bad: list[int] = data.check_slots(  # type: ignore[attr-defined]
            offsets, layout.block_bytes, digests, copy)
        return bad

    return _load(session, handle, keys, read, _blocks_transport(session, layout),
                 deadline=deadline, host_only=host_only)


def _load(session: SessionPort, handle: Registered, keys: Sequence[bytes], read: LoadMove,
          tp: int = 0, *, deadline: float | None = None, host_only: bool = False) -> list[bool]:
    """Round after round until ``deadline``: the first asks for every key, each later one
    for the keys the daemon deferred (held below, not placed in the host tier that round),
    while each round serves something and the daemon did not answer that its reads outlast
    the deadline (``deadline_cut``). A job that would start after the deadline does not
    (its keys are misses; what earlier jobs loaded stays loaded). ``host_only``: one round,
    of what the host tier holds now (``PrepareLoadRequest.host_only``)."""
    tp = tp or make_transport_value(session.transport_name)
    deadline = session.deadline() if deadline is None else deadline
    found = [False] * len(keys)
    pipe = _LoadPipe(session, handle, pack_keys(keys), read, tp, deadline, found)
    pipe.host_only = host_only
    todo = list(range(len(keys)))
    try:
        while todo:
            spans = _job_spans(session, handle, tp, len(todo))
            served, todo = pipe.round([todo[s:e] for s, e in spans], _pipelined(session, spans))
            if pipe.cut is not None:
                todo = [p for p in todo if p < pipe.cut]
            if not served or host_only or pipe.deadline_cut:
                break
    except OutOfTime:
        session.counters.gets_failed += 1
        return _cut(found, pipe.cut)  # every block marked found was confirmed by its CompleteLoad
    except Away:
        session.counters.gets_failed += 1
        return [False] * len(keys)
    return _cut(found, pipe.cut)


def _cut(found: list[bool], cut: int | None) -> list[bool]:
    """A block whose bytes failed verification is a miss, and so is every later one: the
    prefix the engine may use ends there."""
    if cut is not None:
        found[cut:] = [False] * (len(found) - cut)
    return found


class _LoadPipe:
    """One get's jobs, pipelined as a put's (``_StorePipe``): PrepareLoad ahead of the
    copies, CompleteLoad behind them. A job's blocks count as found only once its
    CompleteLoad confirmed that its pins held during the copy.

    A failure ends the round, and the get: no further job starts or copies, every job already
    prepared still gets its CompleteLoad (its pins go at once) and each is collected, and then
    ``round`` raises the first failure. After an OutOfTime (a PrepareLoad too late, or shed)
    what was confirmed stays found; any other failure (a transfer, a CompleteLoad not
    confirmed, the daemon away) is an Away, which the get answers with all misses (and a
    failed transfer trips the breaker once the jobs are closed). The get's thread only.
    """

    def __init__(self, session: SessionPort, handle: Registered, packed: bytes, read: LoadMove,
                 tp: int,
                 deadline: float, found: list[bool]) -> None:
        self.session, self.handle, self.packed = session, handle, packed
        self.read, self.tp, self.deadline, self.found = read, tp, deadline, found
        self.ahead: deque[tuple[list[int], Any, PendingCall | Away]] = deque()  # positions,
        #   the PrepareLoad request and its call
        self.behind: deque[tuple[list[int] | None, PendingCall | Away]] = deque()  # positions
        #   loaded (None: a job that only unpins), its CompleteLoad
        self.failure: Away | None = None
        self.trip = ""
        self.inline = False  # this round's RPCs: one after the other, on the get's thread
        self.served = 0
        self.deferred: list[int] = []
        self.cut: int | None = None  # the first position whose bytes failed verification
        self.host_only = False  # PrepareLoad pins only what the host tier holds now
        self.deadline_cut = False  # the daemon answered by the deadline with reads still going

    def round(self, jobs: list[list[int]], pipelined: bool) -> tuple[int, list[int]]:
        """Load the positions of ``jobs`` (each at most one batch), pipelined or one RPC
        after the other on the get's thread: (blocks served and confirmed, positions deferred
        to another round)."""
        todo = deque(jobs)
        self.served, self.deferred = 0, []
        self.inline = not pipelined
        ahead, behind = (PREPARES_AHEAD, COMPLETES_BEHIND) if pipelined else (0, 0)
        try:
            while self.ahead or (todo and self.failure is None):
                while todo and self.failure is None and len(self.ahead) <= ahead:
                    self._prepare(todo.popleft())
                self._job(*self.ahead.popleft())
                while len(self.behind) > behind:
                    self._collect(*self.behind.popleft())
            while self.behind:
                self._collect(*self.behind.popleft())
        finally:
            if self.ahead or self.behind:  # an error on the way out: unpin what was prepared
                self.failure = self.failure or Away("get failed")
                _close(self.ahead, lambda job: self._job(*job))
                _close(self.behind, lambda job: self._collect(*job))
            if self.trip:
                self.session.trip(self.trip)  # reattach the transport on the next call
        if self.failure is not None:
            raise self.failure
        return self.served, self.deferred

    def _prepare(self, positions: list[int]) -> None:
        request = pb.PrepareLoadRequest(namespace_id=self.handle.namespace_id,
                                        keys=_keys_at(self.packed, positions), transport=self.tp,
                                        host_only=self.host_only)
        call: PendingCall | Away
        try:
            call = self.session.start("PrepareLoad", request, deadline=self.deadline,
                                       inline=self.inline)
        except Away as e:
            call = e
        self.ahead.append((positions, request, call))

    def _job(self, todo: list[int], request: Any, call: PendingCall | Away) -> None:
        """Wait for the job's PrepareLoad, copy its pinned blocks (none once the get has
        failed), start its CompleteLoad."""
        try:
            prep = _reply(call)
        except Away as e:
            self.failure = self.failure or e
            if isinstance(e, Unanswered):
                self.trip = self.trip or e.why
            return
        if prep.deadline_cut and not self.deadline_cut:  # answered ahead of the deadline with
            self.deadline_cut = True  # reads still running: this get is out of time
            self.session.counters.out_of_time += 1
        if not prep.job_id:
            self.deferred += _deferred(prep, todo)
            return
        idx = [i for i in range(len(todo)) if prep.found[i]]
        pos = [todo[i] for i in idx]
        offsets = [prep.offsets[i] for i in idx]
        digests = [prep.digests[i] for i in idx] \
            if self.session.verify_bytes and len(prep.digests) == len(todo) else []
        if self.failure is None and _late(self.session, self.deadline):
            self.failure = OutOfTime("deadline spent")
        failure, trip = "get stopped", False
        bad: list[int] = []
        if self.failure is None:
            def move() -> None:
                bad.extend(self.read(prep.job_id, idx, pos, offsets, digests))

            failure, trip = _transfer(self.session, "load", move)
        done = _complete(self.session, "CompleteLoad",
                         pb.CompleteLoadRequest(job_id=prep.job_id,
                                                corrupt=[idx[k] for k in bad]),
                         request, self.deadline, self.inline)
        if not failure:
            if bad:  # a miss, as is every later block of the get (the engine recomputes)
                self.session.counters.corrupt_blocks += len(bad)
                first = pos[bad[0]]
                self.cut = first if self.cut is None else min(self.cut, first)
                pos = [p for p in pos if p < first]
            self.deferred += _deferred(prep, todo)
            self.behind.append((pos, done))
            return
        self.behind.append((None, done))  # the bytes are not trusted: it only unpins
        if self.failure is None:
            self.failure = Away(failure)
            self.trip = failure if trip else ""

    def _collect(self, pos: list[int] | None, call: PendingCall | Away) -> None:
        try:
            _reply(call)
        except (Away, errors.KvtierError) as e:
            if pos is None:
                return  # a job that failed already: nothing was trusted
            # Only a completed load proves the pins held during the copy; if the lease lapsed
            # the slots may have been reused under us: the bytes are not trusted, all misses.
            # A daemon that answered (shed the call, or refused it) trips nothing more.
            why = f"load not confirmed: {e}"
            if isinstance(e, Away) and not isinstance(e, OutOfTime) and not self.trip:
                self.trip = why
            if self.failure is None or isinstance(self.failure, OutOfTime):
                self.failure = Away(why)
            return
        if pos is None:
            return
        for p in pos:
            self.found[p] = True
        self.served += len(pos)
        self.session.counters.bytes_got += len(pos) * self.handle.block_bytes


def _deferred(prep: Any, todo: list[int]) -> list[int]:
    """The positions of ``todo`` that PrepareLoad found below but did not place this round."""
    return [todo[i] for i in range(len(todo))
            if not prep.found[i] and i < len(prep.tiers) and prep.tiers[i] != pb.TIER_NONE]


def _keys_at(packed: bytes, positions: list[int]) -> bytes:
    """The packed keys at increasing ``positions``: one slice when they are contiguous (a first
    round), else joined (the deferred keys of a later round)."""
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):
        return packed[first * KEY_BYTES : (last + 1) * KEY_BYTES]
    return b"".join(packed[p * KEY_BYTES : (p + 1) * KEY_BYTES] for p in positions)


# -- pipelining ------------------------------------------------------------------------------------

def _job_spans(session: SessionPort, handle: Registered, tp: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each job of a call of ``n`` keys: batches of ``max_batch`` keys when
    pipelining is off (``pipeline_bytes`` 0) or the daemon copies (cuda_ipc); else jobs of
    about ``pipeline_bytes`` (``_spans``)."""
    if tp == pb.TRANSPORT_CUDA_IPC or session.pipeline_bytes <= 0:
        step = session.max_batch
        return [(start, min(start + step, n)) for start in range(0, n, step)]
    per_job = max(1, min(session.max_batch, session.pipeline_bytes // handle.block_bytes))
    return _spans(n, per_job)


def _spans(n: int, per_job: int) -> list[tuple[int, int]]:
    """[start, end) of each job over ``n`` keys: one job when they fit in one; else a first and
    a last job of a quarter of ``per_job`` (the first job's Prepare* and the last one's
    Complete* are the round trips nothing overlaps, and the fewer keys they carry, the
    sooner they are answered: ~10 us per key here), and between them as few jobs of at most
    ``per_job`` keys as can be, of even sizes."""
    if n <= per_job:
        return [(0, n)] if n else []
    edge = max(1, per_job // 4)
    mid = n - 2 * edge
    jobs = -(-mid // per_job)
    cuts = [0, *(edge + mid * j // jobs for j in range(jobs)), n - edge, n]
    return list(zip(cuts, cuts[1:], strict=False))


def _pipelined(session: SessionPort, spans: list[tuple[int, int]]) -> bool:
    """Whether a call's jobs overlap their RPCs with the copies: with more than one job, unless
    ``pipeline_bytes`` is 0. Otherwise every RPC is made on the caller's thread, in order."""
    return len(spans) > 1 and session.pipeline_bytes > 0


def _complete(session: SessionPort, method: str, request: Any, prepared: Any, deadline: float,
              inline: bool) -> PendingCall | Away:
    """Start the completion of a job (CompleteStore / CompleteLoad) under the session that
    prepared it (``prepared``: its Prepare* request): ``Session.start_completion``. Away
    (a value, not raised) when it could not even start."""
    try:
        return session.start_completion(method, request, prepared.session_id, deadline,
                                         inline=inline)
    except Away as e:
        return e


def _close(jobs: deque[Any], close: Callable[[Any], None]) -> None:
    """``close`` every job left, on the way out of an error: one that fails again (another
    refusal) does not keep the others from being closed."""
    while jobs:
        with contextlib.suppress(Away, errors.KvtierError):
            close(jobs.popleft())


def _late(session: SessionPort, deadline: float) -> bool:
    """Whether a job's copy would start too late: with less than ``MIN_RPC_S`` of the deadline
    left, as an RPC would not start (its Prepare* was answered before; its copy does not
    start, its completion aborts it)."""
    if session.clock() <= deadline - MIN_RPC_S:
        return False
    session.counters.out_of_time += 1
    return True


def _reply(call: PendingCall | Away) -> Any:
    """The reply of a started call; raises what it failed with."""
    if isinstance(call, Away):
        raise call
    return call.result()


# -- the transfer of a job -------------------------------------------------------------------------

def _transfer(session: SessionPort, what: str, move: Callable[[], None]) -> tuple[str, bool]:
    """Run one job's transfer holding the data channel -> (failure, trip): ``""`` when it went
    through; a transport failure trips the breaker, a failed copy (e.g. a CUDA error) fails this
    job only."""
    try:
        with session.transfer():
            move()
    except errors.TransportError as e:
        return f"{what} transfer: {e}", True
    except (RuntimeError, errors.KvtierError) as e:
        return f"{what} copy: {e}", False
    return "", True


def make_transport_value(name: str) -> int:
    """The transport of a job moving host buffers (a cuda_ipc session moves those over shm)."""
    return int(pb.TRANSPORT_TCP if name == "tcp" else pb.TRANSPORT_SHM)


def _blocks_transport(session: SessionPort, layout: Any) -> int:
    """The transport value of a put_blocks/get_blocks job: cuda_ipc only for CUDA layouts
    on a cuda_ipc session (CPU layouts move over the mapped arena like shm)."""
    if session.transport_name == "cuda_ipc" and getattr(layout.device, "type", "") == "cuda":
        return int(pb.TRANSPORT_CUDA_IPC)
    return make_transport_value(session.transport_name)

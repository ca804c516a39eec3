"""Puts: the two-phase store jobs behind ``NamespaceHandle.put`` / ``put_blocks``::

    PrepareStore -> write the reserved slots (transport) -> CompleteStore(ok)

job after job, pipelined when the session says so (:mod:`kvtier.batches` states the rules:
deadlines, misses and drops, verification). Every job the daemon prepared is completed, also
after a failure (an abort frees its slots at once). Thread-safety: as the session's (transfers
hold its data channel); a ``_StorePipe`` belongs to one call on one thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtier.batch_jobs import (
    COMPLETES_BEHIND,
    PREPARES_AHEAD,
    CopyGuard,
    CopyRevoked,
    Move,
    blocks_transport,
    close_jobs,
    complete,
    job_spans,
    late,
    make_transport_value,
    pipelined,
    reply_of,
    transfer,
)
from kvtier.buffers import byte_view
from kvtier.calls import Away, PendingCall, Registered, SessionPort, Unanswered
from kvtier.results import PutResult
from kvtier_contract import errors
from kvtier_contract.protoutil import KEY_BYTES, pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb


def put(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    views: list[memoryview],
    *,
    deadline: float | None = None,
    token_ids: Sequence[int] | None = None,
    parent: bytes | None = None,
) -> PutResult:
    """``token_ids`` (every key's tokens, ``tokens_per_block`` each) and ``parent`` (the key
    before ``keys[0]``): optional, sent with the store for the daemon's KV events
    (docs/events.md); InvalidArgument naming ``token_ids`` when the count is wrong."""
    origin = check_origin(handle, keys, token_ids, parent)

    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> list[int] | None:
        return session.data().write(
            job_id,
            [(i, off, views[p]) for i, p, off in zip(idx, pos, offsets, strict=True)],
            digest=session.settings.verify_bytes,
        )

    return _store(session, handle, keys, write, deadline=deadline, origin=origin)


def check_origin(
    handle: Registered, keys: Sequence[bytes], token_ids: Sequence[int] | None, parent: bytes | None
) -> tuple[Sequence[int], int, bytes] | None:
    """(token ids, tokens per block, parent key or b"") of a put, checked; None: neither."""
    if not token_ids and parent is None:
        return None
    tpb = handle.namespace.tokens_per_block
    if token_ids and len(token_ids) != len(keys) * tpb:
        raise errors.InvalidArgument(
            f"has {len(token_ids)} token ids for {len(keys)} keys of {tpb} tokens", field="token_ids"
        )
    if parent is not None and len(parent) != KEY_BYTES:
        raise errors.InvalidArgument(f"must be {KEY_BYTES} bytes, got {len(parent)}", field="parent_key")
    return token_ids or (), tpb, parent or b""


def put_blocks(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    layout: Any,
    block_ids: Sequence[int],
    *,
    deadline: float | None = None,
    guard: CopyGuard | None = None,
    token_ids: Sequence[int] | None = None,
    parent: bytes | None = None,
) -> PutResult:
    """put_blocks over a mapped arena: gather straight into the reserved slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies; under
    ``guard``, from the engine's snapshot when it took one (then a plain write into the slots).
    Over cuda_ipc the guarded copy includes the daemon's CudaCopy RPC: a fence that stops
    waiting for it aborts the batch. ``token_ids`` and ``parent``: as for :func:`put`."""
    tp, origin = blocks_transport(session, layout), check_origin(handle, keys, token_ids, parent)

    def write(job_id: int, idx: list[int], pos: list[int], offsets: list[int]) -> list[int] | None:
        source = guard.begin() if guard is not None else None
        intact = True
        digests = None  # None: the daemon hashes the slots at CompleteStore
        try:
            if source is None:
                digests = _gather(session, layout, tp, block_ids, pos, offsets, job_id)
            else:
                digests = session.data().write(
                    job_id,
                    [(i, off, byte_view(source[p])) for i, p, off in zip(idx, pos, offsets, strict=True)],
                    digest=session.settings.verify_bytes,
                )
        finally:
            if guard is not None:
                intact = guard.end(pos[-1] + 1 < len(keys)) if pos else guard.end(True)
        if not intact:
            raise CopyRevoked("the engine took its blocks back during the copy")
        return digests

    return _store(session, handle, keys, write, tp, deadline=deadline, origin=origin)


def _gather(
    session: SessionPort,
    layout: Any,
    tp: int,
    block_ids: Sequence[int],
    pos: list[int],
    offsets: list[int],
    job_id: int,
) -> list[int] | None:
    """Gather the engine's blocks ``block_ids[p]`` (``p`` in ``pos``) of ``layout`` straight into
    job ``job_id``'s reserved slots at ``offsets`` (the data transport's mover,
    :mod:`kvtier.direct`): the slots' digests when the session verifies bytes, else None (the
    daemon hashes the slots at CompleteStore; over cuda_ipc the daemon's copies write the
    slots, so it hashes them)."""
    data = session.data()
    mover = data.mover(layout.device)  # type: ignore[attr-defined]
    ids = [block_ids[p] for p in pos]
    if session.settings.verify_bytes and tp != pb.TRANSPORT_CUDA_IPC:
        # The mover fills the slots group by group; each group is hashed on the helper thread
        # while the next one is gathered.
        digests: list[int] | None = data.store_hashed(  # type: ignore[attr-defined]
            offsets,
            layout.block_bytes,
            lambda lo, hi: mover.store(layout, ids[lo:hi], offsets[lo:hi], job_id),
        )
        return digests
    mover.store(layout, ids, offsets, job_id)
    return None


def _store(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    write: Move,
    tp: int = 0,
    *,
    deadline: float | None = None,
    origin: tuple[Sequence[int], int, bytes] | None = None,
) -> PutResult:
    tp = tp or make_transport_value(session.settings.transport)
    deadline = session.deadline() if deadline is None else deadline
    spans = job_spans(session, handle, tp, len(keys))
    pipe = _StorePipe(session, handle, pack_keys(keys), write, tp, deadline, pipelined(session, spans))
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

    def __init__(
        self,
        session: SessionPort,
        handle: Registered,
        packed: bytes,
        write: Move,
        tp: int,
        deadline: float,
        pipelined: bool,
    ) -> None:
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
                close_jobs(self.ahead, lambda job: self._job(*job))
                close_jobs(self.behind, lambda job: self._collect(*job))
            if self.trip:
                self.session.trip(self.trip)  # reattach the transport on the next call
        return self.result

    def _prepare(self, start: int, end: int) -> None:
        request = pb.PrepareStoreRequest(
            namespace_id=self.handle.namespace_id,
            keys=self.packed[start * KEY_BYTES : end * KEY_BYTES],
            transport=self.tp,
        )
        if self.origin is not None:
            tokens, tpb, parent = self.origin
            request.token_ids.extend(tokens[start * tpb : end * tpb])
            request.parent_key = self.packed[(start - 1) * KEY_BYTES : start * KEY_BYTES] if start else parent
        call: PendingCall | Away
        try:
            call = self.session.start("PrepareStore", request, deadline=self.deadline, inline=self.inline)
        except Away as e:
            call = e
        self.ahead.append((start, end, request, call))

    def _job(self, start: int, end: int, request: Any, call: PendingCall | Away) -> None:
        """Wait for the job's PrepareStore, copy its reserved blocks (none once the put has
        failed), start its CompleteStore."""
        prep = self._prepared(start, end, call)
        if prep is None:
            return
        status = prep.status
        idx = [i for i in range(len(status)) if status[i] == pb.STORE_RESERVED]
        offsets = [prep.offsets[i] for i in idx]
        pos = [start + i for i in idx]
        if not self.stop and late(self.session, self.deadline):
            self.stop = "deadline spent"
        failure, trip = self.stop, False
        digests: list[list[int] | None] = [None]  # the job's digests, as the copy made them
        if not self.stop:

            def move() -> None:
                digests[0] = self.write(prep.job_id, idx, pos, offsets)

            failure, trip = transfer(self.session, "store", move)
        # Also on failure: abort at once, so the keys do not stay reserved until the lease ends.
        self.behind.append(
            (
                len(idx),
                complete(
                    self.session,
                    "CompleteStore",
                    pb.CompleteStoreRequest(
                        job_id=prep.job_id, ok=not failure, digests=(digests[0] or []) if not failure else []
                    ),
                    request,
                    self.deadline,
                    self.inline,
                ),
            )
        )
        if failure and trip:
            self.stop, self.trip = failure, self.trip or failure

    def _prepared(self, start: int, end: int, call: PendingCall | Away) -> Any:
        """The job's PrepareStore reply, what it found present or rejected counted; None when
        it reserved nothing, or when the call failed (its keys dropped; unanswered: no further
        job starts, and the breaker trips once every job is closed)."""
        try:
            prep = reply_of(call)
        except Away as e:
            self._drop(end - start)
            if isinstance(e, Unanswered):
                self.stop, self.trip = self.stop or e.why, self.trip or e.why
            return None
        status = prep.status
        self.result.already_present += status.count(pb.STORE_ALREADY_PRESENT)
        self.result.rejected += status.count(pb.STORE_REJECTED)
        return prep if prep.job_id else None

    def _collect(self, reserved: int, call: PendingCall | Away) -> None:
        try:
            done = reply_of(call)
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

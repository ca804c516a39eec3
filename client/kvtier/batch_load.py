"""Gets: the two-phase load jobs behind ``NamespaceHandle.get_into`` / ``get_blocks``::

    PrepareLoad -> read the pinned slots (transport) -> CompleteLoad

in rounds: the daemon pins what its host tier holds or can place now and marks the rest of what
it has below as deferred; those are loaded again after CompleteLoad, round after round while each
one serves something. A job's blocks count as found when its CompleteLoad is collected (the
pins held during the copy), never before; a block whose bytes differ from its digest is a miss,
as is every later block. :mod:`kvtier.batches` states the rules (deadlines, pipelining).
Thread-safety: as the session's; a ``_LoadPipe`` belongs to one call on one thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvtier.batch_jobs import (
    COMPLETES_BEHIND,
    PREPARES_AHEAD,
    LoadMove,
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
from kvtier.calls import Away, OutOfTime, PendingCall, Registered, SessionPort, Unanswered
from kvtier_contract import errors
from kvtier_contract.protoutil import KEY_BYTES, pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb


def get_into(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    views: list[memoryview],
    *,
    deadline: float | None = None,
    host_only: bool = False,
) -> list[bool]:
    def read(
        job_id: int, idx: list[int], pos: list[int], offsets: list[int], digests: list[int]
    ) -> list[int]:
        return session.data().read(
            job_id, [(i, off, views[p]) for i, p, off in zip(idx, pos, offsets, strict=True)], digests
        )

    return _load(session, handle, keys, read, deadline=deadline, host_only=host_only)


def get_blocks(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    layout: Any,
    block_ids: Sequence[int],
    *,
    deadline: float | None = None,
    host_only: bool = False,
) -> list[bool]:
    """get_blocks over a mapped arena: scatter straight from the pinned slots
    (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies."""

    def read(
        job_id: int, idx: list[int], pos: list[int], offsets: list[int], digests: list[int]
    ) -> list[int]:
        data = session.data()
        mover = data.mover(layout.device)  # type: ignore[attr-defined]

        def copy() -> None:
            mover.load(layout, [block_ids[p] for p in pos], offsets, job_id)

        if not digests:
            copy()
            return []
        # The pinned slots are hashed while the mover (or the daemon's CUDA copy) reads them.
        bad: list[int] = data.check_slots(  # type: ignore[attr-defined]
            offsets, layout.block_bytes, digests, copy
        )
        return bad

    return _load(
        session, handle, keys, read, blocks_transport(session, layout), deadline=deadline, host_only=host_only
    )


def _load(
    session: SessionPort,
    handle: Registered,
    keys: Sequence[bytes],
    read: LoadMove,
    tp: int = 0,
    *,
    deadline: float | None = None,
    host_only: bool = False,
) -> list[bool]:
    """Round after round until ``deadline``: the first asks for every key, each later one
    for the keys the daemon deferred (held below, not placed in the host tier that round),
    while each round serves something and the daemon did not answer that its reads outlast
    the deadline (``deadline_cut``). A job that would start after the deadline does not
    (its keys are misses; what earlier jobs loaded stays loaded). ``host_only``: one round,
    of what the host tier holds now (``PrepareLoadRequest.host_only``)."""
    tp = tp or make_transport_value(session.settings.transport)
    deadline = session.deadline() if deadline is None else deadline
    found = [False] * len(keys)
    pipe = _LoadPipe(session, handle, pack_keys(keys), read, tp, deadline, found)
    pipe.host_only = host_only
    todo = list(range(len(keys)))
    try:
        while todo:
            spans = job_spans(session, handle, tp, len(todo))
            served, todo = pipe.round([todo[s:e] for s, e in spans], pipelined(session, spans))
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

    def __init__(
        self,
        session: SessionPort,
        handle: Registered,
        packed: bytes,
        read: LoadMove,
        tp: int,
        deadline: float,
        found: list[bool],
    ) -> None:
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
                close_jobs(self.ahead, lambda job: self._job(*job))
                close_jobs(self.behind, lambda job: self._collect(*job))
            if self.trip:
                self.session.trip(self.trip)  # reattach the transport on the next call
        if self.failure is not None:
            raise self.failure
        return self.served, self.deferred

    def _prepare(self, positions: list[int]) -> None:
        request = pb.PrepareLoadRequest(
            namespace_id=self.handle.namespace_id,
            keys=keys_at(self.packed, positions),
            transport=self.tp,
            host_only=self.host_only,
        )
        call: PendingCall | Away
        try:
            call = self.session.start("PrepareLoad", request, deadline=self.deadline, inline=self.inline)
        except Away as e:
            call = e
        self.ahead.append((positions, request, call))

    def _job(self, todo: list[int], request: Any, call: PendingCall | Away) -> None:
        """Wait for the job's PrepareLoad, copy its pinned blocks (none once the get has
        failed), start its CompleteLoad."""
        try:
            prep = reply_of(call)
        except Away as e:
            self.failure = self.failure or e
            if isinstance(e, Unanswered):
                self.trip = self.trip or e.why
            return
        if prep.deadline_cut and not self.deadline_cut:  # answered ahead of the deadline with
            self.deadline_cut = True  # reads still running: this get is out of time
            self.session.counters.out_of_time += 1
        if not prep.job_id:
            self.deferred += deferred(prep, todo)
            return
        idx = [i for i in range(len(todo)) if prep.found[i]]
        pos = [todo[i] for i in idx]
        failure, trip, bad = self._copy(prep, todo, idx, pos)
        done = complete(
            self.session,
            "CompleteLoad",
            pb.CompleteLoadRequest(job_id=prep.job_id, corrupt=[idx[k] for k in bad]),
            request,
            self.deadline,
            self.inline,
        )
        if not failure:
            if bad:  # a miss, as is every later block of the get (the engine recomputes)
                self.session.counters.corrupt_blocks += len(bad)
                first = pos[bad[0]]
                self.cut = first if self.cut is None else min(self.cut, first)
                pos = [p for p in pos if p < first]
            self.deferred += deferred(prep, todo)
            self.behind.append((pos, done))
            return
        self.behind.append((None, done))  # the bytes are not trusted: it only unpins
        if self.failure is None:
            self.failure = Away(failure)
            self.trip = failure if trip else ""

    def _copy(
        self, prep: Any, todo: list[int], idx: list[int], pos: list[int]
    ) -> tuple[str, bool, list[int]]:
        """Copy a prepared job's pinned blocks (``idx`` of ``todo``, at ``pos``) unless the get
        has failed or is out of time -> (failure, trip, indexes into ``idx`` whose bytes did not
        match their digest), as ``transfer`` answers."""
        offsets = [prep.offsets[i] for i in idx]
        digests = (
            [prep.digests[i] for i in idx]
            if self.session.settings.verify_bytes and len(prep.digests) == len(todo)
            else []
        )
        if self.failure is None and late(self.session, self.deadline):
            self.failure = OutOfTime("deadline spent")
        bad: list[int] = []
        if self.failure is not None:
            return "get stopped", False, bad

        def move() -> None:
            bad.extend(self.read(prep.job_id, idx, pos, offsets, digests))

        failure, trip = transfer(self.session, "load", move)
        return failure, trip, bad

    def _collect(self, pos: list[int] | None, call: PendingCall | Away) -> None:
        try:
            reply_of(call)
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


def deferred(prep: Any, todo: list[int]) -> list[int]:
    """The positions of ``todo`` that PrepareLoad found below but did not place this round."""
    return [
        todo[i]
        for i in range(len(todo))
        if not prep.found[i] and i < len(prep.tiers) and prep.tiers[i] != pb.TIER_NONE
    ]


def keys_at(packed: bytes, positions: list[int]) -> bytes:
    """The packed keys at increasing ``positions``: one slice when they are contiguous (a first
    round), else joined (the deferred keys of a later round)."""
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):
        return packed[first * KEY_BYTES : (last + 1) * KEY_BYTES]
    return b"".join(packed[p * KEY_BYTES : (p + 1) * KEY_BYTES] for p in positions)

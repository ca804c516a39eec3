"""What the batch operations (:mod:`kvtier.batches`, :mod:`kvtier.batch_store`,
:mod:`kvtier.batch_load`) share: how a call is cut into jobs, the calls that start and complete a
job on a :class:`kvtier.calls.SessionPort`, and the transfer of one job's bytes; the engine's say
over a put of its blocks (:class:`CopyGuard`).

Plain functions over the session port; no state. Thread-safety: as the session's.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvtier.calls import MIN_RPC_S, Away, PendingCall, Registered, SessionPort
from kvtier_contract import errors
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


def guarded_gather(layout: Any, block_ids: Sequence[int], staging: Any, guard: CopyGuard | None) -> Any:
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


# -- pipelining ------------------------------------------------------------------------------------


def job_spans(session: SessionPort, handle: Registered, tp: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of each job of a call of ``n`` keys: batches of ``max_batch`` keys when
    pipelining is off (``pipeline_bytes`` 0) or the daemon copies (cuda_ipc); else jobs of
    about ``pipeline_bytes`` (``spans``)."""
    if tp == pb.TRANSPORT_CUDA_IPC or session.pipeline_bytes <= 0:
        step = session.max_batch
        return [(start, min(start + step, n)) for start in range(0, n, step)]
    per_job = max(1, min(session.max_batch, session.pipeline_bytes // handle.block_bytes))
    return spans(n, per_job)


def spans(n: int, per_job: int) -> list[tuple[int, int]]:
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


def pipelined(session: SessionPort, spans: list[tuple[int, int]]) -> bool:
    """Whether a call's jobs overlap their RPCs with the copies: with more than one job, unless
    ``pipeline_bytes`` is 0. Otherwise every RPC is made on the caller's thread, in order."""
    return len(spans) > 1 and session.pipeline_bytes > 0


def complete(
    session: SessionPort, method: str, request: Any, prepared: Any, deadline: float, inline: bool
) -> PendingCall | Away:
    """Start the completion of a job (CompleteStore / CompleteLoad) under the session that
    prepared it (``prepared``: its Prepare* request): ``Session.start_completion``. Away
    (a value, not raised) when it could not even start."""
    try:
        return session.start_completion(method, request, prepared.session_id, deadline, inline=inline)
    except Away as e:
        return e


def close_jobs(jobs: deque[Any], close: Callable[[Any], None]) -> None:
    """``close`` every job left, on the way out of an error: one that fails again (another
    refusal) does not keep the others from being closed."""
    while jobs:
        with contextlib.suppress(Away, errors.KvtierError):
            close(jobs.popleft())


def late(session: SessionPort, deadline: float) -> bool:
    """Whether a job's copy would start too late: with less than ``MIN_RPC_S`` of the deadline
    left, as an RPC would not start (its Prepare* was answered before; its copy does not
    start, its completion aborts it)."""
    if session.clock() <= deadline - MIN_RPC_S:
        return False
    session.counters.out_of_time += 1
    return True


def reply_of(call: PendingCall | Away) -> Any:
    """The reply of a started call; raises what it failed with."""
    if isinstance(call, Away):
        raise call
    return call.result()


# -- the transfer of a job -------------------------------------------------------------------------


def transfer(session: SessionPort, what: str, move: Callable[[], None]) -> tuple[str, bool]:
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


def blocks_transport(session: SessionPort, layout: Any) -> int:
    """The transport value of a put_blocks/get_blocks job: cuda_ipc only for CUDA layouts
    on a cuda_ipc session (CPU layouts move over the mapped arena like shm)."""
    if session.settings.transport == "cuda_ipc" and getattr(layout.device, "type", "") == "cuda":
        return int(pb.TRANSPORT_CUDA_IPC)
    return make_transport_value(session.settings.transport)

"""Store and load jobs: what one session holds of the index between prepare and complete.

A job is created by the cache's ``prepare_store`` / ``prepare_load`` / ``lookup`` (a hold) and ends at
``complete_*``, on a transfer failure, or when its session is released. Its id is unique for the
daemon's lifetime; only the session that owns it may use it (another session's job answers
NotFound, exactly like an absent one: an id tells nothing).

The data plane reaches a job's slots through the :class:`JobTable` (one call per frame or
batch): ``store_run`` validates a run of keys of a store job and answers where their bytes go,
``load_run`` the pinned slots of a load job. Neither changes the index; ``StoreJob.arrived``
records which keys' bytes the daemon itself received (tcp, cuda_ipc), the only ones a commit of
such a job makes READY. ``LoadJob.sending`` counts the data connections whose write buffers still
hold views of a load job's slots: a job that ends meanwhile keeps its pins until that count is 0
(``TieredCache.load_queued`` / ``load_sent``), so no slot is reused while its bytes may leave.

Ownership: the TieredCache owns the table and every job. Event-loop thread only; no locks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier_contract.errors import FailedPrecondition, InvalidArgument, NotFound
from kvtierd.domain import Transport
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.sessions import Session


@dataclass(eq=False)
class StoreJob:
    id: int
    session_id: int
    ns: NamespaceState
    transport: Transport
    items: dict[int, Entry]  # key index in the request -> reserved entry
    received: set[int] = field(default_factory=set)  # tcp, cuda_ipc: keys whose bytes arrived
    digests: dict[int, int] = field(default_factory=dict)  # tcp: digests of received blocks
    staged: dict[int, int] = field(default_factory=dict)
    """Key index -> the slot its client writes instead, in the session's own arena, when the
    entry's arena is one the session maps read-only (a group's): copied at the commit."""

    def live(self, index: int) -> bool:
        """Key ``index`` is still this job's to write (the job was not aborted meanwhile)."""
        e = self.items.get(index)
        return e is not None and e.job == self.id and e.state is EntryState.WRITING

    def arrived(self, indexes: Iterable[int]) -> None:
        """The daemon received these keys' bytes in full (ignored once the job has ended)."""
        self.received.update(i for i in indexes if self.live(i))


@dataclass(eq=False)
class LoadJob:
    id: int
    session_id: int
    ns: NamespaceState
    transport: Transport
    items: dict[int, Entry]  # key index in the request -> pinned entry
    moves_bytes: bool = True  # False for a pinned lookup: releasing it counts no load
    sending: int = 0  # tcp: connections whose write buffer still holds views of its slots
    ended: bool = False  # completed or released; if still sending, its pins wait for the bytes


Job = StoreJob | LoadJob
J = TypeVar("J", StoreJob, LoadJob)


class JobTable:
    """Every live job by id; see the module docstring."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self.copying: set[int] = set()
        """Jobs whose bytes a daemon-side copy (cuda_ipc) is moving: they may not complete."""

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, job: Job) -> None:
        self._jobs[job.id] = job

    def remove(self, job: Job) -> None:
        del self._jobs[job.id]

    def is_live(self, job: Job) -> bool:
        return self._jobs.get(job.id) is job

    def get(self, session_id: int, job_id: int, kind: type[J]) -> J:
        """The live job ``job_id`` of ``session_id``, of type ``kind``."""
        job = self._jobs.get(job_id)
        if job is None or job.session_id != session_id:  # another session's: as an absent one
            raise NotFound(f"unknown or finished job {job_id}", field="job_id")
        if not isinstance(job, kind):
            raise FailedPrecondition(f"job {job_id} is not a {kind.__name__}", field="job_id")
        return job

    def any(self, session_id: int, job_id: int) -> Job:
        """The live job ``job_id`` of ``session_id``, store or load."""
        job = self._jobs.get(job_id)
        if job is None or job.session_id != session_id:  # another session's: as an absent one
            raise NotFound(f"unknown or finished job {job_id}", field="job_id")
        return job

    def not_copying(self, job_id: int) -> None:
        if job_id in self.copying:
            raise FailedPrecondition(f"a CudaCopy for job {job_id} is in flight", field="job_id")

    # -- data plane -------------------------------------------------------------------------------

    def store_run(
        self, session_id: int, job_id: int, first: int, count: int, nbytes: int
    ) -> tuple[StoreJob, list[Entry]]:
        """A run of ``count`` consecutive keys of a store job from ``first``, ``nbytes`` in all:
        the job and the reserved entry of each key, all validated before anything is written.
        One call per WRITE or WRITE_RUN frame (tcp data channel)."""
        if count <= 0 or nbytes % count:
            raise InvalidArgument(f"run of {count} blocks in {nbytes} bytes", field="length")
        job = self._jobs.get(job_id)
        if not isinstance(job, StoreJob) or job.session_id != session_id:
            raise NotFound(f"no store job {job_id} for this session", field="job_id")
        if count > len(job.items):  # count comes off the wire: bounded before any walk
            raise InvalidArgument(f"run of {count} keys in a job of {len(job.items)}", field="index")
        if first not in job.items:
            raise InvalidArgument(f"key {first} is not reserved in job {job_id}", field="index")
        if nbytes // count != job.ns.block_bytes:
            raise InvalidArgument(
                f"payload of {nbytes // count} bytes, block is {job.ns.block_bytes}", field="length"
            )
        entries = [job.items.get(i) for i in range(first, first + count)]
        if None in entries:
            missing = first + entries.index(None)
            raise InvalidArgument(f"key {missing} is not reserved in job {job_id}", field="index")
        return job, entries  # type: ignore[return-value]  # no None left

    def load_run(self, session_id: int, job_id: int) -> tuple[LoadJob, list[tuple[int, Entry]]]:
        """The pinned entries of a load job, in key order (one call per READ frame)."""
        job = self._jobs.get(job_id)
        if not isinstance(job, LoadJob) or job.session_id != session_id:
            raise NotFound(f"no load job {job_id} for this session", field="job_id")
        self.moves_bytes(job)
        return job, sorted(job.items.items())

    @staticmethod
    def moves_bytes(job: Job) -> None:
        """Refuse to move the bytes of a pinned lookup's job: it only holds blocks against
        eviction (some may still be on their way into the host tier); loads use PrepareLoad."""
        if isinstance(job, LoadJob) and not job.moves_bytes:
            raise FailedPrecondition(
                f"job {job.id} is a pinned lookup: load its blocks with PrepareLoad", field="job_id"
            )


def check_live(session: Session) -> None:
    """Jobs attach only to live sessions: a released one would never free them (its lease
    may lapse while a request awaits flushes or promotions)."""
    if session.released:
        raise NotFound(f"session {session.id} expired or closed", field="session_id")

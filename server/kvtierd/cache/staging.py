"""Staged stores: a store into an arena its session maps read-only (a group's arena,
docs/security.md § Groups, "Group arenas").

The client cannot write the reserved slots there, so it writes staging slots of its own arena
instead; the commit copies each into its entry's slot before the digests are taken and the
blocks become visible, and the job's end frees them.

* :func:`stage`: a staging slot for every reserved entry of a job, or none at all;
* :func:`copy_staged`: the copies, on any thread while the job is marked copying (no other
  writer reaches either slot: the entries are WRITING, the staging slots the job's);
* :func:`free_staged`: at the job's end, every way it ends (held in limbo after a lapsed lease,
  as the entries' own slots are: the session's process may still be writing them).

Event-loop thread, but :func:`copy_staged`.
"""

from __future__ import annotations

from kvtierd.cache.jobs import StoreJob
from kvtierd.cache.residency import HostResidency


def stage(residency: HostResidency, job: StoreJob, pool: int) -> bool:
    """Staging slots in arena ``pool`` (the session's own) for every entry of ``job``, placed
    as any store into ``pool`` is (its coldest blocks evicted): ``job.staged``; False, and none
    kept, when not all could be placed."""
    ns = job.ns
    slots = residency.allocate_many(ns.slot_bytes, len(job.items), set(), pool)
    if len(slots) < len(job.items):
        for off in slots:
            residency.free_slot(off, ns)
        return False
    job.staged = dict(zip(sorted(job.items), slots, strict=True))
    return True


def copy_staged(residency: HostResidency, job: StoreJob) -> None:
    """Each staged slot's bytes into its entry's slot (a CompleteStore's, before the commit)."""
    host, n = residency.host, job.ns.block_bytes
    for i, off in job.staged.items():
        host.view(job.items[i].offset, n)[:] = host.view(off, n)


def free_staged(residency: HostResidency, job: StoreJob, hold_until: float) -> None:
    """The job ended: its staging slots freed (or held in limbo until ``hold_until``)."""
    for off in job.staged.values():
        residency.free_slot(off, job.ns, hold_until)
    job.staged = {}

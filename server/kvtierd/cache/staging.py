"""Staged stores: a store into an arena its session maps read-only (a group's arena,
docs/security.md § Groups, "Group arenas").

The client cannot write the reserved slots there, so it writes staging slots of its own arena
instead; the commit copies each into its entry's slot before the digests are taken and the
blocks become visible, and the job's end frees them.

* :func:`stage`: a staging slot for every reserved entry of a job, or none at all;
  :func:`zero_staged`: zeroed before the client is told of them;
* :func:`copy_staged`: the copies of the keys that commit, on any thread while the job is
  marked copying (no other writer reaches either slot: the entries are WRITING, the staging
  slots the job's);
* :func:`free_staged`: at the job's end, every way it ends (held in limbo after a lapsed lease,
  as the entries' own slots are: the session's process may still be writing them).

Event-loop thread, but :func:`zero_staged` and :func:`copy_staged`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Collection

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


def zero_staged(residency: HostResidency, job: StoreJob) -> None:
    """Every staging slot of ``job`` zeroed (before its client is told of them): a slot hands
    on nothing it held before (its tenant's evicted blocks), even into a group's arena when a
    client reports as written a block it never wrote."""
    host, slot = residency.host, job.ns.slot_bytes
    for src, _dst, count in _runs(sorted((off, off) for off in job.staged.values()), slot, host.pool_of):
        ctypes.memset(_address(host.view(src, count * slot)), 0, count * slot)


def copy_staged(residency: HostResidency, job: StoreJob, keep: Collection[int]) -> None:
    """The staged slots of the keys ``keep`` (batch indexes: those that commit) copied into
    their entries' slots (a CompleteStore's, before the commit): one ``memmove`` (the GIL
    released) per run of slots that follow one another on both sides (one allocation each:
    the usual case is one run per slab)."""
    host, n = residency.host, job.ns.block_bytes
    pairs = sorted((off, job.items[i].offset) for i, off in job.staged.items() if i in keep)
    for src, dst, count in _runs(pairs, job.ns.slot_bytes, host.pool_of):
        size = (count - 1) * job.ns.slot_bytes + n
        ctypes.memmove(_address(host.view(dst, size)), _address(host.view(src, size)), size)


def _runs(
    pairs: list[tuple[int, int]], slot_bytes: int, pool_of: Callable[[int], int]
) -> list[tuple[int, int, int]]:
    """``(staging, entry)`` slot pairs, sorted, as runs ``(first staging, first entry, count)``
    whose slots follow one another on both sides within one arena each (``pool_of``: two pools
    may be neighbours in the host tier's offsets, never in memory)."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s0, d0, count = runs[-1]
            step = count * slot_bytes
            if (
                src == s0 + step
                and dst == d0 + step
                and pool_of(src) == pool_of(s0)
                and pool_of(dst) == pool_of(d0)
            ):
                runs[-1] = (s0, d0, count + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def _address(view: memoryview) -> int:
    """Address of a writable view's first byte (no export held once it returns)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def free_staged(residency: HostResidency, job: StoreJob, hold_until: float) -> None:
    """The job ended: its staging slots freed (or held in limbo until ``hold_until``)."""
    for off in job.staged.values():
        residency.free_slot(off, job.ns, hold_until)
    job.staged = {}

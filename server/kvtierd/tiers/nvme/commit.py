"""The NVMe tier's group commit: journal records queued on the event loop, made durable in
groups on one commit thread.

Role: the write side's ordering of :class:`~kvtierd.tiers.nvme.tier.NvmeTier`. A group first
makes durable the block files written since the last group, then appends its records to the
journal and syncs it (both done by ``sync_group``, handed by the tier, which owns the files and
the journal), so a block is reported durable only after its bytes, its header and its journal
record are; a failed sync fails the whole group, never later "ok".

Primitives: ``dirty(file)`` (a block file written), ``queue(record)`` (rides with the next
group, nobody waits), ``await commit(record)`` (durable when it returns, or the group's
DiskError), ``close()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtierd.tiers.nvme.device import DiskError

SyncGroup = Callable[[Iterable[int], list[Any]], None]
"""Commit thread: ``(block files to sync, records to journal)``, durable when it returns."""


class GroupCommit:
    """Owns the commit thread, the records waiting for the next group (each with the future of
    whoever awaits it, or None), the block files written since the last group, the task running
    groups, and ``groups`` (how many committed). Handed: ``sync_group`` (what a group does) and
    ``on_failure`` (told of each failed group, before its waiters).

    Concurrency: event-loop thread only; one group at a time runs on the commit thread.
    """

    def __init__(self, sync_group: SyncGroup, on_failure: Callable[[DiskError], None]) -> None:
        self._sync_group = sync_group
        self._on_failure = on_failure
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-nvme-commit")
        self._pending: list[tuple[Any, asyncio.Future[None] | None]] = []
        self._dirty_files: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self.groups = 0

    def dirty(self, file: int) -> None:
        """Block file ``file`` was written: the next group syncs it before its records."""
        self._dirty_files.add(file)

    def queue(self, record: Any) -> None:
        """``record`` rides with the next group (which someone's ``commit`` starts)."""
        self._pending.append((record, None))

    async def commit(self, record: Any) -> None:
        """``record`` and everything queued before it, durable when this returns."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((record, fut))
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())
        await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while any(f is not None for _, f in self._pending):
            batch, self._pending = self._pending, []
            files, self._dirty_files = self._dirty_files, set()
            try:
                await loop.run_in_executor(self._thread, self._sync_group, files, [r for r, _ in batch])
            except DiskError as e:
                self._on_failure(e)
                for _, f in batch:
                    if f is not None and not f.done():
                        f.set_exception(e)
                continue
            self.groups += 1
            for _, f in batch:
                if f is not None and not f.done():
                    f.set_result(None)

    def close(self) -> None:
        """Wait for the group in progress; then the commit thread ends."""
        self._thread.shutdown(wait=True)

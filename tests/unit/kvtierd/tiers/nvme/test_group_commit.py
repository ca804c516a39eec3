"""The NVMe tier's group commit: queued records ride with the next awaited one, the block files
written since the last group are synced with it, and a failed group fails all its waiters after
the tier has heard of it. ``sync_group`` here records what each group was given."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from kvtierd.tiers.nvme.device import DiskError, SyncFailed
from kvtierd.tiers.nvme.journal import GroupCommit


class Groups:
    """What each group synced and journaled; ``fail``: the next group raises it."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], list[Any]]] = []
        self.fail: DiskError | None = None
        self.told: list[DiskError] = []

    def sync(self, files: Iterable[int], records: list[Any]) -> None:
        self.seen.append((sorted(files), records))
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err


def test_queued_records_and_dirty_files_go_with_the_next_commit() -> None:
    async def scenario() -> None:
        g = Groups()
        commits = GroupCommit(g.sync, g.told.append)
        commits.dirty(2)
        commits.dirty(0)
        commits.queue("del-1")  # nobody waits on it: it waits for a commit
        await commits.commit("add-2")
        assert g.seen == [([0, 2], ["del-1", "add-2"])] and commits.groups == 1
        await commits.commit("ns-3")  # files already synced: not again
        assert g.seen[1] == ([], ["ns-3"]) and commits.groups == 2
        commits.close()

    asyncio.run(scenario())


def test_a_failed_group_fails_every_waiter_after_the_tier_is_told() -> None:
    async def scenario() -> None:
        g = Groups()
        order: list[str] = []
        commits = GroupCommit(g.sync, lambda e: (g.told.append(e), order.append("told")))
        g.fail = SyncFailed("injected", err=5)

        async def waiter(record: str) -> None:
            try:
                await commits.commit(record)
            except SyncFailed:
                order.append(f"failed {record}")

        await asyncio.gather(waiter("a"), waiter("b"))  # one group holds both
        assert g.seen == [([], ["a", "b"])] and commits.groups == 0
        assert order == ["told", "failed a", "failed b"] and len(g.told) == 1
        await commits.commit("c")  # the next group is a new one, and it succeeds
        assert g.seen[1] == ([], ["c"]) and commits.groups == 1
        commits.close()

    asyncio.run(scenario())

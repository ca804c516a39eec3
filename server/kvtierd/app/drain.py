"""The steps of a drain (SIGTERM/SIGINT): in-flight jobs given until the deadline, each storage
tier settled, flushed, checkpointed and closed, the cluster tier's queued writes given until the
deadline, the KV events' last batches sent.

Functions of the parts they drain, called in order by ``Daemon.drain_and_stop`` on the event
loop; blocking work (checkpoints, closes) runs in the default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from kvtierd.cache import TieredCache, TierLink

if TYPE_CHECKING:  # (redis-py, pyzmq and msgpack: only when configured)
    from kvtierd.cache.fleet import ClusterLink
    from kvtierd.events import EventSink
    from kvtierd.events.publisher import EventPublisher

log = logging.getLogger("kvtierd")


async def wait_jobs(cache: TieredCache, deadline: float) -> None:
    """Until ``deadline``, while blocks are being written or are pinned."""
    while (cache.writing_blocks or cache.pinned_blocks) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def close_storage(link: TierLink, deadline: float) -> None:
    """A probe or late open in progress ends first (its copies back in the index), then the
    flushes, then the promotions: the checkpoint reads the index off-loop; then the tier
    closes. Still busy at the deadline: no checkpoint (the journals stay)."""
    loop = asyncio.get_running_loop()
    settled = await settle(link, deadline)
    flushed = await link.flush_all(deadline)
    settled = await settle(link, deadline) and settled
    if not settled:  # still opening or reading: no checkpoint, the journals stay
        log.warning(
            "%s: still busy at the drain deadline; no checkpoint (the next start replays the journals)",
            link.tier.name,
        )
        return
    try:
        if await loop.run_in_executor(None, link.recovery.checkpoint):  # (or it said why not)
            log.info("%s checkpoint written (%d blocks flushed while draining)", link.tier.name, flushed)
    except Exception as e:  # noqa: BLE001  (the next start replays the journal instead)
        log.error("%s checkpoint failed: %s", link.tier.name, e)
    await loop.run_in_executor(None, link.tier.close)


async def settle(link: TierLink, deadline: float) -> bool:
    """Wait (until ``deadline``, at least 0.1 s) for the link's tasks; whether they ended."""
    try:
        await asyncio.wait_for(link.settle(), max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        return False
    return True


async def close_fleet(fleet: ClusterLink, deadline: float) -> None:
    """Imports end by their deadline; queued writes get the drain deadline, then are dropped
    (counted); then the cluster tier closes."""
    while fleet.tier.pending_writes and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(fleet.settle(), 2.0)
    await asyncio.get_running_loop().run_in_executor(None, fleet.close)


async def close_events(publisher: EventPublisher, events: EventSink) -> None:
    """The drain's last events (demotions) sent, then the publisher closed."""
    events.flush()
    await asyncio.get_running_loop().run_in_executor(None, publisher.close, 1.0)

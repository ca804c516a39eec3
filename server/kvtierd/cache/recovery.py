"""The recovery side of a storage tier's link: opening the tier, putting its copies back into
the index, probes of a degraded tier, and the checkpoint on drain.

Part of the cache (kvtierd.cache): :class:`LinkRecovery` is the part of a
:class:`~kvtierd.cache.chain.TierLink` (its ``recovery``) that opens and restores the tier.
**Recovery** puts the copies the tier found back into the index (at start, or when a tier that
could not be opened at start opens on a later probe); **probes** of a degraded tier
(and that late open) run as one task of the link at a time (``probe_soon``): the caller never
waits on the disk, cancelling it interrupts nothing, and ``settle()`` waits for it. Until a late
open has put its copies back, ``flush_all`` and ``checkpoint`` do nothing: the index does not
hold the tier's blocks yet, and a checkpoint of it would drop them.

Concurrency: event-loop thread only; the tier's blocking calls (open, probe) run in the loop's
executor, ``checkpoint`` blocks its caller (the drain).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from kvtier_contract.identity import Namespace
from kvtierd.cache.residency import HostResidency
from kvtierd.events import MEDIUM_STORAGE
from kvtierd.index import Entry, EntryState, NamespaceState
from kvtierd.ratelog import RateLimitedLog
from kvtierd.tiers.base import Recovered, StorageTier, TierUnavailable

log = logging.getLogger("kvtierd.chain")
PROBE_LOG_INTERVAL_S = 300.0  # a probe failing the same unforeseen way logs this seldom


class RecoveryLink(Protocol):
    """What a recovery asks of its link (kvtierd.cache.chain.TierLink): its copies, its tasks."""

    def add_copy(self, e: Entry, loc: Any, *, announce: bool = True) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class LinkRecovery:
    """The recovery part of a :class:`~kvtierd.cache.chain.TierLink` (its ``recovery``; see
    the module docstring). Owns the count of copies restored, the late open awaited (the
    ``register`` it will use) and the probe in progress with its failure count; the copies
    are the link's (``add_copy``), the probe a task of the link (``spawn``). Event-loop thread
    only."""

    def __init__(
        self,
        link: RecoveryLink,
        residency: HostResidency,
        tier: StorageTier,
        level: int,
        namespaces: Callable[[], Iterable[NamespaceState]],
    ) -> None:
        self.link = link
        self.residency = residency
        self.tier = tier
        self.level = level
        self._namespaces = namespaces
        self.restored = 0  # copies put back into the index at start (and at a late open)
        # Set while the tier awaits a late open (it could not be opened at start), until the
        # copies it found are back in the index.
        self._deferred: Callable[[Namespace], NamespaceState] | None = None
        self._probing: asyncio.Task[None] | None = None  # the probe (or late open) in progress
        self._probe_failures = 0
        self._probe_log = RateLimitedLog(log, PROBE_LOG_INTERVAL_S)

    def restore(
        self, register: Callable[[Namespace], NamespaceState], opened: Recovered | None = None
    ) -> int:
        """Open the tier and put the copies it holds back into the index (at startup);
        ``opened``: what the caller's own ``tier.open()`` returned (the daemon opens the tier
        before it reserves host memory, to refuse a degraded one first), not opened again.

        A tier whose index cannot be read now (TierUnavailable: a missing or read-only
        directory, an I/O error) is left closed and degraded; the host tier serves, and
        :meth:`probe` opens and restores it once the disk is back."""
        try:
            rec = opened if opened is not None else self.tier.open()
        except TierUnavailable as err:
            log.error(
                "%s tier not opened, the host tier serves alone until a probe opens it: %s",
                self.tier.name,
                err,
            )
            self._deferred = register
            return 0
        return self._put_back(rec, register)

    @property
    def indexed(self) -> bool:
        """Whether the index holds every copy the tier holds (False until a late open has put
        them back): only then may a drain flush to the tier and checkpoint it."""
        return self._deferred is None

    def probe_soon(self) -> None:
        """Start a probe of the degraded tier in the background, unless one is in progress: a
        task of this link (see the module docstring). A tier that could not be opened at start
        is opened there and its copies put back into the live index."""
        if self._probing is None:
            self._probing = self.link.spawn(self._probe())

    async def probe(self) -> bool:
        """``probe_soon`` and wait for that probe; whether the tier admits now. Cancelling the
        caller leaves the probe running."""
        self.probe_soon()
        task = self._probing
        assert task is not None
        await asyncio.shield(task)
        return self.tier.admitting

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            register = self._deferred
            if register is None:
                await loop.run_in_executor(None, self.tier.probe)
            else:
                try:
                    rec = await loop.run_in_executor(None, self.tier.open)
                except TierUnavailable as err:
                    log.debug("%s tier still unavailable: %s", self.tier.name, err)
                    return
                n = self._put_back(rec, register)  # no await between the open and this
                self._deferred = None
                self.restored += n
                log.info("%s tier opened late: %d copies restored", self.tier.name, n)
            self._probe_failures = 0
        except Exception:  # noqa: BLE001  (unforeseen: the traceback once, then rate-limited)
            self._probe_failures += 1
            if self._probe_failures == 1:
                log.exception("%s probe failed", self.tier.name)
            else:
                self._probe_log.error(
                    "%s probe failed again (%d times in a row)",
                    self.tier.name,
                    self._probe_failures,
                    exc_info=False,
                )
        finally:
            self._probing = None

    def _put_back(self, rec: Recovered, register: Callable[[Namespace], NamespaceState]) -> int:
        """Index the copies ``rec`` holds. At startup the index is empty; after a late open it
        is live: an entry stored meanwhile (READY, or WRITING: its commit then finds the copy
        and writes none; its abort leaves the block held here) gets the copy as its own; any
        other clash (a second copy, a size mismatch) releases the slot."""
        namespaces, skipped = _register_recovered(rec, register)
        restored = dropped = 0
        announced: list[Entry] = []
        for digest, key, loc in rec.blocks:
            home = namespaces.get(digest)
            if home is None or loc.payload_len != home.block_bytes:
                dropped += digest in skipped
                self.tier.release(loc, digest, key)
                continue
            e = home.entries.get(key)
            if e is None:
                e = Entry(home, key, -1, 0)
                e.state = EntryState.READY
                e.digest = self.tier.digest_of(loc)  # the block's digest from its commit
                home.entries[key] = e
                home.ready[key] = e
            elif e.copy_in(self.level) is not None:
                self.tier.release(loc, digest, key)
                continue
            self.link.add_copy(e, loc, announce=False)
            announced.append(e)
            restored += 1
        if announced:  # (at start: after the
            self.residency.events.stored(announced, MEDIUM_STORAGE)  # AllBlocksCleared)
        if skipped:
            _log_skipped(self.tier.name, skipped, dropped)
        return restored

    def checkpoint(self) -> bool:
        """Blocking: the tier records every copy it holds, for a warm next start; True once
        written. Nothing (False) while a probe or late open is in progress or the tier's copies
        are not in the index yet: the journals then stay, and the next start replays them."""
        if self._probing is not None or not self.indexed:
            log.warning(
                "%s checkpoint skipped: the tier is still being opened or probed (the "
                "next start replays its journals)",
                self.tier.name,
            )
            return False
        nss = list(self._namespaces())
        namespaces = {ns.spec.digest: ns.spec.to_dict() for ns in nss}
        blocks = [
            (ns.spec.digest, e.key, e.copy_in(self.level))
            for ns in nss
            for e in ns.entries.values()
            if e.copy_in(self.level) is not None
        ]
        self.tier.checkpoint(namespaces, blocks)
        return True


def _register_recovered(
    rec: Recovered, register: Callable[[Namespace], NamespaceState]
) -> tuple[dict[bytes, NamespaceState], dict[bytes, str]]:
    """The recovered namespaces registered (by digest), and those this daemon cannot host (a
    moving ref...) with why."""
    namespaces: dict[bytes, NamespaceState] = {}
    skipped: dict[bytes, str] = {}
    for digest, spec in rec.namespaces.items():
        try:
            namespaces[digest] = register(Namespace.from_dict(spec))
        except Exception as err:  # noqa: BLE001  (skip it; one summary line: _log_skipped)
            skipped[digest] = str(err)
    return namespaces, skipped


def _log_skipped(tier_name: str, skipped: dict[bytes, str], dropped: int) -> None:
    """The recovered namespaces not restored (digest -> why) and their ``dropped`` blocks
    freed: one line, not one per namespace (a rule change can refuse many), three reasons
    at most."""
    why = sorted(set(skipped.values()))
    more = f" (and {len(why) - 3} more reasons)" if len(why) > 3 else ""
    log.warning(
        "%s: %d recovered namespaces not restored, their %d blocks freed: %s%s",
        tier_name,
        len(skipped),
        dropped,
        "; ".join(why[:3]),
        more,
    )

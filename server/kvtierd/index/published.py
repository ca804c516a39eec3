"""Published indexes: a namespace's READY keys, read-only in shared memory for same-host lookups.

Lifecycle::

    registry = Publishers(boot_epoch)
    fd, size, gen = registry.handout(ns)   # first ask builds it from ns.ready; a read-only fd
    registry.hold(ns_id, +1)               # a client's index channel reads it
    ns.ready[key] = e / ns.ready.pop(key)  # ReadyMap notes each change with its publisher
    registry.flush()                       # after every RPC: the changes reach the segments
    registry.tick()                        # every 0.1 s: flush, the liveness stamp, idle ones go
    registry.hold(ns_id, -1)               # no reader left: retired after idle_retire_s
    registry.close()                       # shutdown: every segment says retired

Changes are published in batches: at the end of every RPC (before its reply, so a client that
stored blocks finds them in its next lookup) and at every tick (changes made in the background:
evictions below, demotions, recovery), one by one when few and in one vectorized pass when
many, so a 4,096-block commit costs the daemon about as much as a dozen single ones.

Layout and reader rules: :mod:`kvtier_contract.published_index`. A namespace nobody asked for
costs nothing (``ns.ready.publisher`` is None). Each segment is a memfd sealed against shrinking,
growing and any new writable mapping (``F_SEAL_FUTURE_WRITE``): a client can neither write
nor truncate it, whatever descriptor it holds. A key that finds no slot within ``MAX_PROBE``
(only a namespace whose client picks colliding keys on purpose) is left out: its lookups miss
it, and the daemon's work per change stays bounded.

A namespace of ``background_from`` keys or more is built on a thread of its own, off the event
loop (:mod:`kvtierd.index.publisher`: one namespace's :class:`Publisher`, and the
:class:`ReadyMap` that feeds it; both re-exported here with :class:`Segment`). Until a
namespace's first segment is built, a handout is refused and its clients look up over gRPC
(they ask again in a second).

Ownership and concurrency: the event-loop thread is the only writer of a live segment (ReadyMap
is changed only there); a build thread writes only its new segment, which no one sees until the
loop installs it; readers are other processes, lock-free (8-byte slot stores, see the contract
module).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from kvtierd.index.publisher import BACKGROUND_FROM, NamespaceState, Publisher, ReadyMap
from kvtierd.index.segment import Segment, seals_future_writes

__all__ = ["BACKGROUND_FROM", "NamespaceState", "Publisher", "Publishers", "ReadyMap", "Segment"]

log = logging.getLogger("kvtierd.index")


class Publishers:
    """Every published index of one daemon (namespaces that a client asked for).

    Event-loop thread only. ``enabled`` False: handout refuses (config ``publish_index``, a
    big-endian host, or a kernel without ``F_SEAL_FUTURE_WRITE``: a segment a client could
    write is not published). Readers are counted per namespace id (``hold``), so they outlive
    a publisher dropped and built again; a namespace nobody has read for ``idle_retire_s`` is
    retired at the next tick (the grace keeps a client that reconnects from costing a build
    each time)."""

    def __init__(
        self,
        boot_epoch: int,
        enabled: bool = True,
        *,
        idle_retire_s: float = 30.0,
        clock: Any = time.monotonic,
        flags: int = 0,
        background_from: int = BACKGROUND_FROM,
        stamp_clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """``clock``: idle time (s); ``stamp_clock``: the segments' liveness stamps (ns)."""
        self.boot_epoch = boot_epoch
        self.flags = flags  # pi.FLAG_* written into every segment (a cluster tier behind)
        self.enabled = enabled and sys.byteorder == "little" and seals_future_writes()
        self.idle_retire_s = idle_retire_s
        self.background_from = background_from
        self._clock = clock
        self._stamp_clock = stamp_clock
        self._all: dict[int, Publisher] = {}
        self._dirty: set[Publisher] = set()
        self._readers: dict[int, int] = {}  # namespace id -> index channels reading it
        self._idle_since: dict[int, float] = {}  # published namespaces nobody reads
        self.builds = 0

    def handout(self, ns: NamespaceState) -> tuple[int, int, int]:
        if not self.enabled:
            raise OSError(
                "published indexes are disabled on this daemon (publish_index, or "
                "the kernel cannot seal a segment against writes)"
            )
        self.flush()  # (a failure drops that publisher here, and a new one is built below)
        pub = ns.ready.publisher
        if pub is None:
            pub = Publisher(
                ns,
                self.boot_epoch,
                self._dirty,
                self.flags,
                background_from=self.background_from,
                stamp_clock=self._stamp_clock,
            )
            self.builds += 1
            ns.ready.publisher = pub
            self._all[ns.id] = pub
            if not self._readers.get(ns.id):
                self._idle_since[ns.id] = self._clock()
        return pub.handout()

    def hold(self, namespace_id: int, delta: int) -> None:
        """A reader (a client's index channel) starts (+1) or stops (-1) reading a namespace's
        index; one that nobody reads is retired once idle for ``idle_retire_s``."""
        n = self._readers.get(namespace_id, 0) + delta
        if n > 0:
            self._readers[namespace_id] = n
            self._idle_since.pop(namespace_id, None)
        else:
            self._readers.pop(namespace_id, None)
            if namespace_id in self._all:
                self._idle_since[namespace_id] = self._clock()

    def reading(self, namespace_id: int) -> bool:
        """Whether a client's index channel reads this namespace's index."""
        return self._readers.get(namespace_id, 0) > 0

    def forget(self, ns: NamespaceState) -> None:
        """``ns`` is no longer registered: its index (if any) goes."""
        pub = ns.ready.publisher
        if pub is not None:
            self._drop(pub)
        self._idle_since.pop(ns.id, None)

    def _drop(self, pub: Publisher) -> None:
        self._dirty.discard(pub)
        pub.close()  # retired: its clients look up over gRPC, then ask for a new one
        pub.ns.ready.publisher = None
        self._all.pop(pub.ns.id, None)
        self._idle_since.pop(pub.ns.id, None)

    def flush(self) -> None:
        """Publish every pending change (after each RPC, and each tick for background ones)."""
        while self._dirty:
            pub = self._dirty.pop()
            try:
                pub.flush()
            except Exception:  # noqa: BLE001  (never the RPC's failure: this index goes instead)
                log.exception("namespace %d: published index dropped", pub.ns.id)
                self._drop(pub)

    def tick(self) -> None:
        """Pending changes, the liveness stamp of every live segment, idle ones retired
        (every ``STAMP_INTERVAL_S``)."""
        self.flush()
        now, mono = self._stamp_clock(), self._clock()
        for ns_id, pub in list(self._all.items()):
            idle = self._idle_since.get(ns_id)
            if (
                (pub.segment is None and pub.building is None)
                or pub.ns.ready.publisher is not pub
                or (idle is not None and mono - idle >= self.idle_retire_s)
            ):
                self._drop(pub)
                continue
            if pub.segment is not None:
                pub.segment.stamp(now)

    def figures(self) -> dict[str, int]:
        segs = [p.segment for p in self._all.values() if p.segment is not None]
        return {
            "published_indexes": len(segs),
            "published_index_building": sum(p.building is not None for p in self._all.values()),
            "published_index_bytes": sum(s.size for s in segs),
            "published_index_left_out": sum(s.left_out for s in segs),
            "published_index_builds": self.builds,
        }

    def close(self) -> None:
        for pub in list(self._all.values()):
            self._drop(pub)

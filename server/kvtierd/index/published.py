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

A namespace of ``background_from`` keys or more (default 32,768) is built on a thread of its
own, so a big build (about 1.4 s per million keys on a loaded 2-core machine) never stalls the
event loop: the thread fills a new segment from a snapshot of the keys (a list copied on the
loop; the thread never touches the dict), the loop meanwhile keeps publishing changes into the
old segment (if any) and notes them for replay, and when the thread is done the loop flushes
what is pending into the old segment, replays onto the new one what changed since the snapshot
(checking each key, so none is there twice), and swaps them. Until a namespace's first segment
is built, a handout is refused and its clients look up over gRPC (they ask again in a second).

Ownership and concurrency: the event-loop thread is the only writer of a live segment (ReadyMap
is changed only there); a build thread writes only its new segment, which no one sees until the
loop installs it; readers are other processes, lock-free (8-byte slot stores, see the contract
module).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvtier_contract import published_index as pi
from kvtierd.index.segment import Segment, _future_write_seal

__all__ = ["BACKGROUND_FROM", "NamespaceState", "Publisher", "Publishers", "ReadyMap", "Segment"]

log = logging.getLogger("kvtierd.index")


class NamespaceState(Protocol):
    """What a publisher needs of a namespace (kvtierd.index.entry.NamespaceState)."""

    id: int
    ready: ReadyMap


_VECTORIZE_FROM = 48  # pending changes of one kind from which a flush goes vectorized
BACKGROUND_FROM = 32768  # keys from which a segment is built on a thread (off the event loop)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Publisher:
    """The published index of one namespace (``ns.ready.publisher``). Event-loop thread only,
    but for ``building``, which a build thread fills (see the module docstring)."""

    def __init__(self, ns: NamespaceState, boot_epoch: int, dirty: set[Publisher],
                 flags: int = 0, *, background_from: int = BACKGROUND_FROM,
                 stamp_clock: Callable[[], int] = time.monotonic_ns) -> None:
        """``stamp_clock``: the liveness stamp's clock (monotonic ns; readers compare it with
        theirs through the offset they saw at mapping time)."""
        self.ns = ns
        self.stamp_clock = stamp_clock
        self.boot_epoch = boot_epoch
        self.flags = flags
        self.generation = 0
        self.pending: dict[bytes, bool] = {}
        self.dirty = dirty
        self.background_from = background_from
        self.building: Segment | None = None  # filled by a build thread, installed on the loop
        self.replay: dict[bytes, bool] = {}  # changes since the building segment's snapshot
        self.segment: Segment | None = None
        if not self._build_in_background():
            self.segment = self._build()

    def _build_in_background(self) -> bool:
        """Start a build thread for a big namespace (only under a running event loop, which
        installs the result); False: build it here."""
        loop = _running_loop()
        if loop is None or len(self.ns.ready) < self.background_from:
            return False
        keys = list(self.ns.ready)  # a copy of the key pointers: the thread never reads the dict
        seg = Segment(self.ns.id, self.boot_epoch, self.generation + 1,
                      pi.capacity_for(len(keys)), self.flags)
        self.building, self.replay = seg, {}

        def fill() -> None:
            error: BaseException | None = None
            try:
                seg.fill(keys, len(keys))
            except BaseException as e:  # noqa: BLE001  (reported to the loop, which logs it)
                error = e
            try:
                loop.call_soon_threadsafe(self._built, seg, error)
            except RuntimeError:  # the loop is closed (shutdown): nobody will install it
                seg.retire()

        threading.Thread(target=fill, name=f"kvtier-index-build-{self.ns.id:x}",
                         daemon=True).start()
        return True

    def _built(self, seg: Segment, error: BaseException | None) -> None:
        """On the loop: install the segment a build thread filled (see the module docstring)."""
        if self.building is not seg:  # closed (or dropped) meanwhile
            seg.retire()
            return
        self.building = None
        replay, self.replay = self.replay, {}
        if error is not None:
            seg.retire()
            log.warning("namespace %d: published index not built (%s); its clients look up "
                        "over gRPC", self.ns.id, error)
            if self.segment is None:
                self.ns.ready.publisher = None  # the registry drops it at its next tick
            return
        self._publish(self.pending)  # into the old segment: nothing is pending for the new one
        self.pending = {}
        for key, present in replay.items():
            found = seg._find(key) >= 0
            if present and not found:
                seg.insert(key)
            elif found and not present:
                seg.remove(key)
        seg.stamp(self.stamp_clock())
        old, self.segment = self.segment, seg
        self.generation = seg.generation
        if old is not None:
            old.retire()
        if (seg.keys + seg.tombstones) * pi.LOAD_DIVISOR > seg.capacity:
            self._rebuild()  # it grew past half full while it was built

    def _build(self) -> Segment:
        """A new segment holding ``ns.ready`` as it is now (pending changes included), built
        here."""
        n = len(self.ns.ready)
        seg = Segment(self.ns.id, self.boot_epoch, self.generation + 1, pi.capacity_for(n),
                      self.flags)
        try:
            seg.fill(self.ns.ready.keys(), n)
        except BaseException:
            seg.retire()
            raise
        self.generation += 1
        self.pending = {}
        seg.stamp(self.stamp_clock())
        return seg

    def note(self, key: bytes, present: bool) -> None:
        """A change of ``ns.ready``, published at the next ``flush``. ReadyMap notes only real
        changes, so a key added and removed (or removed and added back) since the last flush
        cancels out: whatever is pending differs from the table."""
        if self.building is not None:
            self.replay[key] = present
        p = self.pending
        if key in p:
            del p[key]
        else:
            p[key] = present
            self.dirty.add(self)

    def flush(self) -> None:
        """Publish the pending changes: one by one when few, vectorized when many."""
        pending, self.pending = self.pending, {}
        seg = self.segment
        if not pending or seg is None:
            return
        self._publish(pending)
        if self.building is None and \
                (seg.keys + seg.tombstones) * pi.LOAD_DIVISOR > seg.capacity:
            self._rebuild()

    def _publish(self, pending: dict[bytes, bool]) -> None:
        """Apply ``pending`` to the live segment (none: nothing to do)."""
        seg = self.segment
        if not pending or seg is None:
            return
        gone = [k for k, present in pending.items() if not present]
        new = [k for k, present in pending.items() if present]
        if len(gone) < _VECTORIZE_FROM:
            for k in gone:
                seg.remove(k)
        else:
            seg.remove_many(gone)
        if len(new) < _VECTORIZE_FROM:
            for k in new:
                seg.insert(k)
        elif new:
            seg.insert_many(new)

    def _rebuild(self) -> None:
        """A new generation sized for the keys now; the old one says retired (clients that read
        it get the new fd on their next lookup). A big namespace is rebuilt on a thread while
        the old segment keeps answering. If no new segment can be made (out of memory or
        descriptors), the old one is retired anyway: lookups go over gRPC."""
        old = self.segment
        try:
            if self._build_in_background():
                return
            self.segment = self._build()
        except OSError as e:
            log.warning("namespace %d: published index not rebuilt (%s); its clients look up "
                        "over gRPC", self.ns.id, e)
            self.segment = None
            self.ns.ready.publisher = None
        if old is not None:
            old.retire()

    def handout(self) -> tuple[int, int, int]:
        """A new read-only descriptor of the current segment (the caller closes it), its size
        and generation (flushed first by ``Publishers.handout``)."""
        seg = self.segment
        if seg is None:
            raise OSError("no published index yet (being built: ask again)"
                          if self.building is not None else
                          "no published index (it could not be rebuilt)")
        fd = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return fd, seg.size, self.generation

    def close(self) -> None:
        self.building = None  # a build thread still running retires its segment when done
        self.replay = {}
        if self.segment is not None:
            self.segment.retire()
            self.segment = None


class Publishers:
    """Every published index of one daemon (namespaces that a client asked for).

    Event-loop thread only. ``enabled`` False: handout refuses (config ``publish_index``, a
    big-endian host, or a kernel without ``F_SEAL_FUTURE_WRITE``: a segment a client could
    write is not published). Readers are counted per namespace id (``hold``), so they outlive
    a publisher dropped and built again; a namespace nobody has read for ``idle_retire_s`` is
    retired at the next tick (the grace keeps a client that reconnects from costing a build
    each time)."""

    def __init__(self, boot_epoch: int, enabled: bool = True, *,
                 idle_retire_s: float = 30.0, clock: Any = time.monotonic,
                 flags: int = 0, background_from: int = BACKGROUND_FROM,
                 stamp_clock: Callable[[], int] = time.monotonic_ns) -> None:
        """``clock``: idle time (s); ``stamp_clock``: the segments' liveness stamps (ns)."""
        self.boot_epoch = boot_epoch
        self.flags = flags  # pi.FLAG_* written into every segment (a cluster tier behind)
        self.enabled = enabled and sys.byteorder == "little" and _future_write_seal()
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
            raise OSError("published indexes are disabled on this daemon (publish_index, or "
                          "the kernel cannot seal a segment against writes)")
        self.flush()  # (a failure drops that publisher here, and a new one is built below)
        pub = ns.ready.publisher
        if pub is None:
            pub = Publisher(ns, self.boot_epoch, self._dirty, self.flags,
                            background_from=self.background_from, stamp_clock=self._stamp_clock)
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
            if (pub.segment is None and pub.building is None) or pub.ns.ready.publisher \
                    is not pub or (idle is not None and mono - idle >= self.idle_retire_s):
                self._drop(pub)
                continue
            if pub.segment is not None:
                pub.segment.stamp(now)

    def figures(self) -> dict[str, int]:
        segs = [p.segment for p in self._all.values() if p.segment is not None]
        return {"published_indexes": len(segs),
                "published_index_building": sum(p.building is not None
                                                for p in self._all.values()),
                "published_index_bytes": sum(s.size for s in segs),
                "published_index_left_out": sum(s.left_out for s in segs),
                "published_index_builds": self.builds}

    def close(self) -> None:
        for pub in list(self._all.values()):
            self._drop(pub)




class ReadyMap(dict[bytes, Any]):
    """``NamespaceState.ready``: a dict whose every change reaches the namespace's publisher.

    Reads are the plain dict's (C speed: ``map(ready.get, keys)``); only ``[k] = e``, ``pop``
    and ``del`` are allowed to change it, each forwarded when a publisher is attached."""

    __slots__ = ("publisher",)

    def __init__(self) -> None:
        super().__init__()
        self.publisher: Publisher | None = None

    def __setitem__(self, key: bytes, value: Any) -> None:
        new = key not in self
        super().__setitem__(key, value)
        if new and self.publisher is not None:
            self.publisher.note(key, True)

    def __delitem__(self, key: bytes) -> None:
        super().__delitem__(key)
        if self.publisher is not None:
            self.publisher.note(key, False)

    def pop(self, key: bytes, *default: Any) -> Any:
        had = key in self
        value = super().pop(key, *default)
        if had and self.publisher is not None:
            self.publisher.note(key, False)
        return value

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise TypeError("ReadyMap changes only through [k] = v, pop and del (the published "
                        "index follows those)")

    clear = update = setdefault = popitem = __ior__ = _refuse

"""One namespace's published index: its writer (:class:`Publisher`) and the dict that feeds it
(:class:`ReadyMap`, the namespace's READY keys). The registry of all of them, and the lifecycle:
:mod:`kvtierd.index.published` (which re-exports both).

A namespace of ``background_from`` keys or more (default 32,768) is built on a thread of its
own, so a big build (about 1.4 s per million keys on a loaded 2-core machine) never stalls the
event loop: the thread fills a new segment from a snapshot of the keys (a list copied on the
loop; the thread never touches the dict), the loop meanwhile keeps publishing changes into the
old segment (if any) and notes them for replay, and when the thread is done the loop flushes
what is pending into the old segment, replays onto the new one what changed since the snapshot
(checking each key, so none is there twice), and swaps them. Until a namespace's first segment
is built, a handout is refused and its clients look up over gRPC (they ask again in a second).

Ownership and concurrency: a Publisher owns its segments; the event-loop thread is the only
writer of a live segment (ReadyMap is changed only there, and notes each change with its
publisher); a build thread writes only its new segment, which no one sees until the loop
installs it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvtier_contract import published_index as pi
from kvtierd.index.segment import Segment

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

    def __init__(
        self,
        ns: NamespaceState,
        boot_epoch: int,
        dirty: set[Publisher],
        flags: int = 0,
        *,
        background_from: int = BACKGROUND_FROM,
        stamp_clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
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
        seg = Segment(
            self.ns.id, self.boot_epoch, self.generation + 1, pi.capacity_for(len(keys)), self.flags
        )
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

        threading.Thread(target=fill, name=f"kvtier-index-build-{self.ns.id:x}", daemon=True).start()
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
            log.warning(
                "namespace %d: published index not built (%s); its clients look up over gRPC",
                self.ns.id,
                error,
            )
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
        seg = Segment(self.ns.id, self.boot_epoch, self.generation + 1, pi.capacity_for(n), self.flags)
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
        if self.building is None and (seg.keys + seg.tombstones) * pi.LOAD_DIVISOR > seg.capacity:
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
            log.warning(
                "namespace %d: published index not rebuilt (%s); its clients look up over gRPC", self.ns.id, e
            )
            self.segment = None
            self.ns.ready.publisher = None
        if old is not None:
            old.retire()

    def handout(self) -> tuple[int, int, int]:
        """A new read-only descriptor of the current segment (the caller closes it), its size
        and generation (flushed first by ``Publishers.handout``)."""
        seg = self.segment
        if seg is None:
            raise OSError(
                "no published index yet (being built: ask again)"
                if self.building is not None
                else "no published index (it could not be rebuilt)"
            )
        fd = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDONLY | os.O_CLOEXEC)
        return fd, seg.size, self.generation

    def close(self) -> None:
        self.building = None  # a build thread still running retires its segment when done
        self.replay = {}
        if self.segment is not None:
            self.segment.retire()
            self.segment = None


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
        raise TypeError(
            "ReadyMap changes only through [k] = v, pop and del (the published index follows those)"
        )

    clear = update = setdefault = popitem = __ior__ = _refuse

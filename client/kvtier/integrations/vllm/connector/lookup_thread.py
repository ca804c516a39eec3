"""The planner's lookup thread: the one thread that talks to the daemon for vLLM's scheduler.

The scheduler thread (``Planner``) hands it tasks and collects outcomes, waiting for one only
within its per-step budget (``wait``)::

    submit(req_id, gen, variant, tokens)   hash the prompt, pinned lookup -> take(req_id, gen)
    wait(req_id, gen, timeout_s)            block until that answer is there (bounded), then take
    release(pins)                           unpin what a lookup pinned
    forget(req_id)                          the request is gone: its pins are released, whenever
                                            its lookup answers
    close()                                 after the tasks already queued; closes the backend

Its first task is the backend's ``warmup`` (open the session before the first request).
``take`` answers only the generation asked for; an outcome never taken is replaced by the
request's next one, its pins released. Lookups go before queued releases (a release only delays
the unpinning; a lookup delays a request's admission). A task that raises is logged and the
request misses: a bug here never reaches the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier.integrations.vllm.connector.config import Variant
from kvtier.results import TierFigure

log = logging.getLogger("vllm.kvtier")

Pin = tuple[int, int, int]  # (slice index, pin id, boot epoch)
# (slice index, parent key or None, token ids, offset of the first in the request) -> the keys of
# the token ids' full blocks, chained from the parent: pure hashing (no RPC), any thread.
KeyChain = Callable[[int, "bytes | None", Sequence[int], int], list[bytes]]


@dataclass(frozen=True)
class SharedScope:
    """A request's leading ``blocks`` are keyed in a group's scope (a prefix the group
    published, ``kvtier.prefixes``): they load from ``variant``'s namespace (the group's), and
    are stored there only when this engine's tenant is a ``publisher`` of the group."""

    blocks: int
    variant: Variant
    publisher: bool


@dataclass(frozen=True)
class LookupOutcome:
    """Answer of one background lookup: keys per slice, the hit prefix (minimum over slices),
    the tier of each hit (slice 0), the pins to release, and how to chain more keys on (the
    request's generated blocks; None: the keys of the looked-up tokens are all there is).
    ``shared``: the leading blocks keyed in a group's scope (None: every block is the
    request's own variant's)."""

    keys: list[list[bytes]]
    hits: int
    tiers: list[str]
    pins: list[Pin]
    chain: KeyChain | None = None
    shared: SharedScope | None = None


class Backend(Protocol):
    """The daemon as the lookup thread sees it (called from that thread only)."""

    def lookup(self, variant: Variant, token_ids: Sequence[int], *, promote: bool = True) -> LookupOutcome:
        """A pinned lookup; ``promote`` False: hold the hits only, start no promotion of those
        held below the host tier (``NamespaceHandle.lookup_pinned``)."""
        ...

    def release(self, pins: Sequence[Pin]) -> None: ...

    def warmup(self) -> None:
        """Connect and register ahead of the first request (the lookup thread's first task)."""

    # Optional: ``tier_figures() -> Mapping[str, TierFigure]``, callable from any thread without
    # an RPC (the daemon's per-tier load figures); ``LookupThread.tier_figures`` reads it. And
    # ``events() -> bool``, the same way: the daemon publishes KV events of the session's blocks.

    def close(self) -> None: ...


class LookupThread:
    """The one thread that talks to the daemon for the scheduler. Tasks in, outcomes out.

    Owns the thread and the backend (called from that thread only). The scheduler thread and
    this one share only the task queue, the result map and the forgotten set, under ``_cond``.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._cond = threading.Condition()
        self._tasks: deque[list[Pin] | str] = deque()  # the warmup, then releases
        self._lookups: deque[tuple[str, int, Variant, Sequence[int]]] = deque()
        self._results: dict[str, tuple[int, LookupOutcome]] = {}
        self._forgotten: set[str] = set()
        self._busy = False
        self._closed = False
        self.promote = True
        """Whether lookups start promoting hits held below the host tier (the scheduler thread
        sets it False while its decisions cut those tiers: no disk reads for blocks it will
        recompute). Read by the lookup thread per lookup; a stale value costs one promotion."""
        self._tasks.append("warmup")  # the first lookup must not pay for opening the session
        self._thread = threading.Thread(target=self._run, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, gen: int, variant: Variant, tokens: Sequence[int]) -> None:
        with self._cond:
            self._forgotten.discard(req_id)
            self._lookups.append((req_id, gen, variant, list(tokens)))
            self._cond.notify_all()

    def release(self, pins: list[Pin]) -> None:
        with self._cond:
            self._tasks.append(list(pins))
            self._cond.notify_all()

    def take(self, req_id: str, gen: int) -> LookupOutcome | None:
        with self._cond:
            got = self._results.get(req_id)
            if got is None or got[0] != gen:
                return None
            del self._results[req_id]
            return got[1]

    def wait(self, req_id: str, gen: int, timeout_s: float) -> LookupOutcome | None:
        """``take``, waiting at most ``timeout_s`` for the answer (the scheduler thread's bounded
        wait; the lookup thread runs meanwhile: the wait releases the GIL)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                got = self._results.get(req_id)
                if got is not None and got[0] == gen:
                    del self._results[req_id]
                    return got[1]
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)

    def forget(self, req_id: str) -> None:
        """The request is gone: drop its result, release the pins of a result still to come."""
        with self._cond:
            got = self._results.pop(req_id, None)
            if got is not None:
                if got[1].pins:
                    self._tasks.append(list(got[1].pins))
            else:
                self._forgotten.add(req_id)
            self._cond.notify_all()

    def events(self) -> bool:
        """Whether the daemon publishes KV events of this engine's blocks, as the backend's
        session was told at its open (any thread, no RPC); False without a session yet, or for a
        backend without ``events``."""
        told = getattr(self._backend, "events", None)
        return bool(told()) if told is not None else False

    def tier_figures(self) -> Mapping[str, TierFigure]:
        """The daemon's per-tier load figures as the backend's session last heard them (any
        thread: a read of what its heartbeats brought, never an RPC); empty when the backend
        has none (no session yet, or a backend without ``tier_figures``)."""
        figures = getattr(self._backend, "tier_figures", None)
        if figures is None:
            return {}
        try:
            return dict(figures())
        except Exception:  # figures are advice: never a reason to fail the scheduler
            log.exception("kvtier: reading the daemon's tier figures failed")
            return {}

    def pending(self) -> int:
        with self._cond:
            return len(self._tasks) + len(self._lookups) + int(self._busy)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._backend.close()

    def _run(self) -> None:
        while True:
            task = self._next_task()
            if task is None:
                return
            try:
                self._do(task)
            except Exception:  # a bug here must not kill the engine: that request misses
                log.exception("kvtier: lookup thread task failed")
            finally:
                with self._cond:
                    self._busy = False

    def _next_task(self) -> tuple[str, int, Variant, Sequence[int]] | list[Pin] | str | None:
        """The next task (lookups before queued releases, but never ahead of the warmup), or
        None once closed with nothing left; marks the thread busy."""
        with self._cond:
            while not self._tasks and not self._lookups and not self._closed:
                self._cond.wait()
            task: tuple[str, int, Variant, Sequence[int]] | list[Pin] | str
            if self._lookups and not (self._tasks and self._tasks[0] == "warmup"):
                task = self._lookups.popleft()
            elif self._tasks:
                task = self._tasks.popleft()
            else:
                return None
            self._busy = True
            return task

    def _do(self, task: tuple[str, int, Variant, Sequence[int]] | list[Pin] | str) -> None:
        if isinstance(task, list):
            self._backend.release(task)
            return
        if isinstance(task, str):
            warmup = getattr(self._backend, "warmup", None)
            if warmup is not None:
                warmup()
            return
        req_id, gen, variant, tokens = task
        outcome = (
            self._backend.lookup(variant, tokens)
            if self.promote
            else self._backend.lookup(variant, tokens, promote=False)
        )
        with self._cond:
            if req_id in self._forgotten:
                self._forgotten.discard(req_id)
                if outcome.pins:
                    self._tasks.append(list(outcome.pins))
            else:
                stale = self._results.get(req_id)
                if stale is not None and stale[1].pins:  # an older lookup never taken
                    self._tasks.append(list(stale[1].pins))
                self._results[req_id] = (gen, outcome)
                self._cond.notify_all()  # a scheduler thread may be waiting for it

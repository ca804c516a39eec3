"""Lookups without a round trip: the daemon's published indexes, mapped read-only.

Lifecycle (owned by a :class:`kvtier.connection.Connection`)::

    local = LocalIndexes()
    local.reset(shm_socket, session_id, boot_epoch, data_secret)   # each session (re)open
    hit = local.lookup(namespace_id, packed, n)       # int, or None: ask over gRPC instead
    tallies = local.take_tallies()                    # sent with the next heartbeat
    local.clear()                                     # session gone

The first lookup of a namespace starts a background fetch of that namespace's segment (a
read-only descriptor, from the daemon's shm socket, asked for with the session's id and data
secret) and goes over gRPC itself; a remote
client, whose shm socket is not there, stops asking for ``_RETRY_REMOTE_S``. A mapped segment
answers only while the daemon shows it is alive: the session's index channel (the connection
segments are fetched on, which the daemon keeps open while the session lives) is not closed
at its end, which a daemon that died or ended the session does at once; and its stamp is at
most ``STALE_AFTER_S`` old (a frozen daemon); and only while it is not retired and of the
session's boot epoch. Otherwise ``lookup`` answers None and the caller asks over gRPC, which
also decides about a daemon that is away (the breaker). Layout and rules:
:mod:`kvtier_contract.published_index`.

A lookup here is advisory as every lookup is: it does not touch the eviction policy (the load
that follows does) and is counted in the namespace's Stats when the tallies reach the daemon.

Thread-safety: lookups from any thread without a lock (they read one immutable view; a
segment is replaced, never changed under a reader: the old mapping lives while a reader holds
it). Segments are fetched on a background thread, never on the caller's: the first lookup of a
namespace goes over gRPC and starts the fetch.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier_contract import published_index as pi
from kvtier_contract import wire

_RETRY_S = 1.0  # after a failed fetch of a namespace's segment
_RETRY_REMOTE_S = 30.0  # after finding no shm socket at all (a client on another host)
_FETCH_TIMEOUT_S = 5.0  # on the fetcher thread (a first build of a big namespace takes a while)


class Segment:
    """One mapped segment. Immutable for the client; the daemon writes slots and stamp."""

    __slots__ = ("map", "buckets", "bucket_mask", "epoch", "generation", "flags", "_offset", "_words")

    def __init__(self, m: mmap.mmap, clock: Callable[[], float]) -> None:
        magic, version, epoch, _ns, generation, capacity, _probe, flags, _, _ = pi.HEADER.unpack_from(m, 0)
        if (
            magic != pi.MAGIC
            or version != pi.VERSION
            or capacity & (capacity - 1)
            or capacity < pi.BUCKET
            or pi.segment_bytes(capacity) > len(m)
        ):
            raise ValueError("not a published index segment of this version")
        self.map = m
        self.buckets = np.frombuffer(m, dtype="<i8", count=capacity, offset=pi.HEADER_BYTES).reshape(
            -1, pi.BUCKET
        )
        self.bucket_mask = capacity // pi.BUCKET - 1
        self.epoch = epoch
        self.generation = generation
        self.flags = flags
        self._words = memoryview(m)[: pi.HEADER_BYTES].cast("Q")  # the header's u64 words
        stamp, _ = self.stamp_ns()
        self._offset = clock() - stamp / 1e9  # our clock minus the daemon's, give or take a tick

    def stamp_ns(self) -> tuple[int, bool]:
        """(the daemon's stamp in ns, retired): each word one aligned 8-byte load, as the daemon
        writes it with one aligned store, so never a stamp half-written (a byte-wise ``struct``
        read could see one, or the 0 of a daemon's ``pack_into``, and take the index for stale)."""
        words = self._words
        retired = words[pi.RETIRED_WORD] != 0
        return words[pi.STAMP_WORD], retired

    def state(self, now: float) -> str:
        """ "ok", "stale" (the daemon's stamp is older than ``STALE_AFTER_S``) or "retired".

        The stamp is the daemon's monotonic clock; ours is compared through the offset seen at
        mapping time (the daemon answered then, so its stamp was fresh), so a clock namespace
        between the two processes changes nothing."""
        stamp, retired = self.stamp_ns()
        if retired:
            return "retired"
        if now - self._offset - stamp / 1e9 > pi.STALE_AFTER_S:
            return "stale"
        return "ok"

    def hits(self, packed: bytes, n: int) -> int:
        """Length of the prefix of the ``n`` packed keys found in the table."""
        if not n:
            return 0
        # int64 views: the same bits as the daemon's u64 slots, and indexes numpy takes as is
        raw = np.frombuffer(packed, dtype="<i8", count=4 * n).reshape(n, 4)
        fp = raw[:, 0] | pi.FP_BIT
        home = raw[:, 1] & self.bucket_mask
        rows = self.buckets.take(home, axis=0)  # (n, BUCKET): each key's home bucket, one gather
        found = _any4(rows == fp[:, None])
        if found.all():  # nearly always for a chain that is all there
            return n
        miss = np.flatnonzero(~found)  # absent, or in a later bucket (its home one full)
        empty = _any4(rows.take(miss, axis=0) == pi.EMPTY)
        buckets, bmask = self.buckets, self.bucket_mask
        for i, e in zip(miss.tolist(), empty.tolist(), strict=True):  # the first absent ends it
            if e:
                return i
            key_fp, b = int(fp[i]), int(home[i])
            for _ in range(pi.MAX_PROBE - 1):  # a full home bucket: the next ones (rare)
                b = (b + 1) & bmask
                row = buckets[b].tolist()
                if key_fp in row:
                    break
                if pi.EMPTY in row:
                    return i
            else:
                return i
        return n


def _any4(rows: np.ndarray) -> np.ndarray:
    """Per row of an (n, 4) bool array: any True (one u32 per row; ~8x faster than any(1))."""
    out: np.ndarray = rows.view(np.uint32).ravel() != 0
    return out


@dataclass
class Tally:
    lookups: int = 0
    blocks_requested: int = 0
    blocks_hit: int = 0


class LocalIndexes:
    """The published indexes of one session's namespaces (see the module docstring).

    State: ``_view`` = (session id, boot epoch, shm socket path, index channel, segments),
    replaced whole (never changed in place) under ``_lock`` by ``reset``/``clear``, by the
    fetcher installing a segment and by a lookup that finds the channel closed; lookups read it
    without the lock. A segment is used only with the channel it came on. Fetches run on one
    short-lived ``kvtier-index`` thread at a time, never on the caller's: a lookup that finds no
    segment starts one and goes over gRPC this time."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, fetch_timeout_s: float = _FETCH_TIMEOUT_S
    ) -> None:
        self._clock = clock
        self._fetch_timeout_s = fetch_timeout_s
        self._lock = threading.Lock()
        self._view = _View()
        self._fetching = False  # a fetcher thread runs (under _lock)
        self._next_try: dict[int, float] = {}  # namespace -> when to ask again (-1: the socket)
        self._tallies: dict[int, Tally] = {}
        self._tally_lock = threading.Lock()
        self.fetched = 0

    def reset(self, shm_socket: str, session_id: int, boot_epoch: int, data_secret: bytes) -> None:
        """A session opened: forget every segment of an older one (another boot, maybe).
        ``data_secret``: the session's (OpenSessionReply), sent with every index request."""
        with self._lock:
            old = self._view
            if boot_epoch != old.epoch:
                with self._tally_lock:
                    self._tallies = {}
            self._view = _View(session_id, boot_epoch, shm_socket, secret=data_secret)
            self._next_try = {}
        old.close()

    def clear(self) -> None:
        with self._lock:
            old, self._view = self._view, _View(epoch=self._view.epoch)
        old.close()

    def lookup(self, namespace_id: int, packed: bytes, n: int, *, tally: bool = True) -> int | None:
        """Hit prefix of ``n`` packed keys, or None (no usable segment: ask over gRPC).
        ``tally`` False: not counted in the daemon's Stats (a probe that a counted lookup
        follows)."""
        view = self._view
        if not view.session or not view.path:
            return None
        seg = view.segments.get(namespace_id)
        if seg is None or view.channel is None:
            self._fetch_soon(namespace_id)
            return None
        alive = _peek(view.channel)
        if alive is None:
            return None  # bytes of a reply in flight: the fetcher reads them
        if not alive:  # closed: the daemon died or ended our session
            self._drop(view)
            return None
        state = seg.state(self._clock())
        if state == "retired":
            self._fetch_soon(namespace_id)
            return None
        if state == "stale":
            return None
        hit = seg.hits(packed, n)
        if hit < n and seg.flags & pi.FLAG_SHARED_TIER:
            return None  # the daemon's cluster tier may hold the rest: ask it
        if not tally:
            return hit
        with self._tally_lock:
            t = self._tallies.get(namespace_id)
            if t is None:
                t = self._tallies[namespace_id] = Tally()
            t.lookups += 1
            t.blocks_requested += n
            t.blocks_hit += hit
        return hit

    def take_tallies(self) -> dict[int, Tally]:
        with self._tally_lock:
            out, self._tallies = self._tallies, {}
        return {k: v for k, v in out.items() if v.blocks_requested}

    def _drop(self, view: _View) -> None:
        """``view``'s channel closed: a new one (and new segments) on the next fetch."""
        with self._lock:
            if self._view is not view:
                return
            self._view = _View(view.session, view.epoch, view.path, secret=view.secret)
        view.close()

    def _fetch_soon(self, namespace_id: int) -> None:
        now = self._clock()
        if now < self._next_try.get(namespace_id, 0.0) or now < self._next_try.get(-1, 0.0):
            return
        with self._lock:
            if self._fetching:
                return
            self._fetching = True
        threading.Thread(target=self._fetch, args=(namespace_id,), daemon=True, name="kvtier-index").start()

    def _fetch(self, namespace_id: int) -> None:
        """On the fetcher thread: the namespace's segment, on the view's channel."""
        try:
            view = self._view
            ch = view.channel
            try:
                if ch is None:
                    ch = _connect(view.path, self._fetch_timeout_s)
                seg = _ask(ch, view.session, view.secret, namespace_id, self._fetch_timeout_s, self._clock)
            except FileNotFoundError:  # no such socket here: the daemon is on another host
                self._next_try[-1] = self._clock() + _RETRY_REMOTE_S
                return
            except (OSError, ValueError, struct.error) as e:
                self._next_try[namespace_id] = self._clock() + _RETRY_S
                if ch is view.channel:
                    if not isinstance(e, _Refused):  # (a refusal leaves the channel usable)
                        self._drop(view)
                elif ch is not None:
                    ch.close()
                return
            with self._lock:
                ok = self._view is view and seg.epoch == view.epoch
                if ok:
                    self._view = view.with_segment(ch, namespace_id, seg)
                    self.fetched += 1
            if not ok and ch is not view.channel:
                ch.close()  # (the session changed meanwhile: this one is of no use)
        finally:
            with self._lock:
                self._fetching = False


class _Refused(ValueError):
    """The daemon refused one index request (the channel stays usable)."""


@dataclass(frozen=True)
class _View:
    """One session's channel and segments; immutable (LocalIndexes swaps whole views)."""

    session: int = 0
    epoch: int = 0
    path: str = ""  # the daemon's shm socket
    channel: socket.socket | None = None
    segments: dict[int, Segment] = field(default_factory=dict)
    secret: bytes = b""  # the session's data secret, in every index request

    def with_segment(self, ch: socket.socket, namespace_id: int, seg: Segment) -> _View:
        return _View(
            self.session, self.epoch, self.path, ch, {**self.segments, namespace_id: seg}, self.secret
        )

    def close(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(OSError):
                self.channel.close()


def _peek(ch: socket.socket) -> bool | None:
    """True: open; False: closed at the daemon's end; None: bytes waiting (a reply in flight)."""
    try:
        return None if ch.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _connect(path: str, timeout_s: float) -> socket.socket:
    ch = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        ch.settimeout(timeout_s)
        ch.connect(path)
        ch.setblocking(False)  # lookups peek at it; a fetch waits with select
    except OSError:
        ch.close()
        raise
    return ch


def _ask(
    ch: socket.socket,
    session_id: int,
    secret: bytes,
    namespace_id: int,
    timeout_s: float,
    clock: Callable[[], float],
) -> Segment:
    """One index request on an index channel; _Refused when the daemon said no."""
    ch.send(pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, session_id, namespace_id, secret))
    if not select.select([ch], [], [], timeout_s)[0]:
        raise TimeoutError("no index reply in time")
    msg, fds, _flags, _addr = socket.recv_fds(ch, 4096, 1)
    try:
        if msg[:4] == wire.SHM_REFUSED:  # this namespace only; the channel stays open
            raise _Refused(msg[4:].decode(errors="replace"))
        if len(msg) != pi.INDEX_REPLY.size or msg[:4] != pi.INDEX_MAGIC or len(fds) != 1:
            raise ValueError("bad index handshake reply")  # (or b"": closed)
        _, size, _epoch, _gen = pi.INDEX_REPLY.unpack_from(msg)
        if size < pi.HEADER_BYTES or size != os.fstat(fds[0]).st_size:
            raise ValueError("index segment size disagrees with its descriptor")
        m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    try:
        return Segment(m, clock)
    except (ValueError, struct.error):
        m.close()
        raise

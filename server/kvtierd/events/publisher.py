"""The KV-event publisher: one thread that turns queued records into vLLM ``KVEventBatch``es
and sends them on ZMQ PUB sockets, with a replay buffer and a ROUTER socket per stream.

Streams (docs/events.md): the **operator** stream (``events_endpoint``) carries every block;
a **tenant** stream (``events_tenant_endpoint``, a template with ``{tenant}``, ipc:// only)
carries one tenant's blocks and nothing else, on a socket of its own. Each stream has its own
sequence numbers and its own bounded replay buffer of ``buffer_batches`` messages. A stream's
first message is ``AllBlocksCleared`` and its first seq the wall clock in microseconds when it
was made, not 0: a restart is then a forward gap to a subscriber that was following the old
daemon, and the replay it asks for from its next expected seq is the new stream from its
start (AllBlocksCleared, then the NVMe recovery) while that is still buffered.

Lifecycle: ``start()`` (the caller's thread: binds the operator stream and the tenants named
then, under the caller's umask) -> the thread runs -> ``close()`` (sends what is queued, up to a
deadline, then closes the sockets). A tenant stream not bound at start (a tenant added by a
reload) is bound by the thread when its first block comes, then chmod'ed to ``socket_mode``.

Owns the ZMQ context's sockets (the thread alone uses them once started) and the replay
buffers; reads records from :class:`~kvtierd.events.sink.EventQueue`. pyzmq and msgpack (the
``events`` extra) are imported here, lazily by the composition root.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtierd.events.sink import EventQueue, Record
from kvtierd.events.wire import END_SEQ, SEQ, Cleared, Event, Removed, Stored, encode_batch, unpack_tokens

if TYPE_CHECKING:
    from kvtierd.index import Entry

log = logging.getLogger("kvtierd.events")
MAX_EVENTS_PER_BATCH = 1024  # one payload stays well below a MiB of keys
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class EventSettings:
    """What the daemon's configuration says about events (kvtierd.config: ``events_*``)."""

    endpoint: str = ""
    """Operator PUB endpoint ("" = no operator stream)."""
    replay_endpoint: str = ""
    tenant_endpoint: str = ""
    """Template with ``{tenant}`` for per-tenant PUB endpoints ("" = none)."""
    tenant_replay_endpoint: str = ""
    topic: str = ""
    buffer_batches: int = 10_000
    socket_mode: int = 0o600
    hwm: int = 100_000


@dataclass(eq=False)
class _Stream:
    name: str  # "" for the operator stream, else the tenant
    pub: Any
    replay: Any | None
    buffer: deque[tuple[int, bytes]]
    seq: int = 0
    events: list[Event] = field(default_factory=list)


def check_dependencies() -> None:
    """ValueError naming ``events_endpoint`` when pyzmq or msgpack is missing."""
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"events_endpoint: KV events need pyzmq and msgpack (pip install 'kvtierd[events]'): {e}"
        ) from None


def tenant_endpoint(template: str, tenant: str) -> str | None:
    """``template`` for ``tenant``; None when the name cannot be put in a path."""
    if not _TENANT_NAME.fullmatch(tenant) or tenant in (".", ".."):
        return None
    return template.replace("{tenant}", tenant)


class EventPublisher:
    """See the module docstring. ``figures()`` may be read from any thread."""

    def __init__(self, settings: EventSettings, queue: EventQueue) -> None:
        import zmq

        self._zmq = zmq
        self.settings = settings
        self.queue = queue
        self._ctx = zmq.Context()
        self._streams: dict[str, _Stream] = {}  # "" (operator) or tenant -> stream
        self._refused: set[str] = set()  # tenants whose endpoint could not be made
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.events_published = 0
        self.batches_published = 0
        self.replay_requests = 0
        self.send_errors = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, tenants: Sequence[str] = ()) -> None:
        """Bind the operator stream and those of ``tenants`` (ValueError naming the setting
        when an endpoint cannot be bound), then start the thread."""
        s = self.settings
        if s.endpoint:
            self._streams[""] = self._open("", s.endpoint, s.replay_endpoint, "events_endpoint")
        if s.tenant_endpoint:
            for t in tenants:
                self._tenant_stream(t, strict=True)
        self._thread = threading.Thread(target=self._run, name="kvtierd-events", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close every socket."""
        self._stop.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            for st in self._streams.values():
                st.pub.close(linger=0)
                if st.replay is not None:
                    st.replay.close(linger=0)
            self._ctx.term()

    def figures(self) -> dict[str, int]:
        return {
            "events_published": self.events_published,
            "event_batches_published": self.batches_published,
            "event_blocks_dropped": self.queue.dropped_blocks,
            "event_replay_requests": self.replay_requests,
            "event_blocks_queued": self.queue.queued_blocks,
            "event_streams": len(self._streams),
        }

    # -- sockets ----------------------------------------------------------------------------------

    def _open(self, name: str, endpoint: str, replay_endpoint: str, setting: str) -> _Stream:
        zmq = self._zmq
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.settings.hwm)
        replay = None
        try:
            self._bind(pub, endpoint)
            if replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                self._bind(replay, replay_endpoint)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise ValueError(
                f"{setting}: cannot bind {endpoint}{' / ' + replay_endpoint if replay_endpoint else ''}: {e}"
            ) from None
        st = _Stream(
            name, pub, replay, deque(maxlen=self.settings.buffer_batches), seq=time.time_ns() // 1000
        )
        st.events.append(Cleared())  # every stream starts by saying "forget what you knew"
        return st

    def _bind(self, sock: Any, endpoint: str) -> None:
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):  # created under the caller's umask; then the mode
            os.chmod(endpoint.removeprefix("ipc://"), self.settings.socket_mode)

    def _tenant_stream(self, tenant: str, *, strict: bool = False) -> _Stream | None:
        st = self._streams.get(tenant)
        if st is not None or tenant in self._refused:
            return st
        s = self.settings
        pub = tenant_endpoint(s.tenant_endpoint, tenant)
        replay = tenant_endpoint(s.tenant_replay_endpoint, tenant) if s.tenant_replay_endpoint else ""
        try:
            if pub is None or replay is None:
                raise ValueError(
                    f"events_tenant_endpoint: tenant name {tenant!r} cannot be put "
                    "in an endpoint (letters, digits, '.', '_', '-' only)"
                )
            st = self._open(tenant, pub, replay, "events_tenant_endpoint")
        except ValueError as e:
            if strict:
                raise
            log.error("no KV-event stream for tenant %s: %s", tenant, e)
            self._refused.add(tenant)
            return None
        self._streams[tenant] = st
        return st

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            records = self.queue.take(0.0 if stopping else 0.02)
            try:
                self._serve_replays()
                self._route(records)
                self._send_all()
            except Exception:  # noqa: BLE001  (never let the thread die: log, count, go on)
                self.send_errors += 1
                log.exception("KV-event publisher error")
                time.sleep(0.05)
            if stopping and not records:
                return

    def _route(self, records: list[Record]) -> None:
        """Turn records into events on the streams that may see them."""
        operator = self._streams.get("")
        tenanted = bool(self.settings.tenant_endpoint)
        for kind, medium, entries in records:
            if kind == "cleared":
                for st in self._streams.values():
                    if not st.events or not isinstance(st.events[-1], Cleared):
                        st.events.append(Cleared())
                continue
            assert medium is not None
            for tenant, evs in _events(kind, medium, entries):
                if operator is not None:
                    _append(operator.events, evs)
                if tenanted and tenant is not None:
                    mine = self._tenant_stream(tenant)
                    if mine is not None:
                        _append(mine.events, evs)

    def _send_all(self) -> None:
        topic = self.settings.topic.encode()
        for st in self._streams.values():
            while st.events:
                chunk = st.events[:MAX_EVENTS_PER_BATCH]
                del st.events[:MAX_EVENTS_PER_BATCH]
                payload = encode_batch(time.time(), chunk)
                seq = SEQ.pack(st.seq)
                st.pub.send_multipart((topic, seq, payload))
                st.buffer.append((st.seq, payload))
                st.seq += 1
                self.events_published += len(chunk)
                self.batches_published += 1

    def _serve_replays(self) -> None:
        topic = self.settings.topic.encode()
        for st in self._streams.values():
            sock = st.replay
            while sock is not None and sock.poll(0):
                frame = sock.recv_multipart()
                self.replay_requests += 1
                if len(frame) != 3 or len(frame[2]) != 8:
                    log.debug("bad replay request (%d frames)", len(frame))
                    continue
                client, _, start = frame
                first = int.from_bytes(start, "big")
                for seq, payload in st.buffer:
                    if seq >= first:
                        sock.send_multipart((client, b"", topic, SEQ.pack(seq), payload))
                sock.send_multipart((client, b"", b"", END_SEQ, b""))


def _append(out: list[Event], evs: list[Event]) -> None:
    """``out += evs``, a removal joining the removal before it (same medium and tenant): one
    eviction is one record, and a burst of them one event."""
    for ev in evs:
        last = out[-1] if out else None
        if (
            isinstance(ev, Removed)
            and isinstance(last, Removed)
            and last.medium == ev.medium
            and last.tenant == ev.tenant
        ):
            out[-1] = Removed([*last.keys, *ev.keys], ev.medium, ev.tenant)
        else:
            out.append(ev)


def _events(kind: str, medium: Any, entries: list[Entry]) -> Iterator[tuple[str | None, list[Event]]]:
    """The events of one record, per tenant: removals as one list per tenant; stores as one
    ``BlockStored`` per chain (a block whose parent is the block before it joins it)."""
    if kind == "removed":
        by_tenant: dict[str | None, list[bytes]] = {}
        for e in entries:
            by_tenant.setdefault(e.ns.spec.tenant, []).append(e.key)
        for tenant, keys in by_tenant.items():
            yield tenant, [Removed(keys, medium, tenant)]
        return
    run: list[Entry] = []
    for e in entries:
        origin = e.origin
        if run and not (origin is not None and origin[0] == run[-1].key and e.ns is run[-1].ns):
            yield run[0].ns.spec.tenant, [_stored(run, medium)]
            run = []
        run.append(e)
    if run:
        yield run[0].ns.spec.tenant, [_stored(run, medium)]


def _stored(run: list[Entry], medium: Any) -> Stored:
    spec = run[0].ns.spec
    tpb = spec.tokens_per_block
    origin = run[0].origin
    tokens: list[int] = []
    if all(e.origin is not None and len(e.origin[1]) == 4 * tpb for e in run):
        for e in run:
            tokens.extend(unpack_tokens(e.origin[1]))  # type: ignore[index]  # (checked above)
    extra: tuple[str, ...] = tuple(v for v in (spec.adapter_id, spec.cache_salt) if v)
    return Stored(
        keys=[e.key for e in run],
        parent=origin[0] if origin is not None else None,
        token_ids=tokens,
        block_size=tpb,
        medium=medium,
        lora_name=spec.adapter_id,
        extra_keys=[extra] * len(run) if extra else None,
        tenant=spec.tenant,
    )

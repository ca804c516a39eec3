"""The KV-event publisher: one thread that turns queued records into vLLM ``KVEventBatch``es
and sends them on ZMQ XPUB sockets, with a replay buffer and a ROUTER socket per stream.

Streams (docs/events.md): the **operator** stream (``events_endpoint``) carries every block;
a **tenant** stream (``events_tenant_endpoint``, a template with ``{tenant}``, ipc:// only)
carries one tenant's blocks and nothing else, on a socket of its own. Each stream has its own
sequence numbers and its own replay buffer, bounded in bytes (:mod:`~kvtierd.events.replay`).
A stream's first message is ``AllBlocksCleared`` and its first seq the wall clock in
microseconds when it was made, not 0: a restart is then a forward gap to a subscriber that was
following the old daemon, and the replay it asks for from its next expected seq is the new
stream from its start (AllBlocksCleared, then the NVMe recovery) while that is still buffered.
A stream with nothing to send for ``heartbeat_s`` sends its last seq again with no events (not
buffered, the seq not advanced): a subscriber that has that seq skips it, one that joined or
reconnected since (a router after this daemon restarted) sees its gap at once and replays,
instead of crediting the old stream's blocks until the next store.

What it holds is bounded in bytes: the replay buffers (``stream_buffer_bytes`` each, a
tenant's at most its ``buffered_bytes`` quota, ``buffer_bytes`` together); a message is at
most ``max_message_bytes`` (batches split by bytes, a chain split in two where it must); each
socket queues at most ``send_hwm`` messages per peer, and takes at most ``max_peers`` peers
(:mod:`~kvtierd.events.gate`) and holds at most ``len(topic) + 1`` subscriptions per peer
(:mod:`~kvtierd.events.subscriptions`); a replay answer is at most ``replay_max_bytes`` and
never waits for a requester that does not read.

Lifecycle: ``start()`` (the caller's thread: binds the operator stream and the tenants named
then; ValueError naming the setting) -> the thread runs -> ``close()`` (sends what is queued, up
to a deadline, then closes the sockets and unlinks their files). ``add_tenants()`` (a reload,
the event loop) checks the new tenants' paths there and has the thread bind them; a tenant not
announced gets its stream with its first block. Sockets are private before they exist
(:mod:`~kvtierd.events.sockets`).

Owns the ZMQ context's sockets (the thread alone uses them once started), the gate and the
replay buffers; reads records from :class:`~kvtierd.events.sink.EventQueue`. pyzmq and msgpack
(the ``events`` extra) are imported here, lazily by the composition root.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtierd.events.gate import ConnectionGate
from kvtierd.events.records import append_events, events_of
from kvtierd.events.replay import ReplayBuffer, ReplayBuffers
from kvtierd.events.sink import EventQueue, Record
from kvtierd.events.sockets import Bound, SocketRules, bind, check_ipc_path, ipc_path, release
from kvtierd.events.subscriptions import SubscriptionFilter, subscription_max_bytes
from kvtierd.events.wire import END_SEQ, SEQ, BlockHashes, Cleared, Event, batch_payload, messages

log = logging.getLogger("kvtierd.events")
MAX_REQUEST_BYTES = 1024
"""Largest message a peer may send to a replay socket (a request is 8 bytes; a PUB socket's
limit: :func:`subscription_max_bytes`): a larger one closes its connection (ZMQ_MAXMSGSIZE)."""
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
    block_hashes: BlockHashes = "int64"
    """Block keys on the wire: vLLM's default int64 form, or whole (``events_block_hashes``)."""
    heartbeat_s: float = 0.0
    """An idle stream repeats its last seq, with no events, this often (0: never; the daemon's
    ``events_heartbeat_s`` is 2 s by default)."""
    buffer_batches: int = 10_000
    stream_buffer_bytes: int = 4 << 20
    buffer_bytes: int = 64 << 20
    max_message_bytes: int = 128 << 10
    replay_max_bytes: int = 1 << 20
    send_hwm: int = 16
    max_peers: int = 8
    rules: SocketRules = field(default_factory=SocketRules)
    private: bool = False
    """The daemon has tenants: every stream carries tenants' blocks, none may be exposed."""


@dataclass(eq=False)
class _Stream:
    name: str  # "" for the operator stream, else the tenant
    pub: Any
    replay: Any | None
    buffer: ReplayBuffer
    bound: list[Bound | None]
    seq: int = 0
    events: list[Event] = field(default_factory=list)
    sent_at: float = 0.0  # time.monotonic() of its last message (a heartbeat's too)


def check_dependencies() -> None:
    """ValueError naming ``events_endpoint`` when pyzmq or msgpack is missing."""
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "events_endpoint: KV events need pyzmq and msgpack (the kvtierd wheel's events extra, "
            f"pip install 'dist/kvtierd-<version>-py3-none-any.whl[events]'; README.md, Install): {e}"
        ) from None


def tenant_endpoint(template: str, tenant: str) -> str | None:
    """``template`` for ``tenant``; None when the name cannot be put in a path."""
    if not _TENANT_NAME.fullmatch(tenant) or tenant in (".", ".."):
        return None
    return template.replace("{tenant}", tenant)


class EventPublisher:
    """See the module docstring. ``figures()`` may be read from any thread; ``add_tenants``
    from the event loop (a lock hands the names to the thread)."""

    def __init__(self, settings: EventSettings, queue: EventQueue) -> None:
        import zmq

        self._zmq = zmq
        self.settings = settings
        self.queue = queue
        self._ctx = zmq.Context()
        self._gate = ConnectionGate(self._ctx, settings.max_peers)
        self._subs = SubscriptionFilter(settings.topic.encode())
        self._buffers = ReplayBuffers(settings.buffer_bytes)
        self._streams: dict[str, _Stream] = {}  # "" (operator) or tenant -> stream
        self._refused: set[str] = set()  # tenants whose endpoint could not be made
        self._caps: dict[str, int] = {}  # tenant -> its replay buffer's bytes, when announced
        self._announced: list[str] = []  # tenants a reload added, for the thread to bind
        self._lock = threading.Lock()  # guards _announced and _caps
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.events_published = 0
        self.batches_published = 0
        self.heartbeats = 0  # idle streams' repeats of their last seq (tests)
        self.replay_requests = 0
        self.replays_cut = 0
        self.send_errors = 0

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, tenants: Sequence[str] | Mapping[str, int] = ()) -> None:
        """Bind the operator stream and those of ``tenants`` (a mapping: each one's replay
        buffer bytes, at most ``stream_buffer_bytes``), ValueError naming the setting when an
        endpoint cannot be bound; then start the thread."""
        s = self.settings
        if isinstance(tenants, Mapping):
            self._caps.update(tenants)
        if s.endpoint:
            self._streams[""] = self._open("", s.endpoint, s.replay_endpoint, "events_endpoint")
        if s.tenant_endpoint:
            for t in tenants:
                self._tenant_stream(t, strict=True)
        self._thread = threading.Thread(target=self._run, name="kvtierd-events", daemon=True)
        self._thread.start()

    def add_tenants(self, caps: Mapping[str, int]) -> None:
        """Tenants a reload added (each with its replay buffer's bytes): their paths checked
        here (a refusal logged, naming the setting), their streams bound by the thread now."""
        s = self.settings
        for t, cap in caps.items():
            if not s.tenant_endpoint or t in self._streams:
                continue
            try:
                self._check_tenant(t)
            except ValueError as e:
                log.error("no KV-event stream for tenant %s: %s", t, e)
                continue
            with self._lock:
                self._caps[t] = cap
                self._announced.append(t)
        self.queue.wake()

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close every socket."""
        self._stop.set()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is None or not self._thread.is_alive():
            for st in self._streams.values():
                for sock in (st.pub, st.replay):
                    if sock is not None:
                        self._gate.forget(sock)
                        sock.close(linger=0)
                for b in st.bound:
                    release(b)
            self._gate.close()
            self._ctx.term()

    def figures(self) -> dict[str, int]:
        return {
            "events_published": self.events_published,
            "event_batches_published": self.batches_published,
            "event_blocks_dropped": self.queue.dropped_blocks,
            "event_replay_requests": self.replay_requests,
            "event_blocks_queued": self.queue.queued_blocks,
            "event_streams": len(self._streams),
            "event_buffered_bytes": self._buffers.held_bytes,
            "event_buffer_dropped_messages": self._buffers.dropped_messages,
            "event_replays_cut": self.replays_cut,
            "event_connections_refused": self._gate.refused,
            "event_subscriptions_dropped": self._subs.dropped,
        }

    # -- sockets ----------------------------------------------------------------------------------

    def _open(self, name: str, endpoint: str, replay_endpoint: str, setting: str) -> _Stream:
        zmq = self._zmq
        s = self.settings
        for ep in (endpoint, replay_endpoint):
            path = ipc_path(ep)
            if path is not None:
                check_ipc_path(path, setting, s.rules, private=s.private or bool(name))
        socks: list[Any] = []
        bound: list[Bound | None] = []
        try:
            for ep, kind in ((endpoint, zmq.XPUB), (replay_endpoint, zmq.ROUTER)):
                if ep:
                    sock = self._socket(kind, f"{'replay' if kind == zmq.ROUTER else 'pub'}:{name}")
                    socks.append(sock)
                    bound.append(bind(sock, ep, s.rules.mode))
        except (zmq.ZMQError, OSError) as e:
            for sock in socks:
                self._gate.forget(sock)
                sock.close(linger=0)
            for b in bound:
                release(b)
            raise ValueError(
                f"{setting}: cannot bind {endpoint}{' / ' + replay_endpoint if replay_endpoint else ''}: {e}"
            ) from None
        with self._lock:
            cap = min(s.stream_buffer_bytes, self._caps.get(name, s.stream_buffer_bytes))
        st = _Stream(
            name,
            socks[0],
            socks[1] if len(socks) > 1 else None,
            self._buffers.new(cap, s.buffer_batches),
            bound,
            seq=time.time_ns() // 1000,
        )
        st.events.append(Cleared())  # every stream starts by saying "forget what you knew"
        return st

    def _socket(self, kind: int, domain: str) -> Any:
        """An XPUB (subscriptions applied by the thread) or ROUTER socket: small queues, tiny
        requests, at most ``max_peers`` peers."""
        zmq = self._zmq
        sock = self._ctx.socket(kind)
        sock.set_hwm(self.settings.send_hwm)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full requester: EAGAIN, never a wait
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, subscription_max_bytes(self.settings.topic.encode()))
            sock.setsockopt(zmq.XPUB_MANUAL, 1)
        self._gate.watch(sock, domain)
        return sock

    def _endpoints(self, tenant: str) -> tuple[str, str]:
        """A tenant's PUB and replay endpoints; ValueError when its name cannot be in a path."""
        s = self.settings
        pub = tenant_endpoint(s.tenant_endpoint, tenant)
        replay = tenant_endpoint(s.tenant_replay_endpoint, tenant) if s.tenant_replay_endpoint else ""
        if pub is None or replay is None:
            raise ValueError(
                f"events_tenant_endpoint: tenant name {tenant!r} cannot be put "
                "in an endpoint (letters, digits, '.', '_', '-' only)"
            )
        return pub, replay

    def _check_tenant(self, tenant: str) -> None:
        """ValueError naming the setting when the tenant's stream may not be bound."""
        for ep in self._endpoints(tenant):
            path = ipc_path(ep)
            if path is not None:
                check_ipc_path(path, "events_tenant_endpoint", self.settings.rules, private=True)

    def _tenant_stream(self, tenant: str, *, strict: bool = False) -> _Stream | None:
        st = self._streams.get(tenant)
        if st is not None or tenant in self._refused:
            return st
        try:
            pub, replay = self._endpoints(tenant)
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
                self._gate.serve()
                self._bind_announced()
                self._serve_replays()
                self._route(records)
                self._send_all()
            except Exception:  # noqa: BLE001  (never let the thread die: log, count, go on)
                self.send_errors += 1
                log.exception("KV-event publisher error")
                time.sleep(0.05)
            if stopping and not records:
                return

    def _bind_announced(self) -> None:
        with self._lock:
            names, self._announced = self._announced, []
        for t in names:
            self._tenant_stream(t)

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
            for tenant, evs in events_of(kind, medium, entries):
                if operator is not None:
                    append_events(operator.events, evs)
                if tenanted and tenant is not None:
                    mine = self._tenant_stream(tenant)
                    if mine is not None:
                        append_events(mine.events, evs)

    def _send_all(self) -> None:
        topic = self.settings.topic.encode()
        now, beat = time.monotonic(), self.settings.heartbeat_s
        for st in self._streams.values():
            self._subs.serve(st.pub)  # subscriptions come in first: applied before this send
            events, st.events = st.events, []
            for encoded in messages(events, self.settings.max_message_bytes, self.settings.block_hashes):
                payload = batch_payload(time.time(), encoded)
                st.pub.send_multipart((topic, SEQ.pack(st.seq), payload))
                self._buffers.append(st.buffer, st.seq, payload)
                st.seq += 1
                st.sent_at = now
                self.events_published += len(encoded)
                self.batches_published += 1
            if beat and now - st.sent_at >= beat and st.seq:
                # the last seq again, no events: a subscriber behind it sees the gap now (counted
                # first: one who received it reads a count that holds it)
                self.heartbeats += 1
                st.pub.send_multipart((topic, SEQ.pack(st.seq - 1), batch_payload(time.time(), ())))
                st.sent_at = now

    def _serve_replays(self) -> None:
        """Answer waiting replay requests (at most 64 a socket a turn): the buffered messages
        from the asked seq, at most ``replay_max_bytes`` and one fewer than ``send_hwm`` (the
        end marker's room), then the end marker. A requester whose queue is full gets the rest
        cut (counted): it never holds more than ``send_hwm`` messages of the daemon's."""
        zmq = self._zmq
        s = self.settings
        topic = s.topic.encode()
        for st in self._streams.values():
            sock = st.replay
            for _ in range(64):
                if sock is None or not sock.poll(0):
                    break
                frame = sock.recv_multipart()
                self.replay_requests += 1
                if len(frame) != 3 or len(frame[2]) != 8:
                    log.debug("bad replay request (%d frames)", len(frame))
                    continue
                client, _, start = frame
                answer = st.buffer.since(int.from_bytes(start, "big"), s.replay_max_bytes, s.send_hwm - 1)
                try:
                    for seq, payload in answer:
                        sock.send_multipart((client, b"", topic, SEQ.pack(seq), payload), zmq.NOBLOCK)
                    sock.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                except zmq.ZMQError:  # EAGAIN: it reads nothing; EHOSTUNREACH: it left
                    self.replays_cut += 1

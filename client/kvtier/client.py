"""kvtier.Client: the engine's handle on a kvtierd daemon (sync flavour; kvtier.aio wraps it).

Lifecycle::

    client = Client.connect("unix:///run/kvtier.sock", transport="shm")   # never raises when
    ns = client.register(Namespace(...))                                # the daemon is away
    keys = ns.block_keys(token_ids); n = ns.lookup(keys)
    ns.put(keys, blocks); ns.get(keys); ns.get_into(keys, buffers)
    client.close()                       # or `with Client.connect(...) as client:`

Never hang the engine: every RPC has a deadline (``timeout_s``). When the daemon is down or
restarting, lookups answer 0, gets answer misses and puts are dropped, each counted in
``client.counters``; a circuit breaker waits ``backoff`` before trying again, then the client
reopens its session, re-registers its namespaces and reattaches its transport by itself (also
when a reply shows a new boot epoch). Caller mistakes (wrong block size, bad namespace) still
raise :class:`kvtier_contract.errors.InvalidArgument`.

Thread-safety: a Client may be shared by threads; control calls run concurrently, transfers on
the data channel are serialized by a lock, reconnects by another.

Size: this module is over the house limit on purpose: the breaker, the reconnect rules and the
batch operations that depend on them read best in one place.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from kvtier.buffers import byte_view
from kvtier.transports import DataTransport, make_transport
from kvtier_contract import errors
from kvtier_contract.identity import Namespace
from kvtier_contract.protoutil import to_dict
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

T = TypeVar("T")
TransportName = Literal["shm", "tcp", "cuda_ipc"]
_TRANSPORT_NAMES = ("shm", "tcp", "cuda_ipc")
_MAPPED = ("shm", "cuda_ipc")  # transports that map the arena (direct put_blocks/get_blocks)
_DOWN_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


class _Away(Exception):
    """The daemon is unreachable right now (internal: callers get misses and drops)."""


@dataclass
class PutResult:
    """What happened to each key of a put: stored, already there, refused for room, or dropped."""

    stored: int = 0
    already_present: int = 0
    rejected: int = 0
    dropped: int = 0

    def __iadd__(self, other: PutResult) -> PutResult:
        self.stored += other.stored
        self.already_present += other.already_present
        self.rejected += other.rejected
        self.dropped += other.dropped
        return self


@dataclass
class LookupResult:
    """A detailed lookup: the ready prefix, each hit's tier, and whether NVMe holds it durably."""

    hits: int
    tiers: list[str]  # "host" or "nvme", one per hit
    durable: list[bool]  # one per hit


@dataclass
class PinnedLookup:
    """A lookup whose hits stay pinned (not evictable) until ``Client.release(pin)``.

    ``pin`` is 0 when nothing was pinned (no hit, or the daemon was away); ``epoch`` is the boot
    epoch the pin belongs to (a restarted daemon has forgotten it)."""

    hits: int
    tiers: list[str]
    pin: int
    epoch: int


_TIER_NAMES = {pb.TIER_HOST: "host", pb.TIER_NVME: "nvme"}


@dataclass
class ClientCounters:
    lookups: int = 0
    lookups_failed: int = 0  # answered as a miss because the daemon was away
    puts_dropped: int = 0  # blocks not stored because the daemon was away
    gets_failed: int = 0  # get/get_into calls answered as misses because the daemon was away
    reconnects: int = 0
    epoch_changes: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    last_error: str = field(default="", repr=False)


def address_target(address: str) -> str:
    """``unix:///path`` stays, ``unix:path`` becomes absolute, ``host:port`` stays.

    ``unix://path`` (two slashes, relative) is refused: gRPC reads ``path``'s first part as an
    authority and fails later with a C-core message naming nothing."""
    if address.startswith("unix://"):
        if not address.startswith("unix:///"):
            raise errors.InvalidArgument(
                f"{address!r}: a Unix socket address is unix:///absolute/path or "
                "unix:relative/path", field="address")
        return address
    if address.startswith("unix:"):
        return "unix://" + os.path.abspath(address[5:])
    return address


class Client:
    """See the module docstring. Owns the gRPC channel, the session and the data transport."""

    def __init__(self, address: str, transport: TransportName = "shm", *, timeout_s: float = 1.0,
                 lease_ttl_s: float = 10.0, client_name: str = "", heartbeat: bool = True,
                 backoff_s: tuple[float, float] = (0.05, 2.0), tenant_key: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if transport not in _TRANSPORT_NAMES:
            raise errors.InvalidArgument(f"unknown transport {transport!r} (expected one of "
                                         f"{', '.join(_TRANSPORT_NAMES)})", field="transport")
        self.address = address_target(address)
        self.transport_name = transport
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.client_name = client_name or f"pid{os.getpid()}"
        self.tenant_key = tenant_key
        self.counters = ClientCounters()
        self._clock = clock
        self._backoff_min, self._backoff_max = backoff_s
        self._backoff = self._backoff_min
        self._retry_at = 0.0
        self._conn_lock = threading.RLock()
        self._data_lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._session_id = 0
        self._epoch = 0
        self._max_batch = 1024
        self._transport: DataTransport | None = None
        self._retired: list[DataTransport] = []  # detached during a transfer, closed after it
        self._namespaces: list[NamespaceHandle] = []
        self._closed = False
        self._last_call = 0.0
        self._hb_stop = threading.Event()
        self._hb: threading.Thread | None = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="kvtier-heartbeat")
            self._hb.start()

    # -- public API -------------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: str, transport: TransportName = "shm", **kwargs: Any) -> Client:
        """A client for ``address``; connects now if it can, later by itself if it cannot."""
        client = cls(address, transport, **kwargs)
        try:
            client._ensure()
        except _Away:
            pass
        return client

    @property
    def connected(self) -> bool:
        return self._session_id != 0

    @property
    def boot_epoch(self) -> int:
        return self._epoch

    @property
    def max_batch(self) -> int:
        """Most keys the daemon takes in one RPC (from the session; 1024 before one is open)."""
        return self._max_batch

    def register(self, namespace: Namespace) -> NamespaceHandle:
        """A handle for ``namespace`` (validated here; registered now or on reconnect)."""
        if not isinstance(namespace, Namespace):
            raise errors.InvalidArgument("expected a kvtier.Namespace", field="namespace")
        handle = NamespaceHandle(self, namespace)
        with self._conn_lock:
            self._namespaces.append(handle)
            if self._session_id:
                try:
                    self._register(handle)
                except _Away:
                    pass
        return handle

    def stats(self) -> dict[str, Any]:
        """The daemon's Stats figures as a dict (raises Unavailable when it is away)."""
        with self._conn_lock:
            self._channel_open()
        try:
            reply = self._stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.Unavailable(f"daemon at {self.address}: {e.code().name}: {e.details()}"
                                     ) from None
        return to_dict(reply)

    def close(self) -> None:
        self._closed = True
        self._hb_stop.set()
        with self._conn_lock:
            if self._session_id and self._stub is not None:
                try:
                    self._stub.CloseSession(pb.CloseSessionRequest(session_id=self._session_id),
                                            timeout=self.timeout_s)
                except grpc.RpcError:
                    pass
            self._disconnect()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- connection management --------------------------------------------------------------------

    def _ensure(self) -> None:
        """Connected, or _Away (without waiting while the breaker is open)."""
        if self._session_id:
            return
        with self._conn_lock:
            if self._session_id:
                return
            if self._closed:
                raise _Away("client closed")
            if self._clock() < self._retry_at:
                raise _Away(self.counters.last_error or "daemon away (backing off)")
            try:
                self._open()
            except _Away as e:
                self._trip(str(e))
                raise
            self._backoff = self._backoff_min

    def _open(self) -> None:
        self._channel_open()
        try:
            reply = self._stub.OpenSession(pb.OpenSessionRequest(
                client_name=self.client_name, lease_ttl_ms=int(self.lease_ttl_s * 1000),
                transport=make_transport(self.transport_name).proto_value), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _Away(f"OpenSession: {e.code().name}: {e.details()}") from None
        transport = make_transport(self.transport_name)
        if reply.data_host in ("0.0.0.0", "::", ""):
            # The daemon listens on every interface: reach it where we reached its gRPC port.
            reply.data_host = _grpc_host(self.address)
        try:
            transport.attach(reply.session_id, reply, self.timeout_s)
        except errors.TransportError as e:
            raise _Away(str(e)) from None
        if self._epoch and reply.boot_epoch != self._epoch:
            self.counters.epoch_changes += 1
        if self._epoch:
            self.counters.reconnects += 1
        self._session_id, self._epoch = reply.session_id, reply.boot_epoch
        self._max_batch = max(1, reply.max_batch_blocks)
        transport.bind_rpc(self._transfer_rpc)
        self._transport = transport
        for handle in self._namespaces:
            self._register(handle)

    def _channel_open(self) -> None:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address, options=[
                ("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 64 << 20)])
            self._stub = pb_grpc.KvtierStub(self._channel)

    def _register(self, handle: NamespaceHandle) -> None:
        spec = pb.NamespaceSpec(**{k: v for k, v in handle.namespace.to_dict().items()
                                   if v is not None})
        try:
            reply = self._stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(spec=spec, digest=handle.namespace.digest),
                timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() in _DOWN_CODES:
                self._trip(f"RegisterNamespace: {e.details()}")
                raise _Away(e.details()) from None
            raise errors.from_grpc_code(e.code().name, e.details() or "") from None
        if reply.block_bytes != handle.block_bytes or reply.namespace_id != handle.namespace_id:
            raise errors.Internal("daemon and client disagree on the namespace's id or block size")
        handle.registered_epoch = reply.boot_epoch

    def _trip(self, why: str) -> None:
        """Open the breaker: forget the session, retry after the backoff."""
        with self._conn_lock:
            self.counters.last_error = why
            self._disconnect(keep_channel=True)
            self._retry_at = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)

    def _disconnect(self, keep_channel: bool = False) -> None:
        self._session_id = 0
        if self._transport is not None:
            transport, self._transport = self._transport, None
            # A transfer in flight on another thread (or this one: cuda_ipc makes RPCs inside a
            # transfer) may still use the mapping: it closes the transport when it ends.
            self._retired.append(transport)
            if self._data_lock.acquire(blocking=False):
                try:
                    self._close_retired()
                finally:
                    self._data_lock.release()
        if not keep_channel and self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None

    def _call(self, method: str, request: Any, *, reconnect: bool = True) -> Any:
        """One RPC with the deadline; _Away when the daemon is away. Retries once after a
        reconnect when the daemon forgot our session or namespace (it restarted)."""
        for attempt in (0, 1):
            self._ensure()
            if hasattr(request, "session_id"):
                request.session_id = self._session_id
            try:
                reply = getattr(self._stub, method)(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                code = e.code()
                if code in _DOWN_CODES:
                    self._trip(f"{method}: {code.name}: {e.details()}")
                    raise _Away(e.details()) from None
                if code == grpc.StatusCode.NOT_FOUND and attempt == 0 and reconnect and \
                        ("session" in (e.details() or "") or "namespace" in (e.details() or "")):
                    self._reset_session()
                    continue
                raise errors.from_grpc_code(code.name, e.details() or "") from None
            self._last_call = self._clock()
            if reply.boot_epoch != self._epoch:
                self._reset_session()  # daemon restarted under us: this reply is still valid
            return reply
        raise AssertionError("unreachable")

    def _reset_session(self) -> None:
        with self._conn_lock:
            self._disconnect(keep_channel=True)
            self._retry_at = 0.0

    def _transfer_rpc(self, method: str, request: Any) -> Any:
        """A control RPC made by the data transport inside a transfer (cuda_ipc): no
        reconnect (the job belongs to this session); a daemon away is a TransportError."""
        try:
            return self._call(method, request, reconnect=False)
        except _Away as e:
            raise errors.TransportError(f"{method}: {e}") from None

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(max(0.05, self.lease_ttl_s / 3)):
            if self._clock() - self._last_call < self.lease_ttl_s / 3:
                continue
            try:
                self._call("Heartbeat", pb.HeartbeatRequest())
            except (_Away, errors.KvtierError):
                pass

    # -- data operations (used by NamespaceHandle) ----------------------------------------------

    def _batches(self, n: int) -> range:
        return range(0, n, self._max_batch)

    def _lookup(self, handle: NamespaceHandle, keys: Sequence[bytes]) -> int:
        self.counters.lookups += 1
        packed = _pack_keys(keys)
        try:
            total = 0
            for start in self._batches(len(keys)):
                chunk = packed[start * 32 : (start + self._max_batch) * 32]
                reply = self._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                              keys=chunk))
                total += reply.hit_blocks
                if reply.hit_blocks < len(chunk) // 32:
                    break
            return total
        except _Away:
            self.counters.lookups_failed += 1
            return 0

    def _lookup_detail(self, handle: NamespaceHandle, keys: Sequence[bytes]) -> LookupResult:
        if len(keys) > self._max_batch:
            raise errors.ResourceExhausted(f"at most {self._max_batch} keys per detailed lookup",
                                           field="keys")
        try:
            reply = self._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                          keys=_pack_keys(keys)))
        except _Away:
            self.counters.lookups_failed += 1
            return LookupResult(0, [], [])
        return LookupResult(reply.hit_blocks, [_TIER_NAMES.get(t, "?") for t in reply.tiers],
                            [bool(d) for d in reply.durable] or [False] * reply.hit_blocks)

    def _lookup_pinned(self, handle: NamespaceHandle, keys: Sequence[bytes]) -> PinnedLookup:
        if len(keys) > self._max_batch:
            raise errors.ResourceExhausted(f"at most {self._max_batch} keys per pinned lookup",
                                           field="keys")
        self.counters.lookups += 1
        try:
            reply = self._call("Lookup", pb.LookupRequest(namespace_id=handle.namespace_id,
                                                          keys=_pack_keys(keys), pin=True))
        except _Away:
            self.counters.lookups_failed += 1
            return PinnedLookup(0, [], 0, 0)
        return PinnedLookup(reply.hit_blocks, [_TIER_NAMES.get(t, "?") for t in reply.tiers],
                            reply.job_id, reply.boot_epoch)

    def release(self, pin: int, epoch: int = 0) -> bool:
        """Unpin what ``lookup_pinned`` pinned. Never raises: a pin the daemon no longer knows
        (restart, lease expiry) is already released. Returns whether the daemon confirmed."""
        if not pin or (epoch and epoch != self._epoch):
            return False
        try:
            self._call("CompleteLoad", pb.CompleteLoadRequest(job_id=pin), reconnect=False)
        except (_Away, errors.KvtierError):
            return False
        return True

    def _put(self, handle: NamespaceHandle, keys: Sequence[bytes], blocks: Sequence[Any]) -> PutResult:
        if len(keys) != len(blocks):
            raise errors.InvalidArgument(f"{len(blocks)} blocks for {len(keys)} keys",
                                         field="blocks")
        views = [byte_view(b) for b in blocks]
        for i, v in enumerate(views):
            if len(v) != handle.block_bytes:
                raise errors.InvalidArgument(
                    f"block {i} has {len(v)} bytes, namespace blocks have {handle.block_bytes}",
                    field="blocks")
        def write(job_id: int, base: int, idx: list[int], offsets: list[int]) -> None:
            self._data().write(job_id, [(i, off, views[base + i])
                                        for i, off in zip(idx, offsets, strict=True)])

        return self._put_keys(handle, keys, write)

    def _put_blocks(self, handle: NamespaceHandle, keys: Sequence[bytes], layout: Any,
                    block_ids: Sequence[int]) -> PutResult:
        """put_blocks over a mapped arena: gather straight into the reserved slots
        (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies."""
        def write(job_id: int, base: int, idx: list[int], offsets: list[int]) -> None:
            mover = self._data().mover(layout.device)  # type: ignore[attr-defined]
            mover.store(layout, [block_ids[base + i] for i in idx], offsets, job_id)

        return self._put_keys(handle, keys, write, self._blocks_transport(layout))

    def _blocks_transport(self, layout: Any) -> int:
        """The transport value of a put_blocks/get_blocks job: cuda_ipc only for CUDA layouts
        on a cuda_ipc session (CPU layouts move over the mapped arena like shm)."""
        if self.transport_name == "cuda_ipc" and getattr(layout.device, "type", "") == "cuda":
            return int(pb.TRANSPORT_CUDA_IPC)
        return make_transport_value(self.transport_name)

    def _put_keys(self, handle: NamespaceHandle, keys: Sequence[bytes],
                  write: Callable[[int, int, list[int], list[int]], None],
                  tp: int = 0) -> PutResult:
        tp = tp or make_transport_value(self.transport_name)
        packed = _pack_keys(keys)
        result = PutResult()
        for start in self._batches(len(keys)):
            end = min(start + self._max_batch, len(keys))
            try:
                result += self._put_batch(handle, packed[start * 32 : end * 32], start, write, tp)
            except _Away:
                result.dropped += end - start
                self.counters.puts_dropped += end - start
        return result

    def _put_batch(self, handle: NamespaceHandle, packed: bytes, base: int,
                   write: Callable[[int, int, list[int], list[int]], None], tp: int) -> PutResult:
        prep = self._call("PrepareStore", pb.PrepareStoreRequest(
            namespace_id=handle.namespace_id, keys=packed, transport=tp))
        status = prep.status
        result = PutResult(already_present=status.count(pb.STORE_ALREADY_PRESENT),
                           rejected=status.count(pb.STORE_REJECTED))
        if not prep.job_id:
            return result
        idx = [i for i in range(len(status)) if status[i] == pb.STORE_RESERVED]
        items = [prep.offsets[i] for i in idx]
        failure = ""
        trip = True
        try:
            with self._transfer():
                write(prep.job_id, base, idx, items)
        except errors.TransportError as e:
            failure = f"store transfer: {e}"
        except (RuntimeError, errors.KvtierError) as e:  # e.g. a CUDA error: this job only
            failure, trip = f"store copy: {e}", False
        try:
            # Also on failure: abort at once, so the keys do not stay reserved until the lease ends.
            done = self._call("CompleteStore", pb.CompleteStoreRequest(
                job_id=prep.job_id, ok=not failure), reconnect=False)
        except (_Away, errors.KvtierError):
            result.dropped += len(items)
            self.counters.puts_dropped += len(items)
            return result
        finally:
            if failure and trip:
                self._trip(failure)  # reattach the transport on the next call
        result.stored += done.committed
        result.dropped += done.aborted
        self.counters.puts_dropped += done.aborted
        self.counters.bytes_put += done.committed * handle.block_bytes
        return result

    def _get_into(self, handle: NamespaceHandle, keys: Sequence[bytes],
                  views: list[memoryview]) -> list[bool]:
        def read(job_id: int, base: int, idx: list[int], offsets: list[int]) -> None:
            self._data().read(job_id, [(i, off, views[base + i])
                                       for i, off in zip(idx, offsets, strict=True)])

        return self._get_keys(handle, keys, read)

    def _get_blocks(self, handle: NamespaceHandle, keys: Sequence[bytes], layout: Any,
                    block_ids: Sequence[int]) -> list[bool]:
        """get_blocks over a mapped arena: scatter straight from the pinned slots
        (kvtier.direct), or, for CUDA layouts over cuda_ipc, through the daemon's copies."""
        def read(job_id: int, base: int, idx: list[int], offsets: list[int]) -> None:
            mover = self._data().mover(layout.device)  # type: ignore[attr-defined]
            mover.load(layout, [block_ids[base + i] for i in idx], offsets, job_id)

        return self._get_keys(handle, keys, read, self._blocks_transport(layout))

    def _get_keys(self, handle: NamespaceHandle, keys: Sequence[bytes],
                  read: Callable[[int, int, list[int], list[int]], None],
                  tp: int = 0) -> list[bool]:
        tp = tp or make_transport_value(self.transport_name)
        packed = _pack_keys(keys)
        found = [False] * len(keys)
        try:
            for start in self._batches(len(keys)):
                end = min(start + self._max_batch, len(keys))
                self._get_batch(handle, packed[start * 32 : end * 32], found, start, read, tp)
        except _Away:
            self.counters.gets_failed += 1
            return [False] * len(keys)
        return found

    def _get_batch(self, handle: NamespaceHandle, packed: bytes, found: list[bool], base: int,
                   read: Callable[[int, int, list[int], list[int]], None], tp: int) -> None:
        prep = self._call("PrepareLoad", pb.PrepareLoadRequest(
            namespace_id=handle.namespace_id, keys=packed, transport=tp))
        if not prep.job_id:
            return
        idx = [i for i in range(len(packed) // 32) if prep.found[i]]
        failure = ""
        trip = True
        try:
            with self._transfer():
                read(prep.job_id, base, idx, [prep.offsets[i] for i in idx])
        except errors.TransportError as e:
            failure = f"load transfer: {e}"
        except (RuntimeError, errors.KvtierError) as e:  # e.g. a CUDA error: this job only
            failure, trip = f"load copy: {e}", False
        try:
            self._call("CompleteLoad", pb.CompleteLoadRequest(job_id=prep.job_id), reconnect=False)
        except (_Away, errors.KvtierError) as e:
            # Only a completed load proves the pins held during the copy; if the lease lapsed
            # the slots may have been reused under us: the bytes are not trusted, all misses.
            failure, trip = failure or f"load not confirmed: {e}", True
        if failure:
            if trip:
                self._trip(failure)
            raise _Away(failure)
        for i in idx:
            found[base + i] = True
        self.counters.bytes_got += len(idx) * handle.block_bytes

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[None]:
        """Hold the data channel for one transfer; close what was detached meanwhile."""
        with self._data_lock:
            try:
                yield
            finally:
                self._close_retired()

    def _close_retired(self) -> None:
        """Close detached transports (the caller holds the data lock)."""
        while self._retired:
            self._retired.pop().close()

    def _data(self) -> DataTransport:
        if self._transport is None:
            raise errors.TransportError("no data transport attached")
        return self._transport


def _grpc_host(address: str) -> str:
    if address.startswith("unix:"):
        return "127.0.0.1"
    host = address.rpartition(":")[0]
    return host.strip("[]") or "127.0.0.1"


def make_transport_value(name: str) -> int:
    """The transport of a job moving host buffers (a cuda_ipc session moves those over shm)."""
    return int(pb.TRANSPORT_TCP if name == "tcp" else pb.TRANSPORT_SHM)


def _pack_keys(keys: Sequence[bytes]) -> bytes:
    if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {32}):  # C-speed checks
        raise errors.InvalidArgument("every block key must be 32 bytes", field="keys")
    return b"".join(keys)


class NamespaceHandle:
    """A registered namespace on one Client: hashing plus the batch operations.

    ``lookup`` -> longest ready prefix; ``put`` -> PutResult; ``get`` -> list of bytearray or
    None; ``get_into`` fills caller buffers and returns which keys were found. Thread-safe as the
    Client is.
    """

    def __init__(self, client: Client, namespace: Namespace) -> None:
        self.client = client
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.namespace_id = namespace.namespace_id
        self.registered_epoch = 0

    def block_keys(self, token_ids: Sequence[int], *, parent: bytes | None = None,
                   extras: Sequence[bytes] | None = None) -> list[bytes]:
        return self.namespace.block_keys(token_ids, parent=parent, extras=extras,
                                         tenant_key=self.client.tenant_key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self.client._lookup(self, keys)

    def lookup_detail(self, keys: Sequence[bytes]) -> LookupResult:
        """Like lookup, with the tier of each hit and whether NVMe holds it durably."""
        return self.client._lookup_detail(self, keys)

    def lookup_pinned(self, keys: Sequence[bytes]) -> PinnedLookup:
        """Like lookup_detail (at most one batch of keys), and the hits stay pinned against
        eviction until ``client.release(result.pin, result.epoch)``."""
        return self.client._lookup_pinned(self, keys)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Ask the daemon to promote the NVMe-resident blocks of the ready prefix ahead of a
        get; returns how many promotions it started (0 when the daemon is away)."""
        try:
            reply = self.client._call("Prefetch", pb.PrefetchRequest(
                namespace_id=self.namespace_id, keys=_pack_keys(keys)))
        except _Away:
            return 0
        return int(reply.promoting)

    def put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> PutResult:
        return self.client._put(self, keys, blocks)

    def put_blocks(self, keys: Sequence[bytes], layout: Any, block_ids: Sequence[int]) -> PutResult:
        """Store engine blocks ``block_ids`` of a paged cache (a ``kvtier.layouts`` layout) under
        ``keys``: one gather kernel into a staging tensor, then one batched put."""
        if self.client.transport_name in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return self.client._put_blocks(self, keys, layout, block_ids)
        staging = self._staging(layout, keys, block_ids)
        layout.gather(block_ids, staging)
        return self.put(keys, list(staging))

    def get_blocks(self, keys: Sequence[bytes], layout: Any, block_ids: Sequence[int]) -> list[bool]:
        """Load ``keys`` into engine blocks ``block_ids`` (one batched get, then one scatter
        kernel); blocks not found are left untouched. Returns which were loaded."""
        if self.client.transport_name in _MAPPED:
            self._check_layout(layout, keys, block_ids)
            return self.client._get_blocks(self, keys, layout, block_ids)
        staging = self._staging(layout, keys, block_ids)
        found = self.get_into(keys, list(staging))
        hit = [i for i, f in enumerate(found) if f]
        if hit:
            ids = [block_ids[i] for i in hit]
            layout.scatter(ids, staging[hit] if len(hit) < len(found) else staging)
        return found

    def _staging(self, layout: Any, keys: Sequence[bytes], block_ids: Sequence[int]) -> Any:
        self._check_layout(layout, keys, block_ids)
        return layout.staging(len(keys))

    def _check_layout(self, layout: Any, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        if layout.block_bytes != self.block_bytes:
            raise errors.InvalidArgument(f"layout blocks have {layout.block_bytes} bytes, namespace "
                                         f"blocks {self.block_bytes}", field="layout")
        if len(block_ids) != len(keys):
            raise errors.InvalidArgument(f"{len(block_ids)} block ids for {len(keys)} keys",
                                         field="block_ids")
        layout.check_ids(block_ids)

    def get(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        bufs = [bytearray(self.block_bytes) for _ in keys]
        found = self.get_into(keys, bufs)
        return [b if f else None for b, f in zip(bufs, found, strict=True)]

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Any]) -> list[bool]:
        if len(keys) != len(buffers):
            raise errors.InvalidArgument(f"{len(buffers)} buffers for {len(keys)} keys",
                                         field="buffers")
        views = [byte_view(b, writable=True, field="buffers") for b in buffers]
        for i, v in enumerate(views):
            if len(v) != self.block_bytes:
                raise errors.InvalidArgument(
                    f"buffer {i} has {len(v)} bytes, namespace blocks have {self.block_bytes}",
                    field="buffers")
        return self.client._get_into(self, keys, views)

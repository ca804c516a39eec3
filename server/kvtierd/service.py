"""gRPC service: translates proto messages to TieredCache / SessionTable calls and back.

Every request is validated (ids, key counts and lengths, transports) before anything touches the
index or memory; every reply carries the boot epoch. Errors from :mod:`kvtier_contract.errors` become gRPC
statuses through the one table ``kvtier_contract.errors.GRPC_STATUS``. Runs on the daemon's event loop.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvtier_contract.errors import (
    GRPC_STATUS,
    FailedPrecondition,
    InvalidArgument,
    KvtierError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvtier_contract.identity import Namespace
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.cache import LoadJob, TieredCache
from kvtierd.sessions import SessionTable
from kvtierd.stats import COUNTER_FIELDS, Counters, LatencyHistogram
from kvtierd.transports.cuda_ipc import CudaIpcCopier

log = logging.getLogger("kvtierd.service")
KEY_BYTES = 32
_TRANSPORTS = frozenset({pb.TRANSPORT_SHM, pb.TRANSPORT_TCP, pb.TRANSPORT_CUDA_IPC})
_OPTIONAL_SPEC = ("adapter_id", "adapter_revision", "cache_salt", "tenant")
_SPEC_FIELDS = tuple(f.name for f in pb.NamespaceSpec.DESCRIPTOR.fields)

Req = TypeVar("Req")
Rep = TypeVar("Rep")


@functools.lru_cache(maxsize=256)
def _key_splitter(n: int) -> struct.Struct:
    return struct.Struct("32s" * n)


def split_keys(data: bytes, max_keys: int) -> Sequence[bytes]:
    """Packed 32-byte keys -> sequence; checks length and count before slicing anything.

    One struct unpack (~20 µs for 1,000 keys) instead of 1,000 slices (~180 µs).
    """
    if len(data) % KEY_BYTES:
        raise InvalidArgument(f"length {len(data)} is not a multiple of {KEY_BYTES}", field="keys")
    n = len(data) // KEY_BYTES
    if n > max_keys:
        raise ResourceExhausted(f"{n} keys exceed the batch limit of {max_keys}", field="keys")
    return _key_splitter(n).unpack(data) if n else ()


def namespace_from_spec(spec: pb.NamespaceSpec) -> Namespace:
    values: dict[str, Any] = {}
    for name in _SPEC_FIELDS:
        if name in _OPTIONAL_SPEC:
            values[name] = getattr(spec, name) if spec.HasField(name) else None
        else:
            values[name] = getattr(spec, name)
    return Namespace(**values)


def _rpc(fn: Callable[[Any, Any, Any], Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Time the call and map kvtier errors to one gRPC status each."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: KvtierService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(self, request, context)
        except KvtierError as e:
            code = getattr(grpc.StatusCode, GRPC_STATUS.get(type(e), "UNKNOWN"))
            self.errors[code.name] = self.errors.get(code.name, 0) + 1
            await context.abort(code, str(e))
        finally:
            self.latency.setdefault(name, LatencyHistogram()).observe(time.perf_counter() - t0)

    return wrapper


class KvtierService(pb_grpc.KvtierServicer):  # type: ignore[misc]
    """The control plane. Owns nothing but its latency histograms; event-loop thread only."""

    def __init__(self, cache: TieredCache, sessions: SessionTable, *, boot_epoch: int,
                 max_batch_blocks: int, advertise: Callable[[], dict[str, Any]],
                 cuda: CudaIpcCopier | None = None) -> None:
        self.cache = cache
        self.cuda = cuda  # the cuda_ipc copier; None when cuda_ipc = false
        self.sessions = sessions
        self.boot_epoch = boot_epoch
        self.max_batch = max_batch_blocks
        self.advertise = advertise  # shm socket path, data channel address, arena size
        self.started = time.monotonic()
        self.draining = False
        self.latency: dict[str, LatencyHistogram] = {}
        self.errors: dict[str, int] = {}

    @_rpc
    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context: Any) -> Any:
        spec = namespace_from_spec(request.spec)
        if request.digest and request.digest != spec.digest:
            raise InvalidArgument("differs from the daemon's digest of the same fields "
                                  "(client and daemon disagree on the hashing spec)", field="digest")
        ns = self.cache.register_namespace(spec)
        return pb.RegisterNamespaceReply(boot_epoch=self.boot_epoch, namespace_id=ns.id,
                                         block_bytes=ns.block_bytes, digest=spec.digest)

    @_rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> Any:
        if self.draining:
            raise Unavailable("daemon is draining")
        if request.transport not in _TRANSPORTS | {pb.TRANSPORT_UNSPECIFIED}:
            raise InvalidArgument(f"unsupported transport {request.transport}", field="transport")
        self._transport(request.transport or pb.TRANSPORT_SHM)
        s = self.sessions.open(request.client_name, request.lease_ttl_ms / 1000.0,
                               request.transport or pb.TRANSPORT_SHM)
        adv = self.advertise()
        return pb.OpenSessionReply(
            boot_epoch=self.boot_epoch, session_id=s.id, lease_ttl_ms=int(s.ttl_s * 1000),
            shm_socket=adv["shm_socket"], data_host=adv["data_host"], data_port=adv["data_port"],
            arena_bytes=adv["arena_bytes"], max_batch_blocks=self.max_batch)

    @_rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        return pb.HeartbeatReply(boot_epoch=self.boot_epoch, lease_ttl_ms=int(s.ttl_s * 1000))

    @_rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> Any:
        self.sessions.close(request.session_id)
        return pb.CloseSessionReply(boot_epoch=self.boot_epoch)

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        ns = self.cache.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        if request.pin:
            job = await self.cache.pin_prefix(s, ns, keys)
            if job is None:
                return pb.LookupReply(boot_epoch=self.boot_epoch)
            n = len(job.items)
            return pb.LookupReply(boot_epoch=self.boot_epoch, hit_blocks=n, job_id=job.id,
                                  tiers=bytes([pb.TIER_HOST]) * n,
                                  offsets=[job.items[i].offset for i in range(n)])
        hit, tiers, durable = self.cache.lookup_detail(ns, keys)
        return pb.LookupReply(boot_epoch=self.boot_epoch, hit_blocks=hit, tiers=tiers,
                              durable=durable)

    @_rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        self.sessions.get(request.session_id)
        ns = self.cache.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        ready = 0
        for k in keys:
            if k not in ns.ready:
                break
            ready += 1
        started = self.cache.bridge.prefetch(ns, keys[:ready]) if self.cache.bridge else 0
        return pb.PrefetchReply(boot_epoch=self.boot_epoch, ready_blocks=ready, promoting=started)

    def _transport(self, value: int) -> int:
        if value not in _TRANSPORTS:
            raise InvalidArgument(f"must be TRANSPORT_SHM, TRANSPORT_TCP or TRANSPORT_CUDA_IPC, "
                                  f"got {value}", field="transport")
        if value == pb.TRANSPORT_CUDA_IPC and self.cuda is None:
            raise FailedPrecondition("cuda_ipc is disabled on this daemon (start it with "
                                     "cuda_ipc = true)", field="transport")
        return value

    def _not_copying(self, job_id: int) -> None:
        if job_id in self.cache.copying:
            raise FailedPrecondition(f"a CudaCopy for job {job_id} is in flight", field="job_id")

    def _copier(self) -> CudaIpcCopier:
        if self.cuda is None:
            raise FailedPrecondition("cuda_ipc is disabled on this daemon (start it with "
                                     "cuda_ipc = true)", field="transport")
        return self.cuda

    @_rpc
    async def RegisterCudaBuffer(self, request: pb.RegisterCudaBufferRequest, context: Any) -> Any:
        cuda = self._copier()
        s = self.sessions.get(request.session_id)
        buf = await cuda.register(s.id, request.device_uuid, request.ipc_handle,
                                  request.handle_offset, request.buffer_bytes)
        if s.released:  # the lease lapsed while the handle was being opened
            cuda.release(s.id, buf.id)
            raise NotFound(f"session {s.id} expired or closed", field="session_id")
        return pb.RegisterCudaBufferReply(boot_epoch=self.boot_epoch, buffer_id=buf.id)

    @_rpc
    async def ReleaseCudaBuffer(self, request: pb.ReleaseCudaBufferRequest, context: Any) -> Any:
        cuda = self._copier()
        s = self.sessions.get(request.session_id)
        cuda.release(s.id, request.buffer_id)
        return pb.ReleaseCudaBufferReply(boot_epoch=self.boot_epoch)

    @_rpc
    async def CudaCopy(self, request: pb.CudaCopyRequest, context: Any) -> Any:
        cuda = self._copier()
        s = self.sessions.get(request.session_id)
        job = self.cache.copy_job(s, request.job_id)
        buf = cuda.buffer(s.id, request.buffer_id)
        self._not_copying(job.id)
        keys = sorted(job.items)
        bb = job.ns.block_bytes
        plan = cuda.plan(buf, [job.items[i].offset for i in keys], bb,
                         list(request.buffer_offsets))
        to_device = isinstance(job, LoadJob)
        self.cache.copying.add(job.id)
        try:
            copies = await cuda.copy(buf, plan, to_device)
        except KvtierError:
            self.cache.copying.discard(job.id)
            self.cache.abort_job(s, job)  # a CUDA error fails this job, nothing else
            raise
        self.cache.copying.discard(job.id)
        self.cache.mark_copied(job)
        return pb.CudaCopyReply(boot_epoch=self.boot_epoch, copies=copies,
                                bytes=len(keys) * bb)

    @_rpc
    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        ns = self.cache.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        transport = self._transport(request.transport)
        if self.draining:
            raise Unavailable("daemon is draining: stores are not admitted")
        if self.cache.bridge is not None:
            new = sum(1 for k in keys if k not in ns.entries)
            await self.cache.bridge.ensure_room(ns.slot_bytes, new)
            # The wait may have outlived the lease: never attach a job to a released session.
            s = self.sessions.get(request.session_id)
        job, status, offsets = self.cache.prepare_store(s, ns, keys, transport)
        return pb.PrepareStoreReply(boot_epoch=self.boot_epoch, job_id=job.id if job else 0,
                                    status=status, offsets=offsets)

    @_rpc
    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        self._not_copying(request.job_id)
        committed, aborted = self.cache.complete_store(s, request.job_id, request.ok,
                                                       list(request.item_ok))
        return pb.CompleteStoreReply(boot_epoch=self.boot_epoch, committed=committed,
                                     aborted=aborted)

    @_rpc
    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        ns = self.cache.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        transport = self._transport(request.transport)
        job = await self.cache.prepare_load(s, ns, keys, transport)
        n = len(keys)
        if job is None:
            return pb.PrepareLoadReply(boot_epoch=self.boot_epoch, found=bytes(n),
                                       offsets=[0] * n, tiers=bytes(n))
        found, offsets, tiers = bytearray(n), [0] * n, bytearray(n)
        for i, e in job.items.items():
            found[i], offsets[i], tiers[i] = 1, e.offset, pb.TIER_HOST
        return pb.PrepareLoadReply(boot_epoch=self.boot_epoch, job_id=job.id, found=bytes(found),
                                   offsets=offsets, tiers=bytes(tiers))

    @_rpc
    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        s = self.sessions.get(request.session_id)
        self._not_copying(request.job_id)
        self.cache.complete_load(s, request.job_id)
        return pb.CompleteLoadReply(boot_epoch=self.boot_epoch)

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        return self.stats_reply()

    def stats_reply(self) -> pb.StatsReply:
        c = self.cache
        reply = pb.StatsReply(
            boot_epoch=self.boot_epoch, uptime_s=time.monotonic() - self.started,
            total=_counters(c.totals()), host_capacity_bytes=c.host.capacity_bytes,
            host_used_bytes=c.host.used_bytes, sessions=len(self.sessions),
            leases_expired=self.sessions.expired_total, pinned_blocks=c.pinned_blocks,
            writing_blocks=c.writing_blocks, eviction_policy=c.policy_name,
            limbo_blocks=c.limbo_blocks)
        if c.bridge is not None:
            reply.nvme.CopyFrom(self.nvme_stats())
        if self.cuda is not None:
            f = self.cuda.figures
            reply.cuda_ipc.CopyFrom(pb.CudaIpcStats(
                enabled=True, devices=len(self.cuda.uuids), buffers=self.cuda.buffers,
                copies=f.copies, copy_errors=f.copy_errors, bytes_copied=f.bytes_copied))
        for ns in c.namespaces.values():
            reply.namespaces.add(namespace_id=ns.id, model_id=ns.spec.model_id,
                                 model_revision=ns.spec.model_revision,
                                 block_bytes=ns.block_bytes, counters=_counters(ns.counters))
        return reply


    def nvme_stats(self) -> pb.NvmeStats:
        b = self.cache.bridge
        assert b is not None
        t, f = b.nvme, b.nvme.figures
        return pb.NvmeStats(
            enabled=True, directory=t.cfg.directory, capacity_bytes=t.space.capacity_bytes,
            used_bytes=t.space.used_bytes, admitting=t.admitting,
            degraded_reason=t.degraded_reason, direct_io=f.direct_io, write_policy=b.write_policy,
            bytes_written=f.bytes_written, bytes_read=f.bytes_read,
            checksum_failures=f.checksum_failures, quarantined_slots=f.quarantined_slots,
            commit_groups=f.commit_groups, write_errors=f.write_errors,
            recovery_seconds=f.recovery_seconds, recovered_blocks=f.recovered_blocks,
            recovery_quarantined=f.recovery_quarantined, recovery_mode=f.recovery_mode,
            flushes_in_flight=b.flushes_in_flight)


def _counters(c: Counters) -> pb.Counters:
    return pb.Counters(**{f: getattr(c, f) for f in COUNTER_FIELDS})

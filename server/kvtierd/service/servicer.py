"""The gRPC servicer: every Kvtier RPC passes the call gate (:func:`kvtierd.service.gate.rpc`)
here and is delegated to the handler family that serves it.

:class:`KvtierService` builds the families, each handed the parts it uses: the
:class:`~kvtierd.service.scope.Scope` (the caller's checks), the shared
:class:`~kvtierd.service.scope.ServiceSettings`, the cache (and through it, its admission), the
session table, the tenancy and the cuda_ipc transport.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.cache import TieredCache
from kvtierd.ratelog import RateLimitedLog
from kvtierd.service.cuda import CudaHandlers
from kvtierd.service.gate import rpc
from kvtierd.service.lookups import LookupHandlers
from kvtierd.service.prefixes import PrefixHandlers
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.service.sessions import SessionHandlers
from kvtierd.service.stats import StatsHandlers
from kvtierd.service.transfers import TransferHandlers
from kvtierd.sessions import Session, SessionTable
from kvtierd.stats import LatencyHistogram
from kvtierd.tenancy import Tenancy
from kvtierd.tenancy.prefixes import PublishedPrefixes
from kvtierd.transports.cuda_ipc import CudaIpcTransport

log = logging.getLogger("kvtierd.service")
BAD_INPUT_LOG_INTERVAL_S = 10.0  # at most one log line per this many seconds for bad bodies


class KvtierService(pb_grpc.KvtierServicer):  # type: ignore[misc]
    """The control plane. Owns the handler families, the settings they share, and what the
    call gate feeds: latency histograms and error counts (per method and status), the calls in
    progress, bad control frames. Event-loop thread only."""

    def __init__(
        self,
        cache: TieredCache,
        sessions: SessionTable,
        *,
        boot_epoch: int,
        max_batch_blocks: int,
        advertise: Callable[[], dict[str, Any]],
        cuda: CudaIpcTransport | None = None,
        max_inflight: int = 1 << 30,
        tenancy: Tenancy | None = None,
        prefixes: PublishedPrefixes | None = None,
    ) -> None:
        self.cache = cache
        self.sessions = sessions
        self.cuda = cuda  # the cuda_ipc transport; None when cuda_ipc = false
        self.tenancy = tenancy or cache.admission.tenancy
        """Who callers are and what their tenants may hold (the daemon's one Tenancy)."""
        self.settings = ServiceSettings(boot_epoch, max_batch_blocks, advertise)
        self.scope = Scope(cache, sessions, self.tenancy, cuda)
        self.sessions_rpc = SessionHandlers(self.scope, self.settings, cache, sessions)
        self.lookups = LookupHandlers(self.scope, self.settings, cache)
        self.transfers = TransferHandlers(self.scope, self.settings, cache)
        self.cuda_rpc = CudaHandlers(self.scope, self.settings)
        self.stats = StatsHandlers(self.scope, self.settings, cache, sessions, self.tenancy, cuda)
        self.prefixes = PrefixHandlers(
            self.scope,
            self.settings,
            prefixes or PublishedPrefixes(self.tenancy),  # (memory only)
        )
        # what the call gate (kvtierd.service.gate.GateState) reads and feeds
        self.latency: dict[str, LatencyHistogram] = {}
        self.max_inflight = max_inflight  # handlers in progress before RESOURCE_EXHAUSTED
        self.inflight = 0
        self.after_rpc: Callable[[], None] = lambda: None
        """Run at the end of every RPC on the event loop (the daemon publishes index changes)."""
        self.errors: dict[tuple[str, str], int] = {}  # (method, status code name) -> count
        self.bad_frames = 0  # control-channel frames that broke the protocol (channel closed)
        self.bad_input_log = RateLimitedLog(log, BAD_INPUT_LOG_INTERVAL_S)

    @property
    def draining(self) -> bool:
        """Stores and new sessions are refused (the daemon drains)."""
        return self.settings.draining

    @draining.setter
    def draining(self, on: bool) -> None:
        self.settings.draining = on

    @property
    def verify_store(self) -> str:
        """Who hashes an shm store (config ``verify_store``; set by the daemon)."""
        return self.settings.verify_store

    @verify_store.setter
    def verify_store(self, who: str) -> None:
        self.settings.verify_store = who

    def count_error(self, method: str, code: str) -> None:
        key = (method, code)
        self.errors[key] = self.errors.get(key, 0) + 1

    def session_arenas(self, session: Session, groups: bool) -> tuple[int, ...] | None:
        return self.scope.session_arenas(session, groups)

    def stats_reply(self) -> pb.StatsReply:
        return self.stats.stats_reply()

    # -- the RPCs, each through the gate to its family --------------------------------------------

    @rpc
    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context: Any) -> Any:
        return await self.sessions_rpc.RegisterNamespace(request, context)

    @rpc
    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> Any:
        return await self.sessions_rpc.OpenSession(request, context)

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        return await self.sessions_rpc.Heartbeat(request, context)

    @rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> Any:
        return await self.sessions_rpc.CloseSession(request, context)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        return await self.lookups.Lookup(request, context)

    @rpc
    async def LookupSlices(self, request: pb.LookupSlicesRequest, context: Any) -> Any:
        return await self.lookups.LookupSlices(request, context)

    @rpc
    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        return await self.lookups.Prefetch(request, context)

    @rpc
    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        return await self.transfers.PrepareStore(request, context)

    @rpc
    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        return await self.transfers.CompleteStore(request, context)

    @rpc
    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        return await self.transfers.PrepareLoad(request, context)

    @rpc
    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        return await self.transfers.CompleteLoad(request, context)

    @rpc
    async def RegisterCudaBuffer(self, request: pb.RegisterCudaBufferRequest, context: Any) -> Any:
        return await self.cuda_rpc.RegisterCudaBuffer(request, context)

    @rpc
    async def ReleaseCudaBuffer(self, request: pb.ReleaseCudaBufferRequest, context: Any) -> Any:
        return await self.cuda_rpc.ReleaseCudaBuffer(request, context)

    @rpc
    async def CudaCopy(self, request: pb.CudaCopyRequest, context: Any) -> Any:
        return await self.cuda_rpc.CudaCopy(request, context)

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        return await self.stats.Stats(request, context)

    @rpc
    async def PublishPrefix(self, request: pb.PublishPrefixRequest, context: Any) -> Any:
        return await self.prefixes.PublishPrefix(request, context)

    @rpc
    async def ListPrefixes(self, request: pb.ListPrefixesRequest, context: Any) -> Any:
        return await self.prefixes.ListPrefixes(request, context)

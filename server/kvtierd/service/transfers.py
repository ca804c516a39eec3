"""Handlers of transfers: PrepareStore, CompleteStore, PrepareLoad, CompleteLoad. Each checks
the caller's session, namespace and transport (:class:`~kvtierd.service.scope.Scope`), hands the
request and its caller to the cache (which admits it: kvtierd.cache.admission; the flows that
hash: :mod:`kvtierd.cache.flows`) and translates the answer into a reply (offsets relative to
the arena the session maps). Event-loop thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from kvtier_contract.errors import Unavailable
from kvtier_contract.protoutil import split_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.flows import complete_load_verified, complete_store_hashed
from kvtierd.cache.jobs import LoadJob
from kvtierd.domain import StoreStatus
from kvtierd.service.scope import Scope, ServiceSettings

log = logging.getLogger("kvtierd.service")


class TransferHandlers:
    """PrepareStore, CompleteStore, PrepareLoad, CompleteLoad (see the module docstring)."""

    def __init__(self, scope: Scope, settings: ServiceSettings, cache: TieredCache) -> None:
        self.scope = scope
        self.settings = settings
        self.cache = cache

    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        transport = self.scope.job_transport(s, request.transport)
        base = self.scope.arena_base(s, ns)
        if self.settings.draining:
            raise Unavailable("daemon is draining: stores are not admitted")
        job, status, offsets = await self.cache.prepare_store(
            s,
            ns,
            keys,
            transport,
            token_ids=list(request.token_ids),
            parent=request.parent_key or None,
            caller=self.scope.caller(),
        )
        if base and job is not None:
            offsets = [
                o - base if st == StoreStatus.RESERVED else 0 for o, st in zip(offsets, status, strict=True)
            ]
        return pb.PrepareStoreReply(
            boot_epoch=self.settings.boot_epoch, job_id=job.id if job else 0, status=status, offsets=offsets
        )

    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        committed, aborted = await complete_store_hashed(
            self.cache,
            s,
            request.job_id,
            request.ok,
            list(request.item_ok),
            list(request.digests),
            trust_client=self.settings.verify_store == "client",
        )
        return pb.CompleteStoreReply(
            boot_epoch=self.settings.boot_epoch, committed=committed, aborted=aborted
        )

    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        """found[i] = 1: key i is pinned at offsets[i]. found[i] = 0 with tiers[i] = a storage
        tier: present there but not placed in the host tier this round (ask again after
        CompleteLoad); with tiers[i] = TIER_NONE: absent."""
        s = self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        transport = self.scope.job_transport(s, request.transport)
        base = self.scope.arena_base(s, ns)
        caller = self.scope.caller()
        # never let the caller's deadline pass waiting on a slow tier (the caller would take
        # a live daemon for one that is away): answer by then with what the host tier holds
        answer_by = AnswerBy.for_deadline(context.time_remaining())
        job, deferred = await self.cache.prepare_load(
            s, ns, keys, transport, host_only=request.host_only, answer_by=answer_by, caller=caller
        )
        if job is not None:
            left = context.time_remaining()
            if left is not None and left <= 0:  # (the loop itself was late): pin nothing
                self.cache.abort_job(s, job)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the load could be answered"
                )
            self.cache.admit_pins(caller, s, job)
        tiers = bytearray(len(keys))
        for i, tier in deferred.items():
            tiers[i] = tier
        return self._load_reply(job, len(keys), tiers, base, answer_by is not None and answer_by.cut)

    def _load_reply(
        self, job: LoadJob | None, n: int, tiers: bytearray, base: int, cut: bool
    ) -> pb.PrepareLoadReply:
        """PrepareLoad's reply: ``job``'s pinned blocks (found, offsets in the session's
        mapping, their digests when bytes are verified; 0: none known, the client checks
        nothing), the deferred ones' tiers, and whether the deadline cut the answer short."""
        found, offsets = bytearray(n), [0] * n
        if job is None:
            return pb.PrepareLoadReply(
                boot_epoch=self.settings.boot_epoch,
                found=bytes(found),
                offsets=offsets,
                tiers=bytes(tiers),
                deadline_cut=cut,
            )
        for i, e in job.items.items():
            found[i], offsets[i], tiers[i] = 1, e.offset - base, pb.TIER_HOST
        digests: list[int] = []
        if self.cache.verify_bytes:
            digests = [0] * n
            for i, e in job.items.items():
                digests[i] = e.digest or 0
        return pb.PrepareLoadReply(
            boot_epoch=self.settings.boot_epoch,
            job_id=job.id,
            found=bytes(found),
            offsets=offsets,
            tiers=bytes(tiers),
            digests=digests,
            deadline_cut=cut,
        )

    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        dropped, ns_id = await complete_load_verified(self.cache, s, request.job_id, list(request.corrupt))
        if dropped:
            log.warning("%d block(s) of namespace %d failed verification at a load: dropped", dropped, ns_id)
        return pb.CompleteLoadReply(boot_epoch=self.settings.boot_epoch, dropped=dropped)

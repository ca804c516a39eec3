"""Handlers of transfers: PrepareStore, CompleteStore, PrepareLoad, CompleteLoad. Each checks
the caller's session, namespace, transport and job quotas, hands the request to the cache (the
flows that wait or hash: :mod:`kvtierd.cache.flows`) and translates the answer into a reply
(offsets relative to the arena the session maps). Event-loop thread only (see
:class:`~kvtierd.service.base.ServiceBase`).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from kvtier_contract.errors import Unavailable
from kvtier_contract.protoutil import split_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache.answer_by import AnswerBy
from kvtierd.cache.flows import complete_load_verified, complete_store_hashed, prepare_store_fitted
from kvtierd.cache.jobs import LoadJob
from kvtierd.cache.stores import check_origin
from kvtierd.domain import StoreStatus
from kvtierd.service.base import ServiceBase
from kvtierd.service.gate import rpc
from kvtierd.sessions import Session

log = logging.getLogger("kvtierd.service")


class TransferHandlers(ServiceBase):
    """PrepareStore, CompleteStore, PrepareLoad, CompleteLoad (see the module docstring)."""

    @rpc
    async def PrepareStore(self, request: pb.PrepareStoreRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        token_ids, parent = list(request.token_ids), request.parent_key or None
        check_origin(ns, keys, token_ids, parent)  # before anything is evicted for the store
        transport = self._job_transport(s, request.transport)
        base = self._arena_base(s, ns)
        self._check_jobs(s)
        if self.draining:
            raise Unavailable("daemon is draining: stores are not admitted")
        job, status, offsets = await prepare_store_fitted(
            self.cache,
            s,
            ns,
            keys,
            transport,
            token_ids=token_ids,
            parent=parent,
            again=lambda: self._jobs_session(request.session_id),
        )
        if base and job is not None:
            offsets = [
                o - base if st == StoreStatus.RESERVED else 0 for o, st in zip(offsets, status, strict=True)
            ]
        return pb.PrepareStoreReply(
            boot_epoch=self.boot_epoch, job_id=job.id if job else 0, status=status, offsets=offsets
        )

    def _jobs_session(self, session_id: int) -> Session:
        """The session, still open and the caller's, within its tenant's job quotas."""
        s = self._session(session_id)
        self._check_jobs(s)
        return s

    @rpc
    async def CompleteStore(self, request: pb.CompleteStoreRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        committed, aborted = await complete_store_hashed(
            self.cache,
            s,
            request.job_id,
            request.ok,
            list(request.item_ok),
            list(request.digests),
            trust_client=self.verify_store == "client",
        )
        return pb.CompleteStoreReply(boot_epoch=self.boot_epoch, committed=committed, aborted=aborted)

    @rpc
    async def PrepareLoad(self, request: pb.PrepareLoadRequest, context: Any) -> Any:
        """found[i] = 1: key i is pinned at offsets[i]. found[i] = 0 with tiers[i] = a storage
        tier: present there but not placed in the host tier this round (ask again after
        CompleteLoad); with tiers[i] = TIER_NONE: absent."""
        s = self._session(request.session_id)
        ns = self._namespace(request.namespace_id)
        keys = split_keys(request.keys, self.max_batch)
        transport = self._job_transport(s, request.transport)
        base = self._arena_base(s, ns)
        self._check_jobs(s)
        # never let the caller's deadline pass waiting on a slow tier (the caller would take
        # a live daemon for one that is away): answer by then with what the host tier holds
        answer_by = AnswerBy.for_deadline(context.time_remaining())
        job, deferred = await self.cache.prepare_load(
            s, ns, keys, transport, host_only=request.host_only, answer_by=answer_by
        )
        if job is not None:
            left = context.time_remaining()
            if left is not None and left <= 0:  # (the loop itself was late): pin nothing
                self.cache.abort_job(s, job)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the load could be answered"
                )
            self._check_pins(s, job)
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
                boot_epoch=self.boot_epoch,
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
            boot_epoch=self.boot_epoch,
            job_id=job.id,
            found=bytes(found),
            offsets=offsets,
            tiers=bytes(tiers),
            digests=digests,
            deadline_cut=cut,
        )

    @rpc
    async def CompleteLoad(self, request: pb.CompleteLoadRequest, context: Any) -> Any:
        s = self._session(request.session_id)
        dropped, ns_id = await complete_load_verified(self.cache, s, request.job_id, list(request.corrupt))
        if dropped:
            log.warning("%d block(s) of namespace %d failed verification at a load: dropped", dropped, ns_id)
        return pb.CompleteLoadReply(boot_epoch=self.boot_epoch, dropped=dropped)

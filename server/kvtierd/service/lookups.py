"""Handlers of lookups: Lookup, LookupSlices (one lookup over an engine's tensor-parallel
slices, all or nothing), Prefetch. Each translates its request into TieredCache lookup calls and
their answer into a reply. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.protoutil import split_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.cache.jobs import LoadJob
from kvtierd.cache.lookup import PREFETCH, SHARED, LookupOptions
from kvtierd.domain import TierId
from kvtierd.index import NamespaceState
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.sessions import Session

NO_OFFSET = (1 << 64) - 1  # a held hit whose host slot may change has no offset to read
MAX_SLICES = 64  # namespaces per LookupSlices call (an engine's TP ranks)


class LookupHandlers:
    """Lookup, LookupSlices, Prefetch (see the module docstring)."""

    def __init__(self, scope: Scope, settings: ServiceSettings, cache: TieredCache) -> None:
        self.scope = scope
        self.settings = settings
        self.cache = cache

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        base = self.scope.arena_base(s, ns) if request.pin else 0
        return (await self._lookup(s, ns, keys, request.pin, base, promote=not request.hold_only))[0]

    async def LookupSlices(self, request: pb.LookupSlicesRequest, context: Any) -> Any:
        """Every argument is checked before anything is pinned; a failure after the first pin
        (a quota, the session gone) releases the pins taken so far, and so does a slice with
        no hit (the common prefix is empty: every slice's reply then has job_id 0). The loop
        yields between slices, so one big call (up to 64 slices) never holds the event loop for
        more than one slice's lookup (docs/benchmarks.md §21)."""
        s = self.scope.session(request.session_id)
        nss, chains = self._slices(request)
        bases = [self.scope.arena_base(s, ns) if request.pin else 0 for ns in nss]
        replies: list[Any] = []
        pinned: list[LoadJob] = []
        hit: int | None = None
        try:
            for n, (ns, keys, base) in enumerate(zip(nss, chains, bases, strict=True)):
                if n:  # other callers' RPCs run between slices: one slice at most delays them
                    await asyncio.sleep(0)
                    s = self.scope.session(request.session_id)  # (closed meanwhile: NOT_FOUND)
                reply, job = await self._lookup(
                    s,
                    ns,
                    keys if hit is None else keys[:hit],
                    request.pin,
                    base,
                    promote=not request.hold_only,
                )
                replies.append(reply)
                if job is not None:
                    pinned.append(job)
                hit = reply.hit_blocks if hit is None else min(hit, reply.hit_blocks)
                if not hit:
                    break
        except BaseException:
            for job in pinned:  # all or nothing
                self.cache.abort_job(s, job)
            raise
        if pinned and not hit:  # a slice holds none of it: nothing is loadable, nothing pinned
            self._unpin_slices(s, pinned, replies)
        return pb.LookupSlicesReply(boot_epoch=self.settings.boot_epoch, hit_blocks=hit or 0, slices=replies)

    def _unpin_slices(self, s: Session, pinned: list[LoadJob], replies: list[Any]) -> None:
        """The common prefix is empty: the slices' pins released, and every reply says so
        (job_id 0, no offsets)."""
        for job in pinned:
            self.cache.abort_job(s, job)
        for reply in replies:
            reply.job_id = 0
            del reply.offsets[:]

    def _slices(self, request: pb.LookupSlicesRequest) -> tuple[list[NamespaceState], list[list[bytes]]]:
        """LookupSlices' namespaces and key chains, every argument checked (InvalidArgument
        naming the field) before anything is looked up."""
        ids = list(request.namespace_ids)
        if not 1 <= len(ids) <= MAX_SLICES:
            raise InvalidArgument(f"{len(ids)} namespaces: 1 to {MAX_SLICES} per call", field="namespace_ids")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a namespace appears twice", field="namespace_ids")
        if len(request.keys) != len(ids):
            raise InvalidArgument(
                f"{len(request.keys)} key chains for {len(ids)} namespaces (one per namespace)", field="keys"
            )
        return [self.scope.namespace(i) for i in ids], [
            list(split_keys(k, self.settings.max_batch)) for k in request.keys
        ]

    async def _lookup(
        self,
        s: Session,
        ns: NamespaceState,
        keys: Sequence[bytes],
        pin: bool,
        base: int,
        *,
        promote: bool = True,
    ) -> tuple[Any, LoadJob | None]:
        """One namespace's lookup (``base``: the session's arena start, for a pin's offsets):
        its reply, and the job holding its pins (``promote`` False: ``hold_only``)."""
        if pin:
            caller = self.scope.caller()
            self.cache.admission.admit_jobs(caller, s)
            held = await self.cache.lookup(ns, keys, LookupOptions(pin=s, promote=promote, shared=True))
            job, tiers = held.job, held.tiers
            if job is None:
                return pb.LookupReply(boot_epoch=self.settings.boot_epoch), None
            self.cache.admit_pins(caller, s, job)
            n = len(job.items)
            # A hold keeps a block's last copy: its host slot only while it has no copy below.
            offsets = [
                e.offset - base if t == TierId.HOST and e.copies is None else NO_OFFSET
                for e, t in zip(job.items.values(), tiers, strict=True)
            ]
            return pb.LookupReply(
                boot_epoch=self.settings.boot_epoch, hit_blocks=n, job_id=job.id, tiers=tiers, offsets=offsets
            ), job
        found = await self.cache.lookup(ns, keys, SHARED)
        return pb.LookupReply(
            boot_epoch=self.settings.boot_epoch,
            hit_blocks=found.hit,
            tiers=found.tiers,
            durable=found.durable,
        ), None

    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> Any:
        self.scope.session(request.session_id)
        ns = self.scope.namespace(request.namespace_id)
        keys = split_keys(request.keys, self.settings.max_batch)
        found = await self.cache.lookup(ns, keys, PREFETCH)
        return pb.PrefetchReply(
            boot_epoch=self.settings.boot_epoch, ready_blocks=found.hit, promoting=found.promoting
        )

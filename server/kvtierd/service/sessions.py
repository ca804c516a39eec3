"""Handlers of sessions and namespaces: RegisterNamespace, OpenSession, Heartbeat (with the
clients' published-index lookup tallies), CloseSession. Each translates its request into
SessionTable / TieredCache calls and their answer into a reply, after the caller's tenant's
checks. Event-loop thread only .
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier_contract.errors import InvalidArgument, PermissionDenied, Unavailable
from kvtier_contract.protoutil import namespace_from_spec
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.index import NamespaceState
from kvtierd.service.gate import CALLER, CREDENTIAL
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.sessions import SessionTable
from kvtierd.tenants import Tenant

_MAX_TALLY = 1 << 32  # blocks per namespace per heartbeat: far above any real rate
_COUNTER_CAP = (1 << 63) - 1  # counters fed by clients' tallies stop here (uint64 in Stats)


class SessionHandlers:
    """RegisterNamespace, OpenSession, Heartbeat, CloseSession (see the module docstring)."""

    def __init__(
        self, scope: Scope, settings: ServiceSettings, cache: TieredCache, sessions: SessionTable
    ) -> None:
        self.scope = scope
        self.settings = settings
        self.cache = cache
        self.sessions = sessions

    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context: Any) -> Any:
        spec = namespace_from_spec(request.spec)
        if request.digest and request.digest != spec.digest:
            raise InvalidArgument(
                "differs from the daemon's digest of the same fields "
                "(client and daemon disagree on the hashing spec)",
                field="digest",
            )
        caller = CALLER.get()
        charged_to = self._tenant_may_register(caller, spec) if caller is not None else None
        ns = self.cache.register_namespace(spec, charged_to)
        if charged_to is not None:  # (a publisher's registration takes over a member's charge)
            ns.charged_to = charged_to
        return pb.RegisterNamespaceReply(
            boot_epoch=self.settings.boot_epoch,
            namespace_id=ns.id,
            block_bytes=ns.block_bytes,
            digest=spec.digest,
        )

    def _tenant_may_register(self, caller: Tenant, spec: Any) -> str | None:
        """A tenant registers only namespaces naming it (``spec.tenant``, part of the digest:
        two tenants never share a namespace, nor its blocks), or naming a group it is a member
        of (``spec.group``, docs/hashing.md §7), within a quota; whose quota a new one is
        charged to (``Admission.admit_namespace``: a member that registers its group's
        namespace first pays for it itself)."""
        owner = self.scope.tenancy.tenant(spec.owner)
        if spec.group is not None:
            if owner is None or not owner.group or not self.scope.tenancy.may_see(caller.name, spec.group):
                raise PermissionDenied(
                    f"{spec.group!r} is not a group of this credential's tenant", field="spec.group"
                )
        elif spec.tenant is None:
            raise InvalidArgument(
                "required: this daemon has tenants (set it to your tenant's name)", field="spec.tenant"
            )
        elif owner is not None and owner.group:
            raise InvalidArgument(f"{spec.tenant!r} is a group: name it as spec.group", field="spec.tenant")
        elif spec.tenant != caller.name and not caller.operator:
            raise PermissionDenied(
                f"{spec.tenant!r} is not the tenant of this credential", field="spec.tenant"
            )
        return self.cache.admission.admit_namespace(caller, spec.namespace_id, spec.owner)

    async def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> Any:
        if self.settings.draining:
            raise Unavailable("daemon is draining")
        if request.transport not in set(Transport) | {pb.TRANSPORT_UNSPECIFIED}:
            raise InvalidArgument(f"unsupported transport {request.transport}", field="transport")
        transport = self.scope.transport(request.transport or pb.TRANSPORT_SHM)
        caller = CALLER.get()
        tenant = caller.name if caller is not None else None
        if caller is not None and transport.label not in caller.transports:
            raise PermissionDenied(
                f"tenant {caller.name} may not use {transport.label} "
                f"(allowed: {', '.join(sorted(caller.transports))})",
                field="transport",
            )
        self.cache.admission.admit_session(caller)
        s = self.sessions.open(
            request.client_name,
            request.lease_ttl_ms / 1000.0,
            transport,
            tenant,
            caller.max_lease_s if caller is not None else None,
            CREDENTIAL.get(),
        )
        adv, pool = self.settings.advertise(), self.scope.mapped_arena(s)
        return pb.OpenSessionReply(
            boot_epoch=self.settings.boot_epoch,
            session_id=s.id,
            lease_ttl_ms=int(s.ttl_s * 1000),
            shm_socket=adv["shm_socket"],
            data_host=adv["data_host"],
            data_port=adv["data_port"],
            arena_bytes=self.cache.host.pool_bytes[pool] if pool is not None else 0,
            max_batch_blocks=self.settings.max_batch,
            data_secret=s.data_secret,
            data_tls=adv.get("data_tls", False),
            lookup_slices=True,
            tier_figures=self.scope.tier_figures(),
            tenant=tenant or "",
            events=self.cache.residency.events.publishing,
        )

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        s = self.scope.session(request.session_id)
        if request.local_lookups:
            self._count_local_lookups(request.local_lookups)
        return pb.HeartbeatReply(
            boot_epoch=self.settings.boot_epoch,
            lease_ttl_ms=int(s.ttl_s * 1000),
            tier_figures=self.scope.tier_figures(),
        )

    def _count_local_lookups(self, tallies: Sequence[Any]) -> None:
        """Add clients' published-index lookups to their namespaces' counters: all checked
        first, so a bad tally changes nothing. Counters saturate (a client cannot wrap them)."""
        if len(tallies) > len(self.scope.visible()):
            raise InvalidArgument(
                f"has {len(tallies)} entries for {len(self.scope.visible())} namespaces",
                field="local_lookups",
            )
        checked: dict[int, tuple[Any, Any]] = {}
        for i, t in enumerate(tallies):
            name = f"local_lookups[{i}]"
            if (
                t.blocks_hit > t.blocks_requested
                or t.lookups > t.blocks_requested
                or t.blocks_requested > _MAX_TALLY
            ):
                raise InvalidArgument(
                    f"needs blocks_hit <= blocks_requested, lookups <= blocks_requested <= {_MAX_TALLY}",
                    field=name,
                )
            ns = self.cache.namespaces.get(t.namespace_id)
            if ns is not None and not self.scope.sees(ns):
                ns = None  # another tenant's: answered as an absent one
            if ns is None:  # (INVALID_ARGUMENT: NOT_FOUND would read as a forgotten session)
                raise InvalidArgument(
                    f"no namespace {t.namespace_id} on this daemon", field=f"{name}.namespace_id"
                )
            if ns.id in checked:
                raise InvalidArgument(f"namespace {ns.id} appears twice", field=f"{name}.namespace_id")
            checked[ns.id] = (ns, t)
        for ns, t in checked.values():
            _add_tally(ns, t)

    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> Any:
        self.sessions.close(request.session_id, self.scope.scope())
        return pb.CloseSessionReply(boot_epoch=self.settings.boot_epoch)


def _add_tally(ns: NamespaceState, t: pb.LookupTally) -> None:
    """One checked tally added to namespace ``ns``'s counters, each saturating at
    ``_COUNTER_CAP``."""
    c, tpb = ns.counters, ns.spec.tokens_per_block
    miss = t.blocks_requested - t.blocks_hit
    for field, n in (
        ("lookups", t.lookups),
        ("local_lookups", t.lookups),
        ("blocks_requested", t.blocks_requested),
        ("blocks_hit_local", t.blocks_hit),
        ("blocks_missed", miss),
        ("tokens_requested", t.blocks_requested * tpb),
        ("tokens_hit", t.blocks_hit * tpb),
        ("tokens_missed", miss * tpb),
    ):
        setattr(c, field, min(_COUNTER_CAP, getattr(c, field) + n))

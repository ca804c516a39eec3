"""Admission: every count a tenant can exhaust, and the one place that refuses by a quota.

The counts are read from their owners (the cache's namespaces and jobs, the session table, the
storage tiers' columns), except those no table holds, which the admission keeps itself: the NVMe
bytes a tenant has queued or being written (a link claims and unclaims them), and a tenant's
control channels and the bytes they hold (a :class:`kvtierd.tenancy.Ledger` of its own; the
channels of :mod:`kvtierd.transports.control` take and give them). Every decision goes through
:meth:`kvtierd.tenancy.Tenancy.check` or the tenant's quota (:meth:`kvtierd.tenancy.Tenancy.quota`),
and every refusal no RPC carries (a block a storage tier does not write, a control channel or
its bytes) is counted here in the tenancy's refusals; a refusal raised to an RPC is counted by
the call gate.

Not here: the transports' own limits, counted before a tenant is known or beside its quotas,
each in a Ledger of the transport's (the shm socket's handshakes per peer uid,
:mod:`kvtierd.transports.shm`; the data port's connections per tenant,
:mod:`kvtierd.transports.tcp_admission`; 8 control channels a session on either).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kvtier_contract.errors import PermissionDenied, ResourceExhausted
from kvtierd.cache.jobs import JobTable, LoadJob, check_live
from kvtierd.index import NamespaceState
from kvtierd.sessions import Session
from kvtierd.tenancy import Ledger, Tenancy
from kvtierd.tenants import Tenant

CHANNELS = "control_channels"  # the quota's name and the ledger's resource
BUFFERED = "buffered_bytes"  # (likewise)


class SessionView(Protocol):
    """What the admission reads of the session table (kvtierd.sessions.SessionTable)."""

    def get(self, session_id: int, tenant: str | None = None) -> Session: ...

    def of_tenant(self, tenant: str) -> list[Session]: ...


class Admission:
    """Owns the admission contract of the cache: which counts a tenant may exhaust, when each
    is counted, and what a refusal leaves.

    * **sessions** and **namespaces** (``admit_session``, ``admit_namespace``): counted before
      one is opened or registered (the open ones of the caller's tenant, plus this one; a
      group's namespaces against the group's quota).
    * **stores into a group's namespace** (``admit_store_into``): its publishers' only.
    * **open jobs** (``admit_jobs``): per session (``session_open_jobs``) and per tenant
      (``open_jobs``), counted before a job is created (a store, a load, a pinned lookup), and
      for a store once more after it waited for room (others may have reserved meanwhile).
    * **pinned bytes** (``admit_pins``): counted after a load or pinned lookup pinned its blocks
      (its hit is only known then), the job included.
    * **host bytes** (``host_quota``, ``tenant_host_bytes``, ``host_excess``): a tenant's
      resident, reserved and limbo host slots; the cache's stores evict the tenant's own
      coldest blocks to keep to it, and it is refused (``refuse_host``) when they cannot.
    * **NVMe bytes** (``nvme_fits``, ``claim_nvme``, ``unclaim_nvme``): a tenant's copies in a
      storage tier plus those queued or being written there; a block that does not fit is not
      written there (counted as a refusal of ``nvme_bytes``).
    * **control channels** (``admit_channel``, ``release_channel``): per name of the channel's
      session's tenant, counted when a channel is made and given back when it ends; one past
      ``control_channels`` is refused (its transport closes it: the client goes on over gRPC).
    * **buffered bytes** (``take_buffered``, ``hold_unread``, ``give_buffered``): what a
      tenant's control channels hold, all of them together: bytes received and not yet a whole
      frame and the request being served (taken as they arrive; bytes that would pass
      ``buffered_bytes`` are refused and their channel closed), and replies the peer leaves
      unread (taken unrefused: the tenant gets no further bytes in); a channel gives all back
      by the time it has ended and its call returned. ``held_channels`` / ``held_buffered``
      read both (stats, tests).

    A refusal is a ResourceExhausted naming the quota (field ``quota``) raised before anything
    changed, except ``admit_pins``, whose caller releases the job it was asked about (the
    cache's ``admit_pins``: nothing stays pinned); the two of a control channel are counted
    here as they are raised. A caller of None (single-tenant daemon, not an RPC) is never
    refused by a per-caller count, except its control channels' ``buffered_bytes`` (the
    owner's default quota).

    Concurrency: event-loop thread only, no locks; every check and the change it admits run
    with no await between them.
    """

    def __init__(
        self,
        tenancy: Tenancy,
        namespaces: Mapping[int, NamespaceState],
        jobs: JobTable,
        sessions: SessionView | None = None,
    ) -> None:
        self.tenancy = tenancy
        self.sessions = sessions  # None: a cache without a session table (tests): no tenant counts
        self._namespaces = namespaces
        self._jobs = jobs
        self._nvme_claimed: dict[tuple[int, str], int] = {}  # (tier level, tenant) -> bytes
        self._channels = Ledger()  # (tenant name, CHANNELS or BUFFERED) -> held

    # -- sessions and namespaces ------------------------------------------------------------------

    def _of_tenant(self, tenant: str) -> list[Session]:
        return [] if self.sessions is None else self.sessions.of_tenant(tenant)

    def admit_session(self, caller: Tenant | None) -> None:
        """One more session of the caller's tenant (quota ``sessions``)."""
        if caller is not None:
            self.tenancy.check(caller, "sessions", len(self._of_tenant(caller.name)) + 1)

    def admit_namespace(self, caller: Tenant | None, namespace_id: int, owner: str | None) -> str | None:
        """One more namespace of ``owner`` (quota ``namespaces``), unless it is registered;
        whose quota it is charged to (``NamespaceState.charged_to``): ``owner``'s (a tenant's
        own; a group's when the caller publishes into it), else the caller's (a member
        registering its group's namespace before any publisher: its own act, so no member can
        fill its group's quota). A publisher registering one a member paid for moves the
        charge to the group, within the group's quota."""
        ns = self._namespaces.get(namespace_id)
        if caller is None:
            return owner if ns is None else ns.charged_to
        publishes = self.tenancy.may_store(caller.name, owner)
        if ns is not None and (ns.charged_to == owner or not publishes):
            return ns.charged_to
        payer = owner if publishes else caller.name
        held = sum(1 for ns in self._namespaces.values() if ns.charged_to == payer)
        who = self.tenancy.tenant(payer) or caller
        self.tenancy.check(who, "namespaces", 1 + held, f"{'group' if who.group else 'tenant'} {payer}")
        return payer

    def admit_store_into(self, caller: Tenant | None, ns: NamespaceState) -> None:
        """A store of ``caller`` into ``ns``: a group's namespace takes only its publishers'
        (and the operator's); a member's is refused (``PERMISSION_DENIED``) and counted."""
        if caller is None or self.tenancy.may_store(caller.name, ns.spec.owner):
            return
        self.tenancy.count_group_store_refusal(caller.name)
        raise PermissionDenied(
            f"tenant {caller.name} reads group {ns.spec.owner!r} but does not publish it: "
            "only its publishers store its blocks",
            field="namespace_id",
        )

    # -- jobs and pins ----------------------------------------------------------------------------

    def admit_jobs(self, caller: Tenant | None, s: Session) -> None:
        """One more open job of session ``s`` and of its tenant (before a job is created)."""
        if caller is None:
            return
        self.tenancy.check(
            caller, "session_open_jobs", len(s.store_jobs) + len(s.load_jobs) + 1, f"session {s.id}"
        )
        if s.tenant is not None:
            held = sum(len(o.store_jobs) + len(o.load_jobs) for o in self._of_tenant(s.tenant))
            self.tenancy.check(caller, "open_jobs", 1 + held, f"tenant {s.tenant}")

    def recheck(self, caller: Tenant | None, s: Session) -> Session:
        """After a wait: the session still open and the caller's (NotFound otherwise, its lease
        renewed as any call naming it), within its job quotas again."""
        if self.sessions is None:
            check_live(s)
        else:
            scope = None if caller is None or caller.operator else caller.name
            s = self.sessions.get(s.id, scope)
        self.admit_jobs(caller, s)
        return s

    def admit_pins(self, caller: Tenant | None, s: Session) -> None:
        """The ``pinned_bytes`` of ``s``'s tenant, counted after its newest job pinned."""
        if caller is None or s.tenant is None or self.tenancy.quota(caller, "pinned_bytes") is None:
            return
        pinned = 0
        for o in self._of_tenant(s.tenant):
            for job_id in o.load_jobs:
                j = self._jobs.get(o.id, job_id, LoadJob)
                pinned += len(j.items) * j.ns.slot_bytes
        self.tenancy.check(caller, "pinned_bytes", pinned, f"tenant {s.tenant}")

    # -- host bytes -------------------------------------------------------------------------------

    def host_quota(self, ns: NamespaceState) -> int | None:
        """The ``host_bytes`` quota of ``ns``'s tenant (None: none, or single-tenant); for a
        namespace left in the shared arena by a tenant that got an arena of its own later, a
        tcp-only tenant's share of it."""
        who = self.tenancy.tenant(ns.spec.owner)
        if who is None:
            return None
        quota = self.tenancy.quota(who, "host_bytes")
        return self.tenancy.shared_share(who) if quota is None and ns.pool == 0 else quota

    def tenant_host_bytes(self, tenant: str) -> int:
        """Bytes of ``tenant``'s resident, reserved (WRITING: a store that never completes holds
        them against its own quota) and limbo host slots, O(namespaces)."""
        return sum(
            (ns.counters.resident_blocks + ns.writing_blocks + ns.limbo_blocks) * ns.slot_bytes
            for ns in self._namespaces.values()
            if ns.spec.owner == tenant
        )

    @staticmethod
    def refuse_host(quota: int, tenant: str, new_bytes: int) -> ResourceExhausted:
        """The refusal by ``host_bytes``: one batch larger than the quota, or the tenant's
        blocks that would make room pinned or being written."""
        if new_bytes > quota:
            msg = f"quota host_bytes ({quota}) is smaller than one batch of {new_bytes} bytes"
        else:
            msg = f"quota host_bytes ({quota}) reached by tenant {tenant} "
            msg += "(its blocks are pinned or being written)"
        return ResourceExhausted(msg, field="quota", quota="host_bytes")

    # -- NVMe bytes -------------------------------------------------------------------------------

    def nvme_quota(self, tenant: str) -> int | None:
        """The tenant's ``nvme_bytes`` quota (None: unlimited)."""
        return self.tenancy.quota(tenant, "nvme_bytes") if self.tenancy.tenants else None

    def nvme_used(self, level: int, tenant: str, resident_column: str) -> int:
        """Bytes of ``tenant`` in the storage tier at ``level``: its copies (the tier's
        ``resident_column``) and those queued or being written."""
        held: int = sum(
            getattr(n.counters, resident_column) for n in self._namespaces.values() if n.spec.owner == tenant
        )
        return self._nvme_claimed.get((level, tenant), 0) + held

    def refuse_nvme(self, tenant: str) -> None:
        """A block of ``tenant`` not written to a storage tier by its ``nvme_bytes``: counted."""
        self.tenancy.count_refusal(tenant, "nvme_bytes")

    def claim_nvme(self, level: int, tenant: str | None, nbytes: int) -> None:
        """A block of ``tenant`` queued for the tier at ``level``."""
        if tenant is not None:
            key = (level, tenant)
            self._nvme_claimed[key] = self._nvme_claimed.get(key, 0) + nbytes

    def unclaim_nvme(self, level: int, tenant: str | None, nbytes: int) -> None:
        """That block's write ended (written or not)."""
        if tenant is None:
            return
        key = (level, tenant)
        left = self._nvme_claimed.get(key, 0) - nbytes
        if left > 0:
            self._nvme_claimed[key] = left
        else:
            self._nvme_claimed.pop(key, None)

    # -- control channels and their bytes ---------------------------------------------------------

    def admit_channel(self, tenant: str | None) -> None:
        """One more open control channel of ``tenant`` (quota ``control_channels``)."""
        self._take(tenant, CHANNELS, 1)

    def release_channel(self, tenant: str | None) -> None:
        """A channel that ``admit_channel`` admitted ended."""
        self._channels.give(tenant, CHANNELS, 1)

    def take_buffered(self, tenant: str | None, nbytes: int) -> None:
        """``nbytes`` more received by a channel of ``tenant`` (quota ``buffered_bytes``)."""
        self._take(tenant, BUFFERED, nbytes)

    def hold_unread(self, tenant: str | None, nbytes: int) -> None:
        """``nbytes`` more of replies the peer has not read: counted, never refused."""
        self._channels.take(tenant, BUFFERED, nbytes, None)

    def give_buffered(self, tenant: str | None, nbytes: int) -> None:
        """``nbytes`` taken by ``take_buffered`` or ``hold_unread`` no longer held."""
        self._channels.give(tenant, BUFFERED, nbytes)

    def held_channels(self, tenant: str | None) -> int:
        """Open control channels of ``tenant`` (None: the single-tenant daemon's owner)."""
        return self._channels.held(tenant, CHANNELS)

    def held_buffered(self, tenant: str | None) -> int:
        """Bytes held by ``tenant``'s control channels."""
        return self._channels.held(tenant, BUFFERED)

    def _take(self, tenant: str | None, quota: str, n: int) -> None:
        """Count ``n`` more of ``quota`` against ``tenant`` as it is in the current file (one a
        reload removed has the owner's quotas until its channels close), or raise and count."""
        after = self._channels.held(tenant, quota) + n
        try:
            self.tenancy.check(self.tenancy.tenant(tenant), quota, after, f"tenant {tenant or '(owner)'}")
        except ResourceExhausted:
            self.tenancy.count_refusal(tenant, quota)
            raise
        self._channels.take(tenant, quota, n, None)

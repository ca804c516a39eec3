"""Registrations: the namespaces one connection registers on every (re)open, and how.

Owns the handles (:class:`kvtier.calls.Registered`) in the order they were added; each carries
its own state (``registered_epoch``: the boot it is registered in; ``register_retry_at``: after a
refusal, when a call may register it again). ``register`` is one RegisterNamespace;
``register_all`` registers every handle at an open, a refused one missing until
``REGISTER_RETRY_S`` has passed. Why the daemon refused one is said through ``note``
(:meth:`kvtier.explainer.Explainer.note`).

A part of :class:`kvtier.connection.Connection`, handed its channel, counters, clock and note.
Thread-safety: ``add`` from any thread without a lock (``list.append`` is atomic; an open
iterating the list meanwhile registers the new handle too, or the next open does: registering
twice is harmless); ``register_all`` under the connection's lock; ``register`` from any thread.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from kvtier.calls import DOWN_CODES, REGISTER_RETRY_S, Away, Overloaded, Registered
from kvtier.diagnose import Diagnosis, explain_rpc
from kvtier.grpc_channel import GrpcChannel
from kvtier.results import ClientCounters
from kvtier_contract import errors
from kvtier_contract.protoutil import namespace_spec
from kvtier_contract.v1 import kvtier_pb2 as pb

Note = Callable[[str, Diagnosis], None]


class Registrations:
    """See the module docstring."""

    def __init__(
        self, channel: GrpcChannel, counters: ClientCounters, clock: Callable[[], float], note: Note
    ) -> None:
        self._channel, self._counters, self._clock, self._note = channel, counters, clock, note
        self.handles: list[Registered] = []  # in the order added (``add``); read by any thread

    def add(self, handle: Registered) -> None:
        self.handles.append(handle)

    def register_all(self, timeout: Callable[[], float], tenant: str | None) -> None:
        """Register every handle, each RPC within ``timeout()``; one the daemon refuses misses
        until ``REGISTER_RETRY_S`` has passed (then its next call registers it). Away when the
        daemon does not answer."""
        for handle in self.handles:
            try:
                self.register(handle, timeout(), tenant)
            except errors.KvtierError as e:  # refused (quota, table full...): its calls miss
                handle.register_retry_at = self._clock() + REGISTER_RETRY_S
                self.refused(handle, e)

    def register(self, handle: Registered, timeout: float, tenant: str | None) -> None:
        """RegisterNamespace (a namespace naming no tenant takes ``tenant``, the session's);
        Away when the daemon does not answer (the caller trips)."""
        if tenant is not None:
            handle.take_tenant(tenant)
        try:
            reply = self._channel.stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(
                    spec=namespace_spec(handle.namespace), digest=handle.namespace.digest
                ),
                timeout=timeout,
            )
        except grpc.RpcError as e:
            if e.code() in DOWN_CODES:
                raise Away(
                    f"RegisterNamespace: {e.code().name}: {e.details()}",
                    explain_rpc(self._channel.peer, "RegisterNamespace", e.code().name, e.details() or ""),
                ) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (e.details() or "").startswith(
                errors.OVERLOADED
            ):
                self._counters.overloaded += 1
                raise Overloaded(e.details()) from None
            raise errors.from_grpc_code(e.code().name, e.details() or "") from None
        if reply.block_bytes != handle.block_bytes or reply.namespace_id != handle.namespace_id:
            raise errors.Internal("daemon and client disagree on the namespace's id or block size")
        handle.registered_epoch = reply.boot_epoch

    def refused(self, handle: Registered, error: errors.KvtierError) -> None:
        """The daemon refused to register ``handle``'s namespace: its calls miss."""
        ns = handle.namespace
        self._note(
            f"RegisterNamespace: {error}",
            Diagnosis(
                f"register-{type(error).__name__}",
                type(error)(
                    f"daemon at {self._channel.address} refused namespace "
                    f"{ns.model_id}@{ns.model_revision} (id {handle.namespace_id}): {error}"
                ),
            ),
        )

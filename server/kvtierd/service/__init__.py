"""gRPC service: translates proto messages to TieredCache / SessionTable calls and back.

Every request is validated (ids, key counts and lengths, transports) before anything touches the
index or memory; every reply carries the boot epoch. Runs on the daemon's event loop. The parts:

* :mod:`~kvtierd.service.gate`: the call gate every call passes (authentication, admission at
  ``max_inflight``, the deadline, an undecodable body, error mapping through
  ``kvtier_contract.errors.GRPC_STATUS``, latency), and the control channel's dispatch through
  it (the frames themselves: :mod:`kvtierd.transports.control`);
* :mod:`~kvtierd.service.registration`: :func:`add_to_server` (lenient request decoding);
* :mod:`~kvtierd.service.servicer`: :class:`KvtierService`, the gRPC servicer: each RPC through
  the gate to its handler family;
* :mod:`~kvtierd.service.scope`: the caller's checks and the settings the families share;
* the handler families, plain classes each handed the parts it uses:
  :mod:`~kvtierd.service.sessions` (sessions and namespaces), :mod:`~kvtierd.service.lookups`,
  :mod:`~kvtierd.service.transfers` (stores and loads, and the completions that hash around the
  cache's primitives; the admission is the cache's: :mod:`kvtierd.cache.admission`),
  :mod:`~kvtierd.service.cuda`, :mod:`~kvtierd.service.stats`, :mod:`~kvtierd.service.prefixes`
  (published prefixes; the registry is :mod:`kvtierd.tenancy.prefixes`).

Health and reflection are other services and never refused.
"""

from kvtierd.service.gate import (
    CALLER,
    CREDENTIAL,
    NEVER_SHED,
    ChannelAbort,
    ChannelContext,
    ChannelDispatch,
    Undecodable,
)
from kvtierd.service.lookups import MAX_SLICES, NO_OFFSET
from kvtierd.service.registration import add_to_server
from kvtierd.service.servicer import BAD_INPUT_LOG_INTERVAL_S, KvtierService
from kvtierd.service.stats import salt_tag

__all__ = [
    "BAD_INPUT_LOG_INTERVAL_S",
    "CALLER",
    "CREDENTIAL",
    "MAX_SLICES",
    "NEVER_SHED",
    "NO_OFFSET",
    "ChannelAbort",
    "ChannelContext",
    "ChannelDispatch",
    "KvtierService",
    "Undecodable",
    "add_to_server",
    "salt_tag",
]

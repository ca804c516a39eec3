"""gRPC service: translates proto messages to TieredCache / SessionTable calls and back.

Every request is validated (ids, key counts and lengths, transports) before anything touches the
index or memory; every reply carries the boot epoch. Runs on the daemon's event loop. The parts:

* :mod:`~kvtierd.service.gate`: the call gate every call passes (authentication, admission at
  ``max_inflight``, the deadline, an undecodable body, error mapping through
  ``kvtier_contract.errors.GRPC_STATUS``, latency);
* :mod:`~kvtierd.service.registration`: :func:`add_to_server` (lenient request decoding);
* :mod:`~kvtierd.service.channel`: the control channel's dispatch (the frames themselves:
  :mod:`kvtierd.transports.control`);
* :mod:`~kvtierd.service.base`: the state and checks the handler families share;
* the handler families: :mod:`~kvtierd.service.sessions` (sessions and namespaces),
  :mod:`~kvtierd.service.lookups`, :mod:`~kvtierd.service.transfers` (stores and loads; the
  flows that wait or hash are the cache's, :mod:`kvtierd.cache.flows`),
  :mod:`~kvtierd.service.cuda`, :mod:`~kvtierd.service.stats`.

Health and reflection are other services and never refused.
"""

from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.service.base import BAD_INPUT_LOG_INTERVAL_S, ServiceBase
from kvtierd.service.channel import ChannelDispatch
from kvtierd.service.cuda import CudaHandlers
from kvtierd.service.gate import CALLER, CREDENTIAL, NEVER_SHED, ChannelAbort, ChannelContext, Undecodable
from kvtierd.service.lookups import MAX_SLICES, NO_OFFSET, LookupHandlers
from kvtierd.service.registration import add_to_server
from kvtierd.service.sessions import SessionHandlers
from kvtierd.service.stats import StatsHandlers, salt_tag
from kvtierd.service.transfers import TransferHandlers


class KvtierService(
    SessionHandlers,
    LookupHandlers,
    TransferHandlers,
    CudaHandlers,
    StatsHandlers,
    pb_grpc.KvtierServicer,  # type: ignore[misc]
):
    """The control plane: every Kvtier handler, one family per base class. Owns nothing but its
    latency histograms and error counts (per method and status); event-loop thread only."""


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
    "ServiceBase",
    "Undecodable",
    "add_to_server",
    "salt_tag",
]

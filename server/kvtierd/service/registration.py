"""Registration of the Kvtier service with a grpc.aio server.

:func:`add_to_server` builds the Kvtier method handlers from the proto descriptor instead of the
generated ``add_KvtierServicer_to_server`` (which stays as generated), with lenient request
deserializers: a body that does not decode reaches the handler as
:class:`~kvtierd.service.gate.Undecodable` and is answered INVALID_ARGUMENT by the call gate,
counted per method in ``errors``, and logged at most once per ``BAD_INPUT_LOG_INTERVAL_S`` (left
to grpc: UNKNOWN, uncounted, a traceback per request). Called once, before the server starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.gate import SERVICE, Undecodable


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, answering :class:`Undecodable` instead of raising for a malformed body."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Undecodable(str(e) or "malformed protobuf")

    return deserialize


def add_to_server(service: Any, server: grpc.aio.Server) -> None:
    """Register ``service``'s methods (all unary) with lenient request deserializers."""
    handlers = {}
    for m in SERVICE.methods:
        assert not (m.client_streaming or m.server_streaming), m.full_name
        request, reply = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            getattr(service, m.name),
            request_deserializer=lenient(request.FromString),
            response_serializer=reply.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)

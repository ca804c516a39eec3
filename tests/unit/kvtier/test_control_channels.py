"""The SDK's control-channel pool (kvtier.control.ControlChannels) without a daemon: a socketpair
plays the daemon's end.

* a daemon that refuses (or does not serve) control channels sends the session to gRPC for good;
  one that cannot be reached now (a restart, its connection cap) only for ``RETRY_S``;
* a reply is parsed as the method's reply message, an error status as a ControlError with the
  daemon's code and message; a connection left without a whole answer is never reused.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import grpc
import pytest

from kvtier import control
from kvtier_contract import wire
from kvtier_contract.v1 import kvtier_pb2 as pb


def failing(error: Exception, counter: list[int]) -> Callable[[float], socket.socket]:
    def dial(_timeout_s: float) -> socket.socket:
        counter[0] += 1
        raise error

    return dial


def test_a_refusal_is_for_good_an_unreachable_daemon_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    dials = [0]
    refused = control.ControlChannels(failing(ValueError("refused: no"), dials), 7, 1.0)
    assert refused.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0) is None
    assert refused.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0) is None
    assert dials == [1] and refused.refused == "refused: no"

    dials = [0]
    away = control.ControlChannels(failing(ConnectionRefusedError(), dials), 7, 1.0)
    clock = [100.0]
    monkeypatch.setattr(control.time, "monotonic", lambda: clock[0])
    assert away.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0) is None
    assert away.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0) is None
    assert dials == [1] and not away.refused  # gRPC meanwhile, no dial
    clock[0] += control.RETRY_S
    assert away.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0) is None
    assert dials == [2]


def serve_one(daemon_end: socket.socket, status: int, body: bytes) -> threading.Thread:
    """Read one call on ``daemon_end`` and answer ``status`` / ``body``."""

    def run() -> None:
        head = daemon_end.recv(wire.CALL.size)
        length, _method, _timeout = wire.CALL.unpack(head)
        got = b""
        while len(got) < length:
            got += daemon_end.recv(length - len(got))
        daemon_end.sendall(wire.RESULT.pack(len(body), status) + body)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_replies_errors_and_unanswered_calls() -> None:
    mine, theirs = socket.socketpair()
    pool = control.ControlChannels(lambda _t: mine, 7, 1.0)
    t = serve_one(theirs, 0, pb.HeartbeatReply(boot_epoch=42).SerializeToString())
    assert pool.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 1.0).boot_epoch == 42
    t.join()
    t = serve_one(theirs, grpc.StatusCode.NOT_FOUND.value[0], b"unknown namespace 3")
    with pytest.raises(control.ControlError) as e:
        pool.call("Lookup", pb.LookupRequest(session_id=7), 1.0)
    t.join()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details() == "unknown namespace 3"
    assert pool.calls == 2
    with pytest.raises(control.ControlError) as e:  # the daemon reads but never answers
        pool.call("Heartbeat", pb.HeartbeatRequest(session_id=7), 0.05)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert mine.fileno() == -1  # closed, not given back
    assert pool.call("Stats", pb.StatsRequest(), 1.0) is None  # not a control method
    theirs.close()

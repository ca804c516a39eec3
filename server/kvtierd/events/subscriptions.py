"""Topic subscriptions on the event PUB sockets: only prefixes of ``events_topic`` are applied.

libzmq keeps every subscription a peer sends in a trie (about 47 bytes of daemon memory a byte
of topic), with no limit and nothing given back until the peer disconnects: a peer sending
distinct subscriptions grew a daemon 5.7 GiB in 33 s. So a stream's PUB socket is an XPUB with
``XPUB_MANUAL``: libzmq applies nothing itself and hands each (un)subscription to the publisher
thread, which applies it (``ZMQ_SUBSCRIBE`` right after reading it, so libzmq gives it to the
connection it came from) only when it is a prefix of the topic, the empty one included: the only
subscriptions that can ever match a message. A connection then holds at most
``len(topic) + 1`` subscriptions.

Anything else (a subscription no message could match, a message that is no subscription) is
dropped and counted, and the connections it came from are closed (:func:`close_peer`: every
connection of that socket from the sender's process, or its IP over TCP): in manual mode libzmq
still records each subscription per connection, to announce its unsubscriptions when it goes,
and only closing the connection gives that back. What one connection can make libzmq hold until
then is bounded: its messages move into the socket only in the publisher thread's socket
calls, at most the receive high-water mark of them at a time, each at most
:func:`subscription_max_bytes` (a larger one closes the connection in libzmq itself), and once
shut down it delivers at most what its peer had already written. A stock SUB subscriber (vLLM's,
the router's) subscribes to the topic or to "" and sees no difference.

Primitives: :func:`subscription_max_bytes`, :func:`close_peer`, :class:`SubscriptionFilter`
(``serve(sock)`` once a turn for each PUB socket). The publisher thread alone.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from typing import Any

log = logging.getLogger("kvtierd.events")
MAX_READS_PER_TURN = 1024
"""Subscription messages read from one socket in one turn of the publisher thread."""


def subscription_max_bytes(topic: bytes) -> int:
    """The largest message a subscriber sends for ``topic`` (``\\x01`` + topic, or a ZMTP 3.1
    SUBSCRIBE command: 10 bytes + topic), with room for its handshake's READY command (libzmq
    applies the limit to that too: a SUB's is 25 bytes)."""
    return len(topic) + 256


class SubscriptionFilter:
    """Reads what peers send to the PUB sockets and applies only prefixes of the topic (see the
    module docstring). Owns its counters; the publisher thread alone calls ``serve``."""

    def __init__(self, topic: bytes) -> None:
        import zmq

        self._zmq = zmq
        self._topic = topic
        self._shut: set[int] = set()  # inodes of the connections close_peer shut down
        self.dropped = 0
        """Messages dropped: subscriptions that are no prefix of the topic, and non-subscriptions."""
        self.closed = 0
        """Connections closed for sending one."""

    def serve(self, sock: Any) -> None:
        """Apply or drop what waits on ``sock``, at most ``MAX_READS_PER_TURN`` (never blocks);
        the connections of each sender of a dropped one are looked for once a turn."""
        zmq = self._zmq
        seen: set[str] = set()
        for _ in range(MAX_READS_PER_TURN):
            try:  # (no poll: each lets libzmq take in more, a recv only every 100th)
                msg = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = msg.bytes
            kind, topic = data[:1], data[1:]
            if kind in (b"\x00", b"\x01") and self._topic.startswith(topic):
                sock.setsockopt(zmq.SUBSCRIBE if kind == b"\x01" else zmq.UNSUBSCRIBE, topic)
            elif kind != b"\x00":  # (a cancel: libzmq has forgotten it already)
                self.dropped += 1
                peer = _peer_address(msg)
                if peer not in seen:  # (one look a turn for each: it lists the process's files)
                    seen.add(peer)
                    n = close_peer(sock, peer, self._shut)
                    self.closed += n
                    log.debug("KV-event subscription %r from %s dropped: %d closed", data[:48], peer, n)


def _peer_address(msg: Any) -> str:
    """The connection's Peer-Address as libzmq records it ("" when it has none)."""
    try:
        return str(msg.get("Peer-Address"))
    except Exception:  # noqa: BLE001  (zmq.ZMQError: no such property)
        return ""


def close_peer(sock: Any, peer: str, shut: set[int]) -> int:
    """Shut down the connections the ZMQ socket ``sock`` accepted from ``peer`` (a message's
    Peer-Address: the IP, or for a Unix socket ``...:uid:gid:pid``; "" matches none), found
    among this process's file descriptors by their local address (the socket's bound one), not
    shut down before (``shut``: their inodes, added to); how many. libzmq then sees them end."""
    local = _local_name(sock)
    n = 0
    for name in os.listdir("/proc/self/fd") if peer and local is not None else ():
        try:
            fd = os.dup(int(name))
        except OSError:  # (closed since it was listed)
            continue
        try:
            conn = socket.socket(fileno=fd)
        except OSError:  # ENOTSOCK: not a socket
            os.close(fd)
            continue
        with conn:
            try:
                ino = os.fstat(conn.fileno()).st_ino
                if ino in shut or conn.type != socket.SOCK_STREAM or conn.getsockname() != local:
                    continue
                if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # the listener itself
                    continue
                if _peer_of(conn) in (peer, peer.rsplit(":", 3)[-3:]):
                    conn.shutdown(socket.SHUT_RDWR)  # (the connection, not just this duplicate)
                    shut.add(ino)
                    n += 1
            except OSError:
                pass
    if len(shut) > 4096:  # (inodes of connections long gone)
        shut.clear()
    return n


def _local_name(sock: Any) -> Any:
    """What ``getsockname()`` says on a connection ``sock`` accepted (None: not known)."""
    import zmq

    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("ipc://"):
        return endpoint.removeprefix("ipc://")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def _peer_of(conn: socket.socket) -> str | list[str]:
    """A connection's peer as libzmq names it: the IP, or ``[uid, gid, pid]`` for a Unix socket."""
    if conn.family == socket.AF_UNIX:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return [str(uid), str(gid), str(pid)]
    return str(conn.getpeername()[0])

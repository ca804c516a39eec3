"""The TCP data channel's framing, stated once (grammar and rationale: docs/tcp_data_channel.md).

Every frame starts with one fixed 32-byte header::

    header  = magic:4s ("KVD1") op:u8 pad:3x job_id:u64le index:u32le status:u32le length:u64le
    frame   = header payload[length]

Client -> daemon: HELLO (job_id = session id, status = the features the client offers, payload =
the session's ``data_secret`` from OpenSessionReply, ``DATA_SECRET_BYTES`` long), WRITE
(index = key index of a store job, payload = the block), WRITE_RUN (index = the first of
``status`` consecutive key indexes, payload = their blocks back to back, each length/status
bytes), FLUSH (ask for an ACK of everything sent for job_id), READ (send the blocks of a load
job). Daemon -> client: HELLO_OK (status = the offered features it accepts), ACK (status = 0 or
an error code), DATA (index = key index, payload = the block), DATA_RUN (as WRITE_RUN), ERROR
(payload = utf-8 message; the daemon closes the connection after it).

Features (bits of HELLO's status): ``FEATURE_RUNS`` = WRITE_RUN and DATA_RUN may be used. A
daemon that does not know a feature answers without its bit, so either side may be older: runs
are used only when both offered them. A run carries many blocks under one header, so the daemon
reads a run straight into adjacent slots with few system calls and no per-block header.
``FEATURE_CONTROL`` = after HELLO_OK the connection is a *control channel* of the session: no
more KVD1 frames, only ``CALL`` / ``RESULT`` (below; the same framing as on the shm socket),
a remote client's control calls without gRPC. A daemon that does not serve it answers
without the bit, and the client closes that connection.

Both sides build the block frames they send with :func:`block_frames` / :func:`run_frames`
(header and payload views, ready for one gathered write): the client its WRITE and WRITE_RUN
frames, the daemon its DATA and DATA_RUN frames.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable

MAGIC = b"KVD1"
# magic, op, job_id, index, status, length  (little endian, 32 bytes)
HEADER = struct.Struct("<4sB3xQIIQ")
assert HEADER.size == 32
MAX_ERROR_BYTES = 4096
FEATURE_RUNS = 1
FEATURE_CONTROL = 2
DATA_SECRET_BYTES = 32  # HELLO's payload: the session's data secret (OpenSessionReply.data_secret)
MAX_RUN_BYTES = 64 << 20  # one WRITE_RUN / DATA_RUN payload at most (or one block): bounded latency

Buffer = bytes | memoryview


class Op(enum.IntEnum):
    HELLO = 1
    WRITE = 2
    FLUSH = 3
    READ = 4
    WRITE_RUN = 5
    HELLO_OK = 17
    ACK = 18
    DATA = 19
    DATA_RUN = 20
    ERROR = 31


_OPS = {int(op): op for op in Op}  # a dict lookup is ~10x cheaper than Op(n) per frame


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_JOB = 1
    BAD_INDEX = 2
    BAD_LENGTH = 3


# -- the shm handshake (docs/shm_transport.md), on the daemon's shm Unix socket, one exchange per
# connection, then the daemon closes it. The session's data secret (OpenSessionReply.data_secret)
# proves the caller opened the session: a session id alone is no credential (it appears in every
# control request); ``KVS1`` (the id alone) is refused by name:
#   client -> daemon:  SHM_MAGIC session_id:u64le data_secret (DATA_SECRET_BYTES)
#   daemon -> client:  SHM_MAGIC arena_bytes:u64le boot_epoch:u64le   + the fd (SCM_RIGHTS)
#                  or  SHM_REFUSED utf-8 message (at most SHM_MAX_ERROR_BYTES)
# Every request on the socket starts with SHM_REQUEST (12 bytes: a magic and a u64), which names
# the exchange; KVS2, KVC1 and the published index's KVI2 go on with the session's data secret.
SHM_MAGIC = b"KVS2"
SHM_MAGIC_V1 = b"KVS1"  # the session id alone: refused
SHM_REFUSED = b"KVE1"
SHM_REQUEST = struct.Struct("<4sQ")  # magic, session_id (then the secret, for KVS2 and KVC1)
SHM_REPLY = struct.Struct("<4sQQ")  # magic, arena_bytes, boot_epoch
SHM_MAX_ERROR_BYTES = 1000
# ``KVS3`` (the same request as KVS2) asks for every arena the session may map: its tenant's own
# (read-write) and, on a daemon with tenants, the arena of each group it reads (docs/security.md
# "Group arenas"), sealed so that no client can write it (F_SEAL_FUTURE_WRITE: no new writable
# mapping, no write(2), no hole punched). The offsets a session is told are offsets in the
# concatenation of its arenas in the reply's order, the writable one first:
#   daemon -> client:  SHM_MAGIC_V3 total_bytes:u64le boot_epoch:u64le count:u32le
#                      count x (arena_bytes:u64le flags:u32le)
#                      (count - 1) x (name_len:u16le name: utf-8, the group of each read-only arena)
#                      + count fds (SCM_RIGHTS), in order
#                  or  SHM_REFUSED utf-8 message
# A daemon that predates KVS3 refuses it (its message names the magic): the client asks KVS2.
SHM_MAGIC_V3 = b"KVS3"
SHM_REPLY_V3 = struct.Struct("<4sQQI")  # magic, total bytes, boot_epoch, arena count
SHM_ARENA = struct.Struct("<QI")  # one arena's bytes and flags
SHM_ARENA_WRITABLE = 1  # the session's own arena (only the first may be)
SHM_MAX_ARENAS = 17  # its own and at most 16 groups' (more groups: the first 16 by name)
SHM_GROUP_NAME = struct.Struct("<H")  # a read-only arena's group name's length (utf-8 bytes)
SHM_MAX_REPLY_BYTES = 16384  # a KVS3 reply at most (17 arenas, 16 names of <= 512 bytes)

# -- the Unix peer login (docs/security.md), on the same socket, one exchange per connection: the
# daemon reads the peer's uid/gid (SO_PEERCRED) and, when a tenant of its tenants file logs in by
# them (``unix_login``), mints a bearer token for it:
#   client -> daemon:  LOGIN_MAGIC 0:u64le                    (SHM_REQUEST's size)
#   daemon -> client:  LOGIN_MAGIC length:u64le token (ASCII, length bytes, at most LOGIN_MAX)
#                  or  SHM_REFUSED utf-8 message
LOGIN_MAGIC = b"KVL1"
LOGIN_REPLY = struct.Struct("<4sQ")  # magic, token length; the token follows
LOGIN_MAX_TOKEN_BYTES = 256

# -- the control channel (docs/shm_transport.md "Control channel"), on the same socket: a
# session's control calls as length-prefixed protobufs, instead of gRPC (a same-host client's
# hot path: Prepare*/Complete* per batch). The connection stays open for the session's life:
#   client -> daemon:  CONTROL_MAGIC session_id:u64le data_secret (DATA_SECRET_BYTES)
#   daemon -> client:  CONTROL_MAGIC boot_epoch:u64le              or  SHM_REFUSED message
# then, one call at a time (the daemon reads the next once it has answered):
#   client -> daemon:  CALL   length:u32le method:u8 timeout_ms:u32le  + the request (length)
#   daemon -> client:  RESULT length:u32le status:u8                   + the reply, or for a
#                      status other than 0 (a gRPC status code) a utf-8 message (length)
CONTROL_MAGIC = b"KVC1"
CONTROL_REPLY = struct.Struct("<4sQ")  # magic, boot_epoch
CALL = struct.Struct("<IBI")  # request length, method (CONTROL_METHODS index + 1), timeout ms
RESULT = struct.Struct("<IB")  # reply length, status (0: OK, else a gRPC status code)
CONTROL_MAX_BYTES = 4 << 20  # one request or reply at most (gRPC's default receive limit)
CONTROL_METHODS = (
    "PrepareStore",
    "CompleteStore",
    "PrepareLoad",
    "CompleteLoad",
    "Lookup",
    "Prefetch",
    "Heartbeat",
    "CudaCopy",
    "LookupSlices",
)
"""Kvtier RPCs a control channel carries: the session-scoped ones a transfer or lookup makes."""


def pack(op: Op, job_id: int = 0, index: int = 0, status: int = 0, length: int = 0) -> bytes:
    return HEADER.pack(MAGIC, op, job_id, index, status, length)


def hello(session_id: int, data_secret: bytes, features: int = 0) -> bytes:
    """A whole HELLO frame: the session and its data secret (OpenSessionReply.data_secret)."""
    return pack(Op.HELLO, session_id, status=features, length=len(data_secret)) + data_secret


def shm_request(magic: bytes, session_id: int, data_secret: bytes) -> bytes:
    """A whole KVS2 or KVC1 request: the session and its data secret."""
    return SHM_REQUEST.pack(magic, session_id) + data_secret


def unpack(buf: bytes | bytearray | memoryview) -> tuple[Op, int, int, int, int]:
    """Parse a header; ValueError for a bad magic or an unknown op."""
    magic, op, job_id, index, status, length = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ValueError(f"bad frame magic {magic!r}")
    known = _OPS.get(op)
    if known is None:
        raise ValueError(f"unknown frame op {op}")
    return known, job_id, index, status, length


def block_frames(op: Op, job_id: int, blocks: Iterable[tuple[int, Buffer]]) -> list[Buffer]:
    """One WRITE or DATA frame per ``(key index, block)``: its header, then the block itself."""
    frames: list[Buffer] = []
    for index, view in blocks:
        frames += (pack(op, job_id, index, length=len(view)), view)
    return frames


def run_frames(op: Op, job_id: int, blocks: Iterable[tuple[int, Buffer]]) -> list[Buffer]:
    """WRITE_RUN or DATA_RUN frames: one header per run of consecutive key indexes whose blocks
    have one size (at most ``MAX_RUN_BYTES`` of them, or one block), then the blocks themselves."""
    frames: list[Buffer] = []
    run: list[Buffer] = []
    first = 0
    for index, view in blocks:
        if run and (
            index != first + len(run)
            or len(view) != len(run[0])
            or (len(run) + 1) * len(view) > MAX_RUN_BYTES
        ):
            frames.append(pack(op, job_id, first, len(run), len(run) * len(run[0])))
            frames += run
            run = []
        if not run:
            first = index
        run.append(view)
    if run:
        frames.append(pack(op, job_id, first, len(run), len(run) * len(run[0])))
        frames += run
    return frames

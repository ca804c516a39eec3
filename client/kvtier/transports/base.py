"""DataTransport: moves the bytes of one prepared job; knows nothing of keys or the index.

Lifecycle::

    attach(session_id, open_reply, timeout_s)   once per session (maps the arena / connects)
      -> write(job_id, items) / read(job_id, items)   any number of times, one at a time
      -> close()

``items`` are ``(key_index, arena_offset, view)`` triples produced by the control plane's
prepare reply. Bytes verified end to end (docs/security.md): ``write(..., digest=True)`` returns
the digest of each block it wrote when the transport copies it itself (shm), and
``read(..., digests)`` checks each block it filled against its digest from PrepareLoad.
Failures raise :class:`kvtier_contract.errors.TransportError`; the client then treats the daemon
as away (stores dropped, loads missed) and reattaches later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

Item = tuple[int, int, memoryview]


class DataTransport(ABC):
    """One session's data path. Not thread-safe: the client serializes transfers."""

    name: str
    proto_value: int
    tls_context: Any = None
    """An ``ssl.SSLContext`` for a data channel that serves TLS (tcp only; set before attach)."""
    tls_server_name: str | None = None
    """The name that channel's certificate is checked against (tcp only)."""
    io_timeout_s: float = 1.0
    """Bound on each blocking socket operation of a transfer once attached (the session's
    ``timeout_s``; attach itself runs within the timeout it is given)."""

    @abstractmethod
    def attach(self, session_id: int, reply: Any, timeout_s: float) -> None: ...

    @abstractmethod
    def write(self, job_id: int, items: list[Item], *, digest: bool = False) -> list[int] | None:
        """Move each view's bytes into the reserved slot; return once the daemon holds them.
        With ``digest``: each block's digest (kvtier_contract.digests) of the bytes written, or
        None when the daemon hashes the blocks itself (tcp, cuda_ipc)."""

    @abstractmethod
    def read(self, job_id: int, items: list[Item], digests: Sequence[int] = ()) -> list[int]:
        """Fill each view with its pinned block's bytes. ``digests`` (one per item, 0 = none
        known; empty = check nothing): the bytes loaded are hashed as they are loaded; returns
        the positions in ``items`` whose bytes did not match (misses)."""

    def bind_rpc(self, rpc: Any) -> None:
        """Receive the session's ``(method, request) -> reply`` call, for transports whose
        transfers are control RPCs too (cuda_ipc); the others ignore it."""
        return None

    @abstractmethod
    def close(self) -> None: ...

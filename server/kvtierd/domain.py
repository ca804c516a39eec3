"""Domain values of the daemon's core: which tier, what a store answered, which transport.

Plain enums, so that the cache, the tiers and the transports never handle protobuf values. Their
numbers equal the wire enums' (``kvtier.v1.Tier``, ``StoreStatus``, ``Transport``), so the service
edge converts by value, in one place; tests/unit/kvtierd/test_domain.py checks that the two agree.
"""

from __future__ import annotations

import enum


class TierId(enum.IntEnum):
    """Where a hit's bytes are now (one byte per hit in lookup replies)."""

    NONE = 0
    HOST = 1
    NVME = 2
    CLUSTER = 3


class StoreStatus(enum.IntEnum):
    """What ``prepare_store`` answered for one key."""

    RESERVED = 1
    ALREADY_PRESENT = 2
    REJECTED = 3


class Transport(enum.IntEnum):
    """How a job's bytes move between a client and the host tier."""

    SHM = 1
    TCP = 2
    CUDA_IPC = 3

    @property
    def label(self) -> str:
        """The name used in counters, metrics and messages: "shm", "tcp", "cuda_ipc"."""
        return self.name.lower()

    @property
    def daemon_moved(self) -> bool:
        """The daemon moves this transport's bytes itself, so a store commits only what arrived
        (tcp: the data channel; cuda_ipc: the daemon's copies). shm clients copy themselves."""
        return self is not Transport.SHM

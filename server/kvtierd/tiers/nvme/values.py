"""The NVMe tier's plain values: its configuration, a block's location on disk, its figures.

Role: data shared by the tier (:mod:`kvtierd.tiers.nvme.tier`, which re-exports them), its startup
(:mod:`kvtierd.tiers.nvme.startup`) and the cache that stores locations. Ownership: NvmeConfig and
NvmeLocation are frozen values; an NvmeFigures belongs to one NvmeTier, which updates it on the
event-loop thread (startup: the opening thread). Concurrency: read anywhere, no locks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NvmeLocation:
    """Where a block lives on disk; ``offset`` is linear over all files (file * file_bytes + …)."""

    offset: int
    slot_bytes: int
    payload_len: int
    checksum: int
    seq: int


@dataclass(frozen=True, kw_only=True)
class NvmeConfig:
    directory: str
    capacity_bytes: int
    io_align: int = 4096
    file_bytes: int = 1 << 30
    slab_bytes: int = 64 << 20
    io_threads: int = 4
    journal_rotate_bytes: int = 64 << 20
    progress_interval_s: float = 5.0  # recovery logs how far it got at most this often


@dataclass
class NvmeFigures:
    """Tier-wide figures (per-namespace ones live in the cache's Counters)."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    checksum_failures: int = 0
    quarantined_slots: int = 0
    write_errors: int = 0
    recovery_seconds: float = 0.0
    recovered_blocks: int = 0
    recovery_quarantined: int = 0
    recovery_mode: str = ""
    direct_io: bool = False
    direct_io_note: str = ""

"""What one bench run measures (``Plan``) and what it found (``Results``), as plain data.

``Plan.from_args`` turns the ``kvtier bench`` arguments into a validated plan; the ``quick`` suite
replaces the size flags by a tiny plan (a few MiB) so that the smoke test stays short. The ``nvme``
suite (``bench.nvme``) uses the same sizes, plus ``disk_dir`` and ``recovery_blocks``.
``Results`` keeps every sample of every figure and reports the best one (highest GB/s, lowest
latency), so a noisy neighbour can only make a figure look worse, never better.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier_contract.units import format_bytes, parse_bytes

Suite = Literal["all", "shm", "tcp", "lookup", "nvme", "quick", "tls", "verify"]
SUITES: tuple[Suite, ...] = ("all", "shm", "tcp", "lookup", "nvme", "quick", "tls", "verify")
MiB = 1 << 20
GB = 1e9

_LOOKUP_UNITS = {
    "lookups_per_s": "lookups/s",
    "lookups_grpc_per_s": "lookups/s",
    "lookups_control_per_s": "lookups/s",
    "daemon_cpu_us_per_lookup": "us",
    "daemon_cpu_us_per_lookup_grpc": "us",
    "daemon_cpu_us_per_lookup_control": "us",
}
NVME_IN_ALL = True
"""Whether ``all`` runs the nvme suite too (it does: all stays under 3 minutes; docs/benchmarks.md)."""


@dataclass(frozen=True)
class Plan:
    """Sizes and amounts of one run. Every throughput figure moves ``total_bytes`` per sample."""

    suite: Suite
    block_sizes: tuple[int, ...]
    """Block sizes in bytes, e.g. 256 KiB, 1 MiB, 4 MiB."""
    batch_bytes: int
    """Bytes per batch (one put/get call, one Redis pipeline): batch_bytes // block blocks."""
    total_bytes: int
    """Bytes moved per sample (rounded down to whole batches, at least one batch)."""
    repeat: int
    """Samples per figure after one warm-up; the best is reported."""
    lookup_keys: int = 1000
    """Length of the key chain that lookups ask for (all hits)."""
    lookup_samples: int = 500
    """Sequential lookups per latency sample (p50 / p99 over them)."""
    lookup_clients: int = 4
    """Client processes that look up concurrently for the lookups/s figure."""
    lookup_seconds: float = 2.0
    """How long the concurrent clients run per sample."""
    min_host_bytes: int = 2 << 30
    """Smallest host tier the bench daemon gets (mind the machine's memory)."""
    redis: bool = True
    progress: bool = True
    json_out: str | None = None
    disk_dir: str | None = None
    """Parent directory of the NVMe suite's tier and raw files (default: the system temp dir)."""
    recovery_blocks: int = 10_000
    """NVMe suite: blocks stored before each restart of the recovery figures."""
    daemon_args: tuple[str, ...] = ()
    """More ``kvtierd serve`` arguments for every daemon of the shm, tcp, tls, verify and lookup
    suites (``--daemon-args``, e.g. ``--eviction-policy prefix``): one setting held against
    another, each in a run of its own."""

    @property
    def indicative(self) -> bool:
        """The quick suite's samples (a few MiB, one round) are too small for a verdict: its
        ratios and lookup figures are reported as indicative, never ok / NO."""
        return self.suite == "quick"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        suite = args.suite
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r} (expected one of {', '.join(SUITES)})")
        common: dict[str, Any] = dict(
            suite=suite,
            redis=not args.no_redis,
            progress=not args.no_progress,
            json_out=args.json_out,
            lookup_clients=max(1, args.lookup_clients),
            disk_dir=getattr(args, "disk_dir", None),
            daemon_args=tuple(shlex.split(getattr(args, "daemon_args", None) or "")),
        )
        if suite == "quick":
            return cls(
                block_sizes=(16 << 10, 64 << 10),
                batch_bytes=1 * MiB,
                total_bytes=4 * MiB,
                repeat=1,
                lookup_samples=100,
                lookup_seconds=0.5,
                min_host_bytes=64 * MiB,
                **{**common, "lookup_clients": min(2, common["lookup_clients"])},
            )
        sizes = tuple(parse_bytes(s.strip(), field="--sizes") for s in args.sizes.split(",") if s)
        if not sizes or min(sizes) <= 0 or any(b % 32 for b in sizes):
            raise ValueError("--sizes: need positive block sizes, each a multiple of 32 bytes")
        if args.batch_mib <= 0 or args.total_mib <= 0 or args.repeat <= 0:
            raise ValueError("--batch-mib, --total-mib and --repeat must be positive")
        plan = cls(
            block_sizes=sizes,
            batch_bytes=args.batch_mib * MiB,
            total_bytes=args.total_mib * MiB,
            repeat=args.repeat,
            **common,
        )
        plan.check_memory()
        return plan

    def check_memory(self) -> None:
        """ValueError when the daemon's arena, Redis and the buffers would not fit in 3/4 of RAM."""
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        sample = max(self.sample_bytes(b) for b in self.block_sizes)
        need = self.host_bytes + 8 * self.batch_bytes  # daemon; each path's batch buffers
        need += 3 * sample  # memcpy as put and as get, the socket sink (baselines.py)
        if self.redis:  # Redis keeps every sample's fresh keys of one block size, +25% per value
            need += (self.repeat + 1) * sample * 5 // 4
        if need > ram * 3 // 4:
            raise ValueError(
                f"this plan needs about {format_bytes(need)} of memory, the machine "
                f"has {format_bytes(ram)}: lower --total-mib or --batch-mib"
            )

    def blocks_per_batch(self, block: int) -> int:
        return max(1, self.batch_bytes // block)

    def batches(self, block: int) -> int:
        """Batches per sample: whole batches of ``total_bytes``, at least one."""
        return max(1, self.total_bytes // (self.blocks_per_batch(block) * block))

    def sample_bytes(self, block: int) -> int:
        return self.batches(block) * self.blocks_per_batch(block) * block

    @property
    def host_bytes(self) -> int:
        """Host tier of the daemon of one block size: two samples of the largest size and a
        slab to spare, at least ``min_host_bytes``, in whole slabs."""
        need = 2 * max(self.sample_bytes(b) for b in self.block_sizes) + self.slab_bytes
        return _round_up(max(self.min_host_bytes, need), self.slab_bytes)

    @property
    def slab_bytes(self) -> int:
        return max(64 * MiB, *(_round_up(b, 4096) for b in self.block_sizes))

    def wants(self, part: Literal["shm", "tcp", "lookup", "nvme", "tls", "verify"]) -> bool:
        if part == "verify":  # verified beside unverified transfers, in one run: its own suite
            return self.suite == "verify"
        if part == "nvme":  # not in quick (disk I/O); in all only when NVME_IN_ALL
            return self.suite == "nvme" or (self.suite == "all" and NVME_IN_ALL)
        if part == "tls":  # tcp beside tcp over TLS, in one run: its own suite only
            return self.suite == "tls"
        if part == "tcp":
            return self.suite in ("all", "quick", "tcp", "tls")
        return self.suite in ("all", "quick", part)

    def describe(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "block_sizes": list(self.block_sizes),
            "batch_bytes": self.batch_bytes,
            "total_bytes": self.total_bytes,
            "repeat": self.repeat,
            "lookup_keys": self.lookup_keys,
            "lookup_samples": self.lookup_samples,
            "lookup_clients": self.lookup_clients,
            "lookup_seconds": self.lookup_seconds,
            "redis": self.redis,
            "host_bytes": self.host_bytes,
            "slab_bytes": self.slab_bytes,
            "disk_dir": self.disk_dir,
            "recovery_blocks": self.recovery_blocks,
        }


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def size_label(n: int) -> str:
    """``262144`` -> ``256KiB`` (exact binary units when they fit)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return format_bytes(n).replace(" ", "")


@dataclass
class Figure:
    """Samples of one figure; ``best`` is the max (throughput) or min (latency)."""

    unit: str
    higher_is_better: bool = True
    samples: list[float] = field(default_factory=list)

    @property
    def best(self) -> float | None:
        if not self.samples:
            return None
        return max(self.samples) if self.higher_is_better else min(self.samples)


@dataclass
class Results:
    """Every figure of a run. Throughput keys are ``(op, block_bytes)``; lookups by name."""

    throughput: dict[tuple[str, int], Figure] = field(default_factory=dict)
    lookup: dict[str, Figure] = field(default_factory=dict)
    recovery: dict[str, Figure] = field(default_factory=dict)
    """NVMe suite: restart and recovery seconds by name (``bench.nvme.RECOVERY_FIGURES``)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """Plain values a run found out (e.g. whether O_DIRECT works, blocks recovered)."""
    notes: list[str] = field(default_factory=list)
    touches: dict[tuple[str, int], Touches] = field(default_factory=dict)
    """Distinct memory per sample of each throughput figure that says (``Op.touches``)."""

    def add_gbps(self, op: str, block: int, gbps: float) -> None:
        self.throughput.setdefault((op, block), Figure("GB/s")).samples.append(gbps)

    def add_lookup(self, name: str, value: float) -> None:
        unit = _LOOKUP_UNITS.get(name, "ms")
        fig = self.lookup.setdefault(name, Figure(unit, higher_is_better=unit == "lookups/s"))
        fig.samples.append(value)

    def add_seconds(self, name: str, seconds: float) -> None:
        self.recovery.setdefault(name, Figure("s", higher_is_better=False)).samples.append(seconds)

    def seconds(self, name: str) -> float | None:
        fig = self.recovery.get(name)
        return fig.best if fig else None

    def gbps(self, op: str, block: int) -> float | None:
        fig = self.throughput.get((op, block))
        return fig.best if fig else None

    def lookup_best(self, name: str) -> float | None:
        fig = self.lookup.get(name)
        return fig.best if fig else None


@dataclass(frozen=True)
class Touches:
    """Distinct bytes one sample of an op reads (``src``) and writes (``dst``), over all its
    batches: a buffer reused for every batch counts once."""

    src: int
    dst: int


@dataclass(frozen=True)
class Op:
    """One throughput figure of one block size: each ``run()`` moves ``plan.sample_bytes``.

    ``check`` (after the timed runs) raises AssertionError unless the bytes round-tripped
    exactly.
    """

    name: str
    """Figure name, e.g. ``"tcp_put"`` (every name: ``targets.OP_ORDER``)."""
    label: str
    """What the progress bar shows, e.g. ``"tcp put 1MiB"``."""
    run: Callable[[], object]
    check: Callable[[], None] | None = None
    touches: Touches | None = None
    """Distinct memory per sample; a baseline's equals that of the kvtier path it is held
    against (``report.TARGETS``)."""


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

"""``kvtier bench nvme``: the NVMe tier's demote / promote GB/s beside raw O_DIRECT I/O of the same
byte counts on the same filesystem, measured in the same run; and recovery time after a restart.

Throughput, per block size, against a kvtierd of its own started with ``--write-policy
write-through``, a host tier that holds one sample (``plan.sample_bytes``, in whole slabs) and an
NVMe tier large enough that nothing is ever evicted from it (every write lands in a fresh,
preallocated slot). Each round, in this order, so that a figure and its baseline see the same
minute of a noisy machine:

1. ``nvme_demote``: put a fresh set A (shm); time from the first put until Stats
   ``nvme.bytes_written`` has grown by A's bytes: every block written, fdatasync'd and journaled.
2. ``nvme_raw_write``: O_DIRECT ``pwrite`` of as many slots of the tier's slot size (a 4 KiB
   header region + the block) into a fresh preallocated file beside the tier, 4 threads (the
   tier's ``io_threads``), one fdatasync per batch (group commit), from page-aligned memory.
3. demote B (it evicts A, clean, from the host tier: A is on NVMe only now).
4. ``nvme_raw_write_1t``: the same with one thread, into another fresh file.
5. demote C (it evicts B).
6. ``nvme_raw_read``: O_DIRECT ``pread`` of the file of step 2, 4 threads, batch by batch.
7. ``nvme_promote_get_into``: ``get_into`` of A, batch by batch (each PrepareLoad promotes its
   batch, then the shm copy): end to end. ``nvme_promote_prepare``: the same bytes over the
   daemon's PrepareLoad service time alone (its /metrics RPC histogram): the daemon-side promote.
8. ``nvme_raw_read_1t``: O_DIRECT read of the file of step 4, one thread.
9. ``nvme_promote_prefetch``: ``prefetch`` of B, then wait until Stats ``nvme.bytes_read`` has
   grown by B's NVMe-only bytes (all promotions started at once; no client copy).
10. ``xxh3``: xxh3_64 of one batch, one thread: the checksum every tier write and read computes.

Every promoted byte is compared with what was put. The raw figures are the bench's own plain
file I/O (``rawdisk``: O_DIRECT where the filesystem takes it, else buffered, and the report says
so); recovery (``RECOVERY_FIGURES``) restarts daemons over a full tier (``recovery``). Daemons are
driven through their public interfaces only (``nvme_daemon``): the SDK never imports kvtierd.

Files go to a private directory under ``plan.disk_dir`` (or the run's temp directory); each block
size's tier is removed when it is done, and free space is checked first.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.bench import recovery
from kvtier.bench.baselines import block_views, random_batch
from kvtier.bench.nvme_daemon import (
    FILE_BYTES,
    IO_ALIGN,
    NvmeDaemon,
    chunks,
    nvme_slot_bytes,
    nvme_stats,
    put_durable,
    round_up,
    tiers_of,
    wait_nvme,
)
from kvtier.bench.plan import GB, MiB, Plan, Results, size_label
from kvtier.bench.progress import Progress
from kvtier.bench.rawdisk import RawDisk, RawFile
from kvtier.bench.transfers import KeySource, bench_namespace, connect
from kvtier.client import Client, NamespaceHandle

__all__ = ["RECOVERY_FIGURES", "Geometry", "bench_nvme", "disk_need", "nvme_slot_bytes", "steps"]

IO_THREADS = 4  # the daemon's default io_threads; the raw baseline's pool (as report.IO_THREADS)
ROUND_STEPS = 9  # progress steps per round of one block size
RECOVERY_FIGURES = recovery.RECOVERY_FIGURES


def steps(plan: Plan) -> int:
    """Progress steps of the nvme suite."""
    return plan.repeat * (ROUND_STEPS * len(plan.block_sizes) + recovery.CYCLE_STEPS)


class Geometry:
    """Sizes of the throughput daemon of one block size (see the module docstring)."""

    def __init__(self, plan: Plan, block: int) -> None:
        self.block = block
        self.per_batch = plan.blocks_per_batch(block)
        self.n = plan.batches(block) * self.per_batch  # blocks per set (one sample)
        host_slot = round_up(block, IO_ALIGN)
        # Slabs of at most 1/8 of a set keep the host tier within a slab of one set, so that
        # after two more sets the first one is on NVMe only.
        self.slab = max(host_slot, min(64 * MiB, round_up(self.n * block // 8, IO_ALIGN)))
        self.host_bytes = math.ceil(self.n / (self.slab // host_slot)) * self.slab
        nvme_slab = 2 * self.slab  # what the daemon makes of --slab-bytes (kvtierd.app)
        per_slab = nvme_slab // nvme_slot_bytes(block)
        want = (math.ceil(3 * plan.repeat * self.n / per_slab) + 2) * nvme_slab
        file_bytes = max(nvme_slab, min(FILE_BYTES, want) // nvme_slab * nvme_slab)
        self.disk_bytes = round_up(want, file_bytes)
        self.raw_bytes = self.n * nvme_slot_bytes(block)

    @property
    def disk_need(self) -> int:
        """Peak bytes on disk: the tier's files, two raw files, the journal."""
        return self.disk_bytes + 2 * self.raw_bytes + 64 * MiB


# -- the throughput rounds -------------------------------------------------------------------------


def _xxh3_gbps(buf: np.ndarray) -> float:
    import xxhash

    t0 = time.perf_counter()
    xxhash.xxh3_64_intdigest(buf.data)
    return buf.nbytes / (time.perf_counter() - t0) / GB


class _Data:
    """The bytes every put sends (one batch, again and again) and the get_into destination."""

    def __init__(self, plan: Plan, block: int) -> None:
        self.src = random_batch(plan, block, seed=block)
        self.views = block_views(self.src, block, plan.blocks_per_batch(block))
        self.dst = np.zeros_like(self.src)
        self.dst_views = block_views(self.dst, block, plan.blocks_per_batch(block))


def _one_size(
    plan: Plan, runs: Path, root: Path, block: int, keys: KeySource, results: Results, progress: Progress
) -> None:
    g = Geometry(plan, block)
    progress.show(f"starting kvtierd with an NVMe tier ({size_label(block)})")
    disk_dir, raw_dir = root / f"tier-{block}", root / f"raw-{block}"
    data = _Data(plan, block)
    pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-raw-io")
    raw = RawDisk(
        raw_dir,
        slot_bytes=nvme_slot_bytes(block),
        per_batch=g.per_batch,
        slots=g.n,
        pool=pool,
        align=IO_ALIGN,
    )
    try:
        with (
            NvmeDaemon(
                runs / f"kvtierd-nvme-{block}",
                disk_dir,
                host_bytes=g.host_bytes,
                slab_bytes=g.slab,
                disk_bytes=g.disk_bytes,
            ) as daemon,
            contextlib.closing(connect(daemon.unix, "shm")) as client,
        ):
            ns = client.register(bench_namespace(block, name="kvtier-bench-nvme"))
            results.facts["tier_direct_io"] = bool(nvme_stats(client)["direct_io"])
            results.facts["raw_direct_io"] = raw.direct_io
            results.facts["raw_direct_io_note"] = raw.direct_io_note
            size = _Size(g, client, ns, daemon, raw, data, results, progress)
            for _ in range(plan.repeat):
                _round(size, keys)
                results.add_gbps("xxh3", block, _xxh3_gbps(data.src))
    finally:
        pool.shutdown(wait=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)


@dataclass(frozen=True)
class _Size:
    """What every round of one block size uses: its geometry, the throughput daemon and an shm
    client of it (``ns`` registered), the raw baseline's disk, the bytes, where figures go.
    Made and owned by ``_one_size``, which closes what it holds; the bench's thread only."""

    g: Geometry
    client: Client
    ns: NamespaceHandle
    daemon: NvmeDaemon
    raw: RawDisk
    data: _Data
    results: Results
    progress: Progress

    def record(self, op: str, seconds: float, what: str) -> None:
        """A set's bytes moved in ``seconds``, as figure ``op``; one progress step."""
        self.results.add_gbps(op, self.g.block, self.g.n * self.g.block / seconds / GB)
        self.progress.step(what)


def _round(s: _Size, keys: KeySource) -> None:
    """One round of the module docstring's steps 1-9 (three fresh sets from ``keys``)."""
    g, raw, progress, record = s.g, s.raw, s.progress, s.record
    label = size_label(g.block)
    sets = [keys.take(g.n) for _ in range(3)]
    raw_files: list[RawFile] = []
    try:
        for i, threads in enumerate((IO_THREADS, 1, 0)):
            progress.show(f"nvme demote {label} (set {'ABC'[i]})")
            record(
                "nvme_demote",
                put_durable(s.client, s.ns, sets[i], s.data.views, g.per_batch, f"demote {label}"),
                f"nvme demote {label}",
            )
            if threads:
                many = "s" if threads > 1 else ""
                progress.show(f"raw O_DIRECT write {label}, {threads} thread{many}")
                raw_files.append(raw.create())
                op = "nvme_raw_write" if threads > 1 else "nvme_raw_write_1t"
                record(op, raw.write(raw_files[-1], threads), f"raw write {label}")
        progress.show(f"raw O_DIRECT read {label}, {IO_THREADS} threads")
        record("nvme_raw_read", raw.read(raw_files[0], IO_THREADS), f"raw read {label}")
        _promote_get_into(s, sets[0])
        progress.step(f"nvme promote {label}")
        progress.show(f"raw O_DIRECT read {label}, 1 thread")
        record("nvme_raw_read_1t", raw.read(raw_files[1], 1), f"raw read {label}")
        progress.show(f"nvme promote {label} (prefetch)")
        _promote_prefetch(s, sets[1])
        progress.step(f"nvme promote {label}")
    finally:
        for f in raw_files:
            raw.drop(f)


def _promote_get_into(s: _Size, keys: list[bytes]) -> None:
    """get_into of a set that is on NVMe only: end to end, and PrepareLoad's share."""
    g, client, ns, daemon, data, results = s.g, s.client, s.ns, s.daemon, s.data, s.results
    block, label = g.block, size_label(g.block)
    if on_host := tiers_of(ns, keys).count("host"):
        raise RuntimeError(
            f"promote {label}: {on_host} blocks of the set are still in the host "
            "tier (it should hold one set only)"
        )
    took, prep0 = 0.0, daemon.rpc_seconds("PrepareLoad")
    for batch in chunks(keys, g.per_batch):
        t0 = time.perf_counter()
        found = ns.get_into(batch, data.dst_views[: len(batch)])
        took += time.perf_counter() - t0
        if not all(found):
            raise RuntimeError(
                f"promote {label}: get_into missed {found.count(False)} blocks "
                f"({client.counters.last_error or 'evicted?'})"
            )
        n = len(batch) * block
        if not np.array_equal(data.dst[:n], data.src[:n]):
            raise AssertionError(f"promote {label}: get_into returned other bytes than were put")
    prep = daemon.rpc_seconds("PrepareLoad") - prep0
    results.add_gbps("nvme_promote_get_into", block, len(keys) * block / took / GB)
    if prep > 0:
        results.add_gbps("nvme_promote_prepare", block, len(keys) * block / prep / GB)


def _promote_prefetch(s: _Size, keys: list[bytes]) -> None:
    """prefetch of a set, then wait until every NVMe-only block of it has been read back."""
    g, client, ns, results = s.g, s.client, s.ns, s.results
    block, label = g.block, size_label(g.block)
    nvme_only = tiers_of(ns, keys).count("nvme")
    r0 = int(nvme_stats(client)["bytes_read"])
    t0 = time.perf_counter()
    for chunk in chunks(keys, g.per_batch):
        ns.prefetch(chunk)
    wait_nvme(client, "bytes_read", r0 + nvme_only * block, what=f"prefetch {label}")
    took = time.perf_counter() - t0
    results.add_gbps("nvme_promote_prefetch", block, nvme_only * block / took / GB)
    if left := tiers_of(ns, keys).count("nvme"):
        raise RuntimeError(f"prefetch {label}: {left} blocks are still on NVMe only")


# -- entry point -----------------------------------------------------------------------------------


def mount_of(path: Path) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path``, from /proc/self/mounts ("?" if unknown)."""
    best, real = ("?", ""), os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _dev, mnt, fstype, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[1]):
                    best = (fstype, mnt)
    except (OSError, ValueError):
        pass
    return best


def disk_need(plan: Plan) -> int:
    """Peak bytes the suite holds on disk at once."""
    return max([Geometry(plan, b).disk_need for b in plan.block_sizes] + [recovery.disk_need(plan)])


def bench_nvme(plan: Plan, tmp: Path, results: Results, progress: Progress) -> None:
    """Every figure of the nvme suite into ``results``: tier and raw files under
    ``plan.disk_dir`` (or ``tmp``), the daemons' sockets and logs under ``tmp`` (keep it short:
    a Unix socket path has at most 107 bytes)."""
    parent = Path(plan.disk_dir) if plan.disk_dir else tmp
    parent.mkdir(parents=True, exist_ok=True)
    need, free = disk_need(plan), shutil.disk_usage(parent).free
    fstype, mnt = mount_of(parent)
    results.facts.update(
        disk_dir=str(parent), filesystem=fstype, mount=mnt, disk_free_bytes=free, disk_need_bytes=need
    )
    if need + (1 << 30) > free:
        if plan.suite == "all":  # the other suites' figures still count
            results.notes.append(
                f"NVMe figures skipped: {need / 2**30:.1f} GiB free needed in "
                f"{parent}, {free / 2**30:.1f} GiB are (kvtier bench nvme "
                "--disk-dir DIR)"
            )
            return
        raise RuntimeError(
            f"nvme suite: needs about {need / 2**30:.1f} GiB free in {parent} "
            f"(and 1 GiB to spare), {free / 2**30:.1f} GiB are: lower --total-mib "
            f"or pass --disk-dir"
        )
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=parent))
    keys = KeySource()
    try:
        for block in plan.block_sizes:
            _one_size(plan, tmp, root, block, keys, results, progress)
        recovery.bench_recovery(plan, tmp, root, keys, results, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not (results.facts.get("tier_direct_io") and results.facts.get("raw_direct_io")):
        results.notes.append(
            f"O_DIRECT unavailable in {parent} ({results.facts.get('raw_direct_io_note')}): "
            "tier and raw figures went through the page cache; reads may come from memory"
        )

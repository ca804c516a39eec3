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

Every promoted byte is compared with what was put. Recovery (``RECOVERY_FIGURES``): a daemon
fills its tier with ``plan.recovery_blocks`` 16 KiB blocks (write-through) and is stopped with
SIGTERM (drain, checkpoint) and restarted ``plan.repeat`` times: process start to the
KVTIERD_READY line, and the daemon's own ``nvme.recovery_seconds`` (mode "warm"); then as many
blocks again are stored, the daemon is killed with SIGKILL and restarted ``plan.repeat`` times
(mode "replay": checkpoint plus journal, slot headers read back and checked, the journal
compacted into a new checkpoint); before each of these restarts but the first, the checkpoint
and journal files are put back as the crash left them, so that every sample replays the same
crash.

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
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.baselines import block_views, random_batch
from kvtier.bench.plan import GB, MiB, Plan, Results, size_label
from kvtier.bench.procs import DaemonProc
from kvtier.bench.progress import Progress
from kvtier.bench.transfers import KeySource, bench_namespace, connect
from kvtier.client import Client, NamespaceHandle

IO_ALIGN = 4096  # the daemon's default --io-align: slot header region and alignment
IO_THREADS = 4  # the daemon's default io_threads; the raw baseline's pool (as report.IO_THREADS)
FILE_BYTES = 1 << 30  # the daemon's default disk_file_bytes
RECOVERY_BLOCK = 16 << 10
ROUND_STEPS = 9  # progress steps per round of one block size
RECOVERY_FIGURES = ("ready_empty_s", "ready_warm_s", "recovery_warm_s", "ready_replay_s",
                    "recovery_replay_s")
_LOOKUP_CHUNK = 1024  # keys per lookup_detail (the daemon's max batch is larger)


def steps(plan: Plan) -> int:
    """Progress steps of the nvme suite."""
    return plan.repeat * (ROUND_STEPS * len(plan.block_sizes) + 2) + 2


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def nvme_slot_bytes(block: int) -> int:
    """Bytes one block occupies on the tier: a header region, then the payload, io-aligned."""
    return IO_ALIGN + _round_up(block, IO_ALIGN)


class Geometry:
    """Sizes of the throughput daemon of one block size (see the module docstring)."""

    def __init__(self, plan: Plan, block: int) -> None:
        self.block = block
        self.per_batch = plan.blocks_per_batch(block)
        self.n = plan.batches(block) * self.per_batch  # blocks per set (one sample)
        host_slot = _round_up(block, IO_ALIGN)
        # Slabs of at most 1/8 of a set keep the host tier within a slab of one set, so that
        # after two more sets the first one is on NVMe only.
        self.slab = max(host_slot, min(64 * MiB, _round_up(self.n * block // 8, IO_ALIGN)))
        self.host_bytes = math.ceil(self.n / (self.slab // host_slot)) * self.slab
        nvme_slab = 2 * self.slab  # what the daemon makes of --slab-bytes (kvtierd.app)
        per_slab = nvme_slab // nvme_slot_bytes(block)
        want = (math.ceil(3 * plan.repeat * self.n / per_slab) + 2) * nvme_slab
        file_bytes = max(nvme_slab, min(FILE_BYTES, want) // nvme_slab * nvme_slab)
        self.disk_bytes = _round_up(want, file_bytes)
        self.raw_bytes = self.n * nvme_slot_bytes(block)

    @property
    def disk_need(self) -> int:
        """Peak bytes on disk: the tier's files, two raw files, the journal."""
        return self.disk_bytes + 2 * self.raw_bytes + 64 * MiB


class NvmeDaemon(DaemonProc):
    """A kvtierd with an NVMe tier over ``disk_dir`` (write-through) and /metrics on a free port;
    ``ready_s``: seconds from starting the process to its KVTIERD_READY line."""

    def __init__(self, run_dir: Path, disk_dir: Path, *, host_bytes: int, slab_bytes: int,
                 disk_bytes: int) -> None:
        super().__init__(run_dir, host_bytes, slab_bytes)
        self.args += ["--disk-dir", str(disk_dir), "--disk-bytes", str(disk_bytes),
                      "--io-align", str(IO_ALIGN), "--write-policy", "write-through",
                      "--metrics-port", "0", "--metrics-host", "127.0.0.1"]
        self.ready_s = 0.0

    def __enter__(self) -> NvmeDaemon:
        t0 = time.perf_counter()
        super().__enter__()
        self.ready_s = time.perf_counter() - t0
        return self

    def kill9(self) -> None:
        """SIGKILL: no drain, no checkpoint (the next start replays the journal)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def rpc_seconds(self, method: str) -> float:
        """The daemon's summed service time of ``method`` (its /metrics RPC histogram)."""
        with urllib.request.urlopen(self.info["metrics"], timeout=30) as r:
            text = r.read().decode()
        key = f'kvtier_rpc_duration_seconds_sum{{method="{method}"}} '
        for line in text.splitlines():
            if line.startswith(key):
                return float(line[len(key):])
        return 0.0


def nvme_stats(client: Client) -> dict[str, Any]:
    return client.stats()["nvme"]  # type: ignore[no-any-return]


def wait_nvme(client: Client, field: str, target: int, *, what: str,
              timeout_s: float = 300.0) -> None:
    """Poll Stats until ``nvme[field] >= target``. Sleeps follow the rate seen so far (each Stats
    call costs the daemon's event loop ~0.5 ms), so that the end is seen within ~2% of the
    elapsed time or 2 ms, without many calls."""
    t0 = time.perf_counter()
    last_t, last_v = t0, -1
    while True:
        nv = nvme_stats(client)
        now, v = time.perf_counter(), int(nv[field])
        if v >= target:
            return
        if not nv["admitting"]:
            raise RuntimeError(f"{what}: the NVMe tier stopped admitting: {nv['degraded_reason']}")
        if now - t0 > timeout_s:
            raise RuntimeError(f"{what}: nvme.{field} reached {v:,} of {target:,} in {timeout_s} s")
        delay = 0.01
        if last_v >= 0 and v > last_v:
            delay = (target - v) / ((v - last_v) / (now - last_t)) / 2
        last_t, last_v = now, v
        time.sleep(min(0.05, max(0.002, (now - t0) * 0.02, delay)))


def _chunks(keys: list[bytes], n: int) -> Iterator[list[bytes]]:
    for i in range(0, len(keys), n):
        yield keys[i : i + n]


def tiers_of(ns: NamespaceHandle, keys: list[bytes]) -> list[str]:
    """``"host"`` / ``"nvme"`` per key (every key must be stored)."""
    out: list[str] = []
    for chunk in _chunks(keys, _LOOKUP_CHUNK):
        res = ns.lookup_detail(chunk)
        if res.hits != len(chunk):
            raise RuntimeError(f"{len(chunk) - res.hits} stored blocks were not found")
        out += res.tiers
    return out


def put_durable(client: Client, ns: NamespaceHandle, keys: list[bytes], views: list[memoryview],
                per_batch: int, what: str) -> float:
    """Put ``keys`` (``views`` again for every batch); seconds until all are durable on NVMe."""
    w0 = int(nvme_stats(client)["bytes_written"])
    t0 = time.perf_counter()
    for batch in _chunks(keys, per_batch):
        res = ns.put(batch, views[: len(batch)])
        if res.stored != len(batch):
            raise RuntimeError(f"{what}: put stored {res.stored} of {len(batch)}: {res}")
    wait_nvme(client, "bytes_written", w0 + len(keys) * ns.block_bytes, what=what)
    return time.perf_counter() - t0


# -- raw baseline ----------------------------------------------------------------------------------


class RawDisk:
    """Fresh preallocated files beside the tier, written and read with O_DIRECT (when the
    filesystem has it) through the tier's own device seam (``FileSystem`` / ``Device``)."""

    def __init__(self, directory: Path, g: Geometry, pool: ThreadPoolExecutor) -> None:
        from kvtierd.tiers.nvme.device import FileSystem, aligned_buffer

        self.fs = FileSystem(str(directory), io_align=IO_ALIGN, create=True)
        self.g, self.pool = g, pool
        self.slot = nvme_slot_bytes(g.block)
        span = g.per_batch * self.slot
        self._src, self._dst = aligned_buffer(span), aligned_buffer(span)
        np.frombuffer(self._src, np.uint8)[:] = np.random.default_rng(7).integers(
            0, 256, span, dtype=np.uint8)  # random bytes: nothing below may skip zeros
        self.src = [self._src[i * self.slot : (i + 1) * self.slot] for i in range(g.per_batch)]
        self.dst = [self._dst[i * self.slot : (i + 1) * self.slot] for i in range(g.per_batch)]
        self._count = 0

    @property
    def direct_io(self) -> bool:
        return bool(self.fs.direct_io)

    @property
    def direct_io_note(self) -> str:
        return str(self.fs.direct_io_note)

    def create(self) -> Any:
        """A fresh file of ``n`` slots, preallocated and synced like the tier's block files."""
        self._count += 1
        return self.fs.create_file(f"raw-{self._count:04d}.bin", self.g.raw_bytes)

    def drop(self, dev: Any) -> None:
        name = os.path.basename(dev.path)
        dev.close()
        self.fs.remove(name)

    def _each_batch(self, fn: Callable[[int], object], threads: int,
                    after: Callable[[], object]) -> float:
        g = self.g
        t0 = time.perf_counter()
        for b0 in range(0, g.n, g.per_batch):
            idx = range(b0, min(g.n, b0 + g.per_batch))
            if threads == 1:
                for i in idx:
                    fn(i)
            else:
                list(self.pool.map(fn, idx))
            after()
        return time.perf_counter() - t0

    def write(self, dev: Any, threads: int) -> float:
        """Seconds to write every slot, one fdatasync per batch (group commit)."""
        slot, src, k = self.slot, self.src, self.g.per_batch
        return self._each_batch(lambda i: dev.pwrite(i * slot, [src[i % k]]), threads, dev.sync)

    def read(self, dev: Any, threads: int) -> float:
        slot, dst, k = self.slot, self.dst, self.g.per_batch

        def one(i: int) -> None:
            if dev.pread_into(i * slot, [dst[i % k]]) != slot:
                raise RuntimeError(f"raw read: short read at slot {i}")

        took = self._each_batch(one, threads, lambda: None)
        if not np.array_equal(np.frombuffer(self._dst, np.uint8),  # the last batch (every
                              np.frombuffer(self._src, np.uint8)):  # batch wrote these bytes)
            raise AssertionError("raw O_DIRECT read returned other bytes than were written")
        return took

    def close(self) -> None:
        self.fs.close()


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


def _one_size(plan: Plan, runs: Path, root: Path, block: int, keys: KeySource, results: Results,
              progress: Progress) -> None:
    g = Geometry(plan, block)
    progress.show(f"starting kvtierd with an NVMe tier ({size_label(block)})")
    disk_dir, raw_dir = root / f"tier-{block}", root / f"raw-{block}"
    data = _Data(plan, block)
    pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="bench-raw-io")
    raw = RawDisk(raw_dir, g, pool)
    try:
        with NvmeDaemon(runs / f"kvtierd-nvme-{block}", disk_dir, host_bytes=g.host_bytes,
                        slab_bytes=g.slab, disk_bytes=g.disk_bytes) as daemon, \
                contextlib.closing(connect(daemon.unix, "shm")) as client:
            ns = client.register(bench_namespace(block, name="kvtier-bench-nvme"))
            results.facts["tier_direct_io"] = bool(nvme_stats(client)["direct_io"])
            results.facts["raw_direct_io"] = raw.direct_io
            results.facts["raw_direct_io_note"] = raw.direct_io_note
            for _ in range(plan.repeat):
                _round(g, client, ns, daemon, raw, keys, data, results, progress)
                results.add_gbps("xxh3", block, _xxh3_gbps(data.src))
    finally:
        pool.shutdown(wait=True)
        raw.close()
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(raw_dir, ignore_errors=True)


def _round(g: Geometry, client: Client, ns: NamespaceHandle, daemon: NvmeDaemon, raw: RawDisk,
           keys: KeySource, data: _Data, results: Results, progress: Progress) -> None:
    block, label = g.block, size_label(g.block)
    nbytes = g.n * block

    def record(op: str, seconds: float, what: str) -> None:
        results.add_gbps(op, block, nbytes / seconds / GB)
        progress.step(what)

    sets = [keys.take(g.n) for _ in range(3)]
    raw_files: list[Any] = []
    try:
        for i, threads in enumerate((IO_THREADS, 1, 0)):
            progress.show(f"nvme demote {label} (set {'ABC'[i]})")
            record("nvme_demote", put_durable(client, ns, sets[i], data.views, g.per_batch,
                                              f"demote {label}"), f"nvme demote {label}")
            if threads:
                many = "s" if threads > 1 else ""
                progress.show(f"raw O_DIRECT write {label}, {threads} thread{many}")
                raw_files.append(raw.create())
                op = "nvme_raw_write" if threads > 1 else "nvme_raw_write_1t"
                record(op, raw.write(raw_files[-1], threads), f"raw write {label}")
        progress.show(f"raw O_DIRECT read {label}, {IO_THREADS} threads")
        record("nvme_raw_read", raw.read(raw_files[0], IO_THREADS), f"raw read {label}")
        _promote_get_into(g, client, ns, daemon, sets[0], data, results)
        progress.step(f"nvme promote {label}")
        progress.show(f"raw O_DIRECT read {label}, 1 thread")
        record("nvme_raw_read_1t", raw.read(raw_files[1], 1), f"raw read {label}")
        progress.show(f"nvme promote {label} (prefetch)")
        _promote_prefetch(g, client, ns, sets[1], results)
        progress.step(f"nvme promote {label}")
    finally:
        for dev in raw_files:
            raw.drop(dev)


def _promote_get_into(g: Geometry, client: Client, ns: NamespaceHandle, daemon: NvmeDaemon,
                      keys: list[bytes], data: _Data, results: Results) -> None:
    """get_into of a set that is on NVMe only: end to end, and PrepareLoad's share."""
    block, label = g.block, size_label(g.block)
    if on_host := tiers_of(ns, keys).count("host"):
        raise RuntimeError(f"promote {label}: {on_host} blocks of the set are still in the host "
                           "tier (it should hold one set only)")
    took, prep0 = 0.0, daemon.rpc_seconds("PrepareLoad")
    for batch in _chunks(keys, g.per_batch):
        t0 = time.perf_counter()
        found = ns.get_into(batch, data.dst_views[: len(batch)])
        took += time.perf_counter() - t0
        if not all(found):
            raise RuntimeError(f"promote {label}: get_into missed {found.count(False)} blocks "
                               f"({client.counters.last_error or 'evicted?'})")
        n = len(batch) * block
        if not np.array_equal(data.dst[:n], data.src[:n]):
            raise AssertionError(f"promote {label}: get_into returned other bytes than were put")
    prep = daemon.rpc_seconds("PrepareLoad") - prep0
    results.add_gbps("nvme_promote_get_into", block, len(keys) * block / took / GB)
    if prep > 0:
        results.add_gbps("nvme_promote_prepare", block, len(keys) * block / prep / GB)


def _promote_prefetch(g: Geometry, client: Client, ns: NamespaceHandle, keys: list[bytes],
                      results: Results) -> None:
    """prefetch of a set, then wait until every NVMe-only block of it has been read back."""
    block, label = g.block, size_label(g.block)
    nvme_only = tiers_of(ns, keys).count("nvme")
    r0 = int(nvme_stats(client)["bytes_read"])
    t0 = time.perf_counter()
    for chunk in _chunks(keys, g.per_batch):
        ns.prefetch(chunk)
    wait_nvme(client, "bytes_read", r0 + nvme_only * block, what=f"prefetch {label}")
    took = time.perf_counter() - t0
    results.add_gbps("nvme_promote_prefetch", block, nvme_only * block / took / GB)
    if left := tiers_of(ns, keys).count("nvme"):
        raise RuntimeError(f"prefetch {label}: {left} blocks are still on NVMe only")


# -- recovery --------------------------------------------------------------------------------------


class _RecoveryRig:
    """One tier directory, restarted again and again with the same flags."""

    def __init__(self, plan: Plan, runs: Path, root: Path, keys: KeySource, results: Results,
                 progress: Progress) -> None:
        self.n, self.block = plan.recovery_blocks, RECOVERY_BLOCK
        self.keys, self.results, self.progress = keys, results, progress
        self.slab = 64 * MiB
        self.host = _round_up(self.n * _round_up(self.block, IO_ALIGN), self.slab)
        per_slab = 2 * self.slab // nvme_slot_bytes(self.block)
        want = (math.ceil(2 * self.n / per_slab) + 1) * 2 * self.slab
        self.disk = _round_up(want, max(2 * self.slab, min(FILE_BYTES, want)))
        self.run_dir, self.disk_dir = runs / "kvtierd-recovery", root / "tier-recovery"
        self.saved_log = root / "log-after-kill"
        self.per_batch = max(1, min(4096, plan.batch_bytes // self.block))
        data = np.random.default_rng(1).integers(0, 256, self.per_batch * self.block, np.uint8)
        self.views = block_views(data, self.block, self.per_batch)

    def start(self) -> NvmeDaemon:
        return NvmeDaemon(self.run_dir, self.disk_dir, host_bytes=self.host,
                          slab_bytes=self.slab, disk_bytes=self.disk)

    def fill(self, d: NvmeDaemon) -> None:
        """Store ``n`` fresh blocks and wait until all are durable."""
        self.progress.show(f"recovery: storing {self.n:,} blocks of {size_label(self.block)}")
        with contextlib.closing(connect(d.unix, "shm")) as client:
            ns = client.register(bench_namespace(self.block, name="kvtier-bench-recovery"))
            took = put_durable(client, ns, self.keys.take(self.n), self.views, self.per_batch,
                               "recovery fill")
        self.results.facts.setdefault("recovery_fill_blocks_per_s", []).append(round(self.n / took))

    def _log_files(self, directory: Path) -> list[Path]:
        from kvtierd.tiers.nvme import journal as jnl

        return [p for p in directory.iterdir() if p.name in (jnl.CHECKPOINT_NAME,
                jnl.CHECKPOINT_TMP) or jnl.parse_journal_name(p.name) is not None]

    def save_log(self) -> None:
        """Keep the checkpoint and journals as the crash left them (block files stay put: a
        recovery writes none), so that every replay sample starts from the same crash."""
        self.saved_log.mkdir()
        for f in self._log_files(self.disk_dir):
            shutil.copy2(f, self.saved_log / f.name)

    def restore_log(self) -> None:
        """Undo what the last recovery did to the log (it compacts the journal into a new
        checkpoint): back to the state right after the crash, durably."""
        for f in self._log_files(self.disk_dir):
            f.unlink()
        for f in self._log_files(self.saved_log):
            shutil.copy2(f, self.disk_dir / f.name)
            fd = os.open(self.disk_dir / f.name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(self.disk_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def check(self, d: NvmeDaemon, mode: str, blocks: int) -> float:
        """The daemon's recovery seconds, after checking what it recovered."""
        with contextlib.closing(Client.connect(d.unix, "tcp", timeout_s=30,
                                               client_name="bench-recovery")) as c:
            nv = nvme_stats(c)
        if nv["recovery_mode"] != mode or int(nv["recovered_blocks"]) != blocks:
            raise RuntimeError(f"recovery: expected {blocks:,} blocks ({mode}), the daemon "
                               f"recovered {nv['recovered_blocks']:,} ({nv['recovery_mode']})")
        return float(nv["recovery_seconds"])


def _recovery(plan: Plan, runs: Path, root: Path, keys: KeySource, results: Results,
              progress: Progress) -> None:
    rig = _RecoveryRig(plan, runs, root, keys, results, progress)
    n = rig.n
    try:
        progress.show("recovery: starting kvtierd on an empty directory")
        with rig.start() as d:
            results.add_seconds("ready_empty_s", d.ready_s)
            rig.fill(d)
        progress.step("recovery fill")
        # leaving the with-block sent SIGTERM: drain, checkpoint
        for r in range(plan.repeat):
            progress.show("recovery: restart after SIGTERM")
            with rig.start() as d:
                results.add_seconds("recovery_warm_s", rig.check(d, "warm", n))
                results.add_seconds("ready_warm_s", d.ready_s)
                progress.step("recovery")
                if r == plan.repeat - 1:
                    rig.fill(d)  # in the journal only: no checkpoint covers these
                    d.kill9()
        rig.save_log()
        progress.step("recovery fill")
        for r in range(plan.repeat):
            progress.show("recovery: restart after kill -9")
            if r:
                rig.restore_log()  # the same crash again
            with rig.start() as d:
                results.add_seconds("recovery_replay_s", rig.check(d, "replay", 2 * n))
                results.add_seconds("ready_replay_s", d.ready_s)
                d.kill9()  # quicker than a drain; the next sample restores the log anyway
            progress.step("recovery")
        results.facts.update(recovery_block_bytes=rig.block, recovered_warm_blocks=n,
                             recovered_replay_blocks=2 * n, replayed_journal_records=n)
    finally:
        shutil.rmtree(rig.disk_dir, ignore_errors=True)


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
    recovery = 2 * plan.recovery_blocks * nvme_slot_bytes(RECOVERY_BLOCK) + 1024 * MiB
    return max([Geometry(plan, b).disk_need for b in plan.block_sizes] + [recovery])


def bench_nvme(plan: Plan, tmp: Path, results: Results, progress: Progress) -> None:
    """Every figure of the nvme suite into ``results``: tier and raw files under
    ``plan.disk_dir`` (or ``tmp``), the daemons' sockets and logs under ``tmp`` (keep it short:
    a Unix socket path has at most 107 bytes)."""
    parent = Path(plan.disk_dir) if plan.disk_dir else tmp
    parent.mkdir(parents=True, exist_ok=True)
    need, free = disk_need(plan), shutil.disk_usage(parent).free
    fstype, mnt = mount_of(parent)
    results.facts.update(disk_dir=str(parent), filesystem=fstype, mount=mnt, disk_free_bytes=free,
                         disk_need_bytes=need)
    if need + (1 << 30) > free:
        if plan.suite == "all":  # the other suites' figures still count
            results.notes.append(f"NVMe figures skipped: {need / 2**30:.1f} GiB free needed in "
                                 f"{parent}, {free / 2**30:.1f} GiB are (kvtier bench nvme "
                                 "--disk-dir DIR)")
            return
        raise RuntimeError(f"nvme suite: needs about {need / 2**30:.1f} GiB free in {parent} "
                           f"(and 1 GiB to spare), {free / 2**30:.1f} GiB are: lower --total-mib "
                           f"or pass --disk-dir")
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-nvme-", dir=parent))
    keys = KeySource()
    try:
        for block in plan.block_sizes:
            _one_size(plan, tmp, root, block, keys, results, progress)
        _recovery(plan, tmp, root, keys, results, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not (results.facts.get("tier_direct_io") and results.facts.get("raw_direct_io")):
        results.notes.append(
            f"O_DIRECT unavailable in {parent} ({results.facts.get('raw_direct_io_note')}): "
            "tier and raw figures went through the page cache; reads may come from memory")

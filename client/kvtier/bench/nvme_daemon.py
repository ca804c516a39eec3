"""The kvtierd the nvme suite drives, and the Stats polls that its figures are timed against.

Everything here talks to the daemon through its public interfaces only: the ``kvtierd serve``
command line (``procs.DaemonProc``), the SDK (put, lookup_detail, Stats) and its /metrics page.

* :class:`NvmeDaemon`: a kvtierd with an NVMe tier over a directory, write-through, /metrics on a
  free port; ``ready_s`` (process start to KVTIERD_READY), ``kill9``, ``rpc_seconds``.
* :func:`wait_nvme` / :func:`put_durable`: put, then poll Stats until ``nvme.bytes_written`` (or
  another counter) reaches a target; :func:`tiers_of`: which tier holds each key.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.bench.procs import DaemonProc
from kvtier.client import Client, NamespaceHandle

IO_ALIGN = 4096  # the daemon's default --io-align: slot header region and alignment
FILE_BYTES = 1 << 30  # the daemon's default disk_file_bytes
_LOOKUP_CHUNK = 1024  # keys per lookup_detail (the daemon's max batch is larger)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def nvme_slot_bytes(block: int) -> int:
    """Bytes one block occupies on the tier: a header region, then the payload, io-aligned."""
    return IO_ALIGN + round_up(block, IO_ALIGN)


class NvmeDaemon(DaemonProc):
    """A kvtierd with an NVMe tier over ``disk_dir`` (write-through) and /metrics on a free port;
    ``ready_s``: seconds from starting the process to its KVTIERD_READY line."""

    def __init__(
        self, run_dir: Path, disk_dir: Path, *, host_bytes: int, slab_bytes: int, disk_bytes: int
    ) -> None:
        super().__init__(run_dir, host_bytes, slab_bytes)
        self.args += [
            "--disk-dir",
            str(disk_dir),
            "--disk-bytes",
            str(disk_bytes),
            "--io-align",
            str(IO_ALIGN),
            "--write-policy",
            "write-through",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
        ]
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
                return float(line[len(key) :])
        return 0.0


def nvme_stats(client: Client) -> dict[str, Any]:
    return client.stats()["nvme"]  # type: ignore[no-any-return]


def wait_nvme(client: Client, field: str, target: int, *, what: str, timeout_s: float = 300.0) -> None:
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


def chunks(keys: list[bytes], n: int) -> Iterator[list[bytes]]:
    for i in range(0, len(keys), n):
        yield keys[i : i + n]


def tiers_of(ns: NamespaceHandle, keys: list[bytes]) -> list[str]:
    """``"host"`` / ``"nvme"`` per key (every key must be stored)."""
    out: list[str] = []
    for chunk in chunks(keys, _LOOKUP_CHUNK):
        res = ns.lookup_detail(chunk)
        if res.hits != len(chunk):
            raise RuntimeError(f"{len(chunk) - res.hits} stored blocks were not found")
        out += res.tiers
    return out


def put_durable(
    client: Client, ns: NamespaceHandle, keys: list[bytes], views: list[memoryview], per_batch: int, what: str
) -> float:
    """Put ``keys`` (``views`` again for every batch); seconds until all are durable on NVMe."""
    w0 = int(nvme_stats(client)["bytes_written"])
    t0 = time.perf_counter()
    for batch in chunks(keys, per_batch):
        res = ns.put(batch, views[: len(batch)])
        if res.stored != len(batch):
            raise RuntimeError(f"{what}: put stored {res.stored} of {len(batch)}: {res}")
    wait_nvme(client, "bytes_written", w0 + len(keys) * ns.block_bytes, what=what)
    return time.perf_counter() - t0

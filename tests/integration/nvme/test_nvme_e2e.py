"""NVMe tier end to end: a real daemon with ``--disk-dir``, a real client, ``kvtierd fsck``.

The host tier is 2 MiB (128 blocks of 16 KiB), so a few hundred blocks are enough to push most
of them out to the NVMe tier.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_namespace

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.tiers.nvme.format import CorruptSlot, data_file_name, decode_header

HOST = ("--host-bytes", "2MiB", "--slab-bytes", "1MiB")
HOST_BLOCKS = 128


def serve(disk: Path, policy: str) -> tuple[str, ...]:
    return (*HOST, "--disk-dir", str(disk), "--disk-bytes", "16MiB", "--write-policy", policy)


def block(i: int, nbytes: int) -> bytes:
    return hashlib.shake_256(b"e2e block %d" % i).digest(nbytes)


def read_all(ns: kvtier.client.NamespaceHandle, keys: Sequence[bytes]) -> list[bytearray | None]:
    """One get() of every key, twice the 128-block host tier: it streams through it in rounds."""
    return ns.get(keys)


def digest(ns: kvtier.client.NamespaceHandle, keys: Sequence[bytes], got: Sequence[bytearray | None]) -> str:
    """sha256 over (namespace digest, key, bytes) of every block; a miss counts as b"-"."""
    h = hashlib.sha256()
    for k, g in zip(keys, got, strict=True):
        h.update(ns.namespace.digest + k + (bytes(g) if g is not None else b"-"))
    return h.hexdigest()


def fsck(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtierd", "fsck", str(directory)], capture_output=True, text=True, timeout=60
    )


def slot_of(directory: Path, ns: kvtier.client.NamespaceHandle, key: bytes) -> int:
    """File offset of the slot holding ``key`` in the first block file (headers only)."""
    data = (directory / data_file_name(0)).read_bytes()
    for off in range(0, len(data), 4096):
        try:
            decode_header(data[off : off + 4096], expect_digest=ns.namespace.digest, expect_key=key)
        except CorruptSlot:
            continue
        return off
    raise AssertionError("no slot holds the key")


def test_graceful_restart_serves_the_demoted_blocks_from_nvme(daemon_factory: Any, tmp_path: Path) -> None:
    disk, run_dir = tmp_path / "nvme", tmp_path / "run"
    d1 = daemon_factory(*serve(disk, "write-back"), run_dir=run_dir)
    with kvtier.Client.connect(d1.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2 * HOST_BLOCKS)))  # twice the host tier
        data = [block(i, ns.block_bytes) for i in range(len(keys))]
        for i in range(0, len(keys), 16):
            assert ns.put(keys[i : i + 16], data[i : i + 16]).stored == 16
        seen = ns.lookup_detail(keys)
        assert seen.hits == len(keys)  # write-back lost nothing
        assert seen.tiers.count("nvme") == len(keys) - HOST_BLOCKS  # evicted, demoted first
        assert all(d for d, t in zip(seen.durable, seen.tiers, strict=True) if t == "nvme")
        got = read_all(ns, keys)
        assert [bytes(g) if g else None for g in got] == data
        before = digest(ns, keys, got)
        extra = ns.block_keys(list(range(16 * 8)), parent=keys[-1])  # fresh, hottest: dirty
        assert ns.put(extra, [block(-i, ns.block_bytes) for i in range(8)]).stored == 8
        assert ns.lookup_detail(extra).durable == [False] * 8
    assert d1.stop(signal.SIGTERM) == 0  # drain: the dirty blocks are flushed, then a checkpoint
    check = fsck(disk)
    assert check.returncode == 0, check.stdout + check.stderr

    d2 = daemon_factory(*serve(disk, "write-back"), run_dir=run_dir)
    with kvtier.Client.connect(d2.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        nvme = client.stats()["nvme"]
        assert (nvme["recovery_mode"], nvme["recovered_blocks"]) == ("warm", len(keys) + 8)
        assert nvme["recovery_quarantined"] == 0
        after = ns.lookup_detail(keys + extra)
        assert after.hits == len(keys) + 8
        assert set(after.tiers) == {"nvme"} and all(after.durable)
        assert digest(ns, keys, read_all(ns, keys)) == before
        assert [bytes(g) if g else None for g in ns.get(extra)] == [
            block(-i, ns.block_bytes) for i in range(8)
        ]
        total = client.stats()["total"]
        assert total["blocks_hit_nvme"] == len(keys) + 8
        assert total["promotions"] == len(keys) + 8


def test_fsck_finds_a_flipped_payload_byte_and_the_daemon_serves_a_miss(
    daemon_factory: Any, tmp_path: Path
) -> None:
    disk, run_dir = tmp_path / "nvme", tmp_path / "run"
    d1: DaemonProcess = daemon_factory(*serve(disk, "write-through"), run_dir=run_dir)
    with kvtier.Client.connect(d1.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 8)))
        data = [block(i, ns.block_bytes) for i in range(8)]
        assert ns.put(keys, data).stored == 8
    assert d1.stop(signal.SIGTERM) == 0
    assert fsck(disk).returncode == 0

    slot = slot_of(disk, ns, keys[3])
    with open(disk / data_file_name(0), "r+b") as f:  # bit rot in block 3's payload
        f.seek(slot + 4096 + 10)
        byte = f.read(1)
        f.seek(slot + 4096 + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    check = fsck(disk)
    assert check.returncode == 1 and "corrupt" in check.stdout, check.stdout

    d2 = daemon_factory(*serve(disk, "write-through"), run_dir=run_dir)
    with kvtier.Client.connect(d2.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        assert ns.lookup(keys) == 8  # a warm start trusts the checkpoint; reads verify
        got = ns.get(keys)
        assert got[3] is None  # a miss, never the damaged bytes
        assert [bytes(g) for i, g in enumerate(got) if i != 3 and g is not None] == data[:3] + data[4:]
        nvme = client.stats()["nvme"]
        assert (nvme["checksum_failures"], nvme["quarantined_slots"]) == (1, 1)
        assert ns.lookup(keys) == 3  # the block left the index: the prefix ends before it


def test_a_16_kib_io_alignment_round_trips_through_a_restart(daemon_factory: Any, tmp_path: Path) -> None:
    disk, run = tmp_path / "disk16", tmp_path / "run16"
    args = (*serve(disk, "write-through"), "--io-align", "16KiB")
    d = daemon_factory(*args, run_dir=run)
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())  # 16 KiB blocks: header region + one 16 KiB slot
        keys = ns.block_keys(list(range(16 * 40)))
        assert ns.put(keys, [block(i, ns.block_bytes) for i in range(40)]).stored == 40
        deadline = time.monotonic() + 10
        while not all(ns.lookup_detail(keys).durable) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(ns.lookup_detail(keys).durable)
    assert d.stop(signal.SIGTERM) == 0
    assert fsck(disk).returncode == 0
    d2 = daemon_factory(*args, run_dir=run)
    with kvtier.Client.connect(d2.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        assert read_all(ns, keys) == [bytearray(block(i, ns.block_bytes)) for i in range(40)]
        assert client.stats()["nvme"]["recovered_blocks"] == 40


def test_stats_cli_shows_the_nvme_tier(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(*serve(tmp_path / "disk", "write-through"), run_dir=tmp_path / "run")
    with kvtier.Client.connect(d.unix, transport="shm") as client:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        ns.put(keys, [block(i, ns.block_bytes) for i in range(4)])
    table = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", d.unix],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "nvme tier" in table and "write-through" in table and "direct I/O" in table
    assert "promotions" in table and "nvme resident blocks" in table


# -- loads larger than the free host tier (they stream through it in rounds) ---------------------

BIG = dict(num_layers=32, num_kv_heads=8, head_dim=128)  # 16 tokens: 2 MiB blocks (bf16)
BIG_HOST = ("--host-bytes", "64MiB", "--slab-bytes", "4MiB")  # 32 slots of 2 MiB


@pytest.fixture(scope="module")
def big_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """64 MiB host tier over a 1 GiB NVMe tier, holding 100 blocks of 2 MiB (68 on NVMe only)."""
    tmp = tmp_path_factory.mktemp("big")
    d = DaemonProcess(
        tmp / "run",
        *BIG_HOST,
        "--disk-dir",
        str(tmp / "nvme"),
        "--disk-bytes",
        "1GiB",
        "--write-policy",
        "write-through",
    ).start()
    try:
        with kvtier.Client.connect(d.unix, transport="shm") as client:
            ns = client.register(make_namespace(**BIG))
            keys = ns.block_keys(list(range(16 * 100)))
            for i in range(0, 100, 4):
                assert (
                    ns.put(keys[i : i + 4], [block(j, ns.block_bytes) for j in range(i, i + 4)]).stored == 4
                )
            seen = ns.lookup_detail(keys)
            assert seen.hits == 100 and seen.tiers.count("nvme") >= 68
        yield d
    finally:
        d.kill()


@pytest.mark.parametrize("count", [20, 40, 100])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_get_bigger_than_the_host_tier_serves_every_block(
    big_daemon: DaemonProcess, transport: str, count: int
) -> None:
    with kvtier.Client.connect(big_daemon.address(transport), transport=transport) as client:
        ns = client.register(make_namespace(**BIG))
        keys = ns.block_keys(list(range(16 * 100)))[:count]
        assert ns.lookup(keys) == count
        got = ns.get(keys)
        assert [i for i, g in enumerate(got) if g is None] == []  # no hit lost
        assert all(bytes(g) == block(i, ns.block_bytes) for i, g in enumerate(got) if g)
        assert client.counters.gets_failed == 0


def test_get_blocks_bigger_than_the_host_tier_serves_every_block(big_daemon: DaemonProcess) -> None:
    import torch

    from kvtier.layouts import PagedKvLayout

    with kvtier.Client.connect(big_daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace(**BIG))
        keys = ns.block_keys(list(range(16 * 100)))
        cache = torch.zeros(100, ns.block_bytes, dtype=torch.uint8)
        layout = PagedKvLayout.contiguous(cache, num_layers=BIG["num_layers"])
        ids = list(range(99, -1, -1))  # into the engine's blocks in reverse order
        assert ns.get_blocks(keys, layout, ids) == [True] * 100
        assert all(bytes(cache[ids[i]].numpy()) == block(i, ns.block_bytes) for i in range(100))


def test_a_pinned_lookup_reports_disk_hits_as_disk_hits(big_daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(big_daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace(**BIG))
        keys = ns.block_keys(list(range(16 * 100)))[:20]  # on NVMe only; host holds others
        plain = ns.lookup_detail(keys)
        assert plain.tiers == ["nvme"] * 20
        pinned = ns.lookup_pinned(keys)  # answered at once, promoted in the background
        assert (pinned.hits, pinned.tiers) == (20, plain.tiers) and pinned.pin
        got = ns.get(keys)  # every pinned hit loads
        assert all(g is not None and bytes(g) == block(i, ns.block_bytes) for i, g in enumerate(got))
        assert client.release(pinned.pin, pinned.epoch)
        assert client.stats()["pinned_blocks"] == 0


def test_a_pinned_lookup_gives_no_offset_whose_slot_may_change(big_daemon: DaemonProcess) -> None:
    """A hold keeps a block's last copy, not its host slot: a hit that NVMe also holds may leave
    the host tier while held, so its offset is never handed out (2**64-1)."""
    with kvtier.Client.connect(big_daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace(**BIG))
        keys = ns.block_keys(list(range(16 * 100)))
        seen = ns.lookup_detail(keys)
        reply = client.session.call(
            "Lookup", pb.LookupRequest(namespace_id=ns.namespace_id, keys=b"".join(keys), pin=True)
        )
        assert reply.hit_blocks == 100 and list(reply.tiers).count(1) == seen.tiers.count("host")
        assert set(reply.offsets) == {(1 << 64) - 1}  # write-through: every hit is on NVMe too
        assert client.release(reply.job_id, reply.boot_epoch)

"""Bytes verified end to end (issue 11; docs/security.md): every block gets a digest when it is
committed, every load is checked against it before the bytes reach the caller, and the NVMe
header's checksum is that same digest.

The attacker here is a process with an shm mapping of the arena (what any shm session of the
tenant has) that overwrites a committed block's slot: later loads must serve a miss, over shm
and over tcp, count it (``corrupt_blocks``) and drop the block, never hand out the bytes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import xxhash
from conftest import DaemonProcess, make_namespace, shm_handshake

import kvtier
from kvtier_contract.protoutil import pack_keys
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.tiers.nvme.format import CorruptSlot, data_file_name, decode_header


def block(i: int, nbytes: int) -> bytes:
    return hashlib.shake_256(b"verified %d" % i).digest(nbytes)


_SECRETS: dict[int, bytes] = {}  # session id -> data secret, of the sessions raw_session opened


@contextmanager
def raw_session(daemon: DaemonProcess, transport: int = pb.TRANSPORT_SHM) -> Iterator[tuple[Any, int]]:
    with grpc.insecure_channel(daemon.grpc) as ch:
        stub = pb_grpc.KvtierStub(ch)
        opened = stub.OpenSession(
            pb.OpenSessionRequest(client_name="verify", lease_ttl_ms=30_000, transport=transport), timeout=5
        )
        _SECRETS[opened.session_id] = opened.data_secret  # (arena() hands it over)
        yield stub, opened.session_id


@contextmanager
def arena(daemon: DaemonProcess, session_id: int) -> Iterator[mmap.mmap]:
    """The arena, mapped read-write through the shm handshake (what any shm session gets)."""
    msg, fds = shm_handshake(daemon, session_id, _SECRETS[session_id])
    assert fds, msg
    try:
        mm = mmap.mmap(
            fds[0], os.fstat(fds[0]).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fds[0])
    try:
        yield mm
    finally:
        mm.close()


def slot_and_digest(stub: Any, sid: int, ns_id: int, key: bytes) -> tuple[int, int]:
    """A committed block's arena offset and its digest (PrepareLoad, then CompleteLoad)."""
    rep = stub.PrepareLoad(
        pb.PrepareLoadRequest(session_id=sid, namespace_id=ns_id, keys=key, transport=pb.TRANSPORT_SHM),
        timeout=5,
    )
    assert rep.found == b"\x01", rep
    stub.CompleteLoad(pb.CompleteLoadRequest(session_id=sid, job_id=rep.job_id), timeout=5)
    return rep.offsets[0], rep.digests[0]


def ns_counters(client: kvtier.Client, ns: Any) -> dict[str, int]:
    st = client.stats()
    [mine] = [n for n in st["namespaces"] if n["namespace_id"] == ns.namespace_id]
    return dict(mine["counters"])


def test_an_overwritten_committed_slot_is_a_miss_over_shm_and_tcp_counted_and_dropped(
    daemon: DaemonProcess,
) -> None:
    with (
        kvtier.Client.connect(daemon.unix, transport="shm") as shm,
        kvtier.Client.connect(daemon.grpc, transport="tcp") as tcp,
    ):
        ns = shm.register(make_namespace())
        n = 96  # 1.5 MiB: the SDK hashes on its helper thread (from 1 MiB a transfer)
        keys = ns.block_keys(list(range(16 * n)))
        data = [block(i, ns.block_bytes) for i in range(n)]
        assert ns.put(keys, data).stored == n
        ns_tcp = tcp.register(make_namespace())
        with raw_session(daemon) as (stub, sid), arena(daemon, sid) as mm:
            # Each digest is the block's xxh3_64, fixed at the commit.
            for i in (2, 5):
                off, dg = slot_and_digest(stub, sid, ns.namespace_id, keys[i])
                assert dg == xxhash.xxh3_64_intdigest(data[i])
            off5, _ = slot_and_digest(stub, sid, ns.namespace_id, keys[5])
            mm[off5 : off5 + 64] = b"\xee" * 64  # overwritten after its commit

            got = ns_tcp.get(keys)  # tcp: the client checks what it received
            assert got[:5] == data[:5]
            assert got[5:] == [None] * (n - 5)  # a miss, and so is every later block
            assert ns_counters(tcp, ns_tcp)["corrupt_blocks"] == 1
            assert tcp.counters.corrupt_blocks == 1
            assert ns.lookup(keys) == 5  # dropped: never served again

            off2, _ = slot_and_digest(stub, sid, ns.namespace_id, keys[2])
            mm[off2 + 1000] ^= 0x01  # one flipped bit
            got = ns.get(keys)  # shm: the client checks what it copied
            assert got[:2] == data[:2] and got[2:] == [None] * (n - 2)
            assert ns.lookup(keys) == 2
        st = shm.stats()
        assert st["total"]["corrupt_blocks"] == 2
        assert ns_counters(shm, ns)["corrupt_blocks"] == 2
        # Only the two corrupt blocks left the index: stored again, every block is a hit again.
        assert ns.put(keys, data).stored == 2
        assert ns.get(keys) == data


def test_a_client_cannot_drop_a_block_that_is_fine(daemon: DaemonProcess) -> None:
    """CompleteLoad's ``corrupt`` is checked by the daemon (it rehashes the slot)."""
    with kvtier.Client.connect(daemon.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        assert ns.put(keys, [block(i, ns.block_bytes) for i in range(4)]).stored == 4
        with raw_session(daemon) as (stub, sid):
            rep = stub.PrepareLoad(
                pb.PrepareLoadRequest(
                    session_id=sid,
                    namespace_id=ns.namespace_id,
                    keys=pack_keys(keys),
                    transport=pb.TRANSPORT_SHM,
                ),
                timeout=5,
            )
            with pytest.raises(grpc.RpcError) as e:
                stub.CompleteLoad(
                    pb.CompleteLoadRequest(session_id=sid, job_id=rep.job_id, corrupt=[7]), timeout=5
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "corrupt" in (e.value.details() or "")
            done = stub.CompleteLoad(
                pb.CompleteLoadRequest(session_id=sid, job_id=rep.job_id, corrupt=[0, 1]), timeout=5
            )
            assert done.dropped == 0
        assert ns.lookup(keys) == 4
        assert ns_counters(c, ns)["corrupt_blocks"] == 0


def test_complete_store_digests_count_mismatch_is_invalid_argument_and_changes_nothing(
    daemon: DaemonProcess,
) -> None:
    with kvtier.Client.connect(daemon.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        data = [block(10 + i, ns.block_bytes) for i in range(2)]
        with raw_session(daemon) as (stub, sid), arena(daemon, sid) as mm:
            prep = stub.PrepareStore(
                pb.PrepareStoreRequest(
                    session_id=sid,
                    namespace_id=ns.namespace_id,
                    keys=pack_keys(keys),
                    transport=pb.TRANSPORT_SHM,
                ),
                timeout=5,
            )
            assert prep.status == bytes([pb.STORE_RESERVED]) * 2
            for off, d in zip(prep.offsets, data, strict=True):
                mm[off : off + len(d)] = d
            digests = [xxhash.xxh3_64_intdigest(d) for d in data]
            for bad in ([digests[0]], digests * 2):
                with pytest.raises(grpc.RpcError) as e:
                    stub.CompleteStore(
                        pb.CompleteStoreRequest(session_id=sid, job_id=prep.job_id, ok=True, digests=bad),
                        timeout=5,
                    )
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "digests" in (e.value.details() or "")
                assert ns.lookup(keys) == 0  # nothing committed; the job is still open
            # A digest that does not match (a buggy or lying client): committed, and a miss at
            # the next load, its own namespace's loss only.
            done = stub.CompleteStore(
                pb.CompleteStoreRequest(
                    session_id=sid, job_id=prep.job_id, ok=True, digests=[digests[0], 12345]
                ),
                timeout=5,
            )
            assert done.committed == 2
        got = ns.get(keys)
        assert got == [data[0], None]
        assert ns_counters(c, ns)["corrupt_blocks"] == 1


def test_an_shm_put_without_client_digests_is_hashed_by_the_daemon(daemon_factory: Any) -> None:
    """``verify_bytes=False`` on the client: no digests sent, the daemon hashes the slots."""
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    with kvtier.Client.connect(d.unix, transport="shm", verify_bytes=False) as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 3)))
        data = [block(20 + i, ns.block_bytes) for i in range(3)]
        assert ns.put(keys, data).stored == 3
        with raw_session(d) as (stub, sid):
            for k, b in zip(keys, data, strict=True):
                assert slot_and_digest(stub, sid, ns.namespace_id, k)[1] == xxhash.xxh3_64_intdigest(b)


def header_checksum(directory: Path, ns_digest: bytes, key: bytes) -> int:
    data = (directory / data_file_name(0)).read_bytes()
    for off in range(0, len(data), 4096):
        try:
            h = decode_header(data[off : off + 4096], expect_digest=ns_digest, expect_key=key)
        except CorruptSlot:
            continue
        return h.payload_checksum
    raise AssertionError("no slot holds the key")


def test_the_nvme_checksum_is_the_digest_from_the_commit(daemon_factory: Any, tmp_path: Path) -> None:
    """Demoted after an overwrite of its slot, a block's NVMe header still carries the digest
    of the bytes committed (not of the arena at demotion): the copy fails verification when
    read back and is quarantined, never served."""
    disk, conf = tmp_path / "nvme", tmp_path / "kvtierd.toml"
    conf.write_text("write_after_hits = 1\n")
    d = daemon_factory(
        "--host-bytes",
        "2MiB",
        "--slab-bytes",
        "1MiB",
        "--disk-dir",
        str(disk),
        "--disk-bytes",
        "16MiB",
        "--write-policy",
        "selective",
        "--config",
        str(conf),
    )
    with kvtier.Client.connect(d.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 2)))
        data = [block(30 + i, ns.block_bytes) for i in range(2)]
        assert ns.put(keys, data).stored == 2
        with raw_session(d) as (stub, sid), arena(d, sid) as mm:
            off, dg = slot_and_digest(stub, sid, ns.namespace_id, keys[1])
            assert dg == xxhash.xxh3_64_intdigest(data[1])
            mm[off : off + 8] = b"\x00" * 8  # before its demotion
        assert ns.lookup(keys) == 2  # a hit: the selective policy writes both down
        for _ in range(100):
            st = c.stats()
            if st["total"]["demotions"] == 2:
                break
            time.sleep(0.05)
        assert st["total"]["demotions"] == 2
        for k, b in zip(keys, data, strict=True):
            assert header_checksum(disk, ns.namespace.digest, k) == xxhash.xxh3_64_intdigest(b)


def test_get_blocks_checks_the_slots_it_scatters(daemon: DaemonProcess) -> None:
    """The direct path (a mover scattering pinned slots into an engine's layout) is checked
    too: an overwritten slot is a miss there as well, counted and dropped."""
    torch = pytest.importorskip("torch")
    from kvtier.layouts import PagedKvLayout

    with kvtier.Client.connect(daemon.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        n = 8
        src = torch.randint(0, 255, (n, ns.block_bytes), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        keys = ns.block_keys(list(range(16 * n)))
        assert ns.put_blocks(keys, PagedKvLayout.contiguous(src, num_layers=1), list(range(n))).stored == n
        with raw_session(daemon) as (stub, sid), arena(daemon, sid) as mm:
            off, dg = slot_and_digest(stub, sid, ns.namespace_id, keys[3])
            assert dg == xxhash.xxh3_64_intdigest(src[3].numpy().tobytes())
            mm[off + 7] ^= 0xFF
        found = ns.get_blocks(keys, PagedKvLayout.contiguous(dst, num_layers=1), list(range(n)))
        assert found == [True] * 3 + [False] * (n - 3)
        assert torch.equal(dst[:3], src[:3])
        assert ns_counters(c, ns)["corrupt_blocks"] == 1
        assert ns.lookup(keys) == 3


def test_verify_store_daemon_ignores_the_clients_digests(daemon_factory: Any) -> None:
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--verify-store", "daemon")
    with kvtier.Client.connect(d.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16)))
        data = block(40, ns.block_bytes)
        with raw_session(d) as (stub, sid), arena(d, sid) as mm:
            prep = stub.PrepareStore(
                pb.PrepareStoreRequest(
                    session_id=sid,
                    namespace_id=ns.namespace_id,
                    keys=pack_keys(keys),
                    transport=pb.TRANSPORT_SHM,
                ),
                timeout=5,
            )
            mm[prep.offsets[0] : prep.offsets[0] + len(data)] = data
            stub.CompleteStore(
                pb.CompleteStoreRequest(session_id=sid, job_id=prep.job_id, ok=True, digests=[12345]),
                timeout=5,
            )
            assert slot_and_digest(stub, sid, ns.namespace_id, keys[0])[1] == xxhash.xxh3_64_intdigest(data)
        assert ns.get(keys) == [data]


def test_without_verify_bytes_nothing_is_hashed_or_checked(daemon_factory: Any) -> None:
    """The switch (for measuring the cost): no digests, and an overwritten slot is served as
    it is, which is the threat verified bytes remove."""
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--no-verify-bytes")
    with kvtier.Client.connect(d.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        keys = ns.block_keys(list(range(16)))
        assert ns.put(keys, [block(50, ns.block_bytes)]).stored == 1
        with raw_session(d) as (stub, sid), arena(d, sid) as mm:
            rep = stub.PrepareLoad(
                pb.PrepareLoadRequest(
                    session_id=sid, namespace_id=ns.namespace_id, keys=keys[0], transport=pb.TRANSPORT_SHM
                ),
                timeout=5,
            )
            assert list(rep.digests) == []
            stub.CompleteLoad(pb.CompleteLoadRequest(session_id=sid, job_id=rep.job_id), timeout=5)
            mm[rep.offsets[0] : rep.offsets[0] + 4] = b"evil"
        [got] = ns.get(keys)
        assert got is not None and bytes(got[:4]) == b"evil"

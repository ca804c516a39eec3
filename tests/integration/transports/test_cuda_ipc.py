"""The cuda_ipc protocol of the daemon, without a GPU.

A real ``Daemon`` (gRPC on a Unix socket, host arena, shm fd server) runs in this process with
``HostMemoryDriver`` in place of cupy: "device memory" is memory of this process and an "IPC
handle" carries its address, so the daemon's copies are plain memmoves. What this checks is the
daemon's half of the transport: validation before any copy, which job states a copy and its
failure lead to, that a store commits only what a CudaCopy moved, handle sharing and closing with
the session, the figures. The CUDA calls themselves (cupy's runtime) run only in
tests/gpu/test_cuda_paths.py on a CUDA machine.
"""

from __future__ import annotations

import asyncio
import ctypes
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import make_namespace

import kvtier
from kvtier.layouts import PagedKvLayout
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.app import Daemon
from kvtierd.config import DaemonConfig
from kvtierd.transports.cuda_driver import CudaFailure, Move
from kvtierd.transports.cuda_ipc import runs

UUID_A, UUID_B = bytes(range(16)), bytes(range(16, 32))
StatusCode = grpc.StatusCode


class HostMemoryDriver:
    """Test double for the CUDA runtime (see the module docstring). Thread-safe enough: the
    copier calls it from one worker thread per device."""

    def __init__(self, uuids: Sequence[bytes]) -> None:
        self.uuids = list(uuids)
        self.registered: list[tuple[int, int]] = []
        self.opened: list[tuple[int, int]] = []
        self.closed: list[tuple[int, int]] = []
        self.copies: list[int] = []  # moves per copy call
        self.fail_copy = False
        self.gate: threading.Event | None = None  # when set: copies wait for it
        self.copy_entered = threading.Event()

    def device_uuids(self) -> list[bytes]:
        return list(self.uuids)

    def register_host(self, address: int, nbytes: int) -> None:
        self.registered.append((address, nbytes))

    def unregister_host(self, address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != address]

    def open_handle(self, device: int, handle: bytes) -> tuple[int, int]:
        address, size = struct.unpack_from("<QQ", handle)
        self.opened.append((device, address))
        return int(address), int(size)

    def close_handle(self, device: int, address: int) -> None:
        self.closed.append((device, address))

    def copy(self, device: int, moves: Sequence[Move], to_device: bool) -> None:
        self.copy_entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail_copy:
            raise CudaFailure("cudaErrorIllegalAddress: injected by the test")
        for dst, src, n in moves:
            ctypes.memmove(dst, src, n)
        self.copies.append(len(moves))


def handle_of(array: np.ndarray) -> bytes:
    """The fake IPC handle of ``array``'s memory (its address and size, padded to 64 bytes)."""
    return struct.pack("<QQ", array.ctypes.data, array.nbytes).ljust(64, b"\0")


class InProcessDaemon:
    """A Daemon on its own event-loop thread; ``stub`` talks to it over its Unix socket."""

    def __init__(self, tmp: Path, driver: HostMemoryDriver, lease_ttl_s: float = 5.0) -> None:
        self.driver = driver
        self.cfg = DaemonConfig.from_flat(
            host_bytes=16 << 20,
            slab_bytes=1 << 20,
            prefault=False,
            socket_path=str(tmp / "kvtier.sock"),
            listen="",
            data_listen="127.0.0.1:0",
            metrics_port=-1,
            lease_ttl_s=lease_ttl_s,
            min_lease_ttl_s=0.2,
            drain_timeout_s=0.5,
            lease_sweep_s=0.05,
            run_dir=str(tmp),
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> Daemon:
            d = Daemon(self.cfg, cuda_driver=driver)
            await d.start()
            return d

        self.daemon = self.run(start())
        self.address = f"unix://{self.cfg.grpc.socket_path}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.KvtierStub(self.channel)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def call(self, method: str, **fields: Any) -> Any:
        request = getattr(pb, f"{method}Request")(**fields)
        return getattr(self.stub, method)(request, timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.run(self.daemon.drain_and_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon(tmp_path, HostMemoryDriver([UUID_A, UUID_B]))
    yield d
    d.close()


class Session:
    """One cuda_ipc session with the test namespace registered."""

    def __init__(self, d: InProcessDaemon) -> None:
        self.d = d
        reply = d.call("OpenSession", client_name="t", transport=pb.TRANSPORT_CUDA_IPC, lease_ttl_ms=5000)
        self.id = reply.session_id
        ns = make_namespace()
        self.bb = ns.block_bytes
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        self.ns_id = d.call("RegisterNamespace", spec=spec).namespace_id

    def call(self, method: str, **fields: Any) -> Any:
        return self.d.call(method, session_id=self.id, **fields)

    def buffer(
        self, array: np.ndarray, offset: int = 0, nbytes: int | None = None, uuid: bytes = UUID_A
    ) -> int:
        return int(
            self.call(
                "RegisterCudaBuffer",
                device_uuid=uuid,
                ipc_handle=handle_of(array),
                handle_offset=offset,
                buffer_bytes=array.nbytes - offset if nbytes is None else nbytes,
            ).buffer_id
        )

    def prepare_store(self, ids: Sequence[int], tp: int = pb.TRANSPORT_CUDA_IPC) -> Any:
        return self.call("PrepareStore", namespace_id=self.ns_id, keys=keys(*ids), transport=tp)

    def prepare_load(self, ids: Sequence[int], tp: int = pb.TRANSPORT_CUDA_IPC) -> Any:
        return self.call("PrepareLoad", namespace_id=self.ns_id, keys=keys(*ids), transport=tp)


def keys(*ids: int) -> bytes:
    return b"".join(i.to_bytes(32, "big") for i in ids)


def pattern(n_blocks: int, block_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n_blocks * block_bytes, dtype=np.uint8)


def refused(fn: Any, code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.RpcError) as exc:
        fn()
    assert exc.value.code() == code, (exc.value.code(), exc.value.details())
    if field:
        assert (exc.value.details() or "").startswith(f"{field}: "), exc.value.details()
    return str(exc.value.details())


def figures(d: InProcessDaemon) -> dict[str, Any]:
    from kvtier_contract.protoutil import to_dict

    return to_dict(d.stub.Stats(pb.StatsRequest(), timeout=10))


# ---- the protocol ----------------------------------------------------------------------------


def test_store_then_load_moves_bytes_through_the_daemons_copies(daemon: InProcessDaemon) -> None:
    s = Session(daemon)
    bb, n = s.bb, 5
    src = pattern(n, bb, 1)
    buf = s.buffer(src)
    assert daemon.driver.registered, "the arena is page-locked at start"
    prep = s.prepare_store(range(1, n + 1))
    assert list(prep.status) == [pb.STORE_RESERVED] * n
    # Blocks 0..4 of the buffer; fresh slots are consecutive: one copy for the whole batch.
    done = s.call("CudaCopy", job_id=prep.job_id, buffer_id=buf, buffer_offsets=[i * bb for i in range(n)])
    assert (done.copies, done.bytes) == (1, n * bb)
    assert s.call("CompleteStore", job_id=prep.job_id, ok=True).committed == n

    # The bytes are in the arena: an shm reader sees them.
    with kvtier.Client.connect(daemon.address, "shm") as c:
        ns = c.register(make_namespace())
        got = ns.get([i.to_bytes(32, "big") for i in range(1, n + 1)])
        assert b"".join(g or b"" for g in got) == src.tobytes()

    # Load into another buffer, blocks in reverse order at an offset inside the allocation.
    dst = np.zeros(8 * bb, np.uint8)
    buf2 = s.buffer(dst, offset=bb, nbytes=6 * bb)
    load = s.prepare_load(range(1, n + 1))
    reply = s.call(
        "CudaCopy", job_id=load.job_id, buffer_id=buf2, buffer_offsets=[(n - 1 - i) * bb for i in range(n)]
    )
    assert reply.copies == n  # no two neighbours in both the arena and the buffer
    s.call("CompleteLoad", job_id=load.job_id)
    for i in range(n):
        assert (
            dst[bb + (n - 1 - i) * bb : bb + (n - i) * bb].tobytes() == src[i * bb : (i + 1) * bb].tobytes()
        )
    assert not dst[:bb].any() and not dst[6 * bb :].any()
    f = figures(daemon)
    assert f["total"]["bytes_in_cuda_ipc"] == n * bb and f["total"]["bytes_out_cuda_ipc"] == n * bb
    assert f["total"]["bytes_in_shm"] == 0
    cu = f["cuda_ipc"]
    assert cu["enabled"] and cu["devices"] == 2 and cu["buffers"] == 2
    assert cu["copies"] == 1 + n and cu["bytes_copied"] == 2 * n * bb and cu["copy_errors"] == 0


def test_a_store_commits_only_what_a_copy_moved(daemon: InProcessDaemon) -> None:
    s = Session(daemon)
    prep = s.prepare_store([1, 2])
    done = s.call("CompleteStore", job_id=prep.job_id, ok=True)  # no CudaCopy was made
    assert (done.committed, done.aborted) == (0, 2)
    assert s.call("Lookup", namespace_id=s.ns_id, keys=keys(1, 2)).hit_blocks == 0
    assert figures(daemon)["writing_blocks"] == 0


def test_runs_merge_only_blocks_adjacent_in_both_places() -> None:
    bb = 100
    assert runs([(0, 0), (100, 100), (200, 200)], bb) == [(0, 0, 300)]
    assert runs([(0, 0), (100, 300), (200, 400)], bb) == [(0, 0, 100), (100, 300, 200)]
    assert runs([(500, 0), (0, 100)], bb) == [(500, 0, 100), (0, 100, 100)]
    assert runs([], bb) == []
    # Never across a registration chunk of the arena (chunk of 250 here).
    assert runs([(0, 0), (100, 100), (200, 200), (300, 300)], bb, chunk=250) == [
        (0, 0, 200),
        (200, 200, 100),
        (300, 300, 100),
    ]


def test_bad_copies_are_refused_naming_the_field_and_change_nothing(daemon: InProcessDaemon) -> None:
    s, other = Session(daemon), Session(daemon)
    bb = s.bb
    src = pattern(4, bb, 2)
    buf = s.buffer(src)
    theirs = other.buffer(pattern(4, bb, 3))
    prep = s.prepare_store([1, 2])
    shm_job = s.prepare_store([3], tp=pb.TRANSPORT_SHM)
    ok = [0, bb]
    cases = [
        (
            dict(job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0]),
            StatusCode.INVALID_ARGUMENT,
            "buffer_offsets",
        ),
        (
            dict(job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0, 3 * bb + 1]),
            StatusCode.INVALID_ARGUMENT,
            "buffer_offsets",
        ),
        (
            dict(job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0, 2**63]),
            StatusCode.INVALID_ARGUMENT,
            "buffer_offsets",
        ),
        (
            dict(job_id=prep.job_id, buffer_id=theirs, buffer_offsets=ok),
            StatusCode.NOT_FOUND,
            "buffer_id",
        ),  # another session's: as an absent one
        (dict(job_id=prep.job_id, buffer_id=999, buffer_offsets=ok), StatusCode.NOT_FOUND, "buffer_id"),
        (
            dict(job_id=shm_job.job_id, buffer_id=buf, buffer_offsets=[0]),
            StatusCode.FAILED_PRECONDITION,
            "job_id",
        ),
        (dict(job_id=987_654, buffer_id=buf, buffer_offsets=ok), StatusCode.NOT_FOUND, "job_id"),
    ]
    for fields, code, field in cases:
        refused(lambda f=fields: s.call("CudaCopy", **f), code, field)
    refused(
        lambda: other.call("CudaCopy", job_id=prep.job_id, buffer_id=theirs, buffer_offsets=ok),
        StatusCode.NOT_FOUND,
        "job_id",
    )
    assert daemon.driver.copies == []  # nothing was copied
    # The job is intact: a good copy after all those commits both blocks.
    s.call("CudaCopy", job_id=prep.job_id, buffer_id=buf, buffer_offsets=ok)
    assert s.call("CompleteStore", job_id=prep.job_id, ok=True).committed == 2


def test_bad_buffers_are_refused_naming_the_field(daemon: InProcessDaemon) -> None:
    s = Session(daemon)
    h = handle_of(np.zeros(64, np.uint8))
    base = dict(device_uuid=UUID_A, ipc_handle=h, handle_offset=0, buffer_bytes=64)
    cases = [
        (dict(device_uuid=UUID_A[:15]), StatusCode.INVALID_ARGUMENT, "device_uuid"),
        (dict(ipc_handle=h[:63]), StatusCode.INVALID_ARGUMENT, "ipc_handle"),
        (dict(ipc_handle=b""), StatusCode.INVALID_ARGUMENT, "ipc_handle"),
        (dict(buffer_bytes=0), StatusCode.INVALID_ARGUMENT, "buffer_bytes"),
        (dict(buffer_bytes=65), StatusCode.INVALID_ARGUMENT, "buffer_bytes"),  # past the end
        (dict(handle_offset=1), StatusCode.INVALID_ARGUMENT, "buffer_bytes"),
        (dict(device_uuid=b"\xff" * 16), StatusCode.FAILED_PRECONDITION, "device_uuid"),
    ]
    for over, code, field in cases:
        detail = refused(lambda o=over: s.call("RegisterCudaBuffer", **{**base, **o}), code, field)
        if field == "device_uuid" and code == StatusCode.FAILED_PRECONDITION:
            assert "ffffffff" in detail and "CUDA_VISIBLE_DEVICES" in detail
    refused(
        lambda: daemon.call("RegisterCudaBuffer", session_id=12345, **base),
        StatusCode.NOT_FOUND,
        "session_id",
    )
    refused(lambda: s.call("ReleaseCudaBuffer", buffer_id=77), StatusCode.NOT_FOUND, "buffer_id")
    assert figures(daemon)["cuda_ipc"]["buffers"] == 0
    deadline = time.monotonic() + 5  # what was opened to learn its size is closed again
    while len(daemon.driver.closed) < len(daemon.driver.opened) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(daemon.driver.closed) == len(daemon.driver.opened) == 2
    # The second device is matched by its UUID, not by an ordinal.
    s.buffer(np.zeros(64, np.uint8), uuid=UUID_B)
    assert daemon.driver.opened[-1][0] == 1


def test_a_cuda_error_fails_that_job_only(daemon: InProcessDaemon) -> None:
    s = Session(daemon)
    bb = s.bb
    src = pattern(2, bb, 4)
    buf = s.buffer(src)
    prep = s.prepare_store([1, 2])
    s.call("CudaCopy", job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0, bb])
    s.call("CompleteStore", job_id=prep.job_id, ok=True)

    daemon.driver.fail_copy = True
    store = s.prepare_store([3, 4])
    detail = refused(
        lambda: s.call("CudaCopy", job_id=store.job_id, buffer_id=buf, buffer_offsets=[0, bb]),
        StatusCode.ABORTED,
        "",
    )
    assert "injected" in detail
    load = s.prepare_load([1, 2])
    refused(
        lambda: s.call("CudaCopy", job_id=load.job_id, buffer_id=buf, buffer_offsets=[0, bb]),
        StatusCode.ABORTED,
        "",
    )
    f = figures(daemon)
    assert (f["writing_blocks"], f["pinned_blocks"]) == (0, 0)  # entries freed, pins released
    assert f["cuda_ipc"]["copy_errors"] == 2
    refused(lambda: s.call("CompleteStore", job_id=store.job_id, ok=True), StatusCode.NOT_FOUND, "job_id")
    assert s.call("Lookup", namespace_id=s.ns_id, keys=keys(3)).hit_blocks == 0

    daemon.driver.fail_copy = False  # the daemon and the session go on
    again = s.prepare_store([3, 4])
    s.call("CudaCopy", job_id=again.job_id, buffer_id=buf, buffer_offsets=[0, bb])
    assert s.call("CompleteStore", job_id=again.job_id, ok=True).committed == 2
    assert s.call("Lookup", namespace_id=s.ns_id, keys=keys(1, 2, 3, 4)).hit_blocks == 4


def test_slots_under_a_copy_are_never_handed_out_again(daemon: InProcessDaemon) -> None:
    """While the daemon copies into a store's slots, completing that job is refused, and a
    session closed meanwhile leaves the slots in limbo instead of freeing them for reuse."""
    s = Session(daemon)
    bb = s.bb
    buf = s.buffer(pattern(2, bb, 5))
    prep = s.prepare_store([1, 2])
    daemon.driver.gate = threading.Event()
    copy = threading.Thread(
        target=lambda: s.call("CudaCopy", job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0, bb])
    )
    copy.start()
    assert daemon.driver.copy_entered.wait(5)
    refused(
        lambda: s.call("CompleteStore", job_id=prep.job_id, ok=True), StatusCode.FAILED_PRECONDITION, "job_id"
    )
    s.call("CloseSession")
    f = figures(daemon)
    assert (f["limbo_blocks"], f["writing_blocks"]) == (2, 0)  # held back, not free
    daemon.driver.gate.set()
    copy.join(10)


def test_handles_are_shared_and_closed_with_the_session(daemon: InProcessDaemon) -> None:
    drv = daemon.driver
    s = Session(daemon)
    mem = np.zeros(4 << 10, np.uint8)
    a = s.buffer(mem, offset=0, nbytes=1 << 10)
    b = s.buffer(mem, offset=1 << 10, nbytes=1 << 10)  # same allocation: opened once
    assert len(drv.opened) == 1
    s.call("ReleaseCudaBuffer", buffer_id=a)
    time.sleep(0.1)  # sleep: a wrong close would come later, from the device's worker thread
    assert drv.closed == []  # b still uses the mapping
    refused(
        lambda: s.call(
            "RegisterCudaBuffer",
            device_uuid=UUID_A,
            ipc_handle=handle_of(mem),
            handle_offset=0,
            buffer_bytes=0,
        ),
        StatusCode.INVALID_ARGUMENT,
        "buffer_bytes",
    )
    s.call("CloseSession")
    deadline = time.monotonic() + 5
    while not drv.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert drv.closed == [(0, mem.ctypes.data)] and figures(daemon)["cuda_ipc"]["buffers"] == 0
    del b

    # A client that dies with a buffer open: the lease's end closes the handle.
    r = daemon.call("OpenSession", client_name="dies", transport=pb.TRANSPORT_CUDA_IPC, lease_ttl_ms=300)
    mem2 = np.zeros(1 << 10, np.uint8)
    daemon.call(
        "RegisterCudaBuffer",
        session_id=r.session_id,
        device_uuid=UUID_A,
        ipc_handle=handle_of(mem2),
        buffer_bytes=mem2.nbytes,
    )
    deadline = time.monotonic() + 5
    while len(drv.closed) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert drv.closed[-1] == (0, mem2.ctypes.data)
    assert figures(daemon)["leases_expired"] == 1


def test_shutdown_unregisters_the_arena(tmp_path: Path) -> None:
    drv = HostMemoryDriver([UUID_A])
    d = InProcessDaemon(tmp_path, drv)
    assert drv.registered and sum(n for _, n in drv.registered) == d.daemon.arena.size
    s = Session(d)
    s.buffer(np.zeros(64, np.uint8))
    d.close()
    assert drv.registered == [] and len(drv.closed) == 1


# ---- the client over a cuda_ipc session -----------------------------------------------------


def test_a_cuda_ipc_client_moves_host_buffers_and_cpu_layouts_over_the_mapping(
    daemon: InProcessDaemon,
) -> None:
    """CPU layouts have no CUDA memory to export: they move through the mapped arena as with
    shm (jobs of transport SHM), and host buffers too."""
    with kvtier.Client.connect(daemon.address, "cuda_ipc") as client:
        assert client.connected, client.counters.last_error
        ns = client.register(make_namespace(layout="vllm.LBHNC"))
        cache = torch.randn((2, 6, 2, 16, 128), dtype=torch.float32).to(torch.bfloat16)
        layout = PagedKvLayout.from_layer_tensors([cache[i] for i in range(2)], name="LBHNC")
        ks = ns.block_keys(list(range(16 * 3)))
        assert ns.put_blocks(ks, layout, [4, 0, 2]).stored == 3
        out = torch.zeros_like(cache)
        dst = PagedKvLayout.from_layer_tensors([out[i] for i in range(2)], name="LBHNC")
        assert ns.get_blocks(ks, dst, [1, 5, 3]) == [True] * 3
        assert torch.equal(out[:, [1, 5, 3]], cache[:, [4, 0, 2]])
        extra = ns.block_keys(list(range(16 * 4)))[3:]
        assert ns.put(extra, [b"\7" * ns.block_bytes]).stored == 1
        assert ns.get(extra) == [bytearray(b"\7" * ns.block_bytes)]
    assert daemon.driver.copies == []
    f = figures(daemon)["total"]
    assert f["bytes_in_shm"] == 4 * ns.block_bytes and f["bytes_in_cuda_ipc"] == 0


def test_a_cuda_ipc_client_of_a_daemon_without_it_misses_and_says_why(
    tmp_path: Path, daemon_factory: Any
) -> None:
    d = daemon_factory("--host-bytes", "16MiB", "--slab-bytes", "1MiB")
    with pytest.raises(kvtier.errors.FailedPrecondition, match="cuda_ipc is disabled"):
        kvtier.Client.connect(d.unix, "cuda_ipc", timeout_s=2)  # a caller that may fail: told
    with kvtier.Client.connect(d.unix, "cuda_ipc", timeout_s=2, lazy=True) as client:  # an engine
        assert not client.connected
        assert "cuda_ipc is disabled" in client.counters.last_error
        ns = client.register(make_namespace())
        ks = ns.block_keys(list(range(16)))
        assert ns.put(ks, [bytes(ns.block_bytes)]).dropped == 1
        assert ns.lookup(ks) == 0


def test_the_daemon_refuses_to_start_with_cuda_ipc_and_no_cuda(tmp_path: Path) -> None:
    try:
        import cupy  # noqa: F401

        pytest.skip("cupy is installed here: the refusal path is for machines without it")
    except ImportError:
        pass
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtierd",
            "serve",
            "--cuda-ipc",
            "--host-bytes",
            "8MiB",
            "--slab-bytes",
            "1MiB",
            "--socket",
            str(tmp_path / "k.sock"),
            "--listen",
            "",
            "--metrics-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cuda_ipc = true needs cupy" in proc.stderr and "cuda extra" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_copy_outliving_its_rpc_keeps_its_slots_until_it_ends(daemon: InProcessDaemon) -> None:
    """The client's deadline cancels a CudaCopy RPC, not the device copy: the job stays
    uncompletable and its slots are not handed out again until the copy has ended, then the
    job is aborted (its client gave it up)."""
    s = Session(daemon)
    buf = s.buffer(pattern(1, s.bb, 7))
    prep = s.prepare_store([1])
    daemon.driver.gate = threading.Event()
    request = pb.CudaCopyRequest(session_id=s.id, job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0])
    with pytest.raises(grpc.RpcError) as exc:
        daemon.stub.CudaCopy(request, timeout=0.3)
    assert exc.value.code() == StatusCode.DEADLINE_EXCEEDED and daemon.driver.copy_entered.is_set()
    refused(
        lambda: s.call("CompleteStore", job_id=prep.job_id, ok=False),
        StatusCode.FAILED_PRECONDITION,
        "job_id",
    )  # the copy still writes into the slot
    again = s.prepare_store([2], tp=pb.TRANSPORT_SHM)
    assert again.offsets[0] != prep.offsets[0]  # that slot is not handed out meanwhile
    daemon.driver.gate.set()
    deadline = time.monotonic() + 5
    while figures(daemon)["writing_blocks"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the copy ends; its job is aborted
    assert figures(daemon)["writing_blocks"] == 1  # only the shm store of key 2 is left
    refused(lambda: s.call("CompleteStore", job_id=prep.job_id, ok=True), StatusCode.NOT_FOUND, "job_id")


def test_a_pinned_lookup_job_is_not_copied(daemon: InProcessDaemon) -> None:
    """A pinned lookup only holds blocks; its job id moves no bytes (PrepareLoad does)."""
    s = Session(daemon)
    buf = s.buffer(pattern(1, s.bb, 8))
    prep = s.prepare_store([1])
    s.call("CudaCopy", job_id=prep.job_id, buffer_id=buf, buffer_offsets=[0])
    s.call("CompleteStore", job_id=prep.job_id, ok=True)
    pinned = s.call("Lookup", namespace_id=s.ns_id, keys=keys(1), pin=True)
    assert pinned.hit_blocks == 1 and pinned.job_id
    assert list(pinned.offsets) == list(prep.offsets)  # host only: the hold keeps its slot
    detail = refused(
        lambda: s.call("CudaCopy", job_id=pinned.job_id, buffer_id=buf, buffer_offsets=[0]),
        StatusCode.FAILED_PRECONDITION,
        "job_id",
    )
    assert "PrepareLoad" in detail
    s.call("CompleteLoad", job_id=pinned.job_id)

"""The GPU data path on a CUDA machine: paged CUDA caches through a real daemon.

Marked ``gpu`` and skipped cleanly without CUDA (CI has none). The daemon runs with
``--cuda-ipc`` (cupy is on the GPU image), so every test runs over ``shm`` (the client copies,
the arena registered in the client) and ``cuda_ipc`` (the daemon copies through IPC handles of
the client's staging buffer). What they check:
* shm: the arena is registered with CUDA (copies are DMA from page-locked memory); cuda_ipc:
  the daemon made the copies (its figures) and the client registered a buffer;
* LBNHC / LBHNC / BLHNC caches round-trip byte-exact (put at some block ids, get into another
  cache at others, odd counts, a miss leaves its block alone);
* two engine processes share blocks; a client killed mid-store leaves no daemon state behind
  its lease; a failed copy fails its job only;
* the engine's stream is not blocked by a transfer (the copy stream is ordered by events).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, DaemonProcess, make_namespace

import kvtier
from kvtier.layouts import PagedKvLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TRANSPORTS = ["shm", "cuda_ipc"]


@pytest.fixture
def daemon(daemon_factory: Any) -> DaemonProcess:
    """The conftest daemon (64 MiB, 1 MiB slabs, 2 s leases) with cuda_ipc on."""
    return daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--lease-ttl-s", "2", "--cuda-ipc")


L, H, N, D = 2, 2, 16, 64  # make_namespace(): 16 KiB blocks
C = 2 * D
NUM_BLOCKS = 24


def cache(order: str, fill: bool) -> tuple[torch.Tensor, PagedKvLayout]:
    """A vLLM-style shared CUDA buffer and its per-layer [B, H, N, C] views."""
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = {
        "LBNHC": (L, NUM_BLOCKS, N, H, C),
        "LBHNC": (L, NUM_BLOCKS, H, N, C),
        "BLHNC": (NUM_BLOCKS, L, H, N, C),
    }[order]
    buf = (torch.randn(shape, generator=g, device="cuda") if fill else torch.zeros(shape, device="cuda")).to(
        torch.bfloat16
    )
    if order == "LBNHC":
        layers = [buf[i].permute(0, 2, 1, 3) for i in range(L)]
    elif order == "LBHNC":
        layers = [buf[i] for i in range(L)]
    else:
        layers = [buf[:, i] for i in range(L)]
    return buf, PagedKvLayout.from_layer_tensors(layers, name=order)


def block_bytes(layout: PagedKvLayout, ids: list[int]) -> list[bytes]:
    out = torch.empty((len(ids), layout.block_bytes), dtype=torch.uint8, device="cuda")
    layout.gather(ids, out)
    return [bytes(row.cpu().numpy()) for row in out]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC"])
def test_cuda_cache_round_trips(daemon: DaemonProcess, order: str, transport: str) -> None:
    _, src = cache(order, True)
    _, dst = cache(order, False)
    with kvtier.Client.connect(daemon.unix, transport=transport) as client:
        assert client.connected, client.counters.last_error
        ns = client.register(make_namespace(layout=f"vllm.{order}"))
        keys = ns.block_keys(list(range(16 * 7)))
        src_ids, dst_ids = [20, 3, 7, 0, 5, 11, 2], [1, 9, 4, 10, 23, 8, 12]
        assert ns.put_blocks(keys, src, src_ids).stored == 7
        mover = client.session.data().mover(torch.device("cuda", torch.cuda.current_device()))
        if transport == "shm":
            assert mover.registered and mover.host.is_pinned()  # DMA, not pageable copies
        else:
            assert mover.buffer_id and client.stats()["cuda_ipc"]["copies"] >= 1
        untouched = block_bytes(dst, [6])
        assert ns.get_blocks(keys + [b"\1" * 32], dst, dst_ids + [6]) == [True] * 7 + [False]
        torch.cuda.synchronize()
        assert block_bytes(dst, dst_ids) == block_bytes(src, src_ids)
        assert block_bytes(dst, [6]) == untouched
        total = client.stats()["total"]
        moved = 7 * ns.block_bytes
        if transport == "cuda_ipc":
            assert (total["bytes_in_cuda_ipc"], total["bytes_out_cuda_ipc"]) == (moved, moved)
        else:
            assert (total["bytes_in_shm"], total["bytes_out_shm"]) == (moved, moved)


def test_cuda_ipc_buffer_grows_and_odd_batches_round_trip(daemon: DaemonProcess) -> None:
    _, src = cache("LBNHC", True)
    _, dst = cache("LBNHC", False)
    with kvtier.Client.connect(daemon.unix, transport="cuda_ipc") as client:
        ns = client.register(make_namespace(layout="vllm.LBNHC"))
        keys = ns.block_keys(list(range(16 * 23)))
        ids = list(range(23))
        for lo, hi in [(0, 1), (1, 4), (4, 23)]:
            assert ns.put_blocks(keys[lo:hi], src, ids[lo:hi]).stored == hi - lo
        back = ids[::-1]
        assert ns.get_blocks(keys, dst, back) == [True] * 23
        torch.cuda.synchronize()
        assert block_bytes(dst, back) == block_bytes(src, ids)
        assert client.stats()["cuda_ipc"]["copy_errors"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfers_do_not_block_the_engine_stream(daemon: DaemonProcess, transport: str) -> None:
    _, src = cache("LBNHC", True)
    with kvtier.Client.connect(daemon.unix, transport=transport) as client:
        ns = client.register(make_namespace(layout="vllm.LBNHC"))
        keys = ns.block_keys(list(range(16 * 4)))
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            busy = torch.cuda._sleep  # a long kernel queued on the engine's stream
            assert ns.put_blocks(keys, src, [0, 1, 2, 3]).stored == 4
            busy(2_000_000_000)  # ~1 s of GPU time
            t0 = time.perf_counter()
            assert ns.get_blocks(keys, src, [4, 5, 6, 7]) == [True] * 4
            waited = time.perf_counter() - t0
        engine.synchronize()
        assert waited < 0.5
        assert block_bytes(src, [4, 5, 6, 7]) == block_bytes(src, [0, 1, 2, 3])


CHILD = textwrap.dedent("""
    import sys, torch, kvtier
    sys.path.insert(0, {tests!r})
    from conftest import make_namespace
    from test_cuda_paths import cache, block_bytes
    import hashlib
    role, address, transport = sys.argv[1], sys.argv[2], sys.argv[3]
    _, layout = cache("LBHNC", role == "put")
    with kvtier.Client.connect(address, transport=transport, lease_ttl_s=2) as c:
        ns = c.register(make_namespace(layout="vllm.LBHNC"))
        keys = ns.block_keys(list(range(16 * 5)))
        if role == "put":
            assert ns.put_blocks(keys, layout, [1, 3, 5, 7, 9]).stored == 5
            ids = [1, 3, 5, 7, 9]
        elif role == "hang":
            ns.put_blocks(keys, layout, [1, 3, 5, 7, 9])
            print("STORED", flush=True)
            import time; time.sleep(60)
        else:
            assert ns.get_blocks(keys, layout, [0, 2, 4, 6, 8]) == [True] * 5
            ids = [0, 2, 4, 6, 8]
        print(hashlib.sha256(b"".join(block_bytes(layout, ids))).hexdigest())
""")


def child(role: str, address: str, transport: str) -> subprocess.Popen[str]:
    code = CHILD.format(tests=str(Path(__file__).parent))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "tests"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, role, address, transport], stdout=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.parametrize(
    ("put_via", "get_via"), [("shm", "shm"), ("cuda_ipc", "cuda_ipc"), ("cuda_ipc", "shm")]
)
def test_two_engine_processes_share_blocks(daemon: DaemonProcess, put_via: str, get_via: str) -> None:
    put = child("put", daemon.unix, put_via)
    put_out, _ = put.communicate(timeout=120)
    get = child("get", daemon.unix, get_via)
    get_out, _ = get.communicate(timeout=120)
    assert put.returncode == 0 and get.returncode == 0
    assert put_out.split()[-1] == get_out.split()[-1]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_killed_client_leaves_nothing_behind_its_lease(daemon: DaemonProcess, transport: str) -> None:
    proc = child("hang", daemon.unix, transport)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "STORED"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 15  # the daemon fixture's lease is 2 s (+ one in limbo)
    with kvtier.Client.connect(daemon.unix) as c:
        while time.monotonic() < deadline:
            stats = c.stats()
            if stats["sessions"] <= 1 and stats["pinned_blocks"] == 0 and stats["writing_blocks"] == 0:
                break
            time.sleep(0.2)
        assert stats["pinned_blocks"] == 0 and stats["writing_blocks"] == 0
        assert stats["total"]["resident_blocks"] == 5  # what it stored stays served
        assert stats["cuda_ipc"]["buffers"] == 0  # its handles closed with its lease


def test_cuda_ipc_bad_buffers_are_refused_before_any_copy(daemon: DaemonProcess) -> None:
    """A handle that opens nothing, and a buffer declared past the end of its allocation (a copy
    there would fault on the copy engine), are refused at registration; the session goes on."""
    import grpc

    from kvtier.transports.cuda_ipc import _export, device_uuid
    from kvtier_contract.v1 import kvtier_pb2 as pb
    from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

    dev = torch.device("cuda", torch.cuda.current_device())
    mem = torch.full((1 << 21,), 7, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    handle, offset = _export(mem.data_ptr())
    with grpc.insecure_channel(daemon.unix) as ch:
        stub = pb_grpc.KvtierStub(ch)
        sid = stub.OpenSession(
            pb.OpenSessionRequest(client_name="gpu-errors", transport=pb.TRANSPORT_CUDA_IPC)
        ).session_id
        ns = make_namespace()
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        ns_id = stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec)).namespace_id
        uuid = device_uuid(dev)
        for fields, code, field in [
            (
                dict(ipc_handle=os.urandom(64), buffer_bytes=1 << 20),
                grpc.StatusCode.FAILED_PRECONDITION,
                "ipc_handle",
            ),
            (
                dict(ipc_handle=handle, handle_offset=offset, buffer_bytes=1 << 36),
                grpc.StatusCode.INVALID_ARGUMENT,
                "buffer_bytes",
            ),
        ]:
            with pytest.raises(grpc.RpcError) as exc:
                stub.RegisterCudaBuffer(
                    pb.RegisterCudaBufferRequest(session_id=sid, device_uuid=uuid, **fields)
                )
            assert exc.value.code() == code, exc.value.details()
            assert (exc.value.details() or "").startswith(f"{field}: "), exc.value.details()
        buf = stub.RegisterCudaBuffer(
            pb.RegisterCudaBufferRequest(
                session_id=sid,
                device_uuid=uuid,
                ipc_handle=handle,
                handle_offset=offset,
                buffer_bytes=1 << 21,
            )
        ).buffer_id
        prep = stub.PrepareStore(
            pb.PrepareStoreRequest(
                session_id=sid,
                namespace_id=ns_id,
                keys=(1).to_bytes(32, "big"),
                transport=pb.TRANSPORT_CUDA_IPC,
            )
        )
        stub.CudaCopy(
            pb.CudaCopyRequest(session_id=sid, job_id=prep.job_id, buffer_id=buf, buffer_offsets=[4096])
        )
        done = stub.CompleteStore(pb.CompleteStoreRequest(session_id=sid, job_id=prep.job_id, ok=True))
        assert done.committed == 1
        stats = stub.Stats(pb.StatsRequest())
        assert stats.cuda_ipc.copy_errors == 0 and stats.cuda_ipc.buffers == 1
    with kvtier.Client.connect(daemon.unix, transport="shm") as c:
        got = c.register(make_namespace()).get([(1).to_bytes(32, "big")])[0]
        assert got == bytes([7]) * len(got)  # the daemon's copy put the GPU bytes in the arena

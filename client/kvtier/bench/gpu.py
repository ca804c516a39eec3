"""``kvtier bench gpu``: paged GPU KV -> daemon -> paged GPU KV, beside a plain pinned copy.

What it moves (issue 4): ``--gpu-blocks`` (256) blocks of a Llama-3-8B-shaped cache (32 layers,
8 KV heads, head dim 128, bf16, 16 tokens per block: 64 KiB pages, 2 MiB blocks) in vLLM's LBNHC
layout, from random block ids of one engine cache into a fresh kvtierd and back into other block
ids, byte-checked, over each of ``--gpu-transports`` (default ``shm,cuda_ipc``):

* ``shm``: ``put_blocks`` = gather kernel + DMA by the client into the cudaHostRegister'ed arena;
  ``get_blocks`` = DMA + scatter kernel.
* ``cuda_ipc``: the daemon (started with ``--cuda-ipc``) makes the DMA copies between the
  client's IPC-exported staging buffer and its own page-locked arena; the client runs only the
  gather/scatter kernels. Skipped with a note when cupy is missing or the device is a CPU.

The baseline is the same byte count as one ``copy_`` between a pinned host tensor and a device
tensor, each way, measured in the same run and interleaved with the kvtier rounds; the best of
``--repeat`` rounds is kept for every figure.

``--device cpu`` runs the same code on CPU tensors (the baseline is then a plain memcpy): the
smoke test uses it, since CI has no GPU. Targets (docs/benchmarks.md §8): each way >= 45 GB/s and
>= 0.8x the pinned copy, gather/scatter included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GB = 1e9
TARGET_GBPS = 45.0
TARGET_RATIO = 0.8
VERIFIED_RATIO = 0.9  # a verified transfer against its unverified twin (issue 41)
PUT, GET = "(device->daemon)", "(daemon->device)"
UNVERIFIED = ", not verified"


class _Sampler:
    """Times transfers of ``nbytes`` each on ``device`` (synchronized before and after): GB/s
    figures per name, every sample kept."""

    def __init__(self, device: Any, nbytes: int) -> None:
        import torch

        self.device, self.nbytes, self._cuda = device, nbytes, torch.cuda
        self.figures: dict[str, list[float]] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            self._cuda.synchronize()

    def sample(self, name: str, fn: Callable[[], object]) -> None:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        self.figures.setdefault(name, []).append(self.nbytes / (time.perf_counter() - t0) / GB)


def bench_gpu(args: argparse.Namespace) -> int:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kvtier bench gpu: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    shape = tuple(int(x) for x in args.gpu_shape.split(","))
    n = args.gpu_blocks
    layout, src, dst = _paged_cache(shape, n, device)
    bb = layout.block_bytes
    nbytes = n * bb
    s = _Sampler(device, nbytes)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    base = "pinned copy" if device.type == "cuda" else "copy_"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    from kvtier.bench.procs import DaemonProc

    transports, notes = _transports(args.gpu_transports, device)
    host_bytes = max(256 << 20, (args.repeat + 2) * nbytes + (64 << 20))
    extra = ["--cuda-ipc"] if "cuda_ipc" in transports else []
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-gpu-") as tmp,
        DaemonProc(Path(tmp) / "kvtierd", host_bytes, max(64 << 20, bb), extra) as daemon,
        DaemonProc(
            Path(tmp) / "kvtierd-unverified", host_bytes, max(64 << 20, bb), [*extra, "--no-verify-bytes"]
        ) as unverified,
        contextlib.ExitStack() as clients,
    ):
        ops: list[tuple[str, Callable[[], object]]] = [
            (f"{base} host->device", lambda: dev.copy_(host, non_blocking=True)),
            (f"{base} device->host", lambda: host.copy_(dev, non_blocking=True)),
        ]
        for t in transports:
            ops += _transport_ops(t, (daemon.unix, unverified.unix), shape, clients, (layout, src, dst))
        exact = _measure(ops, layout, (src, dst), s.sync, s.sample, args.repeat, s.figures.clear)
    best = {k: max(v) for k, v in s.figures.items()}
    _publish(_report(best, device, n, bb, exact, base, notes), args.json_out)
    return 0 if exact else 1


def _transport_ops(
    t: str,
    addresses: tuple[str, str],
    shape: tuple[int, ...],
    clients: contextlib.ExitStack,
    cache: tuple[Any, list[int], list[int]],
) -> list[tuple[str, Callable[[], object]]]:
    """The put and get of transport ``t``, verified (the daemon at ``addresses[0]``) and not
    (the one at ``addresses[1]``, started with ``--no-verify-bytes``, its client too)."""
    layout, src, dst = cache
    ops: list[tuple[str, Callable[[], object]]] = []
    for address, how in zip(addresses, ("", UNVERIFIED), strict=True):
        ns = _bench_handle(address, t, shape, clients, verify_bytes=not how)
        put, get = _round_trip(ns, layout, src, dst)
        ops += [(f"{t} put_blocks{how} {PUT}", put), (f"{t} get_blocks{how} {GET}", get)]
    return ops


def _publish(report: dict[str, Any], json_out: str | None) -> None:
    """Print the report's table; write the rest of it as JSON to ``json_out`` if given."""
    print(report["table"])
    if json_out:
        Path(json_out).write_text(
            json.dumps({k: v for k, v in report.items() if k != "table"}, indent=2) + "\n"
        )


def _paged_cache(shape: tuple[int, ...], n: int, device: Any) -> tuple[Any, list[int], list[int]]:
    """A random paged KV cache of ``shape`` (layers, kv_heads, head_dim, tokens_per_block) with
    room for ``2 n + 8`` blocks on ``device`` -> (its layout, n source and n destination blocks)."""
    import torch

    from kvtier.layouts import PagedKvLayout

    layers, heads, head_dim, tokens = shape
    num_blocks = 2 * n + 8
    buf = torch.empty((layers, num_blocks, tokens, heads, 2 * head_dim), dtype=torch.bfloat16, device=device)
    buf.view(torch.uint8).random_(0, 256)
    layout = PagedKvLayout.from_layer_tensors(
        [buf[i].permute(0, 2, 1, 3) for i in range(layers)], name="LBNHC"
    )
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    return layout, perm[:n], perm[n : 2 * n]


def _bench_handle(
    address: str, transport: str, shape: tuple[int, ...], clients: contextlib.ExitStack, *, verify_bytes: bool
) -> Any:
    """A connected client over ``transport`` (closed with ``clients``; ``verify_bytes`` as
    ``ClientSettings.verify_bytes``), its namespace of the cache's ``shape`` registered."""
    import kvtier

    layers, heads, head_dim, tokens = shape
    client = kvtier.Client.connect(
        address,
        transport,  # type: ignore[arg-type]
        timeout_s=60,
        verify_bytes=verify_bytes,
    )
    clients.callback(client.close)
    if not client.connected:
        raise RuntimeError(f"{transport}: {client.counters.last_error}")
    return client.register(
        kvtier.Namespace(
            model_id="bench/llama3-8b-shape",
            model_revision="bench",
            tokenizer_digest="none",
            kv_dtype="bfloat16",
            layout="vllm.LBNHC",
            tokens_per_block=tokens,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
        )
    )


def _measure(
    ops: list[tuple[str, Callable[[], object]]],
    layout: Any,
    blocks: tuple[list[int], list[int]],
    sync: Callable[[], None],
    sample: Callable[[str, Callable[[], object]], None],
    repeat: int,
    reset: Callable[[], None],
) -> bool:
    """A warm-up round of ``ops`` (registration, allocator, first faults; each load checked and
    its destination blocks zeroed after), ``reset``, then ``repeat`` sampled rounds; whether
    every load brought the exact blocks."""
    import torch

    src, dst = blocks
    exact = True
    for name, fn in ops:
        fn()
        sync()
        if name.endswith(GET):
            exact = exact and _same_blocks(layout, src, dst)
            layout.scatter(
                dst, torch.zeros((len(dst), layout.block_bytes), dtype=torch.uint8, device=layout.device)
            )
    reset()
    for _ in range(repeat):
        for name, fn in ops:
            sample(name, fn)
    return exact and _same_blocks(layout, src, dst)


def _transports(spec: str, device: Any) -> tuple[list[str], list[str]]:
    """The transports to measure, and why any asked for is left out."""
    wanted = [t.strip() for t in spec.split(",") if t.strip()]
    for t in wanted:
        if t not in ("shm", "cuda_ipc"):
            raise SystemExit(f"kvtier bench gpu: --gpu-transports: unknown transport {t!r}")
    notes: list[str] = []
    if "cuda_ipc" in wanted:
        why = ""
        if device.type != "cuda":
            why = "needs a CUDA device"
        else:
            try:
                import cupy  # noqa: F401
            except ImportError:
                why = "cupy is not installed (pip install cupy-cuda12x: the kvtier wheel's cuda extra)"
        if why:
            wanted.remove("cuda_ipc")
            notes.append(f"cuda_ipc: skipped, {why}")
    return wanted, notes


def _round_trip(
    ns: Any, layout: Any, src: list[int], dst: list[int]
) -> tuple[Callable[[], None], Callable[[], None]]:
    keys: list[bytes] = []

    def put() -> None:
        keys[:] = [os.urandom(32) for _ in src]
        stored = ns.put_blocks(keys, layout, src).stored
        if stored != len(src):
            raise RuntimeError(f"put stored {stored} of {len(src)} blocks")

    def get() -> None:
        if not all(ns.get_blocks(keys, layout, dst)):
            raise RuntimeError("get missed blocks it had just stored")

    return put, get


def _same_blocks(layout: Any, src: list[int], dst: list[int]) -> bool:
    import torch

    a = torch.empty((len(src), layout.block_bytes), dtype=torch.uint8, device=layout.device)
    b = torch.empty_like(a)
    layout.gather(src, a)
    layout.gather(dst, b)
    return bool(torch.equal(a, b))


def _report(
    best: dict[str, float], device: Any, n: int, bb: int, exact: bool, base: str, notes: list[str]
) -> dict[str, Any]:
    """The table and JSON: each transfer against the pinned copy of its direction, and each
    verified transfer against its unverified twin (the digest plan's check, docs/benchmarks.md)."""
    ratios = {
        name: value / best[f"{base} device->host" if PUT in name else f"{base} host->device"]
        for name, value in best.items()
        if PUT in name or GET in name
    }
    verified = _verified_ratios(best)
    lines = [
        f"kvtier bench gpu: {n} blocks x {bb >> 10} KiB on {device} "
        f"({'byte-exact' if exact else 'BYTES DIFFER'}); best of the rounds, GB/s",
        f"{'figure':48} {'GB/s':>7} {'x ' + base:>12}  target",
    ]
    lines += [_figure_line(name, value, ratios.get(name)) for name, value in best.items()]
    lines += [
        f"{name + ' / not verified':48} {ratio:20.2f}  "
        f"{'met' if ratio >= VERIFIED_RATIO else 'missed'} (>= {VERIFIED_RATIO}x)"
        for name, ratio in verified.items()
    ]
    return {
        "device": str(device),
        "blocks": n,
        "block_bytes": bb,
        "byte_exact": exact,
        "gbps": best,
        "ratio_to_pinned": ratios,
        "verified_to_unverified": verified,
        "notes": notes,
        "table": "\n".join(lines + notes),
    }


def _figure_line(name: str, value: float, ratio: float | None) -> str:
    """One figure of the table: its GB/s, and against its pinned copy with the targets."""
    if ratio is None:
        return f"{name:48} {value:7.2f}"
    ok = value >= TARGET_GBPS and ratio >= TARGET_RATIO
    return (
        f"{name:48} {value:7.2f} {ratio:12.2f}  "
        f"{'met' if ok else 'missed'} (>= {TARGET_GBPS:g} GB/s, >= {TARGET_RATIO}x)"
    )


def _verified_ratios(best: dict[str, float]) -> dict[str, float]:
    """Each verified transfer's GB/s over its unverified twin's (same transport, direction)."""
    out: dict[str, float] = {}
    for name, value in best.items():
        for way in (PUT, GET):
            twin = name.replace(f" {way}", f"{UNVERIFIED} {way}")
            if name.endswith(way) and UNVERIFIED not in name and twin in best:
                out[name] = value / best[twin]
    return out

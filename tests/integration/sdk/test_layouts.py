"""Engine layouts round-trip through a real daemon: put from one paged cache, get into another
at different block ids, byte for byte (CPU tensors; the same code runs on CUDA tensors)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import DaemonProcess, make_namespace

import kvtier
from kvtier.layouts import PagedKvLayout

L, H, N, D = 2, 2, 16, 64  # make_namespace(): 2 layers, 2 KV heads, 16 tokens, head dim 64
C = 2 * D  # K‖V in the last dim
PAGE = H * N * C * 2  # bf16
NUM_BLOCKS = 12

Make = Callable[[torch.Tensor], PagedKvLayout]


def lbnhc(buf: torch.Tensor) -> PagedKvLayout:  # one buffer, layer-outer, [B,N,H,C] physical
    per_layer = buf.view(torch.bfloat16).view(L, NUM_BLOCKS, N, H, C)
    return PagedKvLayout.from_layer_tensors([per_layer[i].permute(0, 2, 1, 3) for i in range(L)])


def lbhnc(buf: torch.Tensor) -> PagedKvLayout:  # one buffer, layer-outer, [B,H,N,C] physical
    per_layer = buf.view(torch.bfloat16).view(L, NUM_BLOCKS, H, N, C)
    return PagedKvLayout.from_layer_tensors([per_layer[i] for i in range(L)])


def blhnc(buf: torch.Tensor) -> PagedKvLayout:  # one buffer, block-outer: layers interleaved
    per_block = buf.view(torch.bfloat16).view(NUM_BLOCKS, L, H, N, C)
    return PagedKvLayout.from_layer_tensors([per_block[:, i] for i in range(L)])


def separate(buf: torch.Tensor) -> PagedKvLayout:  # one tensor per layer (no shared buffer)
    parts = buf.view(L, NUM_BLOCKS * PAGE)
    return PagedKvLayout.from_layer_tensors(
        [parts[i].clone().view(torch.bfloat16).view(NUM_BLOCKS, H, N, C) for i in range(L)]
    )


def contiguous(buf: torch.Tensor) -> PagedKvLayout:
    return PagedKvLayout.contiguous(buf.view(NUM_BLOCKS, L * PAGE), num_layers=L)


LAYOUTS = {"LBNHC": lbnhc, "LBHNC": lbhnc, "BLHNC": blhnc, "separate": separate, "contiguous": contiguous}


def pages(layout: PagedKvLayout, block: int) -> bytes:
    """The kvtier block of engine block ``block``, read the slow obvious way (per layer)."""
    out = layout.staging(1)
    layout.gather([block], out)
    return out.numpy().tobytes()


@pytest.mark.parametrize("name", LAYOUTS)
def test_gather_is_the_pages_in_layer_order(name: str) -> None:
    buf = torch.randint(0, 256, (L * NUM_BLOCKS * PAGE,), dtype=torch.uint8)
    layout = LAYOUTS[name](buf)
    assert layout.block_bytes == make_namespace().block_bytes
    if name != "separate":
        assert len(layout.groups) == 1  # one kernel per batch, whatever the layout
    out = layout.staging(3)
    layout.gather([9, 0, 4], out)
    assert out[1].numpy().tobytes() == pages(layout, 0)
    # a scatter of what was gathered, elsewhere, reproduces the same pages
    layout.scatter([1, 2, 3], out)
    assert [pages(layout, b) for b in (1, 2, 3)] == [pages(layout, b) for b in (9, 0, 4)]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_round_trips_through_the_daemon(daemon: DaemonProcess, transport: str, name: str) -> None:
    src = LAYOUTS[name](torch.randint(0, 256, (L * NUM_BLOCKS * PAGE,), dtype=torch.uint8))
    dst = LAYOUTS[name](torch.zeros(L * NUM_BLOCKS * PAGE, dtype=torch.uint8))
    with kvtier.Client.connect(daemon.address(transport), transport=transport) as client:
        ns = client.register(make_namespace(layout=f"test.{name}"))
        keys = ns.block_keys(list(range(16 * 5)))
        src_ids, dst_ids = [11, 3, 7, 0, 5], [2, 9, 4, 10, 1]  # odd count, not contiguous
        assert ns.put_blocks(keys, src, src_ids).stored == 5
        untouched = pages(dst, 6)
        assert ns.get_blocks(keys + [b"\0" * 32], dst, dst_ids + [6]) == [True] * 5 + [False]
        assert [pages(dst, b) for b in dst_ids] == [pages(src, b) for b in src_ids]
        assert pages(dst, 6) == untouched  # a miss leaves its engine block alone


def test_bad_block_ids_and_buffers_are_refused() -> None:
    layout = lbhnc(torch.zeros(L * NUM_BLOCKS * PAGE, dtype=torch.uint8))
    with pytest.raises(kvtier.errors.InvalidArgument, match="block_ids"):
        layout.gather([NUM_BLOCKS], layout.staging(1))
    with pytest.raises(kvtier.errors.InvalidArgument, match="block_ids"):
        layout.scatter([-1], layout.staging(1))
    with pytest.raises(kvtier.errors.InvalidArgument, match="out"):
        layout.gather([0, 1], layout.staging(1))
    with pytest.raises(kvtier.errors.InvalidArgument, match="layers"):
        PagedKvLayout.from_layer_tensors([torch.zeros(4, 2, 8)[:, :, ::2]])  # strided pages


def test_a_layout_of_another_block_size_is_refused(daemon: DaemonProcess) -> None:
    layout = lbhnc(torch.zeros(L * NUM_BLOCKS * PAGE, dtype=torch.uint8))
    with kvtier.Client.connect(daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace(num_layers=3))
        keys = ns.block_keys(list(range(16)))
        with pytest.raises(kvtier.errors.InvalidArgument, match="layout"):
            ns.put_blocks(keys, layout, [0])
        with pytest.raises(kvtier.errors.InvalidArgument, match="block_ids"):
            client.register(make_namespace()).put_blocks(keys, layout, [0, 1])
        assert client.stats()["total"]["stores_accepted"] == 0


def test_runs_group_consecutive_slots() -> None:
    from kvtier.direct import runs

    assert runs([], 8) == []
    assert runs([0, 8, 16, 40, 48, 8], 8) == [(0, 3, 0), (3, 2, 40), (5, 1, 8)]
    # never across a registration chunk (each is page-locked on its own)
    assert runs([0, 8, 16, 24], 8, chunk=16) == [(0, 2, 0), (2, 2, 16)]


def test_registrations_are_cut_where_runs_are() -> None:
    """A group's read-only arena starts past the session's own, anywhere: its ranges are cut at
    the same multiples of the chunk as copies, so no run spans two registrations."""
    from kvtier.direct import register_ranges

    assert register_ranges(0, 40, chunk=16) == [(0, 16), (16, 32), (32, 40)]
    assert register_ranges(24, 56, chunk=16) == [(24, 32), (32, 48), (48, 56)]
    assert register_ranges(24, 30, chunk=16) == [(24, 30)]
    assert register_ranges(32, 32, chunk=16) == []


class FailingCopy(PagedKvLayout):
    """A layout whose kernels fail like a CUDA error would (RuntimeError)."""

    def gather(self, block_ids: object, out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    def scatter(self, block_ids: object, src: torch.Tensor) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")


def test_a_failed_copy_fails_its_job_only(daemon: DaemonProcess) -> None:
    good = lbhnc(torch.randint(0, 256, (L * NUM_BLOCKS * PAGE,), dtype=torch.uint8))
    bad = FailingCopy(good.groups, good.num_layers, good.num_blocks, good.page_bytes, good.name)
    with kvtier.Client.connect(daemon.unix, transport="shm") as client:
        ns = client.register(make_namespace(layout="test.LBHNC"))
        keys = ns.block_keys(list(range(16 * 3)))
        result = ns.put_blocks(keys, bad, [0, 1, 2])
        assert result.stored == 0 and result.dropped == 3
        stats = client.stats()
        assert stats["writing_blocks"] == 0 and stats["total"]["stores_dropped"] == 3
        assert client.counters.reconnects == 0  # the daemon and the session are fine
        assert ns.put_blocks(keys, good, [0, 1, 2]).stored == 3  # the same keys store later
        assert ns.get_blocks(keys, bad, [3, 4, 5]) == [False] * 3
        assert client.stats()["pinned_blocks"] == 0  # the failed load unpinned its blocks
        assert ns.get_blocks(keys, good, [3, 4, 5]) == [True] * 3
        assert [pages(good, b) for b in (3, 4, 5)] == [pages(good, b) for b in (0, 1, 2)]


def test_kernels_move_wide_elements_and_bytes_at_odd_offsets() -> None:
    layout = lbhnc(torch.randint(0, 256, (L * NUM_BLOCKS * PAGE,), dtype=torch.uint8))
    assert layout._dtype == torch.int64  # 8-byte elements: CPU index_copy_ is 10x faster
    raw = torch.zeros(2 * layout.block_bytes + 1, dtype=torch.uint8)
    odd = raw[1:].view(2, layout.block_bytes)  # starts 1 byte in: gathered byte-wise
    layout.gather([4, 7], odd)
    assert odd[0].numpy().tobytes() == pages(layout, 4)
    layout.scatter([0, 1], odd)
    assert [pages(layout, b) for b in (0, 1)] == [pages(layout, b) for b in (4, 7)]

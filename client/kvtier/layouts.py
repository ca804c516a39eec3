"""Engine KV-cache layouts: move a batch of engine blocks to and from kvtier blocks.

An engine keeps KV in paged tensors; kvtier stores one immutable byte string per block. The
mapping is the same for every layout: a kvtier block is the concatenation, in layer order, of the
block's per-layer *pages* (a page = the bytes one layer keeps for one engine block, treated as
opaque: its inner order is the engine layout's, which is why the layout name is part of the
namespace). So ``block_bytes = num_layers × page_bytes``.

``PagedKvLayout`` builds, once, a strided byte view ``[num_blocks, num_layers, page_bytes]`` over
the engine's memory (one shared buffer with layer and block strides — vLLM's LB*/BL* layouts — or
a list of per-layer tensors); a batch then moves with **one gather kernel** (``index_select``)
or **one scatter kernel** (``index_copy_``) per batch (per layer when the layers do not share one
buffer), never one copy per (layer, block). The same code runs on CPU tensors (tests) and CUDA
tensors; the result lands in a staging tensor that ``NamespaceHandle.put`` / ``get_into`` take.

vLLM layouts (``../shared/notes/vllm-connector.md`` §3.1): each layer's tensor is ``[B, H, N, C]``
(B = blocks, K‖V in C) with a physical order ``LBNHC``, ``LBHNC`` or ``BLHNC``; every one keeps a
(layer, block) page contiguous, so ``from_layer_tensors`` covers them all. ``contiguous`` is one
``[num_blocks, block_bytes]`` tensor.

Importing this module imports torch; ``import kvtier`` does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier_contract.errors import InvalidArgument


@dataclass(frozen=True)
class _Group:
    """Layers ``first .. first+count-1`` as one byte view [num_blocks, count, page_bytes]."""

    first: int
    count: int
    view: torch.Tensor


class PagedKvLayout:
    """A batch mover between an engine's paged KV and kvtier blocks.

    Owns nothing but views of the engine's memory (the engine owns the tensors). Not
    thread-safe: use it from the engine thread, or one instance per thread.
    """

    def __init__(
        self, groups: list[_Group], num_layers: int, num_blocks: int, page_bytes: int, name: str
    ) -> None:
        self.groups = groups
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self.block_bytes = num_layers * page_bytes
        self.name = name
        self.device = groups[0].view.device
        # The kernels move the widest element that divides every page, stride and offset: byte
        # elements made CPU index_copy_ 10-20x slower (0.4 against 3.7-7.5 GB/s for 64 KiB pages).
        self._dtype = _widest(page_bytes, [g.view for g in groups])
        self._wide_views = [_wide(g.view, self._dtype) for g in groups]

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def contiguous(cls, cache: torch.Tensor, *, num_layers: int = 1) -> PagedKvLayout:
        """One C-contiguous tensor whose dim 0 is the block: ``[num_blocks, …]``."""
        if not cache.is_contiguous():
            raise InvalidArgument("a contiguous layout needs a contiguous tensor", field="cache")
        num_blocks = cache.shape[0]
        block = cache[0].numel() * cache.element_size() if num_blocks else 0
        if num_blocks == 0 or block % num_layers:
            raise InvalidArgument(
                f"{num_blocks} blocks of {block} bytes for {num_layers} layers", field="cache"
            )
        page = block // num_layers
        view = _byte_view(cache, (num_blocks, num_layers, page), (block, page, 1), 0)
        return cls([_Group(0, num_layers, view)], num_layers, num_blocks, page, "contiguous")

    @classmethod
    def from_layer_tensors(cls, layers: Sequence[torch.Tensor], *, name: str = "paged") -> PagedKvLayout:
        """Per-layer tensors whose dim 0 is the engine block and whose per-block page is one
        contiguous run of bytes (vLLM's ``[B, H, N, C]`` views in LBNHC, LBHNC or BLHNC order).
        Layers that share one storage at a constant layer stride become one view (one kernel)."""
        if not layers:
            raise InvalidArgument("no layer tensors", field="layers")
        first = layers[0]
        num_blocks = first.shape[0]
        page = first[0].numel() * first.element_size() if num_blocks else 0
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise InvalidArgument(
                    f"layer {i} differs from layer 0 in shape, dtype or device", field="layers"
                )
            if not _page_contiguous(t):
                raise InvalidArgument(f"layer {i}: a block's page is not one contiguous run", field="layers")
        groups: list[_Group] = []
        start = 0
        while start < len(layers):
            end = start + 1
            stride = None
            while end < len(layers) and _same_storage(layers[start], layers[end]):
                step = _byte_offset(layers[end]) - _byte_offset(layers[end - 1])
                if stride is None:
                    stride = step
                if step != stride or layers[end].stride(0) != layers[start].stride(0):
                    break
                end += 1
            t = layers[start]
            block_stride = t.stride(0) * t.element_size()
            view = _byte_view(
                t, (num_blocks, end - start, page), (block_stride, stride or page, 1), _byte_offset(t)
            )
            groups.append(_Group(start, end - start, view))
            start = end
        return cls(groups, len(layers), num_blocks, page, name)

    # -- moving batches ---------------------------------------------------------------------------

    def staging(self, n: int, *, pin_memory: bool = False) -> torch.Tensor:
        """A ``[n, block_bytes]`` uint8 host tensor to gather into / scatter from."""
        return torch.empty(
            (n, self.block_bytes), dtype=torch.uint8, pin_memory=pin_memory and torch.cuda.is_available()
        )

    def gather(self, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Engine blocks ``block_ids`` -> ``out[i]`` = kvtier block i (one kernel per group)."""
        idx = self._index(block_ids)
        out3, views = self._operands(self._out_view(out, len(idx)))
        if len(self.groups) == 1 and out.device == self.device:
            torch.index_select(views[0], 0, idx, out=out3)  # straight into out
            return out
        for g, view in zip(self.groups, views, strict=True):
            picked = torch.index_select(view, 0, idx)  # [n, count, page] on the engine device
            out3[:, g.first : g.first + g.count, :].copy_(picked, non_blocking=True)
        return out

    def scatter(self, block_ids: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
        """kvtier blocks ``src[i]`` -> engine block ``block_ids[i]`` (one kernel per group)."""
        idx = self._index(block_ids)
        src3, views = self._operands(self._out_view(src, len(idx)))
        for g, view in zip(self.groups, views, strict=True):
            part = src3[:, g.first : g.first + g.count, :].to(self.device, non_blocking=True)
            view.index_copy_(0, idx, part)

    def _operands(self, t3: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``t3`` and the engine views in the widest element type both allow (bytes when the
        buffer starts at an odd offset)."""
        width = torch.empty(0, dtype=self._dtype).element_size()
        if self._dtype == torch.uint8 or t3.storage_offset() % width:
            return t3, [g.view for g in self.groups]
        return t3.view(self._dtype), self._wide_views

    def check_ids(self, block_ids: Sequence[int] | torch.Tensor) -> None:
        """``InvalidArgument`` unless every id is an engine block (checked before any I/O, on
        the host: no device work, no wait for the engine's stream)."""
        self._checked(block_ids)

    def _checked(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(block_ids, dtype=torch.long)
        if idx.ndim != 1:
            raise InvalidArgument("must be one-dimensional", field="block_ids")
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise InvalidArgument(f"outside [0, {self.num_blocks})", field="block_ids")
        return idx

    def _index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The checked ids on the cache's device. To CUDA through pinned memory with
        ``non_blocking``: a pageable copy would synchronise the current (engine's) stream."""
        idx = self._checked(block_ids)
        if self.device.type != "cuda":
            return idx
        if idx.device.type == "cpu":
            idx = idx.pin_memory()
        return idx.to(self.device, non_blocking=True)

    def _out_view(self, t: torch.Tensor, n: int) -> torch.Tensor:
        if t.dtype != torch.uint8 or not t.is_contiguous() or t.numel() != n * self.block_bytes:
            raise InvalidArgument(
                f"needs a contiguous uint8 tensor of {n} x {self.block_bytes} bytes", field="out"
            )
        return t.view(n, self.num_layers, self.page_bytes)


_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _widest(page_bytes: int, views: list[torch.Tensor]) -> torch.dtype:
    """The widest integer type whose size divides the page, every view's byte strides and
    offsets, and the staging rows (``[n, layers, page]`` uint8, rows a multiple of the page)."""
    for width, dtype in _WIDTHS:
        if page_bytes % width == 0 and all(
            v.storage_offset() % width == 0 and all(st % width == 0 for st in v.stride()[:-1]) for v in views
        ):
            return dtype
    return torch.uint8


def _wide(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte view ``[..., page]`` seen as ``dtype`` elements (no copy)."""
    return t if dtype == torch.uint8 else t.view(dtype)


def _byte_offset(t: torch.Tensor) -> int:
    return int(t.storage_offset()) * t.element_size()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _page_contiguous(t: torch.Tensor) -> bool:
    """Is ``t[b]`` one dense run of memory (in any dimension order) for every block b?"""
    dims = sorted((st, sz) for st, sz in zip(t.stride()[1:], t.shape[1:], strict=True) if sz != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True


def _byte_view(t: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
    """A uint8 view of ``t``'s storage with byte strides (no copy)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device)
    raw.set_(t.untyped_storage(), offset, shape, strides)
    return raw

"""SGLang's host KV pool seen as kvtier blocks: one SGLang page = one kvtier block.

The only thing read from the pool for addresses is SGLang's zero-copy contract,
``get_page_buffer_meta(host_indices) -> (pointers, sizes)``: per page, the pieces ("segments") of
its bytes in the host pool (MHA page-first: K and V; MHA layer-first: K and V of every layer;
MLA page-first: one; MLA layer-first: one per layer). A kvtier block is the page's segments **in
increasing address order**, which is exactly SGLang's flat data page
(``get_data_page(index, flat=True)``, what its non-zero-copy backends store), so both paths store
the same bytes under the same key.

``HostPoolPages.probe(pool)`` asks the pool for the segments of a few pages (first, second,
middle, last) and checks that every segment sits at ``base_s + page * page_stride`` with one size;
then the whole pool is one strided byte view per segment, and ``kvtier.layouts.PagedKvLayout``
moves a batch with one gather (store) or scatter (load) kernel per run of evenly spaced segments,
straight between the pool and the daemon's mapped arena. A pool that does not fit this shape is
refused at registration (SGLang startup), never guessed at.

``SidePool.probe(pool, name)`` does the same for a hybrid model's side pool (storage v2: Mamba,
SWA, indexer...): its pages move zero-copy when they are fixed-stride pieces of one of the pool's
own tensors, else as SGLang's flat data pages.

Thread-safety: a ``HostPoolPages`` is immutable after ``probe``; ``layout()`` gives each thread
its own ``PagedKvLayout`` (SGLang's prefetch and backup threads call the backend concurrently).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.client import NamespaceHandle

from kvtier.layouts import PagedKvLayout

__all__ = ["HostPoolPages", "PoolShapeError", "whole_pages"]


class PoolShapeError(ValueError):
    """The host pool's pages are not equal-sized segments at a fixed stride per page."""


@dataclass(frozen=True)
class _Shape:
    lo: int  # lowest address of any segment of any page
    hi: int  # one past the highest
    offsets: tuple[int, ...]  # segment s of page 0 starts at lo + offsets[s] (ascending)
    segment_bytes: int
    page_stride: int  # bytes from page p's segment s to page p+1's


class HostPoolPages:
    """Page ids and a per-thread ``PagedKvLayout`` over one SGLang host pool. Owns nothing: the
    pool owns the memory; this object holds the pool and a view of its buffer's storage, which
    keep the memory alive while it exists."""

    def __init__(self, pool: Any, shape: _Shape, page_size: int, num_pages: int, name: str) -> None:
        self.pool = pool
        self.page_size = page_size
        self.num_pages = num_pages
        self.segments = len(shape.offsets)
        self.segment_bytes = shape.segment_bytes
        self.block_bytes = self.segments * shape.segment_bytes
        self.name = name
        # True when every page lies in the pool's own kv_buffer tensor (one allocation), so the
        # address order of a page's segments is fixed by the pool's class, not by the allocator.
        self.in_buffer = False
        self._shape = shape
        self._raw, self.in_buffer = _raw_bytes(pool, shape.lo, shape.hi)
        self._local = threading.local()

    @classmethod
    def probe(cls, pool: Any, name: str) -> HostPoolPages:
        """Read the pool's page geometry from ``get_page_buffer_meta`` (``PoolShapeError`` when it
        is not one fixed-stride segment list per page)."""
        page_size = int(pool.page_size)
        num_pages = int(pool.size) // page_size
        if page_size < 1 or num_pages < 1:
            raise PoolShapeError(f"host pool of {pool.size} tokens in pages of {page_size}")
        pages = sorted({0, min(1, num_pages - 1), num_pages // 2, num_pages - 1})
        segs = {p: _segments(pool, p, page_size) for p in pages}
        first = segs[0]
        size = first[0][1]
        if any(s != size for page in segs.values() for _, s in page):
            raise PoolShapeError("the pages' segments differ in size")
        stride = segs[1][0][0] - first[0][0] if num_pages > 1 else size * len(first)
        for p, page in segs.items():
            if len(page) != len(first):
                raise PoolShapeError(f"page {p} has {len(page)} segments, page 0 {len(first)}")
            for (addr, _), (base, _) in zip(page, first, strict=True):
                if addr != base + p * stride:
                    raise PoolShapeError(f"page {p} is not at a fixed stride from page 0")
        for (a, _), (b, _) in zip(first, first[1:], strict=False):
            if b - a < size:
                raise PoolShapeError("a page's segments overlap")
        lo = first[0][0]
        hi = segs[num_pages - 1][-1][0] + size
        offsets = tuple(addr - lo for addr, _ in first)
        return cls(pool, _Shape(lo, hi, offsets, size, stride), page_size, num_pages, name)

    def layout(self) -> PagedKvLayout:
        """This thread's ``PagedKvLayout`` over the pool: block ``i`` = page ``i``."""
        layout: PagedKvLayout | None = getattr(self._local, "layout", None)
        if layout is None:
            s = self._shape
            views = [
                torch.as_strided(self._raw, (self.num_pages, s.segment_bytes), (s.page_stride, 1), off)
                for off in s.offsets
            ]
            layout = PagedKvLayout.from_layer_tensors(views, name=self.name)
            self._local.layout = layout
        return layout

    def page_ids(self, host_indices: Any, n_pages: int) -> list[int] | None:
        """The pool pages of ``n_pages`` pages given as host token indices (SGLang passes
        ``n_pages * page_size`` indices, page after page; the first index of each page names it,
        as in ``get_page_buffer_meta``). None when they do not name whole pages of this pool."""
        return whole_pages(host_indices, n_pages, self.page_size, self.num_pages)


def whole_pages(host_indices: Any, n_pages: int, page_size: int, num_pages: int) -> list[int] | None:
    """The pages (of ``num_pages`` pages of ``page_size`` tokens) named by ``host_indices``:
    ``n_pages * page_size`` indices, page after page, the first of each page naming it. None
    when they do not name whole pages of the pool."""
    idx = torch.as_tensor(host_indices).reshape(-1)
    if idx.numel() != n_pages * page_size:
        return None
    starts = idx[::page_size].tolist()
    ids = [int(s) // page_size for s in starts]
    if any(int(s) % page_size or not 0 <= p < num_pages for s, p in zip(starts, ids, strict=True)):
        return None
    return ids


def _raw_bytes(pool: Any, lo: int, hi: int) -> tuple[torch.Tensor, bool]:
    """A uint8 tensor over host memory ``[lo, hi)``, and whether it is a view of the storage of
    one of the pool's own CPU tensors (its ``kv_buffer``, else another tensor attribute such as
    the DSA indexer's buffer) that covers every page: the view keeps the memory alive, even once
    SGLang drops the buffer at teardown. Else a view of the raw addresses (kept alive by the
    pool), which may span memory between separate allocations that no page uses."""
    attrs = getattr(pool, "__dict__", {})
    buffers = [getattr(pool, "kv_buffer", None), *attrs.values()]
    for buf in buffers:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cpu":
            storage = buf.untyped_storage()
            base = storage.data_ptr()
            if base <= lo and hi <= base + storage.nbytes():
                raw = torch.empty(0, dtype=torch.uint8)
                raw.set_(storage, lo - base, (hi - lo,), (1,))
                return raw, True
    raw = torch.frombuffer((ctypes.c_ubyte * (hi - lo)).from_address(lo), dtype=torch.uint8)
    return raw, False


def _segments(pool: Any, page: int, page_size: int) -> list[tuple[int, int]]:
    """(address, size) of each segment of ``page``, in increasing address order."""
    indices = torch.arange(page * page_size, (page + 1) * page_size, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    if not ptrs or len(ptrs) != len(sizes):
        raise PoolShapeError("get_page_buffer_meta gave no segments")
    return sorted((int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True))


# Pool attributes that make up a side pool's geometry (its namespace layout digest), where present.
SIDE_GEOMETRY_ATTRS = (
    "dtype",
    "layout",
    "layer_num",
    "head_num",
    "head_dim",
    "kv_cache_dim",
    "num_mamba_layers",
    "temporal_dtype",
    "conv_dtype",
    "temporal_state_shape",
    "conv_state_shapes",
    "size_per_token",
    "indexer_dtype",
    "indexer_page_stride_size",
)


@dataclass
class SidePool:
    """One side pool of a hybrid model: its pages, moved zero-copy when they are equal pieces
    of one of the pool's own tensors at a fixed stride (``pages``), else as SGLang's flat data
    pages (``get_data_page`` / ``set_from_flat_data_page``, the path of SGLang's file backend:
    Mamba state, whose pieces live in separate buffers)."""

    name: str
    pool: Any
    page_size: int
    num_pages: int
    block_bytes: int
    pages: HostPoolPages | None
    handle: NamespaceHandle | None = None

    @classmethod
    def probe(cls, pool: Any, name: str) -> SidePool:
        page_size = int(pool.page_size)
        num_pages = int(pool.size) // page_size
        if page_size < 1 or num_pages < 1:
            raise PoolShapeError(f"host pool of {pool.size} tokens in pages of {page_size}")
        dummy = pool.get_dummy_flat_data_page()
        block_bytes = int(dummy.numel()) * int(dummy.element_size())
        page = pool.get_data_page(0, flat=True)
        if int(page.numel()) * int(page.element_size()) != block_bytes or block_bytes < 1:
            raise PoolShapeError(
                f"a data page has {page.numel() * page.element_size()} bytes, "
                f"the pool's empty page {block_bytes}"
            )
        pages: HostPoolPages | None = None
        try:
            pages = HostPoolPages.probe(pool, f"sglang.v2.{name}")
        except Exception:  # noqa: BLE001 - no fixed-stride pieces: flat pages instead
            pages = None
        if pages is not None and (not pages.in_buffer or pages.block_bytes != block_bytes):
            pages = None
        return cls(name, pool, page_size, num_pages, block_bytes, pages)

    def page_ids(self, host_indices: Any, n_pages: int) -> list[int] | None:
        if host_indices is None:
            return None
        return whole_pages(host_indices, n_pages, self.page_size, self.num_pages)

"""A ``DynamicCache``'s KV as kvtier blocks and back (layouts ``hf.dynamic.LKHTD`` and
``hf.dynamic.mla.LKTD``), for ``KvtierPrefixCache``.

Block bytes (layout ``hf.dynamic.LKHTD``): block ``b`` of a sequence is, for each layer in
order, K then V, each ``[kv_heads, tokens_per_block, head_dim]`` in C order, taken from batch row
0 of ``cache.layers[i].keys/values`` (``[batch, kv_heads, seq, head_dim]``) at token positions
``b*T .. b*T+T-1``. MLA models (layout ``hf.dynamic.mla.LKTD``) cache 1 head whose keys are the
latent (``kv_lora_rank`` wide) and whose values are the rope key (``qk_rope_head_dim`` wide):
the same order with K and V of different widths (``identity.kv_geometry``). One strided copy
per layer and K/V builds the blocks of a store, one permute per layer and K/V rebuilds the
per-layer tensors of a restore. Keys are the namespace's chained block
keys of the token ids, so block ``b``'s key names the whole prefix ``0 .. b*T+T-1``.

Ownership and concurrency: ``CacheBlocks`` holds the model's geometry and a reference to the
model (for its device and config, read at each call), never a cache; no state of its own
changes, so it may be used from any thread (a ``DynamicCache`` being packed must not change
meanwhile).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtier.integrations.transformers.identity import ConfigError, KvGeometry
from kvtier_contract.errors import InvalidArgument


class CacheBlocks:
    """One model's block geometry: [n, L, row] blocks <-> a one-row ``DynamicCache`` (see the
    module docstring)."""

    def __init__(self, geometry: KvGeometry, tokens_per_block: int, dtype: torch.dtype, model: Any) -> None:
        self.geometry = geometry
        self.tokens_per_block = tokens_per_block
        self.dtype = dtype
        self.model = model

    def block_bytes(self) -> int:
        rows, row = self.block_shape()
        return rows * row * self.dtype.itemsize

    def block_shape(self) -> tuple[int, int]:
        """One block: [L, H*T*Dk + H*T*Dv] (per layer K then V, each [H, T, D] C order)."""
        g = self.geometry
        return g.num_layers, g.num_kv_heads * self.tokens_per_block * (g.key_dim + g.value_dim)

    def parts(self, blocks: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of ``layer`` in [n, L, row] blocks, as [n, H, T, D] views."""
        g, T = self.geometry, self.tokens_per_block
        n, k_len = blocks.shape[0], g.num_kv_heads * T * g.key_dim
        row = blocks[:, layer]
        return (
            row[:, :k_len].view(n, g.num_kv_heads, T, g.key_dim),
            row[:, k_len:].view(n, g.num_kv_heads, T, g.value_dim),
        )

    def unpack(self, blocks: torch.Tensor) -> Any:
        """[n, L, row] blocks -> a DynamicCache of n*T tokens on the model's device."""
        blocks = blocks.to(self.model.device)
        n, H, T = blocks.shape[0], self.geometry.num_kv_heads, self.tokens_per_block
        cache = DynamicCache(config=self.model.config)
        for layer in range(self.geometry.num_layers):
            k, v = (
                _wide(part).permute(1, 0, 2, 3).reshape(1, H, n * T, -1).view(self.dtype)
                for part in self.parts(blocks, layer)
            )  # rows moved as wide words
            cache.update(k, v, layer)
        return cache

    # -- store --------------------------------------------------------------------------------------

    def pack(self, cache: Any, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of batch row 0 -> [n, L, row] contiguous CPU blocks (one
        strided copy per layer and K/V on the cache's device, then one copy to the CPU)."""
        H, T = self.geometry.num_kv_heads, self.tokens_per_block
        n = (end - start) // T
        first = cache.layers[0].keys
        out = torch.empty((n, *self.block_shape()), dtype=self.dtype, device=first.device)
        for i, layer in enumerate(cache.layers):
            for dst, t in zip(self.parts(out, i), (layer.keys, layer.values), strict=True):
                src = t[0, :, start:end]  # [H, n*T, D]
                size = min(_wide_size(dst), _wide_size(src))  # the same words on both sides
                _wide(dst, size).copy_(_wide(src, size).reshape(H, n, T, -1).permute(1, 0, 2, 3))
        return out.to("cpu")

    def check_cache(self, cache: Any) -> int:
        """The number of tokens ``cache`` holds; ``InvalidArgument`` unless it is a DynamicCache
        of full-attention layers with one row in this model's shape and dtype."""
        if not isinstance(cache, DynamicCache):
            raise InvalidArgument(
                f"expected a transformers DynamicCache, got {type(cache).__name__}", field="cache"
            )
        g = self.geometry
        L, H = g.num_layers, g.num_kv_heads
        if len(cache.layers) != L or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise InvalidArgument(
                f"expected {L} DynamicLayer layers, got {[type(x).__name__ for x in cache.layers]}",
                field="cache",
            )
        held = cache.get_seq_length()
        for i, layer in enumerate(cache.layers):
            for name, t, D in (("keys", layer.keys, g.key_dim), ("values", layer.values, g.value_dim)):
                if held == 0 and (t is None or t.numel() == 0):
                    continue
                if t is None or tuple(t.shape) != (1, H, held, D) or t.dtype != self.dtype:
                    shape = None if t is None else (tuple(t.shape), t.dtype)
                    raise InvalidArgument(
                        f"layer {i} {name}: expected [1, {H}, {held}, {D}] {self.dtype}, got {shape}",
                        field="cache",
                    )
        return int(held)

    # -- generate -----------------------------------------------------------------------------------


_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _wide_size(t: torch.Tensor) -> int:
    """The widest integer element (bytes) that divides ``t``'s last dimension, its other strides
    and its offset in bytes: strided CPU copies of 2-byte elements are several times slower than
    of 8-byte ones. The last dimension must be contiguous."""
    es = t.element_size()
    spans = [t.shape[-1] * es, t.storage_offset() * es, *(s * es for s in t.stride()[:-1])]
    return next(size for size in _WIDE if all(x % size == 0 for x in spans))


def _wide(t: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """``t`` (same bytes) viewed with ``size``-byte integer elements (default the widest)."""
    return t.view(_WIDE[size or _wide_size(t)])


def check_full_attention(config: Any) -> None:
    """Refuse a model whose DynamicCache is not made of full-attention DynamicLayers: a
    sliding-window layer drops old tokens, a linear-attention layer keeps a state, not a KV per
    token, so neither maps onto prefix blocks."""
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds - {DynamicLayer.__name__}:
        raise ConfigError(
            "model",
            f"only full-attention models are supported; this model's "
            f"cache has {sorted(kinds)} layers (sliding window or hybrid)",
        )

"""``KvtierPrefixCache``: restore a stored prompt prefix into a ``DynamicCache`` before
``generate`` and store a processed prompt's KV as kvtier blocks (docs/transformers.md).

Lifecycle::

    pc = KvtierPrefixCache("unix:run/kvtier.sock", model, model_revision="<commit>",
                           tokenizer_digest=tokenizer_files_digest(tok_dir))
    out = pc.generate(input_ids, max_new_tokens=64)        # restore -> generate -> store
    # or by hand:
    cache, n = pc.restore(input_ids)                       # (None, 0) on a miss
    out = model.generate(input_ids, past_key_values=cache or DynamicCache(config=model.config))
    pc.store(out[0], cache)
    pc.close()

Block bytes (layout ``hf.dynamic.LKHTD``): block ``b`` of a sequence is, for each layer in
order, K then V, each ``[kv_heads, tokens_per_block, head_dim]`` in C order, taken from batch row
0 of ``cache.layers[i].keys/values`` (``[batch, kv_heads, seq, head_dim]``) at token positions
``b*T .. b*T+T-1``. MLA models (layout ``hf.dynamic.mla.LKTD``) cache 1 head whose keys are the
latent (``kv_lora_rank`` wide) and whose values are the rope key (``qk_rope_head_dim`` wide):
the same order with K and V of different widths (``identity.kv_geometry``). One strided copy
per layer and K/V builds the blocks of a store, one permute per layer and K/V rebuilds the
per-layer tensors of a restore. Keys are the namespace's chained block
keys of the token ids, so block ``b``'s key names the whole prefix ``0 .. b*T+T-1``.

Load or recompute (``load_policy``, docs/transformers.md §7): ``restore`` loads the stored
prefix a ``kvtier.adaptive.Decider`` chooses, from each hit's tier (``lookup_tiers``), the load
figures of earlier restores (and the daemon's ``tier_figures``) and the model's prefill rate,
which ``generate`` measures by timing the model's forward passes.

Failure behaviour: the daemon away, slow or restarting makes ``restore`` a miss and ``store`` a
drop (the kvtier Client never raises for that); a block evicted between the lookup and the get
cuts the restored prefix there. Caller mistakes (a batch of several rows, a cache of another
kind, shape or dtype) raise ``InvalidArgument``; a model whose cache is not all full-attention
``DynamicLayer`` (sliding window, hybrid, linear attention) is refused at construction. A store
that fails after ``generate`` never loses the output: ``generate`` logs the reason (once per
reason), counts it in ``store_failures`` and returns what the model generated.

Owns its Client when given an address (``close`` closes it), never the model. Not thread-safe:
one instance per thread (the counters are plain fields); the Client underneath may be shared.

Size: over the 400-line budget (issue 27 lists it): one class whose restore, store and timed
generate share the cache's state; the load-or-recompute decision (issue 30) is in
``kvtier.adaptive``, only its feeding is here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvtier.adaptive import Decider, PrefillRate
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.transformers.identity import (
    ConfigError,
    PrefixCacheOptions,
    dtype_name,
    kv_geometry,
    model_namespace,
)
from kvtier.settings import ClientSettings
from kvtier_contract.errors import InvalidArgument

log = logging.getLogger("kvtier.integrations.transformers")


@dataclass
class PrefixCacheCounters:
    """What one ``KvtierPrefixCache`` did. Tokens are prompt positions; times are wall seconds."""

    restores: int = 0
    restore_hits: int = 0  # restores that returned a cache
    restored_tokens: int = 0
    restore_s: float = 0.0
    stores: int = 0
    blocks_stored: int = 0
    blocks_already_present: int = 0
    blocks_not_stored: int = 0  # dropped (daemon away, deadline) or rejected (no room)
    store_s: float = 0.0
    generate_uncached: int = 0  # generate calls passed through (batch > 1, padding, beams)
    store_failures: int = 0  # stores after generate that raised (logged; the output returned)
    # The load-or-recompute decision (``load_policy``; the full counts in ``decider.stats``):
    tokens_recomputed_slower: int = 0  # stored tokens recomputed: loading them was slower
    tokens_recomputed_policy: int = 0  # stored tokens recomputed: ``load_policy="never"``
    predicted_load_s: float = 0.0  # the predicted time of the restores that had a prediction
    actual_load_s: float = 0.0  # the same restores' measured time
    prefill_steps: int = 0  # forward passes timed during generate (the prefill rate's source)


class KvtierPrefixCache:
    """Prefix caching for one Hugging Face causal LM (see the module docstring)."""

    def __init__(self, client: Client | str, model: Any, *, model_revision: str,
                 tokenizer_digest: str, **options: Any) -> None:
        try:
            self.options = PrefixCacheOptions(model_revision=model_revision,
                                              tokenizer_digest=tokenizer_digest, **options)
        except TypeError as e:
            known = ", ".join(f.name for f in fields(PrefixCacheOptions))
            raise ConfigError("options", f"{e}; known options: {known}") from None
        self.model = model
        config = model.config
        _check_full_attention(config)
        self.dtype: torch.dtype = model.dtype
        self.namespace = model_namespace(config, dtype_name(self.dtype), self.options)
        self.geometry = kv_geometry(config)
        self._said: set[str] = set()  # store failures already logged
        self._predicted_s: float | None = None  # the last decision's predicted load time
        self._owns_client = isinstance(client, str)
        if isinstance(client, str):
            o = self.options
            client = Client.connect(client, lazy=True, settings=ClientSettings(  # away: misses
                transport=o.transport, timeout_s=o.request_timeout_ms / 1000,
                op_timeout_s=o.op_timeout_ms / 1000, token_file=o.token_file,
                client_name="kvtier-transformers"))
        self.client: Client = client
        self.handle: NamespaceHandle = client.register(self.namespace)
        self.counters = PrefixCacheCounters()
        self.decider = Decider(self.options.load_policy, probe_after_s=self.options.probe_after_s,
                               prefill=PrefillRate())

    # -- restore ------------------------------------------------------------------------------------

    def restore(self, input_ids: Any) -> tuple[Any, int]:
        """``(DynamicCache, n)`` holding the KV of the first ``n`` tokens of ``input_ids`` (one
        row: a 1-D sequence or a ``[1, seq]`` tensor), the longest stored prefix of whole blocks
        that leaves at least one token to compute; ``(None, 0)`` on a miss."""
        ids = _one_row(input_ids)
        started = time.perf_counter()
        try:
            return self._restore(ids)
        finally:
            self.counters.restores += 1
            self.counters.restore_s += time.perf_counter() - started

    def _restore(self, ids: list[int]) -> tuple[Any, int]:
        T = self.options.tokens_per_block
        max_blocks = (len(ids) - 1) // T if self.options.load else 0
        if max_blocks <= 0:
            return None, 0
        deadline = time.monotonic() + self.options.op_timeout_ms / 1000
        keys = self.handle.block_keys(ids[: max_blocks * T])[: self.client.max_batch]
        looked = self.handle.lookup_tiers(keys)  # a miss without a round trip when it can
        tiers = looked.tiers[: looked.hits]
        if not tiers:
            return None, 0
        hits = self._decide(tiers)
        if hits <= 0:
            return None, 0
        staging = torch.empty((hits, *self._block_shape()), dtype=self.dtype)
        started = time.perf_counter()
        found = self.handle.get_into(keys[:hits], list(staging), deadline=deadline)
        n = next((i for i, f in enumerate(found) if not f), len(found))
        if n == 0:
            return None, 0
        self._loaded(tiers[:n], time.perf_counter() - started, complete=n == hits)
        cache = self._unpack(staging[:n])
        self.counters.restore_hits += 1
        self.counters.restored_tokens += n * T
        return cache, n * T

    def _decide(self, tiers: list[str]) -> int:
        """How many of the hit blocks (``tiers``: where each one is) to restore, by
        ``load_policy``, with the daemon's latest per-tier figures fed in first."""
        for tier, fig in self.client.tier_figures().items():
            self.decider.report(tier, fig.latency_s, fig.bytes_per_s, age_s=fig.age_s)
        before = self.decider.stats
        slower, policy = before.tokens_recomputed_slower, before.tokens_recomputed_policy
        d = self.decider.decide(tiers, block_tokens=self.options.tokens_per_block,
                                block_bytes=self._block_bytes())
        c, after = self.counters, self.decider.stats
        c.tokens_recomputed_slower += after.tokens_recomputed_slower - slower
        c.tokens_recomputed_policy += after.tokens_recomputed_policy - policy
        self._predicted_s = d.predicted_s
        return d.load_blocks

    def _loaded(self, tiers: list[str], seconds: float, *, complete: bool) -> None:
        """A restore of blocks from ``tiers`` took ``seconds``: the decider's load figures."""
        by_tier: dict[str, int] = {}
        for tier in tiers:
            by_tier[tier] = by_tier.get(tier, 0) + self._block_bytes()
        predicted = self._predicted_s if complete else None  # a cut load is not what was predicted
        self.decider.loaded(by_tier, seconds, predicted_s=predicted)
        if predicted is not None:
            self.counters.predicted_load_s += predicted
            self.counters.actual_load_s += seconds

    def _block_bytes(self) -> int:
        rows, row = self._block_shape()
        return rows * row * self.dtype.itemsize

    def _block_shape(self) -> tuple[int, int]:
        """One block: [L, H*T*Dk + H*T*Dv] (per layer K then V, each [H, T, D] C order)."""
        g = self.geometry
        return g.num_layers, g.num_kv_heads * self.options.tokens_per_block * (g.key_dim +
                                                                                g.value_dim)

    def _parts(self, blocks: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of ``layer`` in [n, L, row] blocks, as [n, H, T, D] views."""
        g, T = self.geometry, self.options.tokens_per_block
        n, k_len = blocks.shape[0], g.num_kv_heads * T * g.key_dim
        row = blocks[:, layer]
        return (row[:, :k_len].view(n, g.num_kv_heads, T, g.key_dim),
                row[:, k_len:].view(n, g.num_kv_heads, T, g.value_dim))

    def _unpack(self, blocks: torch.Tensor) -> Any:
        """[n, L, row] blocks -> a DynamicCache of n*T tokens on the model's device."""
        blocks = blocks.to(self.model.device)
        n, H, T = blocks.shape[0], self.geometry.num_kv_heads, self.options.tokens_per_block
        cache = DynamicCache(config=self.model.config)
        for layer in range(self.geometry.num_layers):
            k, v = (_wide(part).permute(1, 0, 2, 3).reshape(1, H, n * T, -1).view(self.dtype)
                    for part in self._parts(blocks, layer))  # rows moved as wide words
            cache.update(k, v, layer)
        return cache

    # -- store --------------------------------------------------------------------------------------

    def store(self, token_ids: Any, cache: Any, *, skip_tokens: int = 0) -> int:
        """Store the full blocks of ``token_ids`` (one row) whose KV ``cache`` holds, from block
        ``skip_tokens // tokens_per_block`` on (blocks known to be stored already, e.g. the ones
        ``restore`` returned). Returns the number of blocks the daemon stored; blocks it already
        had, dropped or refused are counted in ``counters``."""
        ids = _one_row(token_ids)
        if not self.options.store:
            return 0
        started = time.perf_counter()
        T = self.options.tokens_per_block
        held = self._check_cache(cache)
        total = min(len(ids), held) // T
        first = max(0, skip_tokens) // T
        if total <= first:
            return 0
        keys = self.handle.block_keys(ids[: total * T])[first:]
        blocks = self._pack(cache, first * T, total * T)
        deadline = time.monotonic() + self.options.op_timeout_ms / 1000
        result = self.handle.put(keys, list(blocks), deadline=deadline)
        c = self.counters
        c.stores += 1
        c.blocks_stored += result.stored
        c.blocks_already_present += result.already_present
        c.blocks_not_stored += result.dropped + result.rejected
        c.store_s += time.perf_counter() - started
        return result.stored

    def _pack(self, cache: Any, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of batch row 0 -> [n, L, row] contiguous CPU blocks (one
        strided copy per layer and K/V on the cache's device, then one copy to the CPU)."""
        H, T = self.geometry.num_kv_heads, self.options.tokens_per_block
        n = (end - start) // T
        first = cache.layers[0].keys
        out = torch.empty((n, *self._block_shape()), dtype=self.dtype, device=first.device)
        for i, layer in enumerate(cache.layers):
            for dst, t in zip(self._parts(out, i), (layer.keys, layer.values), strict=True):
                src = t[0, :, start:end]  # [H, n*T, D]
                size = min(_wide_size(dst), _wide_size(src))  # the same words on both sides
                _wide(dst, size).copy_(_wide(src, size).reshape(H, n, T, -1).permute(1, 0, 2, 3))
        return out.to("cpu")

    def _check_cache(self, cache: Any) -> int:
        """The number of tokens ``cache`` holds; ``InvalidArgument`` unless it is a DynamicCache
        of full-attention layers with one row in this model's shape and dtype."""
        if not isinstance(cache, DynamicCache):
            raise InvalidArgument(f"expected a transformers DynamicCache, got "
                                  f"{type(cache).__name__}", field="cache")
        g = self.geometry
        L, H = g.num_layers, g.num_kv_heads
        if len(cache.layers) != L or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise InvalidArgument(f"expected {L} DynamicLayer layers, got "
                                  f"{[type(x).__name__ for x in cache.layers]}", field="cache")
        held = cache.get_seq_length()
        for i, layer in enumerate(cache.layers):
            for name, t, D in (("keys", layer.keys, g.key_dim),
                               ("values", layer.values, g.value_dim)):
                if held == 0 and (t is None or t.numel() == 0):
                    continue
                if t is None or tuple(t.shape) != (1, H, held, D) or t.dtype != self.dtype:
                    shape = None if t is None else (tuple(t.shape), t.dtype)
                    raise InvalidArgument(f"layer {i} {name}: expected [1, {H}, {held}, {D}] "
                                          f"{self.dtype}, got {shape}", field="cache")
        return int(held)

    # -- generate -----------------------------------------------------------------------------------

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate(input_ids, **kwargs)`` with the longest stored prefix restored first
        and the prompt's full blocks (and with ``store_generated`` the generated tokens' too)
        stored after. Calls this cannot cache (several rows, a padded attention mask, beam
        search or several return sequences, ``use_cache=False``) run uncached."""
        if "past_key_values" in kwargs:
            raise InvalidArgument("generate brings its own cache; call model.generate to pass "
                                  "past_key_values", field="past_key_values")
        if not self._cacheable(input_ids, kwargs):
            self.counters.generate_uncached += 1
            return self.model.generate(input_ids, **kwargs)
        cache, restored = self.restore(input_ids)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        with self._timed_forwards():
            out = self.model.generate(input_ids, past_key_values=cache, **kwargs)
        try:  # the output is the caller's whatever happens to the store
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            tokens = sequences[0] if self.options.store_generated else input_ids.reshape(-1)
            self.store(tokens, cache, skip_tokens=restored)
        except Exception as e:
            self.counters.store_failures += 1
            reason = f"{type(e).__name__}: {e}"
            if reason not in self._said:
                self._said.add(reason)
                log.error("kvtier prefix cache: KV not stored after generate (the output is "
                          "returned; said once per reason, counted in store_failures): %s",
                          reason)
        return out

    @contextlib.contextmanager
    def _timed_forwards(self) -> Iterator[None]:
        """Time each forward pass of the model while ``generate`` runs (the uncached suffix's
        prefill, then one token per decode step) into the decider's prefill rate: the
        engine's own seconds per token, on this model, device and dtype."""
        cuda = self.model.device.type == "cuda"
        started: list[tuple[int, float]] = []

        def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                if cuda:
                    torch.cuda.synchronize(self.model.device)
                started.append((int(ids.shape[1]), time.perf_counter()))

        def after(module: Any, args: Any, output: Any) -> None:
            if started:
                tokens, t0 = started.pop()
                if cuda:
                    torch.cuda.synchronize(self.model.device)
                self.decider.step(tokens, time.perf_counter() - t0)
                self.counters.prefill_steps += 1

        hooks = [self.model.register_forward_pre_hook(before, with_kwargs=True),
                 self.model.register_forward_hook(after)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _cacheable(self, input_ids: Any, kwargs: dict[str, Any]) -> bool:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            return False
        gen = kwargs.get("generation_config") or self.model.generation_config
        for name in ("num_beams", "num_return_sequences"):
            if int(kwargs.get(name, getattr(gen, name, 1) or 1)) != 1:
                return False
        return bool(kwargs.get("use_cache", getattr(gen, "use_cache", True)))

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the Client if this cache connected it (a caller's Client stays open)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> KvtierPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _one_row(token_ids: Any) -> list[int]:
    """Token ids of one sequence: a 1-D sequence or tensor, or a [1, seq] tensor."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidArgument(f"expected one sequence ([seq] or [1, seq]), got shape "
                                  f"{list(token_ids.shape)}; batch size 1 only",
                                  field="input_ids")
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, Sequence) and all(isinstance(t, int) for t in token_ids):
        return list(token_ids)
    raise InvalidArgument("expected token ids (a tensor or a sequence of ints)", field="input_ids")


def _check_full_attention(config: Any) -> None:
    """Refuse a model whose DynamicCache is not made of full-attention DynamicLayers: a
    sliding-window layer drops old tokens, a linear-attention layer keeps a state, not a KV per
    token, so neither maps onto prefix blocks."""
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds - {DynamicLayer.__name__}:
        raise ConfigError("model", f"only full-attention models are supported; this model's "
                                   f"cache has {sorted(kinds)} layers (sliding window or hybrid)")

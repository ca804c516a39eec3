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
Block bytes: ``cache_blocks`` (``CacheBlocks``, layout ``hf.dynamic.LKHTD``; MLA models
``hf.dynamic.mla.LKTD``). Keys are the namespace's chained block keys of the token ids, so
block ``b``'s key names the whole prefix ``0 .. b*T+T-1``.

Load or recompute (``load_policy``, docs/transformers.md §7): ``restore`` loads the stored
prefix a ``kvtier.adaptive.Decider`` chooses, from each hit's tier (``lookup_tiers``), the load
figures of earlier restores (and the daemon's ``tier_figures``) and the model's prefill rate,
which ``generate`` measures by timing the model's forward passes. A restore waits for its
blocks no longer than recomputing them would take (``kvtier.adaptive.worth_waiting_s``): a
tier that turned slow since its figures costs one restore at most that, and the restore given
up on tells the figures (``cut_load_s``), so the next decision recomputes.

Failure behaviour: the daemon away, slow or restarting makes ``restore`` a miss and ``store`` a
drop (the kvtier Client never raises for that); a block evicted between the lookup and the get
cuts the restored prefix there. Caller mistakes (a batch of several rows, a cache of another
kind, shape or dtype) raise ``InvalidArgument``; a model whose cache is not all full-attention
``DynamicLayer`` (sliding window, hybrid, linear attention) is refused at construction. A store
that fails after ``generate`` never loses the output: ``generate`` logs the reason (once per
reason), counts it in ``store_failures`` and returns what the model generated.

Owns its Client when given an address (``close`` closes it), never the model. Not thread-safe:
one instance per thread (the counters are plain fields); the Client underneath may be shared.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import DynamicCache

from kvtier.adaptive import Decider, PrefillRate, cut_load_s, worth_waiting_s
from kvtier.client import Client, NamespaceHandle
from kvtier.integrations.transformers.cache_blocks import CacheBlocks, check_full_attention
from kvtier.integrations.transformers.identity import (
    ConfigError,
    KvGeometry,
    PrefixCacheOptions,
    config_salt,
    dtype_name,
    kv_geometry,
    model_namespace,
)
from kvtier.settings import ClientSettings
from kvtier.shared_scopes import ScopedKeys, SharedScopes
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
    blocks_shared_skipped: int = 0  # a group's blocks not stored: its publishers store them
    shared_restored_tokens: int = 0  # of restored_tokens, those of a group's published prefix
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

    def __init__(
        self, client: Client | str, model: Any, *, model_revision: str, tokenizer_digest: str, **options: Any
    ) -> None:
        try:
            self.options = PrefixCacheOptions(
                model_revision=model_revision, tokenizer_digest=tokenizer_digest, **options
            )
        except TypeError as e:
            known = ", ".join(f.name for f in fields(PrefixCacheOptions))
            raise ConfigError("options", f"{e}; known options: {known}") from None
        self.model = model
        config = model.config
        check_full_attention(config)
        self.dtype: torch.dtype = model.dtype
        self.namespace = model_namespace(config, dtype_name(self.dtype), self.options)
        self.blocks = CacheBlocks(kv_geometry(config), self.options.tokens_per_block, self.dtype, model)
        self._said: set[str] = set()  # store failures already logged
        self._predicted_s: float | None = None  # the last decision's predicted load time
        self._recompute_s: float | None = None  # ... and recompute time of the same tokens
        self._owns_client = isinstance(client, str)
        self.client: Client = _connect(client, self.options) if isinstance(client, str) else client
        self.handle: NamespaceHandle = self.client.register(self.namespace)
        o, salt = self.options, config_salt(config)
        self.scopes = SharedScopes(  # a group's scope keeps the model config's digest
            self.client,
            o.prefix_refresh_ms / 1000,
            enabled=o.shared_prefixes,
            shared=lambda own, group: replace(own, cache_salt=salt, tenant=None, group=group),
        )
        self.counters = PrefixCacheCounters()
        self.decider = Decider(
            self.options.load_policy, probe_after_s=self.options.probe_after_s, prefill=PrefillRate()
        )

    @property
    def geometry(self) -> KvGeometry:
        """The model's KV geometry (``blocks.geometry``: replacing it changes the blocks)."""
        return self.blocks.geometry

    @geometry.setter
    def geometry(self, geometry: KvGeometry) -> None:
        self.blocks.geometry = geometry

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
        scoped = self.scopes.keys(self.handle, ids)
        keys = scoped.keys[: min(max_blocks, self.client.max_batch)]
        tiers = _lookup(scoped, len(keys))
        if not tiers:
            return None, 0
        hits = self._decide(tiers)
        if hits <= 0:
            return None, 0
        staging = torch.empty((hits, *self.blocks.block_shape()), dtype=self.dtype)
        started = time.perf_counter()
        worth = worth_waiting_s(self._recompute_s)  # no longer than recomputing them takes
        if worth is not None:
            deadline = min(deadline, time.monotonic() + worth)
        late = self.client.counters.out_of_time
        found = _get_into(scoped, hits, staging, deadline)
        n = next((i for i, f in enumerate(found) if not f), len(found))
        if n == 0:
            if worth is not None and self.client.counters.out_of_time > late:  # given up on
                self._loaded(tiers[:hits], cut_load_s(time.perf_counter() - started, worth), complete=False)
            return None, 0
        self._loaded(tiers[:n], time.perf_counter() - started, complete=n == hits)
        cache = self.blocks.unpack(staging[:n])
        self.counters.restore_hits += 1
        self.counters.restored_tokens += n * T
        self.counters.shared_restored_tokens += min(n, scoped.shared) * T
        return cache, n * T

    def _decide(self, tiers: list[str]) -> int:
        """How many of the hit blocks (``tiers``: where each one is) to restore, by
        ``load_policy``, with the daemon's latest per-tier figures fed in first."""
        for tier, fig in self.client.tier_figures().items():
            self.decider.report(tier, fig.latency_s, fig.bytes_per_s, age_s=fig.age_s)
        before = self.decider.stats
        slower, policy = before.tokens_recomputed_slower, before.tokens_recomputed_policy
        d = self.decider.decide(
            tiers, block_tokens=self.options.tokens_per_block, block_bytes=self.blocks.block_bytes()
        )
        c, after = self.counters, self.decider.stats
        c.tokens_recomputed_slower += after.tokens_recomputed_slower - slower
        c.tokens_recomputed_policy += after.tokens_recomputed_policy - policy
        self._predicted_s = d.predicted_s
        self._recompute_s = d.recompute_s
        return d.load_blocks

    def _loaded(self, tiers: list[str], seconds: float, *, complete: bool) -> None:
        """A restore of blocks from ``tiers`` took ``seconds``: the decider's load figures."""
        by_tier: dict[str, int] = {}
        for tier in tiers:
            by_tier[tier] = by_tier.get(tier, 0) + self.blocks.block_bytes()
        predicted = self._predicted_s if complete else None  # a cut load is not what was predicted
        self.decider.loaded(by_tier, seconds, predicted_s=predicted)
        if predicted is not None:
            self.counters.predicted_load_s += predicted
            self.counters.actual_load_s += seconds

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
        held = self.blocks.check_cache(cache)
        total = min(len(ids), held) // T
        first = max(0, skip_tokens) // T
        if total <= first:
            return 0
        scoped = self.scopes.keys(self.handle, ids)
        blocks = self.blocks.pack(cache, first * T, total * T)
        deadline = time.monotonic() + self.options.op_timeout_ms / 1000
        c, stored = self.counters, 0
        for part in scoped.cut(first, total):  # a group's blocks only where it publishes
            if not part.stores:
                c.blocks_shared_skipped += part.end - part.start
                continue
            a, b = part.start, part.end
            result = part.handle.put(scoped.keys[a:b], list(blocks[a - first : b - first]), deadline=deadline)
            stored += result.stored
            c.blocks_already_present += result.already_present
            c.blocks_not_stored += result.dropped + result.rejected
        c.stores += 1
        c.blocks_stored += stored
        c.store_s += time.perf_counter() - started
        return stored

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate(input_ids, **kwargs)`` with the longest stored prefix restored first
        and the prompt's full blocks (and with ``store_generated`` the generated tokens' too)
        stored after. Calls this cannot cache (several rows, a padded attention mask, beam
        search or several return sequences, ``use_cache=False``) run uncached."""
        if "past_key_values" in kwargs:
            raise InvalidArgument(
                "generate brings its own cache; call model.generate to pass past_key_values",
                field="past_key_values",
            )
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
                log.error(
                    "kvtier prefix cache: KV not stored after generate (the output is "
                    "returned; said once per reason, counted in store_failures): %s",
                    reason,
                )
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

        hooks = [
            self.model.register_forward_pre_hook(before, with_kwargs=True),
            self.model.register_forward_hook(after),
        ]
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


def _lookup(scoped: ScopedKeys, n: int) -> list[str]:
    """The tier of each of the first ``n`` blocks' hit prefix: the group's blocks first, then
    the cache's own (a miss in the published index costs no round trip)."""
    tiers: list[str] = []
    for part in scoped.cut(0, n):
        looked = part.handle.lookup_tiers(scoped.keys[part.start : part.end])
        tiers += looked.tiers[: looked.hits]
        if looked.hits < part.end - part.start:
            break
    return tiers


def _get_into(scoped: ScopedKeys, n: int, staging: torch.Tensor, deadline: float) -> list[bool]:
    """The first ``n`` blocks into ``staging``, part by part (stops after a part that missed)."""
    found: list[bool] = []
    for part in scoped.cut(0, n):
        a, b = part.start, part.end
        found += part.handle.get_into(scoped.keys[a:b], list(staging[a:b]), deadline=deadline)
        if not all(found):
            break
    return found


def _connect(address: str, o: PrefixCacheOptions) -> Client:
    """The cache's own client of the daemon at ``address`` (lazy: a daemon away is a miss)."""
    return Client.connect(
        address,
        lazy=True,
        settings=ClientSettings(
            transport=o.transport,
            timeout_s=o.request_timeout_ms / 1000,
            op_timeout_s=o.op_timeout_ms / 1000,
            token_file=o.token_file,
            client_name="kvtier-transformers",
        ),
    )


def _one_row(token_ids: Any) -> list[int]:
    """Token ids of one sequence: a 1-D sequence or tensor, or a [1, seq] tensor."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidArgument(
                f"expected one sequence ([seq] or [1, seq]), got shape "
                f"{list(token_ids.shape)}; batch size 1 only",
                field="input_ids",
            )
        return [int(t) for t in token_ids.tolist()]
    if isinstance(token_ids, Sequence) and all(isinstance(t, int) for t in token_ids):
        return list(token_ids)
    raise InvalidArgument("expected token ids (a tensor or a sequence of ints)", field="input_ids")

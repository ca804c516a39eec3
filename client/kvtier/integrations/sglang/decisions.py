"""Load or recompute for the kvtier HiCache backend (``load_policy``, docs/sglang.md).

``batch_exists`` / ``batch_exists_v2`` answer the held prefix cut to what a
``kvtier.adaptive.Decider`` finds worth loading (each page's tier, the loads' measured times, the
daemon's per-tier figures, and the operator's ``prefill_seconds_per_token``: the storage
interface shows no engine step to measure it from). ``PageDecisions.held_and_decided`` makes the
decision and remembers what it reported; ``loaded`` feeds a finished load's time back.

Ownership and concurrency: a part of ``KvtierHiCacheStorage``, handed the backend's
``StorageCore`` (client, counters, the KV pool's geometry); owns the ``Decider`` and two bounded
maps (a reported page's tier, a decided prefix's predicted time), all under one lock: SGLang's
prefetch and I/O threads share them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.adaptive import Decider, FixedPrefillRate, PrefillRate
from kvtier.client import NamespaceHandle
from kvtier.integrations.sglang.core import StorageCore

_REMEMBERED_PAGES = 1 << 16  # pages reported by batch_exists whose tier waits for their load
_REMEMBERED_PREFIXES = 1024  # decided prefixes whose predicted load time waits for it


class PageDecisions:
    """The backend's load-or-recompute decisions; see the module docstring."""

    def __init__(self, core: StorageCore) -> None:
        self.core = core
        spt = core.cfg.prefill_seconds_per_token
        self.decider = Decider(
            core.cfg.load_policy,
            probe_after_s=core.cfg.probe_after_s,
            prefill=FixedPrefillRate(spt) if spt else PrefillRate(),
        )
        self._lock = threading.Lock()  # the prefetch and the I/O threads share it
        self._tier_of: OrderedDict[str, str] = OrderedDict()  # reported page -> its tier
        self._predicted: OrderedDict[tuple[str, int], float] = OrderedDict()

    def held_and_decided(self, handle: NamespaceHandle, keys: list[str]) -> int:
        """The leading pages of ``keys`` the daemon holds, cut to the prefix ``load_policy``
        loads: what ``batch_exists`` tells SGLang, so SGLang prefetches only that prefix and
        recomputes the rest."""
        core = self.core
        tiers = self._held_tiers(handle, keys)
        core.counters.pages_hit += len(tiers)
        if not tiers or core.pages is None:
            return len(tiers)
        ps = core.pages.page_size
        with self._lock:
            for tier, fig in core.client.tier_figures().items():
                self.decider.report(tier, fig.latency_s, fig.bytes_per_s, age_s=fig.age_s)
            stats = self.decider.stats
            slower, policy = stats.tokens_recomputed_slower, stats.tokens_recomputed_policy
            d = self.decider.decide(tiers, block_tokens=ps, block_bytes=core.pages.block_bytes)
            c = core.counters
            c.tokens_reported += d.load_blocks * ps
            c.tokens_recomputed_slower += stats.tokens_recomputed_slower - slower
            c.tokens_recomputed_policy += stats.tokens_recomputed_policy - policy
            for key, tier in zip(keys[: d.load_blocks], tiers, strict=False):
                self._tier_of[key] = tier
                self._tier_of.move_to_end(key)
            if d.load_blocks and d.predicted_s is not None:
                self._predicted[(keys[0], d.load_blocks)] = d.predicted_s
            while len(self._tier_of) > _REMEMBERED_PAGES:  # reported pages SGLang never got
                self._tier_of.popitem(last=False)
            while len(self._predicted) > _REMEMBERED_PREFIXES:
                self._predicted.popitem(last=False)
        return d.load_blocks

    def _held_tiers(self, handle: NamespaceHandle, keys: list[str]) -> list[str]:
        """The tier of each leading page of ``keys`` the daemon holds. A query of any length:
        SGLang's hybrid controller sends every page of a prompt in one ``batch_exists_v2``, so
        the keys go in lookups of at most the client's batch limit, the next one only while
        every page so far is held (as ``HiCacheFile`` answers the whole prefix)."""
        tiers: list[str] = []
        step = max(1, self.core.client.max_batch)
        for start in range(0, len(keys), step):
            chunk = self.core.keys(handle, keys[start : start + step])
            looked = handle.lookup_detail(chunk)
            tiers += looked.tiers[: looked.hits]
            if looked.hits < len(chunk):
                break
        return tiers

    def loaded(self, keys: Sequence[str], found: Sequence[bool], seconds: float) -> None:
        """A load of pages ``batch_exists`` reported is over: its time, with its bytes by tier,
        into the decider's figures (a load of pages whose tier is not known, or with a miss,
        measures nothing)."""
        pages = self.core.pages
        if pages is None or not keys:
            return
        with self._lock:
            tiers = [self._tier_of.pop(k, None) for k in keys]
            predicted = self._predicted.pop((keys[0], len(keys)), None)
            if not all(found) or any(t is None for t in tiers):
                return
            by_tier: dict[str, int] = {}
            for tier in tiers:
                assert tier is not None
                by_tier[tier] = by_tier.get(tier, 0) + pages.block_bytes
            self.decider.loaded(by_tier, seconds, predicted_s=predicted)
            if predicted is not None:
                self.core.counters.predicted_load_s += predicted
                self.core.counters.actual_load_s += seconds

"""The Transformers prefix cache's load-or-recompute decision (``load_policy``, issue 30),
through a real daemon and a real (randomly initialised, built here) Llama-shaped model.

* slow tier: the daemon's NVMe reads are slowed (``python -m kvtierd.testing.serve
  --read-latency-ms``, test-only) and its host tier is tiny, so stored prompts sit on NVMe only.
  ``always`` restores every stored block (slowly); the daemon times those reads and hands its
  NVMe figure to every session, so ``adaptive`` restores nothing and recomputes, with the same
  output: the tier is slower than the model's measured prefill;
  ``never`` restores nothing.
* fast tier (the host tier of a plain daemon): ``adaptive`` restores what ``always`` restores.
* a tier that turns slow after its figures said fast (``--read-latency-file``): the first
  restore gives up after the recompute time (``kvtier.adaptive.worth_waiting_s``), not the
  read's 300 ms, and tells the figures, so the next restore is not tried.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import DaemonProcess, SlowDiskDaemon, make_namespace, small_tiers  # noqa: E402
from tests_helpers import set_read_latency  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvtier  # noqa: E402
from kvtier.adaptive import FixedPrefillRate  # noqa: E402
from kvtier.integrations.transformers import KvtierPrefixCache  # noqa: E402

pytestmark = pytest.mark.timeout(120)

T = 16
REV = "0123456789abcdef0123456789abcdef01234567"
GEN = dict(max_new_tokens=2, do_sample=False)
READ_LATENCY_MS = 300  # per NVMe read: a 4-block restore >= 300 ms, its recompute ~ 10 ms


def tiny_host_args(work: Path) -> list[str]:
    """A 1 MiB host tier over write-through NVMe: stored prompts can be pushed to NVMe only."""
    return small_tiers(work, "1MiB", "256KiB", "64MiB", "write-through")


def store_on_nvme_only(address: str, model: Any, seeds: range) -> dict[int, Any]:
    """Generate (and store) each seed's prompt, push them out of the 1 MiB host tier, wait until
    the daemon holds their 4 blocks on NVMe only; their plain outputs."""
    expected = {}
    with cache(address, model, "never") as pc:
        for seed in seeds:
            expected[seed] = pc.generate(prompt(seed), **GEN)
        assert pc.counters.blocks_stored == len(seeds) * 4
        with kvtier.Client.connect(address) as c:
            h = c.register(make_namespace(model_id="test/filler"))
            filler = [bytes([i % 251]) * (16 << 10) for i in range(160)]
            h.put(h.block_keys(list(range(160 * 16))), filler)
        deadline = time.monotonic() + 20
        while True:
            tiers = [
                t
                for seed in seeds
                for t in pc.handle.lookup_detail(pc.handle.block_keys(prompt(seed)[0, :64].tolist())).tiers
            ]
            if tiers == ["nvme"] * 4 * len(seeds) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert tiers == ["nvme"] * 4 * len(seeds), tiers
    return expected


def mlp_heavy_llama() -> Any:
    """Compute-heavy, KV-light: 2 layers, 1 KV head of 64 (16 KiB fp32 blocks of 16 tokens), a
    2048-wide MLP, so a host-tier restore is clearly faster than recomputing."""
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=1,
            max_position_embeddings=512,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )
    ).eval()


def prompt(seed: int, n: int = 70) -> Any:  # 4 full blocks + 6 tokens
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (1, n), generator=g)


def cache(address: str, model: Any, policy: str) -> KvtierPrefixCache:
    return KvtierPrefixCache(
        address,
        model,
        model_revision=REV,
        tokenizer_digest="none",
        model_id="test/mlp-heavy",
        tokens_per_block=T,
        load_policy=policy,
        probe_after_s=60.0,
    )


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady step times on a shared test host (no OpenMP spinning)
    try:
        yield mlp_heavy_llama()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def slow(
    tmp_path_factory: pytest.TempPathFactory, model: Any
) -> Iterator[tuple[SlowDiskDaemon, dict[int, Any]]]:
    """The slow daemon holding prompts 10..15 on its NVMe tier only; their plain outputs."""
    work: Path = tmp_path_factory.mktemp("tf_adaptive")
    d = SlowDiskDaemon(work / "daemon", *tiny_host_args(work), latency_ms=READ_LATENCY_MS).start()
    try:
        expected = store_on_nvme_only(d.unix, model, range(10, 16))
        yield d, expected
    finally:
        d.kill()


def warm_up(pc: KvtierPrefixCache, base: int = 90) -> None:
    """A few misses: the model's prefill rate, measured (a few steps average out a noisy one on
    a shared test host)."""
    for seed in range(base, base + 3):
        pc.generate(prompt(seed, 100 + seed % 10), **GEN)


def timed_generate(pc: KvtierPrefixCache, seed: int) -> tuple[Any, float]:
    started = time.perf_counter()
    out = pc.generate(prompt(seed), **GEN)
    return out, time.perf_counter() - started


def test_slow_tier_adaptive_recomputes_where_always_loads_slowly(
    slow: tuple[SlowDiskDaemon, dict[int, Any]], model: Any
) -> None:
    d, expected = slow
    with cache(d.unix, model, "always") as always:
        outs = [timed_generate(always, seed) for seed in (10, 11)]
        for (out, _), seed in zip(outs, (10, 11), strict=True):
            assert torch.equal(out, expected[seed])
        assert always.counters.restored_tokens == 2 * 64
        always_s = [s for _, s in outs]

    with cache(d.unix, model, "adaptive") as adaptive:
        warm_up(adaptive)
        assert adaptive.decider.prefill.seconds_per_token() is not None
        # the daemon measured the always cache's slow NVMe reads and hands the figure to
        # every session (OpenSession, heartbeats): adaptive never loads from the slow tier
        fig = adaptive.client.tier_figures()["nvme"]
        hit_bytes = 64 // T * adaptive.blocks.block_bytes()
        assert fig.latency_s + hit_bytes / fig.bytes_per_s >= READ_LATENCY_MS / 1000 * 0.5
        outs = [timed_generate(adaptive, seed) for seed in (12, 13, 14)]
        for (out, _), seed in zip(outs, (12, 13, 14), strict=True):
            assert torch.equal(out, expected[seed])  # recomputed, the same output
        c = adaptive.counters
        assert c.restored_tokens == 0, "adaptive loaded from the slow tier"
        assert c.tokens_recomputed_slower == 3 * 64
        assert adaptive.decider.stats.by_reason.get("slower") == 3
        adaptive_s = [s for _, s in outs]
    print(
        f"\nslow NVMe tier: always {[round(s, 3) for s in always_s]} s per generate, "
        f"adaptive {[round(s, 3) for s in adaptive_s]} s"
    )
    assert sum(adaptive_s) / 3 < sum(always_s) / 2

    with cache(d.unix, model, "never") as never:
        out = never.generate(prompt(15), **GEN)
        assert torch.equal(out, expected[15])
        assert never.counters.restored_tokens == 0
        assert never.counters.tokens_recomputed_policy == 64


def test_fast_tier_adaptive_loads_what_always_loads(daemon: DaemonProcess, model: Any) -> None:
    seeds = (20, 21, 22)
    with cache(daemon.unix, model, "never") as store:
        expected = {seed: store.generate(prompt(seed), **GEN) for seed in seeds}
    restored = {}
    for base, policy in ((40, "always"), (50, "adaptive")):
        with cache(daemon.unix, model, policy) as pc:
            warm_up(pc, base)
            for seed in seeds:
                assert torch.equal(pc.generate(prompt(seed), **GEN), expected[seed])
            restored[policy] = pc.counters.restored_tokens
            if policy == "adaptive":
                assert pc.decider.stats.by_reason.get("faster", 0) >= 2, pc.decider.stats
                assert pc.counters.tokens_recomputed_slower == 0
    assert restored == {"always": 3 * 64, "adaptive": 3 * 64}


def test_a_tier_turned_slow_costs_one_restore_the_recompute_time(tmp_path: Path, model: Any) -> None:
    latency = tmp_path / "read-latency-ms"
    d = SlowDiskDaemon(tmp_path / "daemon", *tiny_host_args(tmp_path), latency_file=latency).start()
    try:
        expected = store_on_nvme_only(d.unix, model, range(30, 34))
        with cache(d.unix, model, "adaptive") as pc:
            # 1 ms a token (a fixed figure: the test's timing must not hang on this host's
            # speed): recomputing a 4-block hit takes 64 ms, reading it from a fast disk ~1 ms
            pc.decider.prefill = FixedPrefillRate(0.001)
            for seed in (30, 31):  # the disk is fast: the NVMe figure says so
                assert torch.equal(pc.generate(prompt(seed), **GEN), expected[seed])
            assert pc.counters.restored_tokens == 2 * 64
            set_read_latency(latency, READ_LATENCY_MS)  # now every read sleeps 300 ms
            out, took = timed_generate(pc, 32)
            assert torch.equal(out, expected[32])  # recomputed
            assert pc.counters.restored_tokens == 2 * 64
            assert took < READ_LATENCY_MS / 1000 - 0.05, took  # gave up after ~64 ms
            out, _ = timed_generate(pc, 33)  # the cut restore told the figures: not tried
            assert torch.equal(out, expected[33])
            assert pc.decider.stats.by_reason.get("slower") == 1, pc.decider.stats
            assert pc.counters.restored_tokens == 2 * 64
    finally:
        d.kill()

"""Transformers prefix caching through a real daemon: a tiny randomly initialised Llama-shaped
model (built here, no download) generates greedily with and without a restored prefix.

Every scenario uses 16-token blocks, so a 70-token prompt has 4 full blocks (64 tokens) that can
be restored, and 6 tokens the model still computes."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import DaemonProcess  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig  # noqa: E402

from kvtier.integrations.transformers import LAYOUT, ConfigError, KvtierPrefixCache  # noqa: E402
from kvtier_contract.errors import InvalidArgument  # noqa: E402

pytestmark = pytest.mark.timeout(120)

T = 16  # tokens per block
REV = "0123456789abcdef0123456789abcdef01234567"
GEN = dict(max_new_tokens=8, do_sample=False)


def tiny_llama(seed: int = 0, **overrides: Any) -> Any:
    """2 layers, 2 KV heads of 16: 256 B of fp32 KV per token per layer."""
    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**fields)).eval()


class Computed:
    """Counts the token positions the model's decoder actually runs, per forward call."""

    def __init__(self, model: Any) -> None:
        self.calls: list[int] = []
        self._hook = model.model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append(int(ids.shape[1]))

    def take(self) -> list[int]:
        calls, self.calls = self.calls, []
        return calls


def prompt(n: int, seed: int = 1) -> Any:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (1, n), generator=g)


def prefix_cache(address: str, model: Any, **options: Any) -> KvtierPrefixCache:
    options = {
        "model_revision": REV,
        "tokenizer_digest": "none",
        "model_id": "test/tiny-llama",
        "tokens_per_block": T,
        # What is checked is what loads and stores: every hit loaded (whether loading beats a
        # recompute is test_transformers_adaptive.py's subject, and a tiny model on a loaded
        # box recomputes faster), and deadlines a loaded 2-core CI box meets.
        "load_policy": "always",
        "request_timeout_ms": 5000,
        **options,
    }
    return KvtierPrefixCache(address, model, **options)


@pytest.fixture
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def pc(daemon: DaemonProcess, model: Any) -> Iterator[KvtierPrefixCache]:
    with prefix_cache(daemon.unix, model) as cache:
        yield cache


def test_restored_prefix_gives_identical_output_and_computes_fewer_tokens(
    daemon: DaemonProcess, model: Any, transport: str
) -> None:
    with prefix_cache(daemon.address(transport), model, transport=transport) as pc:
        check_generate_twice(pc, model)


def check_generate_twice(pc: KvtierPrefixCache, model: Any) -> None:
    ids = prompt(70)
    computed = Computed(model)
    with torch.no_grad():
        expected = model.generate(ids, **GEN)
    assert computed.take() == [70] + [1] * 7  # plain prefill, then one token per decode step

    cold = pc.generate(ids, **GEN)  # nothing stored yet: the same full prefill
    assert torch.equal(cold, expected)
    assert computed.take() == [70] + [1] * 7
    # The cache held 70 + 7 tokens after generate: 4 full blocks stored (prompt and output).
    assert pc.counters.blocks_stored == 4

    warm = pc.generate(ids, **GEN)  # 64 tokens restored, 6 computed
    assert torch.equal(warm, expected)
    assert computed.take() == [6] + [1] * 7
    assert pc.counters.restored_tokens == 64
    assert pc.counters.blocks_already_present == 0  # restored blocks are not sent again


def test_a_shared_prefix_is_restored_up_to_where_the_prompts_diverge(
    pc: KvtierPrefixCache, model: Any
) -> None:
    first = prompt(70)
    pc.generate(first, **GEN)
    other = torch.cat([first[:, :40], prompt(30, seed=2)], dim=1)  # same first 40 tokens
    computed = Computed(model)
    with torch.no_grad():
        expected = model.generate(other, **GEN)
    computed.take()
    got = pc.generate(other, **GEN)
    assert torch.equal(got, expected)
    assert computed.take()[0] == 70 - 32  # 2 whole blocks are shared, the third differs


def test_the_last_prompt_token_is_always_computed(pc: KvtierPrefixCache, model: Any) -> None:
    ids = prompt(64)  # exactly 4 blocks
    pc.generate(ids, **GEN)
    cache, n = pc.restore(ids)
    assert n == 48 and cache.get_seq_length() == 48  # 3 blocks: one token is left to compute
    computed = Computed(model)
    pc.generate(ids, **GEN)
    assert computed.take()[0] == 16


def test_restored_kv_is_bit_identical_to_the_computed_kv(pc: KvtierPrefixCache, model: Any) -> None:
    ids = prompt(50)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert pc.store(ids, cache) == 3  # 48 of 50 tokens in full blocks
    restored, n = pc.restore(torch.cat([ids, prompt(5, seed=3)], dim=1))
    assert n == 48
    for mine, theirs in zip(restored.layers, cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys[:, :, :48])
        assert torch.equal(mine.values, theirs.values[:, :, :48])


def test_another_revision_config_or_tokenizer_gets_no_hits(
    daemon: DaemonProcess, pc: KvtierPrefixCache, model: Any
) -> None:
    ids = prompt(70)
    pc.generate(ids, **GEN)
    assert pc.restore(ids)[1] == 64  # the positive control: the same identity hits

    # Same shape and same weights, another rope theta: other KV, so another namespace.
    rope = tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    rope.load_state_dict(model.state_dict())
    others = [
        prefix_cache(daemon.unix, model, model_revision="fedcba9876543210fedcba9876543210fedcba98"),
        prefix_cache(daemon.unix, rope),
        prefix_cache(daemon.unix, tiny_llama(rms_norm_eps=1e-5)),
        prefix_cache(daemon.unix, model, tokenizer_digest="sha256:" + "e" * 64),
        prefix_cache(daemon.unix, model, cache_salt="tenant-b"),
    ]
    for other in others:
        with other:
            assert other.namespace.layout == LAYOUT
            assert other.namespace.digest != pc.namespace.digest
            assert other.restore(ids) == (None, 0)


def test_identity_fails_closed(model: Any) -> None:
    address = "unix:/nonexistent/kvtier.sock"  # refused before any connection
    with pytest.raises(ConfigError, match="model_revision.*moving ref"):
        prefix_cache(address, model, model_revision="main")
    with pytest.raises(ConfigError, match="model_revision: required"):
        prefix_cache(address, model, model_revision="")
    with pytest.raises(ConfigError, match="tokenizer_digest: required"):
        prefix_cache(address, model, tokenizer_digest=" ")
    with pytest.raises(ConfigError, match="model_id: required"):
        KvtierPrefixCache(address, model, model_revision=REV, tokenizer_digest="none")
    with pytest.raises(ConfigError, match="options.*known options"):
        prefix_cache(address, model, block_size=16)
    torch.manual_seed(0)
    sliding = transformers.MistralForCausalLM(
        MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=32,
        )
    )
    with pytest.raises(ConfigError, match="full-attention"):
        prefix_cache(address, sliding)


def test_daemon_away_is_a_miss_and_a_dropped_store(daemon: DaemonProcess, model: Any) -> None:
    ids = prompt(70)
    with torch.no_grad():
        expected = model.generate(ids, **GEN)
    with prefix_cache(daemon.unix, model, op_timeout_ms=2000, request_timeout_ms=300) as pc:
        pc.generate(ids, **GEN)
        assert pc.counters.blocks_stored == 4
        daemon.kill()
        started = time.monotonic()
        got = pc.generate(ids, **GEN)
        assert time.monotonic() - started < 10  # never hangs on a dead daemon
        assert torch.equal(got, expected)
        assert pc.counters.restored_tokens == 0  # a miss, computed in full
        assert pc.counters.blocks_stored == 4 and pc.counters.blocks_not_stored == 4


def test_a_wrong_address_is_said_once_and_generate_recomputes(
    tmp_path: Any, model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine must not fail: a cache built on an address with no daemon is built, says why
    once at WARNING (not per call), and every generate computes in full."""
    caplog.set_level(logging.WARNING, logger="kvtier.client")
    ids = prompt(70)
    with torch.no_grad():
        expected = model.generate(ids, **GEN)
    with prefix_cache(f"unix:{tmp_path}/none.sock", model, request_timeout_ms=300) as pc:
        for _ in range(3):
            assert torch.equal(pc.generate(ids, **GEN), expected)
        assert pc.counters.restored_tokens == 0
    said = [
        r.getMessage() for r in caplog.records if r.name == "kvtier.client" and r.levelno == logging.WARNING
    ]
    assert len(said) == 1 and "no socket file" in said[0] and "kvtierd running" in said[0], said


def test_calls_it_cannot_cache_run_uncached(pc: KvtierPrefixCache, model: Any) -> None:
    ids = prompt(40)
    batch = torch.cat([ids, prompt(40, seed=5)])
    with torch.no_grad():
        expected = model.generate(batch, **GEN)
    assert torch.equal(pc.generate(batch, **GEN), expected)
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    pc.generate(ids, attention_mask=padded, **GEN)
    assert pc.counters.generate_uncached == 2 and pc.counters.stores == 0
    with pytest.raises(InvalidArgument):
        pc.restore(batch)
    with pytest.raises(InvalidArgument):
        pc.store(ids, model(ids, use_cache=True).past_key_values.layers[0])
    with pytest.raises(InvalidArgument):
        pc.generate(ids, past_key_values=DynamicCache(), **GEN)


def test_store_and_restore_a_thousand_token_prompt(
    pc: KvtierPrefixCache, model: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = prompt(1025)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    started = time.perf_counter()
    assert pc.store(ids, cache) == 64
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    restored, n = pc.restore(ids)
    get_s = time.perf_counter() - started
    assert n == 1024
    assert torch.equal(restored.layers[1].values, cache.layers[1].values[:, :, :1024])
    with capsys.disabled():
        mib = 1024 * pc.namespace.bytes_per_token / 2**20
        print(f"\n1,024 tokens ({mib:.1f} MiB): store {put_s * 1000:.1f} ms, restore {get_s * 1000:.1f} ms")


@pytest.mark.parametrize(
    ("options", "stored", "restored"),
    [
        ({}, 4, 48),  # 60 prompt + 7 generated tokens in the cache: 4 blocks; 3 restorable
        ({"store_generated": False}, 3, 48),  # the prompt's 3 blocks only
        ({"load": False}, 4, 0),  # write-only: stores, never restores
        ({"store": False}, 0, 0),  # read-only: nothing stored, so nothing to restore
    ],
)
def test_load_and_store_options(
    daemon: DaemonProcess, model: Any, options: dict[str, Any], stored: int, restored: int
) -> None:
    ids = prompt(60)
    with prefix_cache(daemon.unix, model, **options) as pc:
        pc.generate(ids, **GEN)
        assert pc.counters.blocks_stored == stored
        assert pc.restore(ids)[1] == restored


def test_importing_without_transformers_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import kvtier.integrations.transformers as m\n"
        "print(m.LAYOUT, 'torch' in sys.modules)\n"
        "try:\n    m.KvtierPrefixCache\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines() == [
        f"{LAYOUT} False",  # the plain-Python part imports without torch or transformers
        "kvtier.integrations.transformers.KvtierPrefixCache needs transformers: "
        "pip install 'kvtier[transformers]'",
    ]

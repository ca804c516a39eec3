"""Transformers prefix caches of different salts (tenants) share a published system prompt
(issue 43, ``kvtier.shared_scopes``): the prompt's whole blocks are keyed in the group's scope,
the rest in each salt's own; another salt restores the shared blocks with the output of a
full recompute, and never the first salt's suffix. A member of a group (a daemon with
tenants, over tcp) restores what a publisher stored and stores none of the group's blocks.
A tiny randomly initialised Llama built here, 16-token blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import DaemonProcess  # noqa: E402
from test_transformers_prefix import GEN, Computed, T, prefix_cache, prompt, tiny_llama  # noqa: E402
from tests_helpers import write_tenants  # noqa: E402

import kvtier  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GROUP = "sys"
SHARED = prompt(2 * T + 5, seed=21)  # 2 whole blocks, then 5 tokens inside the third
TOKENS = {"pub": "tok-tf-pub", "member": "tok-tf-member"}


def with_suffix(seed: int) -> Any:
    return torch.cat([SHARED, prompt(2 * T + 3, seed=seed)], dim=1)  # 4 full blocks + 8 tokens


def test_salts_share_the_published_prefix_and_never_each_others_suffixes(daemon: DaemonProcess) -> None:
    model = tiny_llama()
    with kvtier.Client.connect(daemon.unix) as c:
        c.publish_prefix(GROUP, "system", SHARED[0].tolist())
    a, b = with_suffix(22), with_suffix(23)
    with torch.no_grad():
        expected_b = model.generate(b, **GEN)
    with (
        prefix_cache(daemon.unix, model, cache_salt="tenant-1") as one,
        prefix_cache(daemon.unix, model, cache_salt="tenant-2") as two,
    ):
        one.generate(a, **GEN)  # tenant 1 computes: 2 blocks into the group, the rest its own
        assert one.counters.blocks_stored == 4  # 2 shared + 2 its own (79 tokens of KV held)
        computed = Computed(model)
        out = two.generate(b, **GEN)
        assert torch.equal(out, expected_b)  # what it restored is what a recompute makes
        assert two.counters.restored_tokens == two.counters.shared_restored_tokens == 2 * T
        assert computed.take()[0] == b.shape[1] - 2 * T
        cache, n = two.restore(a)  # tenant 1's very prompt: the shared blocks only
        assert n == 2 * T and cache is not None
        _, n = one.restore(a)  # and tenant 1 itself: its whole stored prompt
        assert n == 4 * T
    other = tiny_llama(rms_norm_eps=1e-3)  # another config: the group's scope keeps its digest
    with prefix_cache(daemon.unix, other, cache_salt="tenant-2") as three:
        assert three.restore(b) == (None, 0)
    with kvtier.Client.connect(daemon.unix) as c:
        c.withdraw_prefix(GROUP, "system")


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # shm: the group's arena, mapped read-only
def test_a_member_restores_the_publishers_blocks_and_stores_none_of_the_groups(
    daemon_factory: Any, tmp_path: Path, transport: str
) -> None:
    mapping = list(TOKENS) if transport == "shm" else []
    config = write_tenants(
        tmp_path, TOKENS, group=GROUP, publishers=["pub"], members=["member"], mapping=mapping
    )
    config.write_text(config.read_text() + 'tenant_arena_bytes = "64MiB"\n')
    d: DaemonProcess = daemon_factory("--config", str(config), run_dir=tmp_path / "d")
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["pub"]) as c:
        c.publish_prefix(GROUP, "system", SHARED[0].tolist())
    model = tiny_llama()

    def cache(tenant: str) -> Any:
        return prefix_cache(d.unix, model, transport=transport, token_file=str(tmp_path / f"{tenant}.token"))

    m = with_suffix(24)
    with cache("member") as member:
        member.generate(m, **GEN)  # no publisher stored the prefix yet: its own blocks only
        assert member.counters.blocks_shared_skipped == 2 and member.counters.blocks_stored == 2
        with cache("pub") as pub:
            pub.generate(with_suffix(25), **GEN)
            assert pub.counters.blocks_stored == 4
        _, n = member.restore(m)
        assert n == 4 * T and member.counters.shared_restored_tokens == 2 * T

"""The vLLM connector keys a published prefix in its group's scope (issue 43), without vLLM.

The planner and worker are driven as vLLM's scheduler drives them (see test_vllm_planner.py),
against a real daemon process: a prefix published for a group (``Client.publish_prefix``) is
keyed in the group's namespace, the rest of each request in its own salted namespace, chained
on (docs/hashing.md §7). Another salt loads the shared blocks, byte for byte, and never the
first one's private suffix; a member of a group (a daemon with tenants, over tcp) loads what a
publisher stored and stores none of the group's blocks itself.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DaemonProcess
from test_vllm_planner import IDENTITY, decode, lbhnc_cache, matched, prompt, schedule
from tests_helpers import wait_for, write_tenants

import kvtier
from kvtier.integrations.vllm.connector.backend import DaemonBackend
from kvtier.integrations.vllm.connector.config import ConnectorConfig, Variant
from kvtier.integrations.vllm.connector.planner import Planner, RequestInfo, StepInput, StepPlan
from kvtier.integrations.vllm.connector.worker import KvtierWorker
from kvtier_contract import errors
from kvtier_contract.scopes import Region, scoped_block_keys

BS = 16
GROUP = "sys"
SHARED = prompt(2 * BS + 5, seed=11)  # 2 whole blocks, then 5 tokens inside the third
T1, T2 = Variant(cache_salt="tenant-1"), Variant(cache_salt="tenant-2")
TOKENS = {"pub": "tok-shared-pub", "member": "tok-shared-member"}


def planner(cfg: ConnectorConfig) -> Planner:
    return Planner(block_size=BS, backend=DaemonBackend(IDENTITY, cfg), lookup_timeout_s=5.0)


def step(p: Planner, req: str, toks: list[int], variant: Variant, ids: list[int]) -> tuple[StepPlan, int]:
    """A new request's first step: its hit (tokens) and the plan that loads and stores it."""
    p.on_new_request(RequestInfo(req, toks, variant))
    hit, _ = matched(p, req, 0, len(toks))
    assert hit is not None
    p.after_alloc(req, ids, hit)
    return p.build(StepInput([schedule(req, ids, hit, len(toks) - hit)])), hit


def expected_keys(variant: Variant, toks: list[int]) -> list[bytes]:
    """A request's keys as docs/hashing.md §7 has them: the prefix in the group's scope."""
    regions = [
        Region(0, IDENTITY.namespace(variant.shared(GROUP))),
        Region(len(SHARED), IDENTITY.namespace(variant)),
    ]
    return scoped_block_keys(regions, toks)


def test_a_published_prefix_is_keyed_in_the_groups_scope_and_shared_across_salts(
    daemon: DaemonProcess,
) -> None:
    with kvtier.Client.connect(daemon.unix) as c:
        published = c.publish_prefix(GROUP, "system", SHARED)
    assert published.tokens == len(SHARED) and published.publisher
    suffix_1, suffix_2 = prompt(2 * BS + 9, seed=12), prompt(2 * BS + 9, seed=13)
    a, b = SHARED + suffix_1, SHARED + suffix_2
    cfg = ConnectorConfig(address=daemon.unix)
    p = planner(cfg)
    src, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, cfg)
    w.register(layers)
    # tenant 1 computes everything: 2 blocks into the group's namespace, 2 into its own
    plan, hit = step(p, "a", a, T1, [3, 9, 1, 14, 6])
    assert hit == 0
    assert [(s.variant, s.block_ids) for s in plan.stores] == [(T1.shared(GROUP), [3, 9]), (T1, [1, 14])]
    assert [k for s in plan.stores for k in s.keys[0]] == expected_keys(T1, a)
    w.submit_stores(plan.stores)
    assert w.drain() and w.idle()
    p.request_finished("a")
    # tenant 2, another salt: the shared blocks hit (and load, byte for byte), its own miss
    dst, layers2 = lbhnc_cache(False)
    w2 = KvtierWorker(IDENTITY, cfg)
    w2.register(layers2)
    plan, hit = step(p, "b", b, T2, [0, 2, 4, 5, 7])
    assert hit == 2 * BS and p.stats.shared_hit_blocks == 2
    assert len(plan.loads) == 1 and plan.loads[0].shared == 2
    assert plan.loads[0].shared_variant == T2.shared(GROUP) == T1.shared(GROUP)
    assert w2.load(plan.loads) == set()
    for s, t in ((3, 0), (9, 2)):
        assert torch.equal(src[:, s], dst[:, t])
    assert [(s.variant, s.block_ids) for s in plan.stores] == [(T2, [4, 5])]
    p.request_finished("b")
    # tenant 2 sending tenant 1's very prompt: the shared blocks only, never 1's suffix
    _, hit = step(p, "b2", a, T2, [8, 10, 11, 12, 13])
    assert hit == 2 * BS
    # and tenant 1 again: its whole prompt (but the block the last token is in)
    _, hit = step(p, "a2", a, T1, [8, 10, 11, 12, 13])
    assert hit == 4 * BS
    for x in (w, w2):
        x.close()
    p.close()
    with kvtier.Client.connect(daemon.unix) as c:
        assert c.withdraw_prefix(GROUP, "system")


def test_without_a_published_prefix_keys_are_the_flat_ones(daemon: DaemonProcess) -> None:
    toks = SHARED + prompt(BS, seed=14)
    p = planner(ConnectorConfig(address=daemon.unix))
    plan, _ = step(p, "flat", toks, T1, [1, 2, 3])
    assert [(s.variant, s.keys[0]) for s in plan.stores] == [(T1, IDENTITY.namespace(T1).block_keys(toks))]
    p.close()


def tenants_daemon(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    config = write_tenants(tmp_path, TOKENS, group=GROUP, publishers=["pub"], members=["member"])
    d: DaemonProcess = daemon_factory(
        "--config", str(config), "--host-bytes", "64MiB", run_dir=tmp_path / "d"
    )
    return d


def tenant_cfg(d: DaemonProcess, tmp_path: Path, tenant: str, **kw: Any) -> ConnectorConfig:
    return ConnectorConfig(
        address=d.unix, transport="tcp", token_file=str(tmp_path / f"{tenant}.token"), **kw
    )


def test_a_member_loads_the_publishers_blocks_and_stores_none_of_the_groups(
    daemon_factory: Any, tmp_path: Path
) -> None:
    d = tenants_daemon(daemon_factory, tmp_path)
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["member"]) as c:
        with pytest.raises(errors.PermissionDenied) as refused:
            c.publish_prefix(GROUP, "system", SHARED)
        assert refused.value.field == "group"
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["pub"]) as c:
        c.publish_prefix(GROUP, "system", SHARED)
    toks = SHARED + prompt(BS + 3, seed=15)
    pub_cfg, member_cfg = tenant_cfg(d, tmp_path, "pub"), tenant_cfg(d, tmp_path, "member")
    # the member first: no publisher has stored the prefix yet, so it computes and stores only
    # its own blocks (the group's: counted as skipped, never sent)
    pm = planner(member_cfg)
    plan, hit = step(pm, "m0", toks, T2, [1, 2, 3])
    assert hit == 0 and pm.stats.store_shared_skipped_blocks == 2
    assert [(s.variant, s.block_ids) for s in plan.stores] == [(T2, [3])]
    pm.request_finished("m0")
    # the publisher's engine stores the group's blocks
    pp = planner(pub_cfg)
    src, layers = lbhnc_cache(True)
    w = KvtierWorker(IDENTITY, pub_cfg)
    w.register(layers)
    plan, _ = step(pp, "p", toks, T1, [4, 5, 6])
    assert [(s.variant, s.block_ids) for s in plan.stores] == [(T1.shared(GROUP), [4, 5]), (T1, [6])]
    w.submit_stores(plan.stores)
    assert w.drain() and w.idle()
    assert w.take_stats()["stored_blocks"] == 3
    # now the member loads the shared blocks over tcp, byte for byte
    dst, layers2 = lbhnc_cache(False)
    w2 = KvtierWorker(IDENTITY, member_cfg)
    w2.register(layers2)
    plan, hit = step(pm, "m1", toks, T2, [7, 8, 9])  # (its group handle registered at m0)
    assert hit == 2 * BS
    assert plan.loads[0].shared == 2 and w2.load(plan.loads) == set()
    for s, t in ((4, 7), (5, 8)):
        assert torch.equal(src[:, s], dst[:, t])
    assert [(x.variant, x.block_ids) for x in plan.stores] == [(T2, [9])]
    for x in (w, w2):
        x.close()
    for x in (pp, pm):
        x.close()


def test_generated_tokens_completing_the_prefixs_last_block_chain_as_the_next_turn_keys_it(
    daemon: DaemonProcess,
) -> None:
    """A prompt that is the published prefix alone (a publisher warming it, or a first turn)
    ends inside block 2: decode completes that block, and its key has the boundary in it, as
    the next turn's lookup (prefix + answer + a new message) computes it."""
    with kvtier.Client.connect(daemon.unix) as c:
        c.publish_prefix(GROUP, "system", SHARED)
    p = planner(ConnectorConfig(address=daemon.unix))
    toks = list(SHARED)
    p.on_new_request(RequestInfo("t1", list(SHARED), T1, toks))
    assert matched(p, "t1", 0, len(toks)) == (0, False)
    p.after_alloc("t1", [0, 1, 2], 0)
    plan = p.build(StepInput([schedule("t1", [0, 1, 2], 0, len(toks))]))
    assert [(s.variant, s.block_ids) for s in plan.stores] == [(T1.shared(GROUP), [0, 1])]
    toks.append(7)
    stores = decode(p, "t1", toks, prompt(BS, seed=16), BS - 4)
    generated = [s for step in stores for s in step]
    assert [(s.variant, s.block_ids) for s in generated] == [(T1, [2])]
    turn2 = toks + prompt(BS + 3, seed=17)
    assert generated[0].keys[0] == expected_keys(T1, turn2)[2:3]
    p.close()
    with kvtier.Client.connect(daemon.unix) as c:
        c.withdraw_prefix(GROUP, "system")


def test_a_group_the_daemon_refuses_keys_the_request_in_its_own_scope(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """A prefix listed for a group the tenant can no longer register (taken out of it since
    the list was fetched): the request is keyed, looked up and stored in its own scope."""
    d = tenants_daemon(daemon_factory, tmp_path)
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["pub"]) as c:
        c.publish_prefix(GROUP, "system", SHARED)
    cfg = tenant_cfg(d, tmp_path, "member", prefix_refresh_ms=60_000)
    p = planner(cfg)
    toks = SHARED + prompt(BS + 3, seed=18)
    step(p, "warm", prompt(BS + 1, seed=19), T2, [1, 2])  # the list fetched while a member
    (tmp_path / "tenants.toml").write_text(
        (tmp_path / "tenants.toml").read_text().replace('members = ["member"]', "members = []")
    )
    os.kill(d.proc.pid, signal.SIGHUP)
    wait_for("the member is out of the group", lambda: not any(x.group == GROUP for x in member_prefixes(d)))
    plan, hit = step(p, "own", toks, T2, [3, 4, 5])
    assert hit == 0 and [s.variant for s in plan.stores] == [T2]
    own = dataclasses.replace(IDENTITY.namespace(T2), tenant="member")
    assert plan.stores[0].keys[0] == own.block_keys(toks)  # every full block in its own scope
    p.close()


def member_prefixes(d: DaemonProcess) -> list[Any]:
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["member"]) as c:
        return c.published_prefixes()


def test_a_group_refused_at_the_lookup_keys_the_request_in_its_own_scope(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The group's namespace registered (a first request keyed in its scope), then the member
    taken out of the group: the next lookup of the group's blocks is refused (the namespace is
    no longer its to see), and the request is keyed, looked up and stored in its own scope, the
    group set aside, instead of failing every request that begins with the prefix."""
    d = tenants_daemon(daemon_factory, tmp_path)
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["pub"]) as c:
        c.publish_prefix(GROUP, "system", SHARED)
    p = planner(tenant_cfg(d, tmp_path, "member", prefix_refresh_ms=60_000))
    _, hit = step(p, "first", SHARED + prompt(BS + 3, seed=20), T2, [1, 2, 3])  # keyed in the group
    assert hit == 0 and p.stats.store_shared_skipped_blocks == 2
    (tmp_path / "tenants.toml").write_text(
        (tmp_path / "tenants.toml").read_text().replace('members = ["member"]', "members = []")
    )
    os.kill(d.proc.pid, signal.SIGHUP)
    wait_for("the member is out of the group", lambda: not any(x.group == GROUP for x in member_prefixes(d)))
    toks = SHARED + prompt(BS + 3, seed=21)
    plan, hit = step(p, "after", toks, T2, [4, 5, 6])
    assert hit == 0 and [s.variant for s in plan.stores] == [T2]
    own = dataclasses.replace(IDENTITY.namespace(T2), tenant="member")
    assert plan.stores[0].keys[0] == own.block_keys(toks)
    p.close()

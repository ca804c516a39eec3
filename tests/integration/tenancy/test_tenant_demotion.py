"""A tenant's blocks evicted to fit its ``host_bytes`` quota go down to NVMe (issue 39).

A daemon with tenants holds a tcp-only tenant to its share of the shared arena (``host_bytes``):
a store over that share evicts the tenant's own coldest blocks. Those go down to the NVMe tier
first, under the tenant's ``nvme_bytes``, as the global eviction of a single-tenant daemon's full
host tier does; with write-through a put never fails because the tenant's own blocks are still
being written down (the store waits for them, then evicts them: clean). Real daemons (one with a
tenants file, one without), a real client over tcp, an NVMe directory under tmp_path:

* after storing twice the host quota, every block is still a hit and the oldest ones are read
  back from NVMe, bytes equal (and reading them back evicts the newest only once written
  down), for the tenanted daemon as for the single-tenant one and for a tenant with an arena
  of its own (write-back and write-through);
* 30 write-through puts of 16 blocks into a 128-block quota all succeed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_namespace

import kvtier

TOKEN = "demote-t-1"
QUOTA_BLOCKS = 128  # host_bytes of the tenant (2 MiB of make_namespace's 16 KiB blocks)
PUT = 16  # blocks per put
PUTS = 2 * QUOTA_BLOCKS // PUT  # twice the quota
TCP_ONLY = 'transports = ["tcp"]\n[tenant.quotas]\nhost_bytes = "2MiB"\n'


def block(i: int, nbytes: int) -> bytes:
    return hashlib.shake_256(b"demote %d" % i).digest(nbytes)


def disk(tmp_path: Path, policy: str) -> tuple[str, ...]:
    return ("--disk-dir", str(tmp_path / "nvme"), "--disk-bytes", "16MiB", "--write-policy", policy)


def tenanted(daemon_factory: Any, tmp_path: Path, policy: str, *, arena: bool = False) -> DaemonProcess:
    """A daemon with one tenant held to 2 MiB of host slots: tcp-only, in a 16 MiB shared arena
    (its ``host_bytes``), or with an arena of its own of 2 MiB (``arena``: allowed shm too)."""
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    holds = 'transports = ["shm", "tcp"]\narena_bytes = "2MiB"\n' if arena else TCP_ONLY
    (tmp_path / "tenants.toml").write_text(f'[[tenant]]\nname = "t"\ntokens_sha256 = ["{digest}"]\n{holds}')
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tmp_path / "tenants.toml"}"\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "16MiB", "--slab-bytes", "1MiB", *disk(tmp_path, policy)
    )
    return d


def single(daemon_factory: Any, tmp_path: Path, policy: str) -> DaemonProcess:
    """A single-tenant daemon whose whole host tier is 2 MiB: the global eviction."""
    d: DaemonProcess = daemon_factory("--host-bytes", "2MiB", "--slab-bytes", "1MiB", *disk(tmp_path, policy))
    return d


def connect(d: DaemonProcess, token: str | None) -> kvtier.Client:
    return kvtier.Client.connect(d.unix, transport="tcp", token=token)


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
@pytest.mark.parametrize("kind", ["single", "tenanted", "arena"])
def test_blocks_evicted_to_fit_the_host_quota_are_read_back_from_nvme(
    daemon_factory: Any, tmp_path: Path, kind: str, policy: str
) -> None:
    if kind == "single":
        d = single(daemon_factory, tmp_path, policy)
    else:
        d = tenanted(daemon_factory, tmp_path, policy, arena=kind == "arena")
    with connect(d, None if kind == "single" else TOKEN) as client:
        ns = client.register(make_namespace(tenant=None if kind == "single" else "t"))
        keys = ns.block_keys(list(range(16 * PUT * PUTS)))
        data = [block(i, ns.block_bytes) for i in range(len(keys))]
        for i in range(0, len(keys), PUT):
            assert ns.put(keys[i : i + PUT], data[i : i + PUT]).stored == PUT
        seen = ns.lookup_detail(keys)
        assert seen.hits == len(keys), f"{len(keys) - seen.hits} evicted blocks were lost"
        oldest = keys[:QUOTA_BLOCKS]
        assert set(ns.lookup_detail(oldest).tiers) == {"nvme"}  # evicted, written down first
        got = ns.get(oldest)
        assert [bytes(g) if g is not None else None for g in got] == data[:QUOTA_BLOCKS]
        assert client.stats()["total"]["blocks_hit_nvme"] >= QUOTA_BLOCKS
        # the newest blocks made room for the promoted ones: written down first, not lost
        assert ns.lookup_detail(keys[QUOTA_BLOCKS:]).hits == len(keys) - QUOTA_BLOCKS


def test_thirty_write_through_puts_into_a_full_quota_all_succeed(daemon_factory: Any, tmp_path: Path) -> None:
    """Each put is the whole quota: it fits only by evicting the put before it, whose blocks
    write-through has just queued to be written down (refused at HEAD while they were)."""
    d = tenanted(daemon_factory, tmp_path, "write-through")
    with connect(d, TOKEN) as client:
        ns = client.register(make_namespace(tenant="t"))
        keys = ns.block_keys(list(range(16 * QUOTA_BLOCKS * 30)))
        data = [block(i, ns.block_bytes) for i in range(len(keys))]
        batches = range(0, len(keys), QUOTA_BLOCKS)
        stored = [ns.put(keys[i : i + QUOTA_BLOCKS], data[i : i + QUOTA_BLOCKS]).stored for i in batches]
        assert stored == [QUOTA_BLOCKS] * 30
        newer = keys[-3 * QUOTA_BLOCKS :]  # (the 16 MiB disk holds the newest 1,000 or so)
        assert ns.lookup_detail(newer).hits == len(newer)
        got = ns.get(newer[:QUOTA_BLOCKS])  # evicted by the last two puts: read from NVMe
        assert [bytes(g) if g is not None else None for g in got] == data[
            -3 * QUOTA_BLOCKS : -2 * QUOTA_BLOCKS
        ]

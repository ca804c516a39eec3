"""kvtierd.cache.admission: every count a tenant can exhaust, refused at the cache boundary and
leaving nothing changed. A host tier of 8 one-slot blocks; tenant ``t`` with tiny
quotas: 2 open jobs a session, 3 a tenant, 2 blocks pinned, 1 session, 1 namespace."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_contract.errors import ResourceExhausted
from kvtier_contract.identity import Namespace
from kvtierd.cache import TieredCache
from kvtierd.domain import Transport
from kvtierd.index import NamespaceState
from kvtierd.policies import make_policy
from kvtierd.sessions import Session, SessionTable
from kvtierd.tenancy import Tenancy
from kvtierd.tenants import Tenant, token_digest
from kvtierd.tenants_file import load_tenants
from kvtierd.tiers import Arena, HostTier

BLOCK = 4096
SHM = Transport.SHM  # (the client writes the slots itself: a job commits without a data channel)
QUOTAS = 'session_open_jobs = 2\nopen_jobs = 3\npinned_bytes = "8KiB"\nsessions = 1\nnamespaces = 1\n'


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in ids]


@dataclasses.dataclass
class Rig:
    cache: TieredCache
    sessions: SessionTable
    tenant: Tenant
    ns: NamespaceState

    def session(self) -> Session:
        return self.sessions.open("c", None, SHM, "t", None)

    def store(self, s: Session, *ids: int) -> int:
        """A store of ``ids`` prepared as PrepareStore does, for the caller ``t``: its job id."""
        job, _, _ = asyncio.run(self.cache.prepare_store(s, self.ns, keys(*ids), SHM, caller=self.tenant))
        assert job is not None
        return job.id


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[[tenant]]\nname = "t"\ntokens_sha256 = ["{token_digest("tok")}"]\n[tenant.quotas]\n{QUOTAS}'
    )
    tenancy = Tenancy(load_tenants(path))
    arena = Arena(8 * BLOCK, prefault=False)
    host = HostTier(arena, slab_bytes=BLOCK, slot_align_bytes=BLOCK)
    holder: list[TieredCache] = []
    sessions = SessionTable(
        max_sessions=8,
        default_ttl_s=10,
        min_ttl_s=1,
        max_ttl_s=10,
        on_release=lambda s: holder[0].release_session(s),
    )
    cache = TieredCache(
        host, make_policy("lru", ghost_capacity=8), max_namespaces=4, tenancy=tenancy, sessions=sessions
    )
    holder.append(cache)
    spec = Namespace(
        model_id="m",
        model_revision="r",
        tokenizer_digest="none",
        kv_dtype="float16",
        layout="contiguous",
        tokens_per_block=8,
        num_layers=1,
        num_kv_heads=1,
        head_dim=BLOCK // 32,
        tenant="t",
    )
    who = tenancy.tenant("t")
    assert who is not None
    yield Rig(cache, sessions, who, cache.register_namespace(spec))
    arena.close()


def test_open_jobs_are_counted_per_session_then_per_tenant(rig: Rig) -> None:
    s = rig.session()
    rig.store(s, 1)
    rig.store(s, 2)
    with pytest.raises(ResourceExhausted) as err:  # a third job of this session
        rig.store(s, 3)
    assert err.value.quota == "session_open_jobs"
    assert rig.cache.writing_blocks == 2 and keys(3)[0] not in rig.ns.entries  # nothing reserved
    rig.sessions.close(s.id)  # its jobs aborted: nothing open any more
    assert rig.cache.writing_blocks == 0


def test_a_pin_over_the_quota_is_released_at_once(rig: Rig) -> None:
    s = rig.session()
    for i in (1, 2, 3):
        assert rig.cache.complete_store(s, rig.store(s, i), ok=True) == (1, 0)
    loaded, _ = asyncio.run(rig.cache.prepare_load(s, rig.ns, keys(1, 2, 3), SHM, caller=rig.tenant))
    assert loaded is not None and rig.cache.pinned_blocks == 3  # 3 blocks: 12 KiB > 8 KiB
    with pytest.raises(ResourceExhausted) as err:
        rig.cache.admit_pins(rig.tenant, s, loaded)
    assert err.value.quota == "pinned_bytes"
    assert rig.cache.pinned_blocks == 0 and not s.load_jobs  # nothing stays pinned


def test_sessions_and_namespaces_are_counted_before_one_is_added(rig: Rig) -> None:
    admission = rig.cache.admission
    admission.admit_session(rig.tenant)  # none open yet
    rig.session()
    with pytest.raises(ResourceExhausted) as err:
        admission.admit_session(rig.tenant)
    assert err.value.quota == "sessions"
    admission.admit_namespace(rig.tenant, rig.ns.id, "t")  # registered already: not one more
    with pytest.raises(ResourceExhausted) as err:
        admission.admit_namespace(rig.tenant, rig.ns.id + 1, "t")
    assert err.value.quota == "namespaces"
    admission.admit_session(None)  # a single-tenant daemon's owner is never refused
    admission.admit_namespace(None, rig.ns.id + 1, None)


def test_nvme_claims_count_until_their_write_ends(rig: Rig) -> None:
    admission = rig.cache.admission
    assert admission.nvme_used(0, "t", "nvme_resident_bytes") == 0
    admission.claim_nvme(0, "t", BLOCK)
    admission.claim_nvme(0, None, BLOCK)  # (no tenant: nothing to count)
    assert admission.nvme_used(0, "t", "nvme_resident_bytes") == BLOCK
    admission.unclaim_nvme(0, "t", BLOCK)
    assert admission.nvme_used(0, "t", "nvme_resident_bytes") == 0

"""kvtierd.cache.admission: a tenant's control channels and the bytes they hold, counted in the
admission (issue 40). Tenant ``t`` may hold 2 channels and one whole control frame of bytes;
each refusal changes nothing and is counted under its quota's name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier_contract import wire
from kvtier_contract.errors import ResourceExhausted
from kvtierd.cache.admission import Admission
from kvtierd.cache.jobs import JobTable
from kvtierd.tenancy import Tenancy
from kvtierd.tenants import token_digest
from kvtierd.tenants_file import MIN_BUFFERED_BYTES, load_tenants

FRAME = MIN_BUFFERED_BYTES  # one whole 4 MiB frame and its head: t's buffered_bytes


@pytest.fixture
def admission(tmp_path: Path) -> Admission:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[[tenant]]\nname = "t"\ntokens_sha256 = ["{token_digest("tok")}"]\n'
        f"[tenant.quotas]\ncontrol_channels = 2\nbuffered_bytes = {FRAME}\n"
    )
    return Admission(Tenancy(load_tenants(path)), {}, JobTable())


def test_the_channel_past_the_quota_is_refused_and_counted(admission: Admission) -> None:
    admission.admit_channel("t")
    admission.admit_channel("t")  # 2 of 2
    with pytest.raises(ResourceExhausted) as refused:
        admission.admit_channel("t")
    assert refused.value.quota == "control_channels"
    assert admission.held_channels("t") == 2  # nothing changed
    assert admission.tenancy.refusals("t", "control_channels") == 1
    admission.release_channel("t")  # 1 of 2: one more fits again
    admission.admit_channel("t")
    assert admission.held_channels("t") == 2


def test_buffered_bytes_past_the_quota_are_refused_and_all_come_back(admission: Admission) -> None:
    admission.take_buffered("t", wire.CALL.size)  # a frame's head
    admission.take_buffered("t", FRAME - wire.CALL.size)  # its body: exactly the quota
    with pytest.raises(ResourceExhausted) as refused:
        admission.take_buffered("t", 1)
    assert refused.value.quota == "buffered_bytes"
    assert admission.tenancy.refusals("t", "buffered_bytes") == 1
    admission.hold_unread("t", 100)  # a reply left unread: counted past the quota, not refused
    assert admission.held_buffered("t") == FRAME + 100
    admission.give_buffered("t", FRAME)  # the call was served
    admission.give_buffered("t", 100)  # the peer read its reply
    assert admission.held_buffered("t") == 0


def test_the_owner_is_held_to_the_default_buffered_bytes_only() -> None:
    admission = Admission(Tenancy(None), {}, JobTable())  # single-tenant: the owner is None
    for _ in range(100):
        admission.admit_channel(None)  # no control_channels quota
    limit = admission.tenancy.quota(None, "buffered_bytes")
    assert limit is not None
    admission.take_buffered(None, limit)
    with pytest.raises(ResourceExhausted):
        admission.take_buffered(None, 1)
    assert admission.held_channels(None) == 100 and admission.held_buffered(None) == limit

"""The core's domain enums agree with the wire enums by value (the service converts by value)."""

from __future__ import annotations

import enum

import pytest

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.domain import StoreStatus, TierId, Transport


@pytest.mark.parametrize(
    ("domain", "wire", "prefix"),
    [
        (TierId, pb.Tier, "TIER_"),
        (StoreStatus, pb.StoreStatus, "STORE_"),
        (Transport, pb.Transport, "TRANSPORT_"),
    ],
)
def test_every_domain_value_is_the_wire_value_of_the_same_name(
    domain: type[enum.IntEnum], wire: object, prefix: str
) -> None:
    for member in domain:
        assert wire.Value(prefix + member.name) == member.value  # type: ignore[attr-defined]


def test_every_wire_value_but_unspecified_has_a_domain_value() -> None:
    assert {v for k, v in pb.Transport.items() if k != "TRANSPORT_UNSPECIFIED"} == set(Transport)
    assert {v for k, v in pb.StoreStatus.items() if k != "STORE_STATUS_UNSPECIFIED"} == set(StoreStatus)
    assert {v for _, v in pb.Tier.items()} == set(TierId)


def test_transport_labels_name_the_counters() -> None:
    assert [t.label for t in Transport] == ["shm", "tcp", "cuda_ipc"]
    assert [t.daemon_moved for t in Transport] == [False, True, True]

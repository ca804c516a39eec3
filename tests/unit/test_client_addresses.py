"""Address handling of the client: gRPC targets and where the data channel is reached."""

from __future__ import annotations

import os

from kvtier.addresses import address_target, grpc_host


def test_unix_addresses_become_absolute_grpc_targets() -> None:
    assert address_target("unix:///run/kvtier.sock") == "unix:///run/kvtier.sock"
    assert address_target("unix:run/kvtier.sock") == "unix://" + os.path.abspath("run/kvtier.sock")
    assert address_target("10.0.0.5:50051") == "10.0.0.5:50051"


def test_a_wildcard_data_host_is_replaced_by_the_host_that_answered_grpc() -> None:
    assert grpc_host("kvtier.node.local:50051") == "kvtier.node.local"
    assert grpc_host("[fd00::1]:50051") == "fd00::1"
    assert grpc_host("unix:///run/kvtier.sock") == "127.0.0.1"

"""Address handling of the client: gRPC targets and where the data channel is reached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.addresses import address_target, grpc_host
from kvtier_contract import defaults
from kvtier_contract.errors import InvalidArgument
from kvtierd.config import DaemonConfig


def test_unix_addresses_become_absolute_grpc_targets() -> None:
    assert address_target("unix:///run/kvtier.sock") == "unix:///run/kvtier.sock"
    assert address_target("unix:run/kvtier.sock") == "unix://" + os.path.abspath("run/kvtier.sock")
    assert address_target("10.0.0.5:50051") == "10.0.0.5:50051"


def test_a_wildcard_data_host_is_replaced_by_the_host_that_answered_grpc() -> None:
    assert grpc_host("kvtier.node.local:50051") == "kvtier.node.local"
    assert grpc_host("[fd00::1]:50051") == "fd00::1"
    assert grpc_host("unix:///run/kvtier.sock") == "127.0.0.1"


def test_a_relative_unix_address_with_two_slashes_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as exc:
        address_target("unix://run/kvtier.sock")  # gRPC would read "run" as an authority
    assert exc.value.field == "address"


def test_the_default_address_reaches_the_default_daemon(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert defaults.default_address() == "unix:run/kvtier.sock"  # where `make serve` puts it
    assert address_target(defaults.default_address()) == f"unix://{tmp_path}/run/kvtier.sock"
    assert DaemonConfig().socket_path == defaults.SOCKET_PATH
    assert DaemonConfig().listen == defaults.LISTEN == ""  # no TCP: the local default is private

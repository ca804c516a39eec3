"""Address handling of the client: gRPC targets and where the data channel is reached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.addresses import address_target, grpc_host, tcp_endpoint
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


def test_the_default_address_reaches_the_default_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert defaults.default_address() == "unix:run/kvtier.sock"  # where `make serve` puts it
    assert address_target(defaults.default_address()) == f"unix://{tmp_path}/run/kvtier.sock"
    assert DaemonConfig().grpc.socket_path == defaults.SOCKET_PATH
    assert DaemonConfig().grpc.listen == defaults.LISTEN == ""  # no TCP: the local default is private


def test_a_bare_socket_path_is_that_unix_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # gRPC would resolve these as host names, never connecting
    assert address_target("/run/kvtier.sock") == "unix:///run/kvtier.sock"
    assert address_target("run/kvtier.sock") == f"unix://{tmp_path}/run/kvtier.sock"
    assert address_target("./kvtier.sock") == f"unix://{tmp_path}/kvtier.sock"


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("localhost", "no port: write localhost:PORT"),  # gRPC would dial 443
        ("kvtier.sock", "write unix:kvtier.sock"),
        ("127.0.0.1:99999", "port '99999' is not a number in 1..65535"),  # gRPC: 34463
        ("127.0.0.1:0", "1..65535"),
        ("127.0.0.1:http", "1..65535"),
        (":50051", "no host before the port: write 127.0.0.1:50051"),
        ("", "empty; expected unix:///"),
        ("   ", "empty"),
        ("host :50051", "white space"),
        ("::1:50051", "[::1]:50051"),
        ("[::1]", "[::1]:port"),
        ("[::1]:70000", "1..65535"),
        ("http://localhost:50051", "http:// is not an address scheme here; write host:port"),
        ("https://kvtier:443", "not https://"),
        ("unix://", "unix:///absolute/path"),
        ("unix:", "no socket path"),
    ],
)
def test_a_malformed_address_is_refused_naming_the_fix(address: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        address_target(address)
    assert exc.value.field == "address" and words in str(exc.value), str(exc.value)


def test_well_formed_addresses_pass_unchanged() -> None:
    for address in (
        "localhost:50051",
        "[fd00::1]:50051",
        "kvtier.node.local:1",
        "h:65535",
        "dns:///kvtier:50051",
        "ipv4:127.0.0.1:50051",
    ):
        assert address_target(address) == address


def test_only_a_host_port_target_names_one_endpoint_to_probe() -> None:
    assert tcp_endpoint("kvtier.example:50051") == ("kvtier.example", 50051)
    assert tcp_endpoint("[fd00::1]:50051") == ("fd00::1", 50051)
    for target in (
        "unix:///run/kvtier.sock",
        "dns:///kvtier:50051",
        "ipv4:10.0.0.1:1,10.0.0.2:1",
        "ipv6:[::1]:1",
        "unix-abstract:kvtier",
    ):
        assert tcp_endpoint(target) is None, target

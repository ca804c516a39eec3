"""kvtierd.app.start_warnings: the start warns about settings that let more users in than the
owner-only default, or that do less than they seem (issue 39's new user's walk)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtierd.app.start_warnings import start_warnings
from kvtierd.config import DaemonConfig

TLS = {"tls_cert": "/pki/s.crt", "tls_key": "/pki/s.key"}


def warned(**values: Any) -> str:
    return "\n".join(start_warnings(DaemonConfig.from_flat(**values)))


def test_the_embedded_default_warns_of_nothing() -> None:
    assert start_warnings(DaemonConfig()) == []
    assert warned(socket_mode=0o660) == ""  # the daemon's group: the Kubernetes manifests


def test_a_socket_mode_for_every_local_user_without_tenants_is_warned() -> None:
    text = warned(socket_mode=0o666)
    assert text.startswith("socket_mode 0666 (--socket-mode) lets every local user connect"), text
    assert "0600" in text and "0660" in text and "--tenants-file" in text
    assert warned(socket_mode=0o666, tenants_file="/t.toml") == ""  # each needs a credential


def test_a_loopback_listener_without_tenants_is_warned() -> None:
    text = warned(listen="127.0.0.1:50051")
    assert text.startswith("listen 127.0.0.1:50051 (--listen) lets every local user"), text
    assert "--listen ''" in text and "--tenants-file" in text
    assert warned(listen="127.0.0.1:50051", tenants_file="/t.toml") == ""


def test_grpc_off_loopback_with_the_data_channel_on_loopback_is_warned() -> None:
    text = warned(listen="0.0.0.0:50051", tenants_file="/t.toml", **TLS)  # data_listen 127.0.0.1:0
    assert text.startswith(
        "listen 0.0.0.0:50051 (--listen) reaches other hosts but the tcp data channel, "
        "data_listen 127.0.0.1:0 (--data-listen), only this one: remote clients cannot use the tcp"
    ), text
    assert "set --data-listen 0.0.0.0:PORT too" in text
    assert warned(listen="0.0.0.0:50051", data_listen="0.0.0.0:50053", tenants_file="/t.toml", **TLS) == ""
    assert warned(listen="0.0.0.0:50051", data_listen="", tenants_file="/t.toml", **TLS) == ""


@pytest.mark.parametrize(
    ("data_listen", "says"),
    [("127.0.0.1:0", "it serves only the tcp data channel (data_listen 127.0.0.1:0)"), ("", "it is unused")],
)
def test_a_certificate_without_a_tcp_grpc_listener_is_warned(data_listen: str, says: str) -> None:
    text = warned(data_listen=data_listen, **TLS)
    assert text.startswith("tls_cert /pki/s.crt (--tls-cert) is set but there is no TCP gRPC listener"), text
    assert says in text and "add --listen HOST:PORT" in text


def test_a_host_tier_rounded_down_to_whole_slabs_is_warned() -> None:
    """``--host-bytes 1gb`` is 10^9 bytes: 14 slabs of 64 MiB, 896 MiB. Said at start."""
    from kvtier_contract.units import parse_bytes

    text = warned(host_bytes=parse_bytes("1gb"))
    assert text.startswith(
        "host_bytes 1000000000 (--host-bytes) is not a whole number of 64.0 MiB slabs: "
        "the host tier holds 896.0 MiB, rounded down"
    ), text
    assert "1GB = 10^9 bytes" in text and "1GiB = 2^30" in text
    assert warned(host_bytes=parse_bytes("1GiB")) == ""

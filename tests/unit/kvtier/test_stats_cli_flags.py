"""`kvtier stats` names its own flags where the SDK's errors name keyword arguments, and its
table shows only the figures the reply has (a tenant's reply has no eviction policy)."""

from __future__ import annotations

import pytest

from kvtier.cli import as_flags, format_stats


@pytest.mark.parametrize(
    "sdk, cli",
    [
        (
            "this client gave no credential: pass token= or token_file= of a tenant",
            "this client gave no credential: pass --token-file of a tenant",
        ),
        ("it was revoked; check token=/token_file= (docs)", "it was revoked; check --token-file (docs)"),
        (
            "pass tls_ca= the CA; drop tls_ca=/tls_cert= there",
            "pass --tls-ca the CA; drop --tls-ca/--tls-cert there",
        ),
        ("no answer within 2 s (timeout_s=)", "no answer within 2 s (--timeout-s)"),
        ("model_revision: 'main' is a moving ref", "model_revision: 'main' is a moving ref"),
        (  # issue 39: was "--unix-loginTrue"
            "pass token= or token_file= of a tenant, unix_login=True on its Unix socket, or a",
            "pass --token-file of a tenant, --unix-login on its Unix socket, or a",
        ),
    ],
)
def test_sdk_argument_names_become_flags(sdk: str, cli: str) -> None:
    assert as_flags(sdk) == cli


def reply(**fields: object) -> dict[str, object]:
    """A Stats reply as ``Client.stats`` returns it (a tenant's: no policy, pins or writes)."""
    base: dict[str, object] = dict(
        boot_epoch=7,
        uptime_s=12.0,
        sessions=1,
        host_used_bytes=1 << 20,
        host_capacity_bytes=64 << 20,
        total={},
        namespaces=[],
    )
    return {**base, **fields}


def test_a_tenants_table_has_no_blank_policy() -> None:
    head = format_stats(reply()).splitlines()[:2]
    assert "policy" not in head[0] and not head[0].endswith(" "), head  # was "policy  sessions 1"
    assert head[0] == "kvtierd  boot epoch 7  up 12s  sessions 1"
    assert (
        head[1]
        == "host tier 1.0 MiB / 64.0 MiB used (1.6%) (this tenant's blocks, of the arena they live in)"
    )


def test_the_operators_table_has_the_policy_pins_and_writes() -> None:
    head = format_stats(reply(eviction_policy="arc", pinned_blocks=3, writing_blocks=2)).splitlines()[:2]
    assert head[0] == "kvtierd  boot epoch 7  up 12s  policy arc  sessions 1"
    assert head[1] == "host tier 1.0 MiB / 64.0 MiB used (1.6%), 3 pinned, 2 writing"

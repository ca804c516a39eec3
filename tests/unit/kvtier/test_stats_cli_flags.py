"""`kvtier stats` names its own flags where the SDK's errors name keyword arguments."""

from __future__ import annotations

import pytest

from kvtier.cli import as_flags


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
    ],
)
def test_sdk_argument_names_become_flags(sdk: str, cli: str) -> None:
    assert as_flags(sdk) == cli

"""/metrics off loopback (kvtierd.config.checks, kvtierd.tenancy.exposure): plaintext HTTP,
so a non-loopback metrics_host is an explicit choice (metrics_plaintext_remote or the broad
allow_plaintext_remote), tenants or not. With tenants its bearer tokens travel in the clear, so
metrics_plaintext_remote also needs scrape-only tokens in the tenants file (then only they are
taken there); allow_plaintext_remote takes every token."""

from __future__ import annotations

import pytest

from kvtierd.config import DaemonConfig, validate
from kvtierd.tenancy.exposure import check_metrics_exposure, metrics_scrape_only


@pytest.mark.parametrize("tenants_file", ["t.toml", ""])
@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_off_loopback_metrics_without_an_explicit_flag_is_refused(tenants_file: str, host: str) -> None:
    with pytest.raises(ValueError) as e:
        validate(DaemonConfig.from_flat(tenants_file=tenants_file, metrics_host=host))
    msg = str(e.value)
    assert msg.startswith(f"metrics_host: {host} is not a loopback address"), msg
    for fix in (
        "metrics_plaintext_remote = true",
        "--allow-plaintext-metrics",
        "allow_plaintext_remote = true",
        "--allow-plaintext-remote",
        "127.0.0.1",
    ):
        assert fix in msg, (fix, msg)


@pytest.mark.parametrize(
    "overrides",
    [
        {"metrics_host": "0.0.0.0", "metrics_plaintext_remote": True},
        {"metrics_host": "0.0.0.0", "allow_plaintext_remote": True},
        {"tenants_file": "t.toml", "metrics_host": "0.0.0.0", "metrics_plaintext_remote": True},
        {"metrics_host": "0.0.0.0", "metrics_port": -1},  # no /metrics
        {"metrics_host": "127.0.0.1"},
        {"metrics_host": "localhost"},
    ],
)
def test_off_loopback_metrics_with_a_flag_or_on_loopback_is_valid(overrides: dict[str, object]) -> None:
    validate(DaemonConfig.from_flat(**overrides))  # type: ignore[arg-type]


def test_off_loopback_without_a_scrape_token_is_refused_naming_the_field() -> None:
    cfg = DaemonConfig.from_flat(tenants_file="t.toml", metrics_host="0.0.0.0", metrics_plaintext_remote=True)
    validate(cfg)  # reads no file: the scrape-token check comes once the tenants file is read
    with pytest.raises(ValueError) as e:
        check_metrics_exposure(cfg, 0)
    assert str(e.value).startswith("metrics_host: 0.0.0.0 is not a loopback address")
    for fix in ("metrics_tokens_sha256", "--allow-plaintext-metrics", "--allow-plaintext-remote"):
        assert fix in str(e.value), fix
    check_metrics_exposure(cfg, 1)  # a scrape token: allowed, and then it alone is taken
    assert metrics_scrape_only(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tenants_file": "t.toml", "metrics_host": "0.0.0.0", "allow_plaintext_remote": True},
        {"tenants_file": "t.toml", "metrics_host": "127.0.0.1"},
        {"tenants_file": "t.toml", "metrics_host": "::1"},
        {"tenants_file": "t.toml", "metrics_host": "0.0.0.0", "metrics_port": -1},  # no /metrics
        {"metrics_host": "0.0.0.0", "metrics_plaintext_remote": True},  # no tenants: no token asked
    ],
)
def test_every_token_is_taken_where_none_travels_off_the_host_in_the_clear(
    overrides: dict[str, object],
) -> None:
    cfg = DaemonConfig.from_flat(**overrides)  # type: ignore[arg-type]
    check_metrics_exposure(cfg, 0)
    assert not metrics_scrape_only(cfg)

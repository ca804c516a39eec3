"""/metrics of a daemon with tenants off loopback (kvtierd.tenancy.exposure): plaintext
HTTP carries its bearer tokens in the clear, so it is allowed only with scrape-only tokens in the
tenants file (then only they are taken there) or with allow_plaintext_remote."""

from __future__ import annotations

import pytest

from kvtierd.config import DaemonConfig
from kvtierd.tenancy.exposure import check_metrics_exposure, metrics_scrape_only


def test_off_loopback_without_a_scrape_token_is_refused_naming_the_field() -> None:
    cfg = DaemonConfig(tenants_file="t.toml", metrics_host="0.0.0.0")  # validate() sees no file
    with pytest.raises(ValueError) as e:
        check_metrics_exposure(cfg, 0)
    assert str(e.value).startswith("metrics_host: 0.0.0.0 is not a loopback address")
    assert "metrics_tokens_sha256" in str(e.value) and "--allow-plaintext-remote" in str(e.value)
    check_metrics_exposure(cfg, 1)  # a scrape token: allowed, and then it alone is taken
    assert metrics_scrape_only(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tenants_file": "t.toml", "metrics_host": "0.0.0.0", "allow_plaintext_remote": True},
        {"tenants_file": "t.toml", "metrics_host": "127.0.0.1"},
        {"tenants_file": "t.toml", "metrics_host": "::1"},
        {"tenants_file": "t.toml", "metrics_host": "0.0.0.0", "metrics_port": -1},  # no /metrics
        {"metrics_host": "0.0.0.0"},  # no tenants: no token asked
    ],
)
def test_every_token_is_taken_where_none_travels_off_the_host_in_the_clear(
    overrides: dict[str, object],
) -> None:
    cfg = DaemonConfig(**overrides)  # type: ignore[arg-type]
    check_metrics_exposure(cfg, 0)
    assert not metrics_scrape_only(cfg)

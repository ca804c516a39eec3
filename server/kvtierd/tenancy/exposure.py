"""Who /metrics may ask for a token off loopback: the rule for a daemon with tenants whose
/metrics (plaintext HTTP) binds a non-loopback ``metrics_host``.

A bearer token sent to such a /metrics crosses the network in the clear. A scrape-only token
(the tenants file's ``metrics_tokens_sha256``: kvtierd.tenants) acts on nothing, so what a
leaked one gives away is the figures it reads; a tenant's or the operator's token can act on
sessions. Hence:

* a non-loopback ``metrics_host`` is an explicit choice whether or not there are tenants:
  ``metrics_plaintext_remote`` (--allow-plaintext-metrics) or ``allow_plaintext_remote``;
  without either it is refused at start (``validate(cfg)``, kvtierd.config);
* with ``metrics_plaintext_remote`` alone, /metrics off loopback takes scrape tokens only
  (``metrics_scrape_only``), and the daemon starts only when its file has one
  (``check_metrics_exposure``; after a reload without any, every scrape gets 401);
* ``allow_plaintext_remote`` takes every token there, as it lets plaintext gRPC off the host:
  the broad choice, warned at every start.

``validate(cfg)`` reads no file, so the scrape-token check runs once the tenants file is read
(kvtierd.cli before start, kvtierd.app.Daemon for embedders). Pure functions of the config.
"""

from __future__ import annotations

from kvtierd.config import DaemonConfig, is_loopback


def metrics_scrape_only(cfg: DaemonConfig) -> bool:
    """Whether /metrics takes scrape-only tokens alone: a daemon with tenants serving it off
    loopback without ``allow_plaintext_remote`` (a tenant's or the operator's token: 401)."""
    return (
        bool(cfg.tenancy.tenants_file)
        and cfg.metrics.metrics_port >= 0
        and not cfg.grpc.allow_plaintext_remote
        and not is_loopback(f"{cfg.metrics.metrics_host}:{cfg.metrics.metrics_port}")
    )


def check_metrics_exposure(cfg: DaemonConfig, metrics_tokens: int) -> None:
    """ValueError naming metrics_host when /metrics would be off loopback, scrape-only, with no
    scrape token in the tenants file (``metrics_tokens``: how many it lists)."""
    if metrics_tokens == 0 and metrics_scrape_only(cfg):
        raise ValueError(
            f"metrics_host: {cfg.metrics.metrics_host} is not a loopback address: with tenants, /metrics "
            "takes bearer tokens, which plaintext HTTP carries in the clear, and "
            "metrics_plaintext_remote (--allow-plaintext-metrics) accepts only scrape tokens "
            "there: add one to the tenants file (metrics_tokens_sha256), bind it to loopback, or "
            "set allow_plaintext_remote = true (--allow-plaintext-remote: every token, in the "
            "clear)"
        )

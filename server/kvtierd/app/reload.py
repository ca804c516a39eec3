"""SIGHUP: ``reload_tenants`` reads the tenants file again and applies it (new tenants' arenas,
the tenancy's tenants and quotas, revoked sessions closed, leases clamped); a bad file keeps the
current tenants.

Runs on the event loop (the signal handler of :mod:`kvtierd.app.process`), over parts the
:class:`~kvtierd.app.daemon.Daemon` owns and hands it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtierd.tenancy.exposure import metrics_scrape_only
from kvtierd.tenants_file import load_tenants

if TYPE_CHECKING:
    from kvtierd.app.build import TenantArenas
    from kvtierd.config import DaemonConfig
    from kvtierd.sessions import SessionTable
    from kvtierd.tenancy import Tenancy
    from kvtierd.transports.cuda_ipc import CudaIpcTransport

log = logging.getLogger("kvtierd")


def reload_tenants(
    cfg: DaemonConfig,
    tenancy: Tenancy,
    tenant_arenas: TenantArenas,
    sessions: SessionTable,
    cuda: CudaIpcTransport | None,
) -> None:
    """Read the tenants file again (none configured: nothing) and apply it; a bad file keeps
    the current tenants (logged)."""
    if not cfg.tenancy.tenants_file:
        return
    try:
        tenants = load_tenants(cfg.tenancy.tenants_file)
    except ValueError as e:
        log.error("tenants file not reloaded (the current one stays): %s", e)
        return
    tenant_arenas.add(tenants, cuda.copier if cuda is not None else None)
    tenancy.reload(tenants)
    if metrics_scrape_only(cfg) and not tenants.metrics_digests:
        log.warning(
            "the tenants file has no metrics_tokens_sha256 now: every scrape of "
            "/metrics (plaintext, off loopback) is refused until it has one again"
        )
    revoked = tenancy.revoked(sessions.all())
    for s in revoked:  # (their channels and data connections close with them)
        try:
            sessions.close(s.id)
        except Exception:  # (a bug; the other revocations still happen)
            log.exception("closing revoked session %d failed", s.id)
    for s in sessions.all():
        who = tenancy.tenant(s.tenant)
        if who is not None and who.max_lease_s is not None:
            sessions.clamp(s, who.max_lease_s)
    (log.warning if revoked else log.info)(
        "tenants file reloaded: %d tenants; %d sessions closed (their tenant or credential "
        "is no longer in the file)",
        len(tenants),
        len(revoked),
    )

"""Composition root and lifecycle of kvtierd.

``Daemon(cfg)`` (:mod:`~kvtierd.app.daemon`) builds every component (arena, host tier, policy,
cache, sessions, service, transports, metrics); ``run(cfg)`` (:mod:`~kvtierd.app.process`)
drives the lifecycle:

    checks (the Unix socket paths' length and the sockets' lock; kvtierd.preflight: memory,
            NVMe directory, ports; then, in
            Daemon(), the tenants file, the cluster tier's files, the NVMe directory's lock
            and the tier's open, a tier that opens degraded refused unless disk_optional):
            a refusal is one StartupError line, exit 2, before the host arena is reserved
            (and prefaulted) and before any socket is bound; the arena comes next, then the
            NVMe tier's recovered copies are put into the index   (kvtierd.app.build);
            then the start's warnings are logged               (kvtierd.app.start_warnings).
            A SIGINT/SIGTERM meanwhile is noted: the start stops once built, nothing bound.
      -> startup (bind everything, health SERVING, print the ready line)
                                                                 (kvtierd.app.listeners)
      -> serve (lease sweeper runs)
      -> drain on SIGTERM/SIGINT (health NOT_SERVING, stores refused, in-flight jobs get
         ``drain_timeout_s`` to finish) -> shutdown.   A second signal exits at once.
                                                                 (kvtierd.app.drain)

The ready line is ``KVTIERD_READY {json}`` on stdout with the bound addresses (ports chosen by the
OS when configured as 0) and every tier's state (``tiers``), so supervisors and tests need not
guess.
"""

from kvtierd.app.build import cluster_settings
from kvtierd.app.daemon import SERVICE_NAME, Daemon
from kvtierd.app.housekeeping import NVME_HEALTH_NAME
from kvtierd.app.process import describe_tiers, run, serve_daemon

__all__ = [
    "NVME_HEALTH_NAME",
    "SERVICE_NAME",
    "Daemon",
    "serve_daemon",
    "cluster_settings",
    "describe_tiers",
    "run",
]

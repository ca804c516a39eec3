"""The daemon as a process: ``run(cfg)`` takes the sockets' lock, runs the startup checks,
builds the :class:`~kvtierd.app.daemon.Daemon`, starts it, prints the ready line, waits for a
signal (a second one exits at once; SIGHUP reloads the tenants file), drains and stops. A
signal while the daemon is being built stops it before anything is bound; one before the event
loop runs (Ctrl-C during the imports) is one line, no traceback.

One event loop (uvloop when available) owns the daemon; the signal handlers run on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from kvtier_contract.units import format_bytes
from kvtierd import preflight
from kvtierd.app.daemon import Daemon
from kvtierd.app.listeners import lock_sockets
from kvtierd.app.start_warnings import start_warnings
from kvtierd.config import DaemonConfig
from kvtierd.lockfile import InUse
from kvtierd.preflight import StartupError
from kvtierd.transports.cuda_driver import CudaUnavailable

log = logging.getLogger("kvtierd")


async def serve_daemon(cfg: DaemonConfig) -> None:
    """The daemon process's life on its event loop: build, start, serve until a signal, drain
    (a signal while it is built stops it before anything is bound)."""
    with _EarlySignals() as early:  # SIGINT/SIGTERM while the daemon is built: noted
        daemon = _checked_daemon(cfg)
    if early.received:  # nothing bound yet: the tiers closed, nothing left behind
        await daemon.abort_start()
        log.info("kvtierd stopped before it was ready (signal %d during start)", early.received)
        return
    _handle_signals(daemon)
    try:
        await daemon.start()
    except (StartupError, ValueError) as e:  # a port taken since the preflight, a TLS file
        await daemon.abort_start()  # no socket left behind, the NVMe tier closed
        raise e if isinstance(e, StartupError) else StartupError(f"{e}") from None
    except BaseException:  # cancelled (asyncio.run's own SIGINT handler, in its first instant)
        await daemon.abort_start()
        raise
    tiers = daemon.tiers()
    ready = {
        "boot_epoch": daemon.boot_epoch,
        "pid": os.getpid(),
        **daemon.addresses,
        "host_bytes": daemon.host.capacity_bytes,
        "eviction_policy": cfg.host_tier.eviction_policy,
        "cuda_ipc": daemon.cuda is not None,
        "tenants": len(daemon.tenancy.tenants) if daemon.tenancy.tenants else 0,
        "tiers": tiers,
    }
    print("KVTIERD_READY " + json.dumps(ready), flush=True)
    log.info(
        "kvtierd ready: %s; %s",
        describe_tiers(tiers),
        ", ".join(f"{k} {v}" for k, v in daemon.addresses.items()),
    )
    await daemon.wait_stopped()
    await daemon.drain_and_stop()
    log.info("kvtierd stopped")


def _checked_daemon(cfg: DaemonConfig) -> Daemon:
    """The sockets' lock first of all (a second daemon exits before any work), then every
    check before the arena is reserved or a socket bound, then the daemon."""
    socket_lock = lock_sockets(cfg)
    try:
        for warning in preflight.check(cfg):
            log.warning("%s", warning)
        daemon = Daemon(cfg)
    except ValueError as e:  # a file read at start that the CLI found valid (changed since)
        raise StartupError(f"{e}") from None
    daemon._socket_lock = socket_lock
    for warning in start_warnings(cfg):  # (a start refused above says only why)
        log.warning("%s", warning)
    return daemon


class _EarlySignals:
    """SIGINT and SIGTERM while the daemon is being built (synchronous work: the checks, the
    NVMe recovery, the arena's prefault), before the event loop's handlers are installed: the
    first is noted (the start then stops before anything is bound), a second exits at once.
    Main thread only; the handlers before it are put back on exit."""

    def __init__(self) -> None:
        self.received = 0
        self._before: dict[int, Any] = {}

    def __enter__(self) -> _EarlySignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._before[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _note(self, sig: int, frame: object) -> None:
        if self.received:
            os._exit(1)  # the second signal: no waiting for the build to finish
        self.received = sig


def _handle_signals(daemon: Daemon) -> None:
    """SIGTERM/SIGINT drain (a second one exits at once); SIGHUP reloads the tenants file."""
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        daemon.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_tenants)


def run(cfg: DaemonConfig) -> None:
    """Run the daemon until SIGTERM/SIGINT (blocking). Uses uvloop when available."""
    logging.basicConfig(
        level=os.environ.get("KVTIER_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve_daemon(cfg))
        else:
            uvloop.run(serve_daemon(cfg))
    except CudaUnavailable as e:
        print(f"kvtierd: {e}", file=sys.stderr)
        sys.exit(2)
    except InUse as e:  # one line, no traceback: which lock, whose
        print(f"kvtierd: {e}", file=sys.stderr)
        sys.exit(1)
    except StartupError as e:  # a startup check (kvtierd.preflight): setting, flag and fix
        print(f"kvtierd serve: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # SIGINT before serve_daemon's handlers: nothing bound, or undone
        print("kvtierd: interrupted while starting", file=sys.stderr)
        sys.exit(130)


def describe_tiers(tiers: dict[str, Any]) -> str:
    """The ready log line's tiers: ``host 1.0 GiB (lru); nvme /d serving, 12 blocks; ...``."""
    host = tiers["host"]
    parts = [
        f"host {format_bytes(host['bytes'])} ({host['eviction_policy']}"
        + (f", {host['tenant_arenas']} tenant arena(s))" if host["tenant_arenas"] else ")")
    ]
    nvme = tiers["nvme"]
    if nvme is None:
        parts.append("nvme off")
    elif nvme["state"] == "serving":
        parts.append(
            f"nvme {nvme['directory']} serving ({format_bytes(nvme['bytes'])}, "
            f"{nvme['recovered_blocks']} blocks recovered)"
        )
    else:
        parts.append(
            f"nvme {nvme['directory']} DEGRADED, not admitting ({nvme['reason']}): "
            "the host tier serves alone until it opens"
        )
    cluster = tiers["cluster"]
    parts.append(
        "cluster off" if cluster is None else f"cluster {','.join(cluster['seeds'])} ({cluster['state']})"
    )
    return "; ".join(parts)

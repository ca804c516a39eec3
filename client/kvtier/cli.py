"""The ``kvtier`` command: ``stats``, ``bench``, and ``serve`` / ``fsck`` (aliases of ``kvtierd``).

The SDK's only place that reads the environment and files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from typing import Any

from kvtier_contract import defaults
from kvtier_contract.units import format_bytes
from kvtier_contract.version import __version__

DAEMON_COMMANDS = ("serve", "fsck")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache server for LLM serving")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    # Aliases of the daemon's own command, run as a new process (no import arrow into kvtierd).
    for name, what in (("serve", "run the kvtierd daemon: alias of `kvtierd serve`"),
                       ("fsck", "verify an NVMe tier directory offline: alias of `kvtierd fsck`")):
        alias = sub.add_parser(name, help=what, add_help=False)
        alias.add_argument("daemon_args", nargs=argparse.REMAINDER)

    _stats_args(sub.add_parser("stats", help="print the daemon's statistics"))
    _bench_args(sub.add_parser("bench",
                               help="throughput and latency benchmark (see docs/benchmarks.md)"))
    return p


def _stats_args(st: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier stats``."""
    st.add_argument("--address", default=None,
                    help="unix:///abs/path, unix:rel/path or HOST:PORT (default: "
                         f"{defaults.ADDRESS}, the socket `make serve` makes under this directory)")
    st.add_argument("--json", action="store_true",
                    help="machine-readable output (keys: docs/metrics.md, `kvtier stats --json`)")
    st.add_argument("--timeout-s", type=float, default=2.0,
                    help="deadline of the connect and of the Stats call, seconds (default 2)")
    st.add_argument("--token-file", default=None,
                    help="file holding this tenant's bearer token (a daemon with tenants; an "
                         "operator's token sees every namespace); or KVTIER_TOKEN_FILE")
    st.add_argument("--unix-login", action="store_true",
                    help="no token: log in as this Unix user (a tenant with unix_login; a Unix "
                         "socket address)")
    st.add_argument("--tls-ca", help="PEM CA of a daemon whose TCP listener serves TLS")
    st.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    st.add_argument("--tls-key", help="PEM key of --tls-cert")


def _bench_args(b: argparse.ArgumentParser) -> None:
    """The flags of ``kvtier bench``."""
    b.add_argument("suite", nargs="?", default="all",
                   help="all | shm | tcp | lookup | nvme | quick | tls | verify | gpu | overload | soak")
    b.add_argument("--sizes", default="256KiB,1MiB,4MiB", help="block sizes")
    b.add_argument("--batch-mib", type=int, default=64, help="bytes per batch, MiB")
    b.add_argument("--total-mib", type=int, default=512, help="bytes moved per measurement, MiB")
    b.add_argument("--repeat", type=int, default=3, help="measurements per figure (best is kept)")
    b.add_argument("--lookup-clients", type=int, default=4)
    b.add_argument("--json", dest="json_out", help="also write results to this file")
    b.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--disk-dir", help="nvme suite: where its tier and raw files go (a private "
                                      "subdirectory, removed after; default: the temp dir)")
    b.add_argument("--device", default="cuda", help="gpu suite: cuda[:N], or cpu for a dry run")
    b.add_argument("--gpu-blocks", type=int, default=256, help="gpu suite: blocks per transfer")
    b.add_argument("--gpu-transports", default="shm,cuda_ipc",
                   help="gpu suite: transports to measure (cuda_ipc needs cupy and CUDA)")
    b.add_argument("--gpu-shape", default="32,8,128,16",
                   help="gpu suite: layers,kv_heads,head_dim,tokens_per_block (Llama-3-8B)")
    b.add_argument("--overload-threads", type=int, default=64,
                   help="overload suite: concurrent client threads")
    b.add_argument("--duration", type=float, default=None,
                   help="overload, soak suites: seconds of load (default 20 and 60)")
    b.add_argument("--clients", type=int, default=4,
                   help="soak suite: client processes, killed and restarted at random")


def main(argv: list[str] | None = None) -> int:
    """Run one command. Output cut short by its reader (``kvtier stats | head -1``) ends the
    command quietly with status 141 (128 + SIGPIPE, as a shell reports it), no traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        os.close(devnull)
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DAEMON_COMMANDS:  # every argument, --help included, is the daemon's
        return _daemon(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "stats":
        return _stats(args)
    if args.suite == "gpu":
        from kvtier.bench.gpu import bench_gpu  # torch; imported only for this suite

        return bench_gpu(args)
    if args.suite == "overload":
        from kvtier.bench.overload import bench_overload

        return bench_overload(args)
    if args.suite == "soak":
        from kvtier.bench.soak import bench_soak

        return bench_soak(args)
    from kvtier.bench import run_bench  # heavy; imported only for bench

    return int(run_bench(args))


def _daemon(command: str, daemon_args: list[str]) -> int:
    """``kvtier serve|fsck ARGS``: replace this process with ``python -m kvtierd COMMAND ARGS``
    (signals reach the daemon itself, as under ``kvtierd`` directly)."""
    import importlib.util

    if importlib.util.find_spec("kvtierd") is None:  # an SDK-only install (the kvtier wheel)
        print(f"kvtier {command}: the daemon is not installed here (the kvtier wheel is the SDK "
              f"only): install the kvtierd wheel of the same version, or run kvtierd where it "
              f"is (README.md, Install)", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "kvtierd", command, *daemon_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 127  # not reached


# The SDK's errors name its keyword arguments (token=, tls_ca=, ...); `kvtier stats` says its flags.
_SDK_ARGS = {"token_file": "--token-file", "token": "--token-file", "tls_ca": "--tls-ca",
             "tls_cert": "--tls-cert", "tls_key": "--tls-key", "unix_login": "--unix-login",
             "timeout_s": "--timeout-s", "address": "--address"}


def as_flags(message: str) -> str:
    """``message`` with the SDK's ``name=`` spellings replaced by this command's flags."""
    flags = re.sub(r"\b(token_file|token|tls_ca|tls_cert|tls_key|unix_login|timeout_s|address)=",
                   lambda m: _SDK_ARGS[m.group(1)], message)
    return re.sub(r"(--[a-z-]+)(?:\s*(?:or|/)\s*\1)+", r"\1", flags)  # token= or token_file=


def _stats(args: argparse.Namespace) -> int:
    from kvtier.client import Client
    from kvtier.settings import ClientSettings
    from kvtier_contract.errors import KvtierError

    try:
        client = Client(args.address or defaults.default_address(), settings=ClientSettings(
            transport="tcp", timeout_s=args.timeout_s, heartbeat=False,
            token_file=None if args.unix_login else
            args.token_file or os.environ.get("KVTIER_TOKEN_FILE"),
            unix_login=args.unix_login,
            tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key))
    except KvtierError as e:
        print(f"kvtier stats: {as_flags(str(e))}", file=sys.stderr)
        return 2
    try:
        stats = client.stats()
    except KvtierError as e:
        print(f"kvtier stats: {as_flags(str(e))}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(stats_json(stats), indent=2, sort_keys=True))
    else:
        print(format_stats(stats))
    return 0


_ROWS = [
    ("lookups", "lookups"), ("blocks requested", "blocks_requested"),
    ("blocks hit (host)", "blocks_hit_host"), ("blocks hit (nvme)", "blocks_hit_nvme"),
    ("lookups (local index)", "local_lookups"), ("blocks hit (local index)", "blocks_hit_local"),
    ("blocks missed", "blocks_missed"), ("tokens hit", "tokens_hit"),
    ("tokens missed", "tokens_missed"), ("stores accepted", "stores_accepted"),
    ("stores already present", "stores_already_present"), ("stores rejected", "stores_rejected"),
    ("stores dropped", "stores_dropped"), ("blocks loaded", "loads"), ("evictions", "evictions"),
    ("bytes in  shm", "bytes_in_shm"), ("bytes out shm", "bytes_out_shm"),
    ("bytes in  tcp", "bytes_in_tcp"), ("bytes out tcp", "bytes_out_tcp"),
    ("resident blocks", "resident_blocks"), ("resident bytes", "resident_bytes"),
    ("corrupt blocks", "corrupt_blocks"),
]
_CLUSTER_ROWS = [
    ("blocks hit (cluster)", "blocks_hit_cluster"), ("cluster imports", "cluster_imports"),
    ("cluster corrupt values", "cluster_corrupt"),
]
_NVME_ROWS = [
    ("nvme resident blocks", "nvme_resident_blocks"), ("nvme resident bytes", "nvme_resident_bytes"),
    ("promotions", "promotions"), ("demotions", "demotions"), ("nvme evictions", "nvme_evictions"),
    ("checksum failures", "checksum_failures"), ("nvme bytes read", "nvme_bytes_read"),
    ("nvme bytes written", "nvme_bytes_written"),
]


_OPTIONAL_IDENTITY = ("adapter_id", "adapter_revision", "cache_salt", "tenant")


def _salt(shown: str | None) -> str | None:
    """A namespace's cache salt as stats prints it: the daemon's tag (``hmac:<12 hex>``, never
    the salt: docs/metrics.md §4), None when unset; anything else (a daemon that sent the salt
    itself) only as "set"."""
    return None if not shown else shown if shown.startswith("hmac:") else "set"


def stats_json(stats: dict[str, Any]) -> dict[str, Any]:
    """The Stats reply as ``--json`` prints it: every field of the reply, with each namespace's
    ``spec`` (its identity, kvtier_contract.identity.Namespace's 17 fields, the cache salt as
    its tag) holding null for an optional field left unset rather than the wire's empty string."""
    out = dict(stats)
    out["namespaces"] = []
    for ns in stats["namespaces"]:
        spec = dict(ns.get("spec") or {})
        for key in _OPTIONAL_IDENTITY:
            spec[key] = spec.get(key) or None
        spec["cache_salt"] = _salt(spec["cache_salt"])
        out["namespaces"].append({**ns, "spec": spec})
    return out


def _column(ns: dict[str, Any]) -> str:
    """A namespace's column name in the table: model id (cut) # last digits of its id."""
    return f"{ns['model_id'][:18]}#{str(ns['namespace_id'])[-4:]}"


def _identity_lines(namespaces: list[dict[str, Any]]) -> list[str]:
    """Every identity field of each namespace, and the tenant that holds it."""
    lines = ["", "namespaces (identity; tenant: who holds it in the tenants file)"]
    for ns in namespaces:
        sp = ns.get("spec") or {}
        opt = {k: sp.get(k) or "-" for k in _OPTIONAL_IDENTITY}
        adapter = f"{sp['adapter_id']}@{sp.get('adapter_revision')}" if sp.get("adapter_id") else "-"
        lines += [
            f"  {_column(ns)}  id {ns['namespace_id']}  tenant {ns.get('tenant') or '-'}  "
            f"block {format_bytes(int(ns['block_bytes']))}",
            f"    model {sp.get('model_id', ns['model_id'])}  revision "
            f"{sp.get('model_revision', ns['model_revision'])}  tokenizer "
            f"{sp.get('tokenizer_digest', '?')}",
            f"    kv {sp.get('kv_dtype', '?')} layout {sp.get('layout', '?')}  tokens/block "
            f"{sp.get('tokens_per_block', '?')}  layers {sp.get('num_layers', '?')}  kv heads "
            f"{sp.get('num_kv_heads', '?')}  head dim {sp.get('head_dim', '?')}",
            f"    tp rank {sp.get('tp_rank', 0)}/{sp.get('tp_size', 1)}  pp rank "
            f"{sp.get('pp_rank', 0)}/{sp.get('pp_size', 1)}  adapter {adapter}  cache salt "
            f"{_salt(sp.get('cache_salt')) or '-'}  identity tenant {opt['tenant']}",
        ]
    return lines


def _tenant_lines(tenants: list[dict[str, Any]]) -> list[str]:
    """Per tenant: sessions, namespaces, each quota's limit and refusals."""
    lines = ["", "tenants (quota: limit, refusals)"]
    for t in tenants:
        quotas = []
        for q in t.get("quotas", []):
            limit = (format_bytes(int(q["limit"])) if q["name"].endswith("_bytes")
                     else f"{int(q['limit']):,}") if q["limited"] else "unlimited"
            refused = f" ({int(q['refusals']):,} refused)" if q["refusals"] else ""
            quotas.append(f"{q['name']} {limit}{refused}")
        lines += [f"  {t['name']}{' (operator)' if t.get('operator') else ''}  sessions "
                  f"{t['sessions']}  namespaces {t['namespaces']}",
                  "    " + ", ".join(quotas)]
    return lines


def _fmt(key: str, value: Any) -> str:
    v = int(value)
    return format_bytes(v) if "bytes" in key else f"{v:,}"


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table: one column for the total, one per namespace."""
    used, cap = int(stats["host_used_bytes"]), int(stats["host_capacity_bytes"])
    head = [
        f"kvtierd  boot epoch {stats['boot_epoch']}  up {float(stats['uptime_s']):.0f}s  "
        f"policy {stats['eviction_policy']}  sessions {stats['sessions']}",
        f"host tier {format_bytes(used)} / {format_bytes(cap)} used "
        f"({100 * used / max(cap, 1):.1f}%), {stats['pinned_blocks']} pinned, "
        f"{stats['writing_blocks']} writing",
    ]
    nvme = stats.get("nvme") or {}
    if nvme.get("enabled"):
        head.append(_nvme_line(nvme))
    cluster = stats.get("cluster") or {}
    if cluster.get("enabled"):
        head += _cluster_lines(cluster)
    if stats.get("tier_figures"):
        head.append(_read_line(stats["tier_figures"]))
    rows = _ROWS + (_NVME_ROWS if nvme.get("enabled") else []) + \
        (_CLUSTER_ROWS if cluster.get("enabled") else [])
    cols = [("total", stats["total"])] + [(_column(ns), ns["counters"])
                                          for ns in stats["namespaces"]]
    width = max(14, *(len(name) + 2 for name, _ in cols))
    lines = ["", f"{'':<24}" + "".join(f"{name:>{width}}" for name, _ in cols)]
    for label, key in rows:
        lines.append(f"{label:<24}" + "".join(f"{_fmt(key, c.get(key, 0)):>{width}}"
                                              for _, c in cols))
    lines += _hit_lines(stats["total"])
    if stats["namespaces"]:
        lines += _identity_lines(stats["namespaces"])
    if stats.get("tenants"):
        lines += _tenant_lines(stats["tenants"])
    return "\n".join(head + lines)


def _nvme_line(nvme: dict[str, Any]) -> str:
    nused, ncap = int(nvme["used_bytes"]), int(nvme["capacity_bytes"])
    state = "admitting" if nvme["admitting"] else f"DEGRADED ({nvme['degraded_reason']})"
    return (f"nvme tier {format_bytes(nused)} / {format_bytes(ncap)} used, {state}, "
            f"{nvme['write_policy']}, direct I/O {'on' if nvme['direct_io'] else 'off'}, "
            f"{nvme['quarantined_slots']} quarantined; recovered {nvme['recovered_blocks']} "
            f"blocks ({nvme['recovery_mode']}, {float(nvme['recovery_seconds']):.2f}s)")


def _hit_lines(total: dict[str, Any]) -> list[str]:
    """The block hit ratio over every tier (none before a block was requested)."""
    req = int(total.get("blocks_requested", 0))
    if not req:
        return []
    hit = sum(int(total.get(k, 0)) for k in ("blocks_hit_host", "blocks_hit_nvme",
                                              "blocks_hit_local", "blocks_hit_cluster"))
    return [f"\nblock hit ratio {100 * hit / req:.1f}% of {req:,} requested"]


_TIERS = {1: "host", 2: "nvme", 3: "cluster"}  # kvtier.v1.Tier


def _read_line(figures: list[dict[str, Any]]) -> str:
    """The daemon's recent reads into the host tier, per tier (issue 30: load or recompute)."""
    parts = [f"{_TIERS.get(int(f['tier']), '?')} {int(f['latency_us']) / 1000:.1f} ms, "
             f"{format_bytes(int(f['bytes_per_s']))}/s ({int(f['reads']):,} reads, last "
             f"{int(f['age_ms']) / 1000:.1f}s ago)" for f in figures]
    return "reads into the host tier: " + "; ".join(parts)


def _cluster_lines(cl: dict[str, Any]) -> list[str]:
    """The cluster tier: state, write queue, then one line per master."""
    state = "connected" if cl.get("connected") else "UNREACHABLE (lookups miss, stores dropped)"
    lines = [f"cluster tier {state}, write policy {cl.get('write_policy')}, "
             f"{int(cl.get('writes', 0)):,} written, {int(cl.get('write_drops', 0)):,} dropped, "
             f"{int(cl.get('queued_blocks', 0)):,} queued "
             f"({format_bytes(int(cl.get('queued_bytes', 0)))}), "
             f"{int(cl.get('corrupt_values', 0)):,} corrupt values, "
             f"{int(cl.get('lookup_timeouts', 0)):,} late lookups",
             f"  {'node':<22}{'state':>8}{'slots':>7}{'hits':>10}{'misses':>10}{'read':>11}"
             f"{'written':>11}{'errors':>8}{'ms/req':>8}"]
    for n in cl.get("nodes", []):
        answered = max(1, int(n.get("requests", 0)) - int(n.get("errors", 0)))
        ms = 1000 * float(n.get("latency_seconds_sum", 0.0)) / answered
        lines.append(
            f"  {n['address']:<22}{'up' if n.get('healthy') else 'DOWN':>8}"
            f"{int(n.get('slots', 0)):>7}{int(n.get('hits', 0)):>10,}"
            f"{int(n.get('misses', 0)):>10,}{format_bytes(int(n.get('bytes_read', 0))):>11}"
            f"{format_bytes(int(n.get('bytes_written', 0))):>11}{int(n.get('errors', 0)):>8}"
            f"{ms:>8.2f}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())

"""What ``kvtier stats`` prints: the readable table (``format_stats``) and the ``--json``
document (``stats_json``), both made from the daemon's Stats reply as ``Client.stats`` returns
it (a dict, field names as in the proto).

Pure functions of the reply: no I/O, no state, any thread. Imports nothing heavy (``kvtier.cli``
stays cheap to start).
"""

from __future__ import annotations

from typing import Any

from kvtier_contract.units import format_bytes

_ROWS = [
    ("lookups", "lookups"),
    ("blocks requested", "blocks_requested"),
    ("blocks hit (host)", "blocks_hit_host"),
    ("blocks hit (nvme)", "blocks_hit_nvme"),
    ("lookups (local index)", "local_lookups"),
    ("blocks hit (local index)", "blocks_hit_local"),
    ("blocks missed", "blocks_missed"),
    ("tokens hit", "tokens_hit"),
    ("tokens missed", "tokens_missed"),
    ("stores accepted", "stores_accepted"),
    ("stores already present", "stores_already_present"),
    ("stores rejected", "stores_rejected"),
    ("stores dropped", "stores_dropped"),
    ("blocks loaded", "loads"),
    ("evictions", "evictions"),
    ("bytes in  shm", "bytes_in_shm"),
    ("bytes out shm", "bytes_out_shm"),
    ("bytes in  tcp", "bytes_in_tcp"),
    ("bytes out tcp", "bytes_out_tcp"),
    ("resident blocks", "resident_blocks"),
    ("resident bytes", "resident_bytes"),
    ("corrupt blocks", "corrupt_blocks"),
]
_CLUSTER_ROWS = [
    ("blocks hit (cluster)", "blocks_hit_cluster"),
    ("cluster imports", "cluster_imports"),
    ("cluster corrupt values", "cluster_corrupt"),
]
_NVME_ROWS = [
    ("nvme resident blocks", "nvme_resident_blocks"),
    ("nvme resident bytes", "nvme_resident_bytes"),
    ("promotions", "promotions"),
    ("demotions", "demotions"),
    ("nvme evictions", "nvme_evictions"),
    ("checksum failures", "checksum_failures"),
    ("nvme bytes read", "nvme_bytes_read"),
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
    its tag) holding null for an optional field left unset rather than the wire's empty string,
    and ``group`` only for a group's namespace (as ``Namespace.to_dict``)."""
    out = dict(stats)
    out["namespaces"] = []
    for ns in stats["namespaces"]:
        spec = dict(ns.get("spec") or {})
        for key in _OPTIONAL_IDENTITY:
            spec[key] = spec.get(key) or None
        spec["cache_salt"] = _salt(spec["cache_salt"])
        if not spec.get("group"):
            spec.pop("group", None)
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
            f"{_salt(sp.get('cache_salt')) or '-'}  identity "
            + (f"group {sp['group']}" if sp.get("group") else f"tenant {opt['tenant']}"),
        ]
    return lines


def _tenant_lines(tenants: list[dict[str, Any]]) -> list[str]:
    """Per tenant: sessions, namespaces, each quota's limit and refusals."""
    lines = ["", "tenants (quota: limit, refusals)"]
    for t in tenants:
        quotas = []
        for q in t.get("quotas", []):
            limit = (
                (format_bytes(int(q["limit"])) if q["name"].endswith("_bytes") else f"{int(q['limit']):,}")
                if q["limited"]
                else "unlimited"
            )
            refused = f" ({int(q['refusals']):,} refused)" if q["refusals"] else ""
            quotas.append(f"{q['name']} {limit}{refused}")
        lines += [
            f"  {t['name']}{' (operator)' if t.get('operator') else ''}  sessions "
            f"{t['sessions']}  namespaces {t['namespaces']}",
            "    " + ", ".join(quotas),
        ]
    return lines


def _fmt(key: str, value: Any) -> str:
    v = int(value)
    return format_bytes(v) if "bytes" in key else f"{v:,}"


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table: one column for the total, one per namespace."""
    used, cap = int(stats["host_used_bytes"]), int(stats["host_capacity_bytes"])
    policy = f"  policy {stats['eviction_policy']}" if stats.get("eviction_policy") else ""
    head = [  # (a tenant's reply has no policy, pins or writes: the daemon's, not its own)
        f"kvtierd  boot epoch {stats['boot_epoch']}  up {float(stats['uptime_s']):.0f}s"
        f"{policy}  sessions {stats['sessions']}",
        f"host tier {format_bytes(used)} / {format_bytes(cap)} used ({100 * used / max(cap, 1):.1f}%)"
        + (
            f", {stats['pinned_blocks']} pinned, {stats['writing_blocks']} writing"
            if policy
            else " (this tenant's blocks, of the arena they live in)"
        ),
    ]
    nvme = stats.get("nvme") or {}
    if nvme.get("enabled"):
        head.append(_nvme_line(nvme))
    cluster = stats.get("cluster") or {}
    if cluster.get("enabled"):
        head += _cluster_lines(cluster)
    if stats.get("tier_figures"):
        head.append(_read_line(stats["tier_figures"]))
    rows = (
        _ROWS
        + (_NVME_ROWS if nvme.get("enabled") else [])
        + (_CLUSTER_ROWS if cluster.get("enabled") else [])
    )
    cols = [("total", stats["total"])] + [(_column(ns), ns["counters"]) for ns in stats["namespaces"]]
    width = max(14, *(len(name) + 2 for name, _ in cols))
    lines = ["", f"{'':<24}" + "".join(f"{name:>{width}}" for name, _ in cols)]
    for label, key in rows:
        lines.append(f"{label:<24}" + "".join(f"{_fmt(key, c.get(key, 0)):>{width}}" for _, c in cols))
    lines += _hit_lines(stats["total"])
    if stats["namespaces"]:
        lines += _identity_lines(stats["namespaces"])
    if stats.get("tenants"):
        lines += _tenant_lines(stats["tenants"])
    return "\n".join(head + lines)


def _nvme_line(nvme: dict[str, Any]) -> str:
    nused, ncap = int(nvme["used_bytes"]), int(nvme["capacity_bytes"])
    state = "admitting" if nvme["admitting"] else f"DEGRADED ({nvme['degraded_reason']})"
    return (
        f"nvme tier {format_bytes(nused)} / {format_bytes(ncap)} used, {state}, "
        f"{nvme['write_policy']}, direct I/O {'on' if nvme['direct_io'] else 'off'}, "
        f"{nvme['quarantined_slots']} quarantined; recovered {nvme['recovered_blocks']} "
        f"blocks ({nvme['recovery_mode']}, {float(nvme['recovery_seconds']):.2f}s)"
    )


def _hit_lines(total: dict[str, Any]) -> list[str]:
    """The block hit ratio over every tier (none before a block was requested)."""
    req = int(total.get("blocks_requested", 0))
    if not req:
        return []
    hit = sum(
        int(total.get(k, 0))
        for k in ("blocks_hit_host", "blocks_hit_nvme", "blocks_hit_local", "blocks_hit_cluster")
    )
    return [f"\nblock hit ratio {100 * hit / req:.1f}% of {req:,} requested"]


_TIERS = {1: "host", 2: "nvme", 3: "cluster"}  # kvtier.v1.Tier


def _read_line(figures: list[dict[str, Any]]) -> str:
    """The daemon's recent reads into the host tier, per tier (issue 30: load or recompute)."""
    parts = [
        f"{_TIERS.get(int(f['tier']), '?')} {int(f['latency_us']) / 1000:.1f} ms, "
        f"{format_bytes(int(f['bytes_per_s']))}/s ({int(f['reads']):,} reads, last "
        f"{int(f['age_ms']) / 1000:.1f}s ago)"
        for f in figures
    ]
    return "reads into the host tier: " + "; ".join(parts)


def _cluster_lines(cl: dict[str, Any]) -> list[str]:
    """The cluster tier: state, write queue, then one line per master."""
    state = "connected" if cl.get("connected") else "UNREACHABLE (lookups miss, stores dropped)"
    lines = [
        f"cluster tier {state}, write policy {cl.get('write_policy')}, "
        f"{int(cl.get('writes', 0)):,} written, {int(cl.get('write_drops', 0)):,} dropped, "
        f"{int(cl.get('queued_blocks', 0)):,} queued "
        f"({format_bytes(int(cl.get('queued_bytes', 0)))}), "
        f"{int(cl.get('corrupt_values', 0)):,} corrupt values, "
        f"{int(cl.get('lookup_timeouts', 0)):,} late lookups",
        f"  {'node':<22}{'state':>8}{'slots':>7}{'hits':>10}{'misses':>10}{'read':>11}"
        f"{'written':>11}{'errors':>8}{'ms/req':>8}",
    ]
    for n in cl.get("nodes", []):
        answered = max(1, int(n.get("requests", 0)) - int(n.get("errors", 0)))
        ms = 1000 * float(n.get("latency_seconds_sum", 0.0)) / answered
        lines.append(
            f"  {n['address']:<22}{'up' if n.get('healthy') else 'DOWN':>8}"
            f"{int(n.get('slots', 0)):>7}{int(n.get('hits', 0)):>10,}"
            f"{int(n.get('misses', 0)):>10,}{format_bytes(int(n.get('bytes_read', 0))):>11}"
            f"{format_bytes(int(n.get('bytes_written', 0))):>11}{int(n.get('errors', 0)):>8}"
            f"{ms:>8.2f}"
        )
    return lines

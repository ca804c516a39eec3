"""The Grafana dashboard and the alert rules against the metrics a real daemon exposes (issue 29).

One daemon with every tier an operator watches (host, NVMe, a real Redis Cluster) and a tenants
file serves a tenant's traffic (puts, lookups, gets, a quota refusal, a refused request, a bad frame); its
/metrics, scraped with the operator's token, is parsed with prometheus_client's parser. Every
PromQL query of deploy/helm/kvtier/files/kvtier-dashboard.json (panels and variables) and every
``expr`` of kvtier-alerts.yaml is read by a strict selector extractor (tests/promql_selectors.py):
each metric it names must be exposed, each label it matches or groups by must be on that metric,
and a literal value of a bounded label (tier, direction, ...) must be one the daemon writes.
The same daemon shows the tenant label, the exact boot epoch and the process figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import ROOT, DaemonProcess, make_namespace
from prometheus_client.parser import text_string_to_metric_families
from promql_selectors import PromQLError, Query, parse, parse_variable
from redis_cluster import RedisCluster
from tests_helpers import TokenStub, wait_for

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb

FILES = ROOT / "deploy" / "helm" / "kvtier" / "files"
TOKENS = {"team-a": "dash-tok-a-1f2e", "team-b": "dash-tok-b-3d4c", "ops": "dash-tok-ops-5b6a"}
TARGET_LABELS = frozenset({"instance", "job"})  # added by Prometheus to every scraped series
SYNTHETIC = {"up": TARGET_LABELS}  # written by Prometheus per target, not by kvtierd
BOUNDED = frozenset({"tier", "direction", "transport", "outcome", "quota", "reason"})
SALT = "salt-never-in-metrics-7e1"
TOKENIZER = "tokdigest-never-in-metrics-42"


def _tenants(path: Path) -> Path:
    body = ""
    for name, token in TOKENS.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{digest}"]\ntransports = ["tcp"]\n'
        if name == "ops":
            body += "operator = true\n"
        if name == "team-a":
            body += "[tenant.quotas]\nnamespaces = 2\n"
        body += "\n"
    path.write_text(body)
    return path


class Exposition:
    """A scrape, parsed: each sample name's label names and each (sample, label)'s values."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.labels: dict[str, set[str]] = {}
        self.values: dict[tuple[str, str], set[str]] = {}
        self.samples: list[Any] = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append(s)
                self.labels.setdefault(s.name, set()).update(s.labels)
                for k, v in s.labels.items():
                    self.values.setdefault((s.name, k), set()).add(v)

    def value(self, name: str, **labels: str) -> float:
        found = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (name, labels, found)
        return float(found[0])


def scrape(d: DaemonProcess, token: str) -> Exposition:
    req = urllib.request.Request(d.info["metrics"], headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return Exposition(r.read().decode())


def client(d: DaemonProcess, tenant: str) -> kvtier.Client:
    return kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS[tenant])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("dash")
    with RedisCluster(tmp / "redis") as rc:
        key = tmp / "fleet.key"
        key.write_text(hashlib.sha256(b"dashboard fleet").hexdigest() + "\n")
        cfg = tmp / "kvtierd.toml"
        cfg.write_text(
            f'tenants_file = "{_tenants(tmp / "tenants.toml")}"\n'
            f'disk_dir = "{tmp / "nvme"}"\ndisk_bytes = "64MiB"\n'
            f'cluster = "{rc.url}"\ncluster_fleet_key_file = "{key}"\n'
            "cluster_lookup_timeout_ms = 1000\ncluster_fetch_timeout_ms = 3000\n"
        )
        d = DaemonProcess(
            tmp / "d", "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB"
        ).start()
        try:
            with client(d, "ops") as ops:
                wait_for("the cluster tier connected", lambda: ops.stats()["cluster"]["connected"])
            _traffic(d)
            yield d
        finally:
            d.kill()


def _traffic(d: DaemonProcess) -> None:
    """team-a stores, looks up and loads; its third namespace is refused (quota namespaces = 2);
    team-b holds one namespace; a raw request for a session that does not exist is refused."""
    with client(d, "team-a") as a:
        for tokenizer in (TOKENIZER, "tok-other"):
            ns = a.register(make_namespace(tenant="team-a", tokenizer_digest=tokenizer, cache_salt=SALT))
            keys = ns.block_keys(list(range(16 * 4)))
            assert ns.put(keys, [bytes([i]) * ns.block_bytes for i in range(4)]).stored == 4
            assert ns.lookup(keys + [b"\1" * 32]) == 4
            assert all(g is not None for g in ns.get(keys))
        a.register(make_namespace(tenant="team-a", model_id="third/model"))  # (not raised)
        assert "quota namespaces (2) reached" in (a.counters.last_error or "")
    with client(d, "team-b") as b:
        b.register(make_namespace(tenant="team-b", model_id="org/model-of-b"))
    code, _ = TokenStub(d.grpc, TOKENS["team-a"]).code(
        "Lookup", pb.LookupRequest(session_id=12345, namespace_id=1, keys=b"\0" * 32)
    )
    assert code != grpc.StatusCode.OK
    host, port = d.info["data"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:  # not a KVD1 header
        s.sendall(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n")  # > 32 bytes
        with contextlib.suppress(ConnectionResetError):  # (closed with our bytes unread)
            while s.recv(4096):  # answered ERROR, then closed
                pass


def check(query: Query, exposed: Exposition, where: str) -> None:
    """Every selector's metric, matcher labels and bounded values; every grouping's labels."""
    for sel in query.selectors:
        known = SYNTHETIC.get(sel.name)
        if known is None:
            assert sel.name in exposed.labels, f"{where}: no metric {sel.name}"
            known = exposed.labels[sel.name] | TARGET_LABELS
        for label, op, value in sel.matchers:
            assert label in known, f"{where}: {sel.name} has no label {label!r}"
            if label in BOUNDED and op == "=":
                assert value in exposed.values[(sel.name, label)], (
                    f"{where}: {sel.name}{{{label}={value!r}}} is never written"
                )
    for g in query.groupings:
        for sel in g.selectors:
            have = SYNTHETIC.get(sel.name) or exposed.labels[sel.name] | TARGET_LABELS
            for label in g.labels:
                assert label in have, f"{where}: {g.keyword} ({label}) but {sel.name} lacks it"


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((FILES / "kvtier-dashboard.json").read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {t['refId']}", t["expr"]))
    return out


def test_every_dashboard_query_names_metrics_and_labels_the_daemon_exposes(daemon: DaemonProcess) -> None:
    exposed = scrape(daemon, TOKENS["ops"])
    queries = dashboard_queries()
    assert len(queries) >= 40
    used = set()
    for where, expr in queries:
        try:
            q = parse(expr)
        except PromQLError as e:
            raise AssertionError(f"{where}: {e}") from None
        check(q, exposed, where)
        used |= {s.name for s in q.selectors}
    dash = json.loads((FILES / "kvtier-dashboard.json").read_text())
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q, label = parse_variable(var["query"]["query"])
            check(q, exposed, f"variable {var['name']}")
            assert label in exposed.labels[q.selectors[0].name] | TARGET_LABELS
    # what the issue asks the dashboard to show: hits per tier and tenant, bytes in/out,
    # evictions, NVMe health, the cluster tier, quotas, the process
    for name in (
        "kvtier_lookup_blocks_hit_total",
        "kvtier_local_lookup_blocks_hit_total",
        "kvtier_transfer_bytes_total",
        "kvtier_evictions_total",
        "kvtier_nvme_degraded",
        "kvtier_cluster_connected",
        "kvtier_cluster_mac_failures_total",
        "kvtier_quota_limit",
        "kvtier_quota_refusals_total",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "kvtier_bad_frames_total",
    ):
        assert name in used, f"the dashboard shows no {name}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_every_alert_expression_names_metrics_and_labels_the_daemon_exposes(daemon: DaemonProcess) -> None:
    exposed = scrape(daemon, TOKENS["ops"])
    groups = yaml.safe_load((FILES / "kvtier-alerts.yaml").read_text())["groups"]
    names = set()
    for group in groups:
        for rule in group["rules"]:
            names.add(rule["alert"])
            assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]
            try:
                q = parse(rule["expr"])
            except PromQLError as e:
                raise AssertionError(f"alert {rule['alert']}: {e}") from None
            check(q, exposed, f"alert {rule['alert']}")
    assert {
        "KvtierDown",
        "KvtierDraining",
        "KvtierNvmeDegraded",
        "KvtierClusterDisconnected",
        "KvtierClusterMacFailures",
        "KvtierQuotaRefusals",
        "KvtierHitRateCollapse",
        "KvtierBadRequests",
        "KvtierBadFrames",
    } <= names


def test_metrics_carry_the_tenant_the_exact_boot_epoch_and_the_process(daemon: DaemonProcess) -> None:
    ops = scrape(daemon, TOKENS["ops"])
    hits = [s for s in ops.samples if s.name == "kvtier_lookup_blocks_hit_total"]
    assert {s.labels["tier"] for s in hits} == {"host", "nvme", "cluster"}  # never "unknown"
    assert 'tier="unknown"' not in ops.text
    assert sum(s.value for s in hits if s.labels["tenant"] == "team-a" and s.labels["tier"] == "host") == 8
    assert {s.labels["tenant"] for s in hits} == {"team-a", "team-b"}
    assert ops.value("kvtier_quota_refusals_total", tenant="team-a", quota="namespaces") == 1
    assert ops.value("kvtier_quota_limit", tenant="team-a", quota="namespaces") == 2
    assert ops.value("kvtier_tenant_namespaces", tenant="team-a") == 2
    assert ops.value("kvtier_bad_frames_total", transport="tcp") == 1
    assert ops.value("kvtier_bad_frames_total", transport="control") == 0
    epoch = daemon.info["boot_epoch"]
    assert ops.value("kvtier_boot_info", boot_epoch=str(epoch)) == 1  # every digit
    assert ops.value("kvtier_boot_time_seconds") == pytest.approx(epoch / 1e9)
    assert ops.value("process_open_fds") > 0 and ops.value("process_resident_memory_bytes") > 0
    for secret in (*TOKENS.values(), SALT, TOKENIZER):
        assert secret not in ops.text
    a = scrape(daemon, TOKENS["team-a"])  # a tenant: its own figures, nothing of the process
    assert {s.labels["tenant"] for s in a.samples if "tenant" in s.labels} == {"team-a"}
    assert not any(n.startswith(("process_", "python_")) for n in a.labels)


def test_stats_shows_every_identity_field_and_the_tenant(daemon: DaemonProcess) -> None:
    import subprocess
    import sys

    def stats(tenant: str, *flags: str) -> subprocess.CompletedProcess[str]:
        token = daemon.run_dir / f"{tenant}.token"
        token.write_text(TOKENS[tenant])
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier.cli",
                "stats",
                "--address",
                daemon.unix,
                "--token-file",
                str(token),
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    raw = stats("team-a", "--json").stdout
    assert SALT not in raw  # a cache salt isolates users: only its tag is shown
    out = json.loads(raw)
    spaces = out["namespaces"]
    assert len(spaces) == 2 and {ns["tenant"] for ns in spaces} == {"team-a"}
    want = set(make_namespace().to_dict())
    for ns in spaces:
        assert set(ns) == {
            "namespace_id",
            "model_id",
            "model_revision",
            "block_bytes",
            "counters",
            "spec",
            "tenant",
        }
        assert set(ns["spec"]) == want and re.fullmatch(r"hmac:[0-9a-f]{12}", ns["spec"]["cache_salt"])
        assert ns["spec"]["adapter_id"] is None and ns["spec"]["tenant"] == "team-a"
    assert {ns["spec"]["tokenizer_digest"] for ns in spaces} == {TOKENIZER, "tok-other"}
    [tag] = {ns["spec"]["cache_salt"] for ns in spaces}  # one salt: one tag
    [team] = out["tenants"]  # only its own tenant
    assert team["name"] == "team-a"
    assert {q["name"]: q["refusals"] for q in team["quotas"]}["namespaces"] == 1
    text = stats("team-a").stdout
    assert SALT not in text and f"cache salt {tag}" in text
    assert TOKENIZER in text and "tok-other" in text and "tenant team-a" in text
    assert re.search(r"namespaces 2\b", text) and "model-of-b" not in text
    raw = stats("ops", "--json").stdout
    assert SALT not in raw and SALT not in stats("ops").stdout
    ops = json.loads(raw)
    assert {ns["tenant"] for ns in ops["namespaces"]} == {"team-a", "team-b"}
    assert {t["name"] for t in ops["tenants"]} == set(TOKENS)

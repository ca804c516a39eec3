"""deploy/helm/kvtier rendered by the real helm (``make helm``) and checked against real schemas.

Both modes (daemonset, sidecar), with the chart's defaults (a DaemonSet adds the least the chart
asks of it: tenants, here one tenant for the node's engines by Unix login, NODE_TENANT) and with
tests/data/helm/values-all.yaml
(TLS, mTLS, tenants with every quota, an NVMe tier, the scrape token, every monitoring object):
``helm lint --strict`` (values.schema.json included), Kubernetes' JSON schemas with unknown
fields refused, prometheus-operator's schemas for the CRD kinds, the kvtier container's flags
parsed by ``kvtierd serve``'s own parser into a valid config, ports that agree, and a /metrics
that the pod network reaches. tests/helm_chart.py says where the tools come from.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from helm_chart import (
    CHART,
    VALUES_ALL,
    by_kind,
    container,
    helm,
    parse_serve,
    pod_spec,
    render,
    render_error,
    validate_builtin,
    validate_crds,
)

from kvtier_contract.units import parse_bytes
from kvtier_contract.version import __version__
from kvtierd.app import SERVICE_NAME
from kvtierd.config import DaemonConfig
from kvtierd.policies import PolicyName
from kvtierd.tenancy.exposure import check_metrics_exposure, metrics_scrape_only
from kvtierd.tenancy.tenancy import QUOTA_NAMES
from kvtierd.tenants import token_digest
from kvtierd.tenants_file import GROUP_QUOTAS, load_tenants

MODES = ["daemonset", "sidecar"]
CASES = [(mode, values) for mode in MODES for values in ("defaults", "all")]
SCRAPE_TOKEN = "scrape-token-for-tests"  # values-all.yaml's metrics.scrape.token
QUANTITY = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
# A DaemonSet needs tenants (issue 39): the node's engines as one tenant, by Unix login.
NODE_TENANT = (
    "tenants.enabled=true",
    "tenants.list[0].name=node",
    "tenants.list[0].unixLogin=true",
    "tenants.list[0].unixGids={10001}",
    "tenants.list[0].transports={shm}",
)


def least(mode: str) -> tuple[str, ...]:
    """The chart's defaults in ``mode``, with what the chart asks of that mode."""
    return (f"mode={mode}", *(NODE_TENANT if mode == "daemonset" else ()))


def rendered(mode: str, values: str) -> list[dict[str, Any]]:
    if values == "all":
        return render(VALUES_ALL, sets=(f"mode={mode}",))
    return render(sets=least(mode))


def quantity(q: str) -> int:
    digits = q.rstrip("KMGTi")
    return int(digits) * QUANTITY[q[len(digits) :]]


def serve_config(docs: list[dict[str, Any]]) -> Any:
    kvtier = container(docs)
    return parse_serve(kvtier["command"] + kvtier["args"])


def tenants_of(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    (secret,) = [s for s in by_kind(docs)["Secret"] if s["metadata"]["name"].endswith("-tenants")]
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    return load_tenants(tmp_path / "tenants.toml")


def test_chart_version_is_the_projects() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


@pytest.mark.parametrize("values", ["defaults", "all"])
def test_helm_lint_strict_passes(values: str) -> None:
    for mode in MODES:
        sets = (f"mode={mode}",) if values == "all" else least(mode)
        extra = ["--values", str(VALUES_ALL)] if values == "all" else []
        out = helm("lint", "--strict", str(CHART), *[a for s in sets for a in ("--set", s)], *extra)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(("mode", "values"), CASES)
def test_rendered_manifests_pass_kubernetes_and_prometheus_operator_schemas(
    mode: str, values: str, tmp_path: Path
) -> None:
    docs = rendered(mode, values)
    kinds = by_kind(docs)
    assert ("DaemonSet" if mode == "daemonset" else "Deployment") in kinds
    validate_builtin(docs, tmp_path)
    validate_crds(docs)
    if values == "all":
        assert {"ServiceMonitor", "PodMonitor"} <= set(kinds)
    else:  # monitoring objects are off by default: a cluster without their CRDs installs fine
        assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & set(kinds)


@pytest.mark.parametrize(("mode", "values"), CASES)
def test_kvtier_flags_exist_and_ports_agree(mode: str, values: str) -> None:
    docs = rendered(mode, values)
    cfg = serve_config(docs)
    kvtier = container(docs)
    ports = {p["name"]: p["containerPort"] for p in kvtier["ports"]}
    assert ports["health"] == int(cfg.grpc.health_listen.rpartition(":")[2])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kvtier[probe]["grpc"]["port"] == ports["health"]
    assert kvtier["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    # /metrics on the pod IP, on the port the Service, ServiceMonitor and PodMonitor name
    assert cfg.metrics.metrics_host == "0.0.0.0" and ports["metrics"] == cfg.metrics.metrics_port
    # plaintext HTTP off loopback: the narrow explicit flag (kvtierd refuses it without one)
    assert cfg.metrics.metrics_plaintext_remote and not cfg.grpc.allow_plaintext_remote
    (service,) = [s for s in by_kind(docs)["Service"] if s["metadata"]["name"].endswith("-metrics")]
    assert service["spec"]["clusterIP"] == "None"
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] == "metrics" and sport["port"] == cfg.metrics.metrics_port
    for sm in by_kind(docs).get("ServiceMonitor", []):
        assert [e["port"] for e in sm["spec"]["endpoints"]] == [sport["name"]]
        labels = service["metadata"]["labels"]
        assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for pm in by_kind(docs).get("PodMonitor", []):
        assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    socket_dir = str(Path(cfg.grpc.socket_path).parent)
    mounts = {m["name"]: m["mountPath"] for m in kvtier["volumeMounts"]}
    assert mounts["kvtier-run"] == socket_dir
    if cfg.grpc.listen:  # TLS on a TCP listener, or the sidecar's loopback
        assert cfg.grpc.tls_cert or cfg.grpc.listen.startswith("127.0.0.1:")
    if cfg.grpc.tls_cert:
        assert ports["grpc-tls"] == int(cfg.grpc.listen.rpartition(":")[2])
        assert ports["data-tls"] == int(cfg.transports.data_listen.rpartition(":")[2])


@pytest.mark.parametrize("mode", MODES)
def test_the_socket_directory_is_shared_at_the_same_path(mode: str) -> None:
    docs = rendered(mode, "defaults")
    cfg = serve_config(docs)
    socket_dir = str(Path(cfg.grpc.socket_path).parent)
    run = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kvtier-run")
    if mode == "daemonset":
        assert run["hostPath"]["path"] == socket_dir
        assert not any(pod_spec(docs).get(k) for k in ("hostIPC", "hostNetwork", "hostPID"))
    else:
        assert "emptyDir" in run
        engine = container(docs, "engine")
        assert {"name": "kvtier-run", "mountPath": socket_dir} in engine["volumeMounts"]
        env = {e["name"]: e["value"] for e in engine["env"]}
        assert env["KVTIER_ADDRESS"] == f"unix://{cfg.grpc.socket_path}"
    sc = container(docs)["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0 and not sc["allowPrivilegeEscalation"]


@pytest.mark.parametrize("mode", MODES)
def test_an_init_container_makes_the_socket_directory_sticky(mode: str, tmp_path: Path) -> None:
    """/run is a tmpfs on most nodes and an emptyDir is made 0777 (2777 with the fsGroup): an
    init container makes the directory the daemon's (10001) with the engines' group (10001),
    mode 1770 (a 0770 one let a member of the group rename kvtier.sock away and serve a fake
    one that logged another tenant's token; kvtierd now refuses it), over a DirectoryOrCreate
    hostPath or the pod's emptyDir; its command, run here on a real directory, does exactly
    that."""
    docs = rendered(mode, "defaults")
    run = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kvtier-run")
    mount = (
        run["hostPath"]["path"]
        if mode == "daemonset"
        else str(Path(serve_config(docs).grpc.socket_path).parent)
    )
    if mode == "daemonset":
        assert run["hostPath"]["type"] == "DirectoryOrCreate"
    (init,) = pod_spec(docs)["initContainers"]
    assert init["image"] == container(docs)["image"]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert not sc["allowPrivilegeEscalation"] and sc["readOnlyRootFilesystem"]
    assert init["volumeMounts"] == [{"name": "kvtier-run", "mountPath": mount}]
    assert init["command"][-1] == mount
    if os.geteuid() != 0:
        pytest.skip("chown to 10001 needs root")
    node_dir = tmp_path / "run-kvtier"
    node_dir.mkdir()
    os.chmod(node_dir, 0o2777)  # as an emptyDir with an fsGroup (a hostPath: 0755)
    subprocess.run([*init["command"][:-1], str(node_dir)], check=True, timeout=30)
    st = node_dir.stat()
    mode = stat.S_IMODE(st.st_mode) & ~stat.S_ISGID  # (chmod keeps a directory's setgid: harmless)
    assert (st.st_uid, st.st_gid, mode) == (10001, 10001, 0o1770)


def test_without_prepare_the_socket_directory_must_exist() -> None:
    docs = render(sets=(*least("daemonset"), "daemonset.prepareSocketDir=false"))
    run = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "kvtier-run")
    assert run["hostPath"]["type"] == "Directory" and "initContainers" not in pod_spec(docs)


@pytest.mark.parametrize("mode", MODES)
def test_tenants_set_every_quota_and_memory_covers_every_arena(mode: str, tmp_path: Path) -> None:
    docs = rendered(mode, "all")
    cfg = serve_config(docs)
    tenants = tenants_of(docs, tmp_path)
    for t in tenants.by_name.values():
        names = GROUP_QUOTAS if t.group else QUOTA_NAMES  # (a group holds blocks, never a session)
        assert not [n for n in names if getattr(t.quotas, n) is None], t.name
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == "tenants")
    assert cfg.tenancy.tenants_file == f"{mount['mountPath']}/tenants.toml" and mount["readOnly"]
    arenas = sum(
        t.arena_size(cfg.tenancy.tenant_arena_bytes)
        for t in tenants.by_name.values()
        if tenants.maps_memory(t)
    )
    assert tenants.by_name["acme-shared"].arena_bytes == 1 << 30 and tenants.maps_memory(
        tenants.by_name["acme-shared"]
    )
    resources = container(docs)["resources"]
    assert quantity(resources["limits"]["memory"]) > cfg.host_tier.host_bytes + arenas
    shared = [t.quotas.host_bytes or 0 for t in tenants.by_name.values() if not tenants.maps_memory(t)]
    assert sum(shared) <= cfg.host_tier.host_bytes


def test_memory_must_cover_a_groups_arena_too() -> None:
    """A group one of whose readers maps memory gets an arena of its own (issue 43): the chart
    refuses a memory limit that covers the tenants' arenas but not the group's."""
    sets = (*least("daemonset"), "resources.limits.memory=2Gi", "daemon.hostBytes=1GiB")
    group = ("tenants.groups[0].name=g", "tenants.groups[0].publishers={node}")
    assert render(sets=(*sets, *group, "tenants.groups[0].arenaBytes=512MiB"))  # 1 GiB + 256 + 512 MiB
    error = render_error(*sets, *group, "tenants.groups[0].arenaBytes=1GiB")
    assert "group's arena" in error, error


@pytest.mark.parametrize("mode", MODES)
def test_the_scrape_token_is_scrape_only_and_the_monitors_send_it(mode: str, tmp_path: Path) -> None:
    """Issue 29: the scrape credential was an operator tenant (it could act on a session whose id
    it knew) behind --allow-plaintext-remote. It is a scrape-only token now (the tenants file's
    metrics_tokens_sha256: no tenant's), and /metrics on the pod IP takes only it."""
    docs = rendered(mode, "all")
    cfg = serve_config(docs)
    tenants = tenants_of(docs, tmp_path)
    digest = bytes.fromhex(token_digest(SCRAPE_TOKEN))
    assert tenants.metrics_digests == (digest,) and tenants.is_metrics_token(SCRAPE_TOKEN)
    assert tenants.by_token_digest(digest) is None  # no tenant: every RPC refuses it
    listed = yaml.safe_load(VALUES_ALL.read_text())["tenants"]
    assert sorted(tenants.by_name) == sorted(t["name"] for t in listed["list"] + listed["groups"])
    assert not cfg.grpc.allow_plaintext_remote  # so no plaintext gRPC, and no acting token on /metrics
    assert cfg.metrics.metrics_plaintext_remote  # --allow-plaintext-metrics: scrape tokens only there
    assert cfg.metrics.metrics_host == "0.0.0.0" and metrics_scrape_only(cfg)
    check_metrics_exposure(cfg, len(tenants.metrics_digests))  # the daemon starts with it
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs)["Secret"]}
    for monitor in by_kind(docs)["ServiceMonitor"] + by_kind(docs)["PodMonitor"]:
        (endpoint,) = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        ref = endpoint["authorization"]["credentials"]
        assert endpoint["authorization"]["type"] == "Bearer"
        assert secrets[ref["name"]]["stringData"][ref["key"]] == SCRAPE_TOKEN


def test_tls_files_come_from_a_tls_secret_mounted_where_the_flags_point() -> None:
    docs = rendered("daemonset", "all")
    cfg = serve_config(docs)
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == "tls")
    volume = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "tls")
    secret = next(
        s for s in by_kind(docs)["Secret"] if s["metadata"]["name"] == volume["secret"]["secretName"]
    )
    assert secret["type"] == "kubernetes.io/tls" and mount["readOnly"]
    for path in (cfg.grpc.tls_cert, cfg.grpc.tls_key, cfg.grpc.tls_client_ca):
        assert Path(path).parent == Path(mount["mountPath"])
        assert Path(path).name in secret["stringData"]
    assert cfg.grpc.tls_require_client_cert
    existing = render(VALUES_ALL, sets=("tls.existingSecret=my-certs",))
    assert "tls" not in {s["metadata"]["name"].rpartition("-")[2] for s in by_kind(existing)["Secret"]}
    assert (
        next(v for v in pod_spec(existing)["volumes"] if v["name"] == "tls")["secret"]["secretName"]
        == "my-certs"
    )


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (("mode=node",), "mode"),
        (("tenants.enabled=true",), "tenants.list or tenants.existingSecret"),
        (("resources.limits.memory=8Gi",), "resources.limits.memory"),
        (("tls.enabled=true",), "tls.existingSecret"),
        (
            ("tenants.enabled=true", "tenants.list[0].name=a", "metrics.scrape.existingSecret=s"),
            "tokenSha256",
        ),
        (("daemon.extraArgs={--listen=0.0.0.0:50051}",), "daemon.extraArgs"),
        (("daemon.extraArgs={--allow-plaintext-metrics}",), "daemon.extraArgs"),
        (("daemon.hostBytes=16GBs",), "hostBytes"),
        (("tenants.list[0].name=a", "tenants.list[0].quotas.sesions=1"), "sesions"),
    ],
)
def test_bad_values_are_refused_naming_the_value(sets: tuple[str, ...], says: str) -> None:
    assert says in render_error("mode=sidecar", *sets)


def _chart_copy(tmp_path: Path, alerts: str | None, dashboard: str | None) -> Path:
    chart = tmp_path / "kvtier"
    shutil.copytree(CHART, chart)
    for name, text in (("kvtier-alerts.yaml", alerts), ("kvtier-dashboard.json", dashboard)):
        path = chart / "files" / name
        path.unlink(missing_ok=True)
        if text is not None:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    return chart


def test_prometheus_rule_and_dashboard_wrap_the_chart_files(tmp_path: Path) -> None:
    groups = [
        {
            "name": "kvtier",
            "rules": [
                {
                    "alert": "KvtierDown",
                    "expr": 'up{job="kvtier"} == 0',
                    "for": "5m",
                    "labels": {"severity": "critical"},
                    "annotations": {"summary": "kvtierd is down"},
                }
            ],
        }
    ]
    dashboard = json.dumps({"title": "kvtier", "panels": []}, indent=1)
    chart = _chart_copy(tmp_path, yaml.safe_dump({"groups": groups}), dashboard)
    docs = render(VALUES_ALL, chart=chart)
    (rule,) = by_kind(docs)["PrometheusRule"]
    assert rule["spec"]["groups"] == groups
    validate_crds(docs)
    (cm,) = [c for c in by_kind(docs)["ConfigMap"] if c["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvtier-dashboard.json"]) == json.loads(dashboard)
    validate_builtin(docs, tmp_path)


def test_without_the_files_the_chart_renders_without_rule_and_dashboard(tmp_path: Path) -> None:
    docs = render(VALUES_ALL, chart=_chart_copy(tmp_path, None, None))
    assert "PrometheusRule" not in by_kind(docs) and "ConfigMap" not in by_kind(docs)


def test_the_shipped_alerts_and_dashboard_when_present_render_and_validate(tmp_path: Path) -> None:
    """files/ is written by the observability work; once there, the chart must carry it whole."""
    files = CHART / "files"
    docs = render(VALUES_ALL)
    kinds = by_kind(docs)
    if (files / "kvtier-alerts.yaml").exists():
        (rule,) = kinds["PrometheusRule"]
        assert rule["spec"]["groups"] == yaml.safe_load((files / "kvtier-alerts.yaml").read_text())["groups"]
    if (files / "kvtier-dashboard.json").exists():
        (cm,) = kinds["ConfigMap"]
        assert json.loads(cm["data"]["kvtier-dashboard.json"]) == json.loads(
            (files / "kvtier-dashboard.json").read_text()
        )
    validate_crds(docs)
    validate_builtin(docs, tmp_path)


def test_rendered_tenants_file_is_valid_toml_with_the_values_types(tmp_path: Path) -> None:
    docs = rendered("sidecar", "all")
    (secret,) = [s for s in by_kind(docs)["Secret"] if s["metadata"]["name"].endswith("-tenants")]
    raw = tomllib.loads(secret["stringData"]["tenants.toml"])
    values = yaml.safe_load(VALUES_ALL.read_text())["tenants"]["list"]
    assert [t["name"] for t in raw["tenant"]] == [t["name"] for t in values]  # the scrape token: none
    assert raw["metrics_tokens_sha256"] == [token_digest(SCRAPE_TOKEN)]
    for got, want in zip(raw["tenant"], values, strict=False):
        assert got["quotas"] == want["quotas"]
        assert got["transports"] == want["transports"]


def test_an_engine_chart_carries_kvtier_in_its_own_pod(tmp_path: Path) -> None:
    """mode external: the named templates put the same container in a dependent chart's pod."""
    chart = tmp_path / "engine-chart"
    shutil.copytree(Path(__file__).parents[2] / "data" / "helm" / "engine-chart", chart)
    meta = chart / "Chart.yaml"
    meta.write_text(meta.read_text().replace("KVTIER_CHART", str(CHART)))
    out = helm("dependency", "build", str(chart))
    assert out.returncode == 0, out.stderr
    docs = render(chart=chart)
    kinds = by_kind(docs)
    assert "DaemonSet" not in kinds and [d["metadata"]["name"] for d in kinds["Deployment"]] == ["my-engine"]
    cfg = serve_config(docs)
    assert cfg.host_tier.host_bytes == 8 << 30 and cfg.grpc.listen.startswith("127.0.0.1:")
    socket_dir = str(Path(cfg.grpc.socket_path).parent)
    assert {"name": "kvtier-run", "mountPath": socket_dir} in container(docs, "engine")["volumeMounts"]
    assert {"name": "kvtier-run", "mountPath": socket_dir} in container(docs)["volumeMounts"]
    (init,) = pod_spec(docs)["initContainers"]  # the emptyDir made 1770: kvtierd refuses 2777
    assert init["volumeMounts"] == [{"name": "kvtier-run", "mountPath": socket_dir}]
    assert "chmod 1770" in init["command"][2]
    labels = kinds["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    (pm,) = kinds["PodMonitor"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    validate_builtin(docs, tmp_path)
    validate_crds(docs)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_tenants_file_rolls_the_pods(mode: str) -> None:
    def checksum(*sets: str) -> str:
        docs = render(VALUES_ALL, sets=(f"mode={mode}", *sets))
        (workload,) = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
        return str(workload["spec"]["template"]["metadata"]["annotations"]["checksum/secrets"])

    assert checksum() != checksum("tenants.list[1].quotas.sessions=32")


@pytest.mark.parametrize("sets", [("metrics.exposed=false",), ("metrics.enabled=false",)])
def test_metrics_kept_on_loopback_or_off_render_no_scrape_token_and_no_plaintext_flag(
    sets: tuple[str, ...], tmp_path: Path
) -> None:
    docs = render(VALUES_ALL, sets=sets)
    cfg = serve_config(docs)
    if sets == ("metrics.enabled=false",):
        assert cfg.metrics.metrics_port == -1
    else:
        assert cfg.metrics.metrics_host == "127.0.0.1"
    assert not cfg.grpc.allow_plaintext_remote and not cfg.metrics.metrics_plaintext_remote
    assert "metrics" not in {p["name"] for p in container(docs)["ports"]}
    kinds = by_kind(docs)
    assert not {"Service", "ServiceMonitor", "PodMonitor"} & set(kinds)
    assert tenants_of(docs, tmp_path).metrics_digests == ()
    validate_builtin(docs, tmp_path)


def test_the_image_defaults_to_the_projects_version_and_says_it_is_a_placeholder() -> None:
    """No registry publishes the image (issue 39): values.yaml, the chart's README and NOTES say
    so, and how to build, push and name it."""
    for mode in MODES:
        assert container(rendered(mode, "defaults"))["image"].endswith(f"/kvtier:{__version__}")
    for text in ((CHART / "values.yaml").read_text(), (CHART / "README.md").read_text()):
        assert "docker build" in text and "docker push" in text and "image.repository" in text
    out = helm(
        "install",
        "rel",
        str(CHART),
        "--dry-run=client",
        *[a for s in least("daemonset") for a in ("--set", s)],
    )
    assert out.returncode == 0, out.stderr
    assert "placeholder" in out.stdout and "docker push" in out.stdout  # NOTES
    out = helm(
        "install",
        "rel",
        str(CHART),
        "--dry-run=client",
        "--set",
        "mode=sidecar",
        "--set",
        "image.repository=r.io/kvtier",
    )
    assert out.returncode == 0 and "placeholder" not in out.stdout, out.stderr


def _token_secret(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (secret,) = [s for s in by_kind(docs)["Secret"] if s["metadata"]["name"].endswith("-metrics-token")]
    return secret


@pytest.mark.parametrize("mode", MODES)
def test_tls_listeners_without_a_client_credential_are_refused(mode: str) -> None:
    """Issue 39 (HIGH): tls.enabled with no tenants rendered gRPC and the data port on 0.0.0.0
    with no client credential, so a client holding only the CA certificate read every block."""
    pem = ("tls.enabled=true", "tls.cert=CERT", "tls.key=KEY")
    bare = (f"mode={mode}", "daemonset.allowWithoutTenants=true", *pem)
    assert "tls.enabled: gRPC and the data channel would listen on the pod IP with no client credential" in (
        render_error(*bare)
    )
    mtls = serve_config(render(sets=(*bare, "tls.requireClientCert=true", "tls.clientCA=CA")))
    assert mtls.grpc.listen.startswith("0.0.0.0:") and mtls.grpc.tls_require_client_cert
    assert not mtls.tenancy.tenants_file
    tenanted = serve_config(render(sets=(f"mode={mode}", *NODE_TENANT, *pem)))
    assert tenanted.grpc.listen.startswith("0.0.0.0:") and tenanted.tenancy.tenants_file


def test_a_node_daemonset_without_tenants_is_refused_unless_declared_one_trust_domain() -> None:
    """Issue 39 (MEDIUM): the DaemonSet had no tenants file by default (every engine pod of the
    node read and wrote every block) and /metrics on the pod IP asked no token."""
    assert "mode daemonset: without tenants every engine pod" in render_error()
    assert "daemonset.allowWithoutTenants" in render_error()
    docs = render(sets=("daemonset.allowWithoutTenants=true",))
    assert not serve_config(docs).tenancy.tenants_file  # the operator's explicit choice
    sidecar = render(sets=("mode=sidecar",))  # one engine per pod: the pod is the trust domain
    assert not serve_config(sidecar).tenancy.tenants_file


@pytest.mark.parametrize("mode", MODES)
def test_without_a_given_scrape_token_the_chart_makes_one_and_the_monitors_send_it(
    mode: str, tmp_path: Path
) -> None:
    """Issue 39 (MEDIUM): /metrics on the pod IP gets a scrape token by default. Given none, the
    chart makes a random one: its Secret, the tenants file's digest (the daemon starts with it:
    check_metrics_exposure) and both monitors agree within one render."""
    sets = (
        *least(mode),
        *NODE_TENANT,
        "metrics.serviceMonitor.enabled=true",
        "metrics.podMonitor.enabled=true",
    )
    docs = render(sets=sets)
    token = _token_secret(docs)["stringData"]["token"]
    assert len(token) >= 32 and token.isalnum()
    tenants = tenants_of(docs, tmp_path)
    assert tenants.is_metrics_token(token) and len(tenants.metrics_digests) == 1
    cfg = serve_config(docs)
    assert metrics_scrape_only(cfg)
    check_metrics_exposure(cfg, len(tenants.metrics_digests))
    for monitor in by_kind(docs)["ServiceMonitor"] + by_kind(docs)["PodMonitor"]:
        (endpoint,) = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        ref = endpoint["authorization"]["credentials"]
        assert ref == {"name": _token_secret(docs)["metadata"]["name"], "key": "token"}
    validate_builtin(docs, tmp_path)
    validate_crds(docs)
    assert _token_secret(render(sets=sets))["stringData"]["token"] != token  # random, not derived


SIZES_TAKEN = [
    "16GiB",
    "16gib",
    "16 GiB",
    " 16GiB ",
    "512MiB",
    "1.5GiB",
    "0.5KiB",
    "100GB",
    "4k",
    "4Ki",
    "4KB",
    "4kib",
    "2T",
    "1b",
    "16Gi",
    "16G",
    "4096",
]
SIZES_REFUSED = ["16GBs", "16 XB", "-1GiB", "1.5", "0.1KiB", "GiB", "1,5GiB", "1e3", "16 G iB", ""]


@pytest.mark.parametrize("size", SIZES_TAKEN + SIZES_REFUSED)
def test_the_schema_takes_exactly_the_sizes_kvtierd_takes(size: str, tmp_path: Path) -> None:
    """Issue 39 (new user): the schema refused sizes the daemon accepts. Each size goes to
    daemon.hostBytes; a memory limit of 1 byte makes the chart say the bytes it counted, which
    must be parse_bytes' (the daemon's parser); a size it refuses, the chart refuses."""
    try:
        want: int | None = parse_bytes(size)
    except ValueError:
        want = None
    assert (want is not None) == (size in SIZES_TAKEN), size  # the lists agree with the parser
    values = tmp_path / "v.yaml"
    values.write_text(  # JSON: every size a string (YAML would read 1e3 as a number)
        json.dumps(
            {"mode": "sidecar", "daemon": {"hostBytes": size}, "resources": {"limits": {"memory": "1"}}}
        )
    )
    out = helm("template", "rel", str(CHART), "--values", str(values))
    assert out.returncode != 0
    if want is None:
        assert "must exceed" not in out.stderr, out.stderr
        assert "hostBytes" in out.stderr or "size" in out.stderr, out.stderr
    else:
        assert f"every tenant's and group's arena ({want} bytes)" in out.stderr, out.stderr


def test_sizes_may_be_numbers_in_values_files(tmp_path: Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text("mode: sidecar\ndaemon:\n  hostBytes: 17179869184\n")
    cfg = serve_config(render(values))
    assert cfg.host_tier.host_bytes == 16 << 30


@pytest.mark.parametrize("policy", get_args(PolicyName))
def test_every_eviction_policy_kvtierd_takes_the_chart_takes(policy: str) -> None:
    """``daemon.evictionPolicy``: the schema takes exactly kvtierd's policies, and the chart's
    default is kvtierd's (an operator who leaves it out gets what the docs say)."""
    cfg = serve_config(render(sets=(*least("sidecar"), f"daemon.evictionPolicy={policy}")))
    assert cfg.host_tier.eviction_policy == policy
    schema = json.loads((CHART / "values.schema.json").read_text())
    policies = schema["properties"]["daemon"]["properties"]["evictionPolicy"]["enum"]
    assert sorted(policies) == sorted(get_args(PolicyName))
    default = serve_config(rendered("sidecar", "defaults")).host_tier.eviction_policy
    assert default == DaemonConfig().host_tier.eviction_policy

"""Static checks of the Dockerfile and the Kubernetes manifest (no docker, no cluster needed).

The `kvtierd serve` flags both files use are parsed by the real ``kvtier.cli.build_parser()`` and
matched against its option strings exactly (argparse would accept a prefix of a renamed flag), then
turned into a validated ``DaemonConfig``. Ports, paths and sizes must agree across the files. PyYAML
is not a dependency: the manifest is read with a small indentation-based helper (``node``) and the
kvtier container's ``command``/``args`` are one-line JSON-style lists.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from redis_cluster import make_test_pki

from kvtierd.app import SERVICE_NAME
from kvtierd.cli import build_parser
from kvtierd.config import DaemonConfig, flat_keys, with_overrides

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SIDECAR = ROOT / "deploy" / "kubernetes" / "sidecar.yaml"
IMAGE = "python:3.11-slim"

# -- helpers: kvtierd serve ------------------------------------------------------------------------


def serve_options() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings}


def parse_serve(argv: list[str]) -> tuple[argparse.Namespace, DaemonConfig]:
    """``argv`` starts with ``kvtierd serve``: every flag must exist verbatim and parse."""
    assert argv[:2] == ["kvtierd", "serve"], argv
    unknown = [a for a in argv[2:] if a.startswith("--") and a.split("=")[0] not in serve_options()]
    assert not unknown, f"flags not offered by `kvtierd serve`: {unknown}"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`kvtierd serve` rejects {argv[2:]}")
    fields = set(flat_keys())
    cfg = with_overrides(DaemonConfig(), **{k: v for k, v in vars(args).items() if k in fields})
    return args, cfg


def port_of(hostport: str) -> int:
    return int(hostport.rpartition(":")[2])


# -- helpers: Dockerfile --------------------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, rest = (pending + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def exec_form(word: str) -> list[str]:
    values = [rest for w, rest in final_stage() if w == word]
    assert values, f"no {word} in the final stage"
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), values[-1]
    return parsed


def healthcheck_argv() -> list[str]:
    checks = [rest for w, rest in final_stage() if w == "HEALTHCHECK"]
    assert len(checks) == 1, "one HEALTHCHECK in the final stage"
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", checks[0])
    assert m, f"HEALTHCHECK must use the exec form CMD [...]: {checks[0]}"
    argv = json.loads(m.group(1))
    assert isinstance(argv, list)
    return [str(a) for a in argv]


def docker_serve_argv() -> list[str]:
    return exec_form("ENTRYPOINT") + exec_form("CMD")


# -- helpers: the manifest ------------------------------------------------------------------------


def node(lines: list[str], pattern: str) -> list[str]:
    """The first line matching ``pattern`` and every following line indented deeper than it."""
    for i, line in enumerate(lines):
        if re.match(pattern, line):
            indent = len(line) - len(line.lstrip(" "))
            block = [line]
            for nxt in lines[i + 1 :]:
                if (
                    nxt.strip()
                    and not nxt.lstrip().startswith("#")
                    and len(nxt) - len(nxt.lstrip(" ")) <= indent
                ):
                    break
                block.append(nxt)
            return block
    raise AssertionError(f"no line matches {pattern!r}")


def value(lines: list[str], key: str) -> str:
    for line in lines:
        m = re.match(rf"^\s*(?:- )?{re.escape(key)}:\s*(.+?)\s*(?:#.*)?$", line)
        if m:
            return m.group(1).strip("\"'")
    raise AssertionError(f"no {key!r} in {lines[:1]}")


def flow_list(lines: list[str], key: str) -> list[str]:
    text = next(ln for ln in lines if re.match(rf"^\s*{key}:\s*\[", ln))
    parsed = json.loads(text.split(":", 1)[1])
    assert isinstance(parsed, list)
    return [str(a) for a in parsed]


def manifest() -> list[str]:
    return SIDECAR.read_text().splitlines()


def container(name: str) -> list[str]:
    return node(manifest(), rf"^\s*- name: {name}\s*$")


def kvtier_serve_argv() -> list[str]:
    c = container("kvtier")
    return flow_list(c, "command") + flow_list(c, "args")


_QUANTITY = {
    "": 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT]?)", q)
    assert m, f"unsupported memory quantity {q!r}"
    return int(m.group(1)) * _QUANTITY[m.group(2)]


# -- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_builds_from_python_slim_without_torch() -> None:
    ins = instructions()
    bases = [rest.split()[0] for w, rest in ins if w == "FROM"]
    assert bases and all(b == IMAGE for b in bases), bases
    runs = " ".join(rest for w, rest in ins if w == "RUN")
    assert "pip" in runs and "torch" not in runs and "cuda" not in runs.lower()


def test_dockerfile_runs_as_a_numeric_non_root_user() -> None:
    stage = final_stage()
    users = [i for i, (w, _) in enumerate(stage) if w == "USER"]
    assert users, "no USER in the final stage: the daemon would run as root"
    user = stage[users[-1]][1].split(":")
    assert user[0].isdigit() and int(user[0]) != 0, f"USER {stage[users[-1]][1]}"
    assert all(g.isdigit() and int(g) != 0 for g in user[1:])
    entry = next(i for i, (w, _) in enumerate(stage) if w == "ENTRYPOINT")
    assert users[-1] < entry
    assert not [w for w, _ in stage[users[-1] :] if w == "RUN"], "RUN after USER runs as the user"


def test_dockerfile_serve_flags_exist_and_agree_with_exposed_ports() -> None:
    args, cfg = parse_serve(docker_serve_argv())
    assert cfg.grpc.socket_path == "/run/kvtier/kvtier.sock"
    assert cfg.grpc.listen == "127.0.0.1:50051"  # never 0.0.0.0 in plaintext (docs/security.md)
    assert cfg.grpc.health_listen == "0.0.0.0:50052" and cfg.metrics.metrics_host == "0.0.0.0"
    # plaintext /metrics off loopback: the narrow explicit flag, never the broad one
    assert cfg.metrics.metrics_plaintext_remote and not cfg.grpc.allow_plaintext_remote
    exposed = {int(p.split("/")[0]) for w, rest in final_stage() if w == "EXPOSE" for p in rest.split()}
    assert {port_of(cfg.grpc.health_listen), cfg.metrics.metrics_port} <= exposed, exposed
    volumes = [rest for w, rest in final_stage() if w == "VOLUME"]
    assert any(str(Path(cfg.grpc.socket_path).parent) in v for v in volumes), volumes


def test_dockerfile_healthcheck_asks_grpc_health_on_the_plaintext_health_port() -> None:
    argv = healthcheck_argv()
    _, cfg = parse_serve(docker_serve_argv())
    assert argv[:2] == ["python", "-c"], argv
    compile(argv[2], "<HEALTHCHECK>", "exec")
    assert "grpc_health.v1" in argv[2] and "insecure_channel" in argv[2]
    # The health-only listener is plaintext whatever --listen serves (TLS, per the Dockerfile).
    assert f"127.0.0.1:{port_of(cfg.grpc.health_listen)}" in argv[2]
    assert f":{port_of(cfg.grpc.listen)}" not in argv[2]
    assert f"service='{SERVICE_NAME}'" in argv[2]


def test_healthcheck_passes_on_a_daemon_serving_tls_as_advised_and_fails_once_it_stops(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """The HEALTHCHECK's own code, pointed at a test daemon's health listener, the daemon started
    with the Dockerfile's TLS advice (--listen with --tls-cert/--tls-key). The control port itself
    refuses the plaintext probe: what the HEALTHCHECK asked before (issue 29, item 8)."""
    make_test_pki(tmp_path / "pki")
    _, cfg = parse_serve(docker_serve_argv())
    daemon = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        str(tmp_path / "pki" / "server.crt"),
        "--tls-key",
        str(tmp_path / "pki" / "server.key"),
        "--health-listen",
        "127.0.0.1:0",
    )
    code = healthcheck_argv()[2]

    def check(address: str) -> int:
        probe = code.replace(f"127.0.0.1:{port_of(cfg.grpc.health_listen)}", address)
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode

    assert check(daemon.info["health"]) == 0  # SERVING
    assert check(daemon.grpc) != 0  # the TLS control port: a plaintext probe fails
    daemon.stop()
    assert check(daemon.info["health"]) != 0  # refused: unhealthy


def test_dockerfile_installs_the_two_wheels_its_build_stage_builds() -> None:
    ins = instructions()
    stages = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    assert len(stages) == 2, "a build stage and the runtime stage"
    build, final = ins[stages[0] : stages[1]], final_stage()
    assert any(w == "RUN" and "scripts/build_wheels.py --out /wheels" in r for w, r in build)
    copied = {src.rstrip("/") for w, r in build if w == "COPY" for src in shlex.split(r)[:-1]}
    spec = importlib.util.spec_from_file_location("build_wheels", ROOT / "scripts" / "build_wheels.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    inputs = [p for ps in script.PACKAGES.values() for p in ps] + [
        ROOT / "packaging",
        ROOT / "README.md",
        ROOT / "scripts" / "build_wheels.py",
    ]
    missing = [
        str(p.relative_to(ROOT))
        for p in inputs
        if not any(p.relative_to(ROOT).is_relative_to(c) for c in copied)
    ]
    assert not missing, f"the build stage does not COPY what scripts/build_wheels.py reads: {missing}"
    installs = " ".join(r for w, r in final if w == "RUN" and "pip install" in r)
    assert "/wheels/kvtier-*.whl" in installs and "/wheels/kvtierd-*.whl)[cluster,events]" in installs


def test_dockerfile_copies_only_what_exists_and_is_not_dockerignored() -> None:
    ignored = [
        ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    for must in (".venv", "run", ".git"):
        assert must in ignored, f".dockerignore must exclude {must}"
    for word, rest in instructions():
        if word != "COPY" or rest.startswith("--from"):
            continue
        *sources, _dest = shlex.split(rest)
        for src in sources:
            if any(ch in src for ch in "*?["):
                continue  # optional by design: a wildcard may match nothing
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            hit = [p for p in ignored if fnmatch.fnmatch(src.rstrip("/"), p)]
            assert not hit, f"COPY {src} is excluded by .dockerignore {hit}"


# -- Kubernetes sidecar ---------------------------------------------------------------------------


def test_sidecar_is_a_deployment_with_an_engine_and_kvtier() -> None:
    text = SIDECAR.read_text()
    assert "\t" not in text, "YAML must be indented with spaces"
    assert re.search(r"^apiVersion: apps/v1$", text, re.M)
    assert re.search(r"^kind: Deployment$", text, re.M)
    container("engine")
    container("kvtier")


def test_sidecar_serve_flags_exist_and_the_socket_dir_is_shared_at_the_same_path() -> None:
    _, cfg = parse_serve(kvtier_serve_argv())
    socket_dir = str(Path(cfg.grpc.socket_path).parent)
    for name in ("engine", "kvtier"):
        mounts = node(container(name), r"^\s*volumeMounts:")
        assert re.search(
            rf"- name: kvtier-run\s*\n\s*mountPath: {re.escape(socket_dir)}\s*$", "\n".join(mounts), re.M
        ), f"{name} must mount kvtier-run at {socket_dir}"
    volume = node(manifest(), r"^\s*- name: kvtier-run\s*$")  # the first one is the pod volume
    assert any(re.match(r"^\s*emptyDir:", ln) for ln in volume), volume
    assert any(f"unix://{cfg.grpc.socket_path}" in ln for ln in container("engine"))


def test_sidecar_memory_limit_exceeds_the_host_tier() -> None:
    _, cfg = parse_serve(kvtier_serve_argv())
    resources = node(container("kvtier"), r"^\s*resources:")
    limit = quantity_bytes(value(node(resources, r"^\s*limits:"), "memory"))
    request = quantity_bytes(value(node(resources, r"^\s*requests:"), "memory"))
    assert limit > cfg.host_tier.host_bytes, (limit, cfg.host_tier.host_bytes)
    assert request == limit  # the arena is prefaulted: all of it is used from the start


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_sidecar_probes_use_grpc_health_on_the_health_port(probe: str) -> None:
    _, cfg = parse_serve(kvtier_serve_argv())
    grpc_node = node(node(container("kvtier"), rf"^\s*{probe}:"), r"^\s*grpc:")
    assert int(value(grpc_node, "port")) == port_of(cfg.grpc.health_listen)
    service = [ln for ln in grpc_node if re.match(r"^\s*service:", ln)]
    if service:
        assert value(grpc_node, "service") == SERVICE_NAME


def test_sidecar_ports_and_prometheus_annotations_agree_with_the_flags() -> None:
    _, cfg = parse_serve(kvtier_serve_argv())
    assert cfg.grpc.health_listen.startswith("0.0.0.0:"), "kubelet probes reach the pod IP"
    assert cfg.grpc.listen.startswith("127.0.0.1:"), "never 0.0.0.0 in plaintext"
    assert cfg.metrics.metrics_host == "0.0.0.0"
    # the narrow flag only
    assert cfg.metrics.metrics_plaintext_remote and not cfg.grpc.allow_plaintext_remote
    ports = {int(p) for p in re.findall(r"containerPort:\s*(\d+)", "\n".join(container("kvtier")))}
    assert {port_of(cfg.grpc.health_listen), cfg.metrics.metrics_port} <= ports
    annotations = node(manifest(), r"^\s{6}annotations:")
    assert value(annotations, "prometheus.io/scrape") == "true"
    assert int(value(annotations, "prometheus.io/port")) == cfg.metrics.metrics_port


def test_sidecar_kvtier_container_runs_as_non_root() -> None:
    sc = node(container("kvtier"), r"^\s*securityContext:")
    assert value(sc, "runAsNonRoot") == "true"
    assert int(value(sc, "runAsUser")) != 0
    assert value(sc, "allowPrivilegeEscalation") == "false"


def test_sidecar_parses_as_yaml() -> None:
    import yaml  # PyYAML is a dev dependency: this test is never skipped

    docs = [d for d in yaml.safe_load_all(SIDECAR.read_text()) if d]
    assert [d["kind"] for d in docs] == ["Deployment"]
    containers = {c["name"]: c for c in docs[0]["spec"]["template"]["spec"]["containers"]}
    assert containers["kvtier"]["command"] + containers["kvtier"]["args"] == kvtier_serve_argv()


# -- Kubernetes node DaemonSet (docs/security.md) ---------------------------------------------------

DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def _daemonset() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import yaml

    docs = {d["kind"]: d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d}
    assert set(docs) == {"Secret", "DaemonSet"}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (kvtier,) = pod["containers"]
    return docs["Secret"], pod, kvtier


def _sidecar_pod() -> dict[str, Any]:
    import yaml

    (deployment,) = [d for d in yaml.safe_load_all(SIDECAR.read_text()) if d]
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def test_daemonset_prepares_its_socket_dir_as_the_chart_does() -> None:
    """The node's /run/kvtier (a tmpfs: gone after a reboot) is made if missing and given to
    10001 by an init container with only CHOWN and FOWNER: the chart's, same image."""
    _, pod, kvtier = _daemonset()
    run = next(v for v in pod["volumes"] if v["name"] == "kvtier-run")
    assert run["hostPath"] == {"path": "/run/kvtier", "type": "DirectoryOrCreate"}
    (init,) = pod["initContainers"]
    assert init["image"] == kvtier["image"] and init["command"][-1] == "/run/kvtier"
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


@pytest.mark.parametrize("shape", ["daemonset", "sidecar"])
def test_the_socket_directory_is_made_sticky_for_the_daemon(shape: str, tmp_path: Path) -> None:
    """A 0770 directory of the engines' group (or an emptyDir, 2777) let another uid rename
    kvtier.sock away and serve a fake one that logged a tenant's token; kvtierd refuses such a
    directory. Each manifest's init container (run here on a real directory) makes it 10001's,
    mode 1770, and the image's /run/kvtier is made so too."""
    pod = _daemonset()[1] if shape == "daemonset" else _sidecar_pod()
    (init,) = pod["initContainers"]
    kvtier = next(c for c in pod["containers"] if c["name"] == "kvtier")
    assert init["image"] == kvtier["image"]
    assert init["volumeMounts"] == [{"name": "kvtier-run", "mountPath": "/run/kvtier"}]
    assert init["command"][-1] == "/run/kvtier"
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert "chmod 1770 /run/kvtier" in DOCKERFILE.read_text()
    if os.geteuid() != 0:
        pytest.skip("chown to 10001 needs root")
    run = tmp_path / "run-kvtier"
    run.mkdir()
    os.chmod(run, 0o2777)  # an emptyDir with an fsGroup (a hostPath: 0755)
    subprocess.run([*init["command"][:-1], str(run)], check=True, timeout=30)
    st = run.stat()
    mode = stat.S_IMODE(st.st_mode) & ~stat.S_ISGID  # (chmod keeps a directory's setgid: harmless)
    assert (st.st_uid, st.st_gid, mode) == (10001, 10001, 0o1770)


def test_daemonset_is_unprivileged_and_shares_a_hostpath_socket_dir_without_host_ipc() -> None:
    _, pod, kvtier = _daemonset()
    assert not pod.get("hostIPC") and not pod.get("hostNetwork") and not pod.get("hostPID")
    sc = kvtier["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0 and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    _, cfg = parse_serve(kvtier["command"] + kvtier["args"])
    run = next(v for v in pod["volumes"] if v["name"] == "kvtier-run")
    assert run["hostPath"]["path"] == str(Path(cfg.grpc.socket_path).parent)
    # nothing plaintext off-node but /metrics (figures, for the scrape token: see below)
    assert cfg.grpc.listen == "" and cfg.transports.data_listen.startswith("127.0.0.1:")


def test_daemonset_tenants_file_comes_from_a_secret_and_parses(tmp_path: Path) -> None:
    from kvtierd.tenants_file import load_tenants

    secret, pod, kvtier = _daemonset()
    _, cfg = parse_serve(kvtier["command"] + kvtier["args"])
    mount = next(m for m in kvtier["volumeMounts"] if m["name"] == "tenants")
    assert cfg.tenancy.tenants_file == f"{mount['mountPath']}/tenants.toml" and mount["readOnly"]
    volume = next(v for v in pod["volumes"] if v["name"] == "tenants")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    tenants = load_tenants(tmp_path / "tenants.toml")
    assert any(t.operator for t in tenants.by_name.values())
    assert any(t.transports == frozenset({"tcp"}) for t in tenants.by_name.values())


def test_daemonset_tenants_set_every_quota_within_the_daemons_share(tmp_path: Path) -> None:
    """Issue 26: the example tenants left pinned_bytes and open_jobs unset. Every quota is
    written down, and the shared arena's tenants (tcp only) fit it together."""
    from kvtierd.tenancy import QUOTA_NAMES
    from kvtierd.tenants_file import load_tenants

    secret, _, kvtier = _daemonset()
    _, cfg = parse_serve(kvtier["command"] + kvtier["args"])
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    tenants = load_tenants(tmp_path / "tenants.toml").by_name.values()
    for t in tenants:
        unset = [n for n in QUOTA_NAMES if getattr(t.quotas, n) is None]
        assert not unset, (t.name, unset)
    shared = [t.quotas.host_bytes or 0 for t in tenants if not t.maps_memory]
    assert sum(shared) <= cfg.host_tier.host_bytes, (shared, cfg.host_tier.host_bytes)
    assert sum(t.quotas.sessions or 0 for t in tenants) <= cfg.sessions.max_sessions
    assert sum(t.quotas.namespaces or 0 for t in tenants) <= cfg.sessions.max_namespaces


def test_daemonset_memory_limit_covers_the_shared_arena_and_every_tenant_arena(tmp_path: Path) -> None:
    from kvtierd.tenants_file import load_tenants

    secret, _, kvtier = _daemonset()
    _, cfg = parse_serve(kvtier["command"] + kvtier["args"])
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    tenants = load_tenants(tmp_path / "tenants.toml")
    arenas = sum(
        t.arena_size(cfg.tenancy.tenant_arena_bytes) for t in tenants.by_name.values() if t.maps_memory
    )
    resources = kvtier["resources"]
    limit = quantity_bytes(resources["limits"]["memory"])
    assert limit > cfg.host_tier.host_bytes + arenas, (limit, cfg.host_tier.host_bytes, arenas)
    assert quantity_bytes(resources["requests"]["memory"]) == limit  # prefaulted arenas


def test_daemonset_metrics_are_scrapeable_on_the_pod_ip_with_a_scrape_only_token(tmp_path: Path) -> None:
    """Issue 29: /metrics was bound to the pod's loopback, out of Prometheus' reach. It is on the
    pod IP now; with tenants it asks for a token, which a scrape sends in plaintext HTTP, so the
    file has a scrape-only token (metrics_tokens_sha256: no tenant's, refused by every RPC) and
    --allow-plaintext-metrics, not --allow-plaintext-remote: /metrics there takes only it
    (tests/integration/tenancy/test_scrape_tokens.py and test_helm_daemon.py, on a real daemon)."""
    from kvtierd.tenancy.exposure import check_metrics_exposure, metrics_scrape_only
    from kvtierd.tenancy.tenancy import QUOTA_NAMES
    from kvtierd.tenants_file import load_tenants

    secret, _, kvtier = _daemonset()
    _, cfg = parse_serve(kvtier["command"] + kvtier["args"])
    assert cfg.metrics.metrics_host == "0.0.0.0" and not cfg.grpc.allow_plaintext_remote
    assert cfg.metrics.metrics_plaintext_remote  # --allow-plaintext-metrics: scrape tokens only there
    assert cfg.grpc.listen == "" and cfg.transports.data_listen.startswith("127.0.0.1:")
    assert {"name": "metrics", "containerPort": cfg.metrics.metrics_port} in kvtier["ports"]
    (tmp_path / "tenants.toml").write_text(secret["stringData"]["tenants.toml"])
    tenants = load_tenants(tmp_path / "tenants.toml")
    assert len(tenants.metrics_digests) == 1 and metrics_scrape_only(cfg)
    check_metrics_exposure(cfg, len(tenants.metrics_digests))  # the daemon starts with it
    assert tenants.by_token_digest(tenants.metrics_digests[0]) is None  # no tenant's token
    operators = [t for t in tenants.by_name.values() if t.operator]
    for t in operators:  # `kvtier stats` over the socket; refused by /metrics on the pod IP
        held = {n: getattr(t.quotas, n) for n in QUOTA_NAMES if n != "buffered_bytes"}
        assert set(held.values()) == {0}, (t.name, held)


def test_plain_manifests_pass_strict_kubernetes_schemas(tmp_path: Path) -> None:
    import yaml
    from helm_chart import validate_builtin

    for path in (SIDECAR, DAEMONSET):
        validate_builtin([d for d in yaml.safe_load_all(path.read_text()) if d], tmp_path)


def test_manifests_name_the_projects_version() -> None:
    from kvtier_contract.version import __version__

    for path in (SIDECAR, DAEMONSET):
        tags = set(re.findall(r"image: \S+/kvtier:(\S+)", path.read_text()))
        assert tags == {__version__}, (path.name, tags)

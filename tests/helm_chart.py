"""Render deploy/helm/kvtier with the real helm binary and check manifests against real schemas.

The tools are installed by ``make helm`` (a prerequisite of ``make test``) under ``.venv/tools``:
``helm`` (the official binary, pinned by SHA-256), ``kv/`` (a venv with kubernetes-validate and
the Kubernetes JSON schemas it ships) and ``crd/`` (@kubernetes-models/prometheus-operator: the
ServiceMonitor, PodMonitor and PrometheusRule schemas). ``$KVTIER_HELM_TOOLS`` names another
folder; without the tools the tests fail and say how to get them (``KVTIER_SKIP_HELM=1`` skips).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtierd.cli import build_parser
from kvtierd.config import DaemonConfig, flat_keys, with_overrides

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvtier"
VALUES_ALL = ROOT / "tests" / "data" / "helm" / "values-all.yaml"
VALIDATOR = ROOT / "tests" / "data" / "prometheus-operator" / "validate.mjs"
KUBERNETES_VERSION = "1.35.0"
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def tools() -> Path:
    """The folder ``make helm`` fills; fails (or skips, when asked) without it."""
    if os.environ.get("KVTIER_SKIP_HELM") == "1":
        pytest.skip("KVTIER_SKIP_HELM=1")
    folder = Path(os.environ.get("KVTIER_HELM_TOOLS") or ROOT / ".venv" / "tools")
    missing = [
        p for p in ("helm", "kv/bin/kubernetes-validate", "crd/node_modules") if not (folder / p).exists()
    ]
    if missing:
        pytest.fail(
            f"{folder}: no {', '.join(missing)}: run `make helm` (or set "
            "KVTIER_HELM_TOOLS, or KVTIER_SKIP_HELM=1 to skip these tests)",
            pytrace=False,
        )
    return folder


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """``helm ARGS`` with no cluster, no repositories and no home of its own."""
    home = tools() / "home"
    env = dict(
        os.environ,
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
        KUBECONFIG=os.devnull,
    )
    return subprocess.run(
        [str(tools() / "helm"), *args], capture_output=True, text=True, env=env, timeout=120
    )


def render(*values: Path, chart: Path = CHART, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``helm template`` of ``chart`` with the values files and ``--set`` entries given."""
    argv = ["template", "rel", str(chart), "--namespace", "kvtier"]
    for v in values:
        argv += ["--values", str(v)]
    for s in sets:
        argv += ["--set", s]
    out = helm(*argv)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_error(*sets: str, values: tuple[Path, ...] = ()) -> str:
    """What ``helm template`` says when it refuses ``sets``: it must refuse them."""
    argv = ["template", "rel", str(CHART)]
    for v in values:
        argv += ["--values", str(v)]
    for s in sets:
        argv += ["--set", s]
    out = helm(*argv)
    assert out.returncode != 0, f"helm rendered {sets}"
    return out.stderr


def validate_builtin(docs: list[dict[str, Any]], tmp: Path) -> None:
    """Every built-in object against Kubernetes' own schemas, unknown fields refused."""
    path = tmp / "builtin.yaml"
    path.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CRD_KINDS]))
    out = subprocess.run(
        [
            str(tools() / "kv" / "bin" / "kubernetes-validate"),
            "--strict",
            "--quiet",
            "-k",
            KUBERNETES_VERSION,
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def validate_crds(docs: list[dict[str, Any]]) -> None:
    """ServiceMonitor, PodMonitor and PrometheusRule against prometheus-operator's schemas."""
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    out = subprocess.run(
        ["node", "--input-type=module", "-e", VALIDATOR.read_text()],
        input=json.dumps(crds),
        capture_output=True,
        text=True,
        cwd=tools() / "crd",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [], out.stdout


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    return kinds


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (workload,) = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(docs: list[dict[str, Any]], name: str = "kvtier") -> dict[str, Any]:
    (c,) = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
    return c


def serve_options() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["serve"]._actions for s in a.option_strings}


def parse_serve(argv: list[str]) -> DaemonConfig:
    """``kvtierd serve ...``: every flag exists verbatim, parses, and makes a valid config."""
    assert argv[:2] == ["kvtierd", "serve"], argv
    unknown = [a for a in argv[2:] if a.startswith("--") and a.split("=")[0] not in serve_options()]
    assert not unknown, f"flags not offered by `kvtierd serve`: {unknown}"
    args = build_parser().parse_args(argv[1:])
    fields = set(flat_keys())
    return with_overrides(DaemonConfig(), **{k: v for k, v in vars(args).items() if k in fields})

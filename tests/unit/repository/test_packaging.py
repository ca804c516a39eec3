"""The packaging's single sources (issue 29, items 3-5), checked without building anything.

Requirements are written once (packaging/*/requirements.txt) and read by the root development
project; the extras the docs name agree between the root project and the distributions; torch is
never a requirement; ``make serve`` installs only the runtime requirements (no dev tools, torch or
Redis) and passes its ports through. The wheels themselves: tests/integration/deploy/test_wheels.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


def project(path: str) -> dict[str, Any]:
    with (ROOT / path).open("rb") as f:
        return tomllib.load(f)


def requirements(path: str) -> list[str]:
    lines = (ROOT / path).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}


ROOT_PROJECT = project("pyproject.toml")
SDK = project("packaging/kvtier/pyproject.toml")
DAEMON = project("packaging/kvtierd/pyproject.toml")


def test_the_root_project_reads_both_distributions_requirements_files() -> None:
    assert "dependencies" in ROOT_PROJECT["project"]["dynamic"]
    assert "dependencies" not in ROOT_PROJECT["project"]
    files = ROOT_PROJECT["tool"]["setuptools"]["dynamic"]["dependencies"]["file"]
    assert files == ["packaging/kvtier/requirements.txt", "packaging/kvtierd/requirements.txt"]
    for sub in (SDK, DAEMON):
        assert sub["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}


GENERATED = ROOT / "client" / "kvtier_contract" / "v1"


def gencode_versions() -> dict[str, tuple[int, ...]]:
    """The runtime versions the committed generated code checks for at import."""
    pb2 = (GENERATED / "kvtier_pb2.py").read_text()
    found = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    grpc_py = (GENERATED / "kvtier_pb2_grpc.py").read_text()
    grpc = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_py, re.M)
    assert found and grpc, "the generated code's version checks moved: update this test"
    return {"protobuf": version(".".join(found.groups())), "grpcio": version(grpc[1])}


def version(text: str) -> tuple[int, ...]:
    """``7.35`` -> (7, 35, 0): a release's parts, padded so that 7.35 == 7.35.0 < 7.35.1."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


@pytest.mark.parametrize("path", ["packaging/kvtier/requirements.txt", "packaging/kvtierd/requirements.txt"])
def test_every_floor_is_at_least_what_the_generated_code_checks_at_import(path: str) -> None:
    floors = {}
    for req in requirements(path):
        m = re.fullmatch(r"([\w-]+)\s*(?:>=|==)\s*([\d.]+)(?:,.*)?", req)
        if m:
            floors[m[1].lower()] = version(m[2])
    for name, needed in gencode_versions().items():
        assert name in floors, f"{path}: {name} has no floor (>= or ==)"
        assert floors[name] >= needed, (
            f"{path}: {name} floor {'.'.join(map(str, floors[name]))} is below the "
            f"{'.'.join(map(str, needed))} the generated code checks for at import"
        )


def test_the_sdk_needs_no_daemon_package_and_torch_is_never_required() -> None:
    sdk = names(requirements("packaging/kvtier/requirements.txt"))
    assert sdk == {"grpcio", "protobuf", "numpy", "xxhash"}
    daemon = names(requirements("packaging/kvtierd/requirements.txt"))
    assert sdk <= daemon  # the daemon imports them too, pinned
    extras = [
        r
        for p in (ROOT_PROJECT, SDK, DAEMON)
        for reqs in p["project"]["optional-dependencies"].values()
        for r in reqs
    ]
    assert "torch" not in names(extras) | sdk | daemon


def test_the_extras_the_docs_name_agree_with_the_development_project() -> None:
    root = ROOT_PROJECT["project"]["optional-dependencies"]
    for extra in ("transformers", "cuda"):
        assert SDK["project"]["optional-dependencies"][extra] == root[extra], extra
    assert DAEMON["project"]["optional-dependencies"]["cluster"] == root["cluster"]
    assert DAEMON["project"]["optional-dependencies"]["events"] == root["events"]
    scripts = {**SDK["project"]["scripts"], **DAEMON["project"]["scripts"]}
    assert scripts == ROOT_PROJECT["project"]["scripts"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_installs_only_runtime_requirements_and_takes_its_ports_from_make() -> None:
    recipe = subprocess.run(
        [
            "make",
            "-n",
            "-B",
            "--no-print-directory",
            "serve",
            "SERVE_VENV=/v",
            "METRICS_PORT=9465",
            "SERVE_ARGS=--listen 127.0.0.1:50061",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    installs = [ln for ln in recipe.splitlines() if "pip install" in ln]
    assert installs == ["/v/bin/python -m pip install -q -e ."], recipe  # runtime requirements only
    assert not re.search(r"torch|redis|\[dev\]|mypy|\.venv/", recipe), recipe
    assert recipe.splitlines()[-1] == "/v/bin/kvtierd serve --metrics-port 9465 --listen 127.0.0.1:50061"
    # by default the OS picks /metrics' port: a second clone's `make serve` starts too
    assert make_n("serve", "SERVE_VENV=/v").splitlines()[-1] == "/v/bin/kvtierd serve --metrics-port 0 "


def make_n(*argv: str) -> str:
    """What ``make -n -B ARGV...`` would run here."""
    return subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_wheels_builds_with_the_setuptools_the_dockerfile_pins() -> None:
    pinned = re.findall(r"setuptools==[0-9.]+", (ROOT / "Dockerfile").read_text())
    assert len(pinned) == 1, pinned
    installs = [ln for ln in make_n("wheels", "SERVE_VENV=/v").splitlines() if "setuptools" in ln]
    assert installs == [f"/v/bin/python -m pip install -q {pinned[0]}"], installs


@pytest.mark.parametrize("prog", ["kvtier", "kvtierd"])
def test_both_commands_print_the_one_version(prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import build_parser as sdk_parser
    from kvtier_contract.version import __version__
    from kvtierd.cli import build_parser as daemon_parser

    parser = sdk_parser() if prog == "kvtier" else daemon_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"{prog} {__version__}\n"


def test_the_install_instructions_name_wheels_and_images_of_this_version() -> None:
    from kvtier_contract.version import __version__

    for path in ("README.md", "Dockerfile"):
        text = (ROOT / path).read_text()
        named = set(re.findall(r"kvtierd?-(\d+\.\d+\.\d+)-py3-none-any\.whl", text))
        named |= set(re.findall(r"\bkvtier:(\d+\.\d+\.\d+)\b", text))
        assert named == {__version__}, f"{path} names versions {sorted(named)}, not {__version__}"

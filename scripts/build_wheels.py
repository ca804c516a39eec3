"""Build the two wheels of this repository: ``kvtier`` (the SDK with the contract) and ``kvtierd``.

    python scripts/build_wheels.py [--out dist]     # prints the two wheel paths

Run it with a Python that has setuptools >= 77 (the development environment ``.venv`` does): the
wheels are built with ``pip wheel --no-deps --no-build-isolation``, offline.

Why a script. The repository keeps one source tree (``client/kvtier``, ``client/kvtier_contract``,
``server/kvtierd``) and one version, ``client/kvtier_contract/version.py``. The root
``pyproject.toml`` is the development project: ``pip install -e '.[dev]'`` puts all three packages
on the path (``make test``, the engine environments, ``make serve``). Each distribution is its own
setuptools project under ``packaging/<name>/``, and setuptools reads a dynamic version and finds
packages only inside a project's root, while the daemon's version lives under ``client/``. So each
distribution is built from a staged copy in a temporary directory:

* ``kvtier``: ``packaging/kvtier/*``, ``README.md``, ``client/kvtier`` and ``client/kvtier_contract``;
  the version is read by setuptools from the staged contract (``attr``, as in the root project).
* ``kvtierd``: ``packaging/kvtierd/*``, ``README.md`` and ``server/kvtierd``, plus two files this
  script writes: ``VERSION`` (from the contract) and ``requirements.txt`` (the committed one plus
  ``kvtier==<version>``: the daemon runs on the contract of its own version).

Requirements are written once: ``packaging/<name>/requirements.txt``; the root project reads both
files as its own dependencies. Staging also keeps build artefacts (``build/``, ``*.egg-info``) out
of the source tree, where the editable install would see them.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {  # distribution -> the package folders it ships
    "kvtier": [ROOT / "client" / "kvtier", ROOT / "client" / "kvtier_contract"],
    "kvtierd": [ROOT / "server" / "kvtierd"],
}
BENCH_EXTRA = 'bench = ["kvtierd[cluster]"]'  # pinned to the version in the staged copy
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def version() -> str:
    """``__version__`` of client/kvtier_contract/version.py, read without importing it."""
    tree = ast.parse((ROOT / "client" / "kvtier_contract" / "version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise SystemExit("error: client/kvtier_contract/version.py defines no __version__ string")


def stage(dist: str, into: Path) -> Path:
    """A buildable copy of distribution ``dist`` under ``into``; returns its root."""
    root = into / dist
    shutil.copytree(ROOT / "packaging" / dist, root, ignore=_JUNK)
    shutil.copy2(ROOT / "README.md", root / "README.md")
    for package in PACKAGES[dist]:
        shutil.copytree(package, root / package.name, ignore=_JUNK)
    if dist == "kvtierd":
        v = version()
        (root / "VERSION").write_text(v + "\n")
        reqs = root / "requirements.txt"
        reqs.write_text(reqs.read_text() + f"kvtier=={v}\n")
    if dist == "kvtier":  # its bench extra: the daemon of this very version, never another's
        project = root / "pyproject.toml"
        text = project.read_text()
        if BENCH_EXTRA not in text:
            raise SystemExit(f"error: packaging/kvtier/pyproject.toml lost its line {BENCH_EXTRA!r}")
        project.write_text(text.replace(BENCH_EXTRA, f'bench = ["kvtierd[cluster]=={version()}"]'))
    return root


def build(out: Path) -> list[Path]:
    """Build both wheels into ``out`` (created; older wheels of these names are replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    for dist in PACKAGES:
        for old in out.glob(f"{dist}-*.whl"):
            old.unlink()
    with tempfile.TemporaryDirectory(prefix="kvtier-wheels-") as tmp:
        for dist in PACKAGES:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "-q",
                    "--no-deps",
                    "--no-build-isolation",
                    "--wheel-dir",
                    str(out),
                    str(stage(dist, Path(tmp))),
                ],
                check=True,
            )
    return [next(out.glob(f"{dist}-{version()}-*.whl")) for dist in PACKAGES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build the kvtier and kvtierd wheels (see the docstring).")
    p.add_argument("--out", type=Path, default=ROOT / "dist", help="wheel directory (default: dist/)")
    args = p.parse_args(argv)
    try:
        wheels = build(args.out.resolve())
    except subprocess.CalledProcessError as e:
        print(
            f"error: building a wheel failed (exit {e.returncode}); the build needs setuptools "
            ">= 77 in this Python: python -m pip install 'setuptools>=77'",
            file=sys.stderr,
        )
        return 1
    for wheel in wheels:
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())

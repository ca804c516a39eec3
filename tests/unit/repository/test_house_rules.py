"""The house rules that are not about imports (issue 27), read from source.

* **Size budget**: every module of ours (client/, server/; generated protobuf code left out) is
  at most ``MAX_MODULE_LINES`` lines and every function or method at most ``MAX_FUNCTION_LINES``
  (from its ``def`` to its last line, docstring included), unless it is listed in ``EXCEPTIONS``
  below with the reason it is bigger. This list is the one place such reasons live; an entry
  that is no longer over its limit must go (the test says so), so the list stays true.
* **No sleeps in tests/unit**: unit tests order events with injected clocks and events, never
  by sleeping (a sleep is either too short on a loaded CI machine or wasted time).
* **tests/unit mirrors the package tree**: a unit test lives in ``tests/unit/<package path>/``
  of the package it tests (``tests/unit/kvtierd/cache/test_tiering.py`` tests
  ``server/kvtierd/cache``); the tests of the whole repository (``REPOSITORY_TESTS``) sit in
  ``tests/unit/repository/``, and nothing sits at ``tests/unit/`` itself: pytest puts a test
  file's folder on ``sys.path``, and with ``tests/unit`` there a process it spawns (the bench's
  socket baselines) found ``tests/unit/kvtier`` as a namespace package in place of the
  editable-installed ``kvtier``. Basenames stay unique (pytest imports test files by basename).

``ruff format --check`` is the fourth rule; ``make test`` runs it next to ``ruff check``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (ROOT / "client", ROOT / "server")
UNIT = ROOT / "tests" / "unit"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 40

EXCEPTIONS: dict[str, str] = {
    "client/kvtier/bench/soak.py": "the soak's worker program is this module run as a script "
    "(python -m kvtier.bench.soak): worker, sampler and command stay one file, one process image"
}

REPOSITORY_TESTS: dict[str, str] = {
    "test_house_rules.py": "this file: the rules of the whole tree",
    "test_import_rules.py": "the import rules and cycles of all three packages",
    "test_docs_true.py": "docs/ and README.md against the code they describe",
    "test_packaging.py": "the two wheels and what they ship",
    "test_deploy_files.py": "deploy/: the container and Kubernetes files",
    "test_helm_chart.py": "deploy/helm: the chart rendered and linted",
    "test_promql_selectors.py": "the dashboards' query checker in tests/promql_selectors.py",
}


def our_modules() -> list[Path]:
    return sorted(
        p
        for base in SOURCES
        for p in base.rglob("*.py")
        if p.relative_to(base).parts[0] in ("kvtier", "kvtier_contract", "kvtierd") and "_pb2" not in p.name
    )


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method, nested ones included."""
    out: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            out.append((prefix + node.name, node.end_lineno - node.lineno + 1))
            out += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            out += _functions(node, f"{prefix}{node.name}.")
    return out


def oversized() -> dict[str, int]:
    """Every module and function over its limit -> its lines."""
    found: dict[str, int] = {}
    for path in our_modules():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found[_name(path)] = lines
        for name, n in _functions(ast.parse(source, str(path))):
            if n > MAX_FUNCTION_LINES:
                found[f"{_name(path)}::{name}"] = n
    return found


def test_modules_and_functions_keep_to_the_size_budget() -> None:
    over = oversized()
    unlisted = {k: n for k, n in over.items() if k not in EXCEPTIONS}
    assert not unlisted, (
        f"over the size budget ({MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a "
        f"function): split along a real seam, or list it in EXCEPTIONS with the reason: {unlisted}"
    )


def test_every_size_exception_is_still_needed_and_says_why() -> None:
    over = oversized()
    stale = sorted(k for k in EXCEPTIONS if k not in over)
    assert not stale, f"within the budget now: remove from EXCEPTIONS: {stale}"
    assert all(len(why.split()) >= 4 for why in EXCEPTIONS.values())


def _sleeps(path: Path) -> list[int]:
    """Lines of ``time.sleep(...)``, ``asyncio.sleep(...)`` or a bare ``sleep(...)`` call."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "sleep") or (
                isinstance(f, ast.Name) and f.id == "sleep"
            ):
                lines.append(node.lineno)
    return lines


def test_unit_tests_never_sleep() -> None:
    found = {_name(p): _sleeps(p) for p in sorted(UNIT.rglob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"unit tests sleep (inject a clock or wait on an event): {found}"


def _package_dirs() -> set[str]:
    dirs = set()
    for base in SOURCES:
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if rel.parts and rel.parts[0] in ("kvtier", "kvtier_contract", "kvtierd"):
                dirs.add(rel.as_posix())
    return dirs


def test_unit_tests_mirror_the_package_tree() -> None:
    packages = _package_dirs()
    misplaced, names = [], {}
    for path in sorted(UNIT.rglob("test_*.py")):
        rel = path.parent.relative_to(UNIT).as_posix()
        if rel == ".":
            misplaced.append(f"{path.name}: at tests/unit/ (its folder would shadow our packages)")
        elif rel == "repository":
            if path.name not in REPOSITORY_TESTS:
                misplaced.append(f"{path.name}: in tests/unit/repository/ (only REPOSITORY_TESTS are)")
        elif rel not in packages:
            misplaced.append(f"{rel}/{path.name}: no package {rel} under client/ or server/")
        names.setdefault(path.name, []).append(rel)
    twice = {n: dirs for n, dirs in names.items() if len(dirs) > 1}
    assert not misplaced, misplaced
    assert not twice, f"basenames must be unique across tests/unit: {twice}"
    assert all(len(why.split()) >= 4 for why in REPOSITORY_TESTS.values())

"""The import rules of the tree (DESIGN.md §4, "one shared contract, two halves"), read from source.

Every ``import`` and ``from … import`` statement of every module under client/ and server/ counts:
module level, inside functions (lazy imports) and under ``TYPE_CHECKING`` alike, since each is an
arrow a reader has to follow. Rules:

* ``kvtier_contract`` (the shared contract) imports nothing of ``kvtier`` or ``kvtierd``;
* ``kvtierd`` (the daemon) imports nothing of ``kvtier`` (the SDK), only the contract;
* ``kvtier`` never imports ``kvtierd``;
* no import cycles between modules, anywhere.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (ROOT / "client", ROOT / "server")
OURS = ("kvtier", "kvtier_contract", "kvtierd")


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of our three packages."""
    found: dict[str, Path] = {}
    for base in SOURCES:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[0] not in OURS:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` names or lies in (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module of ours, line) for every import statement in ``path``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # ``from pkg import submodule`` is an arrow to the submodule
                target = _resolve(f"{base}.{alias.name}", known) or _resolve(base, known)
                if target and target != module:
                    yield target, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {m: dict(imports_of(m, p, known)) for m, p in known.items()}


def top(module: str) -> str:
    return module.split(".")[0]


def test_the_walk_sees_the_whole_tree() -> None:
    g = graph()
    assert {"kvtier.client", "kvtier_contract.errors", "kvtierd.app"} <= g.keys()
    assert "kvtier_contract.errors" in g["kvtierd.service.gate"]  # the walker does see arrows


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [("kvtier_contract", ("kvtier", "kvtierd")), ("kvtierd", ("kvtier",)), ("kvtier", ("kvtierd",))],
)
def test_halves_import_only_the_contract(importer: str, forbidden: tuple[str, ...]) -> None:
    bad = sorted(
        f"{m} -> {t} (line {line})"
        for m, targets in graph().items()
        if top(m) == importer
        for t, line in targets.items()
        if top(t) in forbidden
    )
    assert not bad, f"{importer} must not import {forbidden}:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    g = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append([*path[path.index(t) :], t])
            elif t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)

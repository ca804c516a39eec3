"""The import rules of the tree (DESIGN.md §4, "one shared contract, two halves"), read from source.

Every ``import`` and ``from … import`` statement of every module under client/ and server/ counts:
module level, inside functions (lazy imports) and under ``TYPE_CHECKING`` alike, since each is an
arrow a reader has to follow. Rules:

* ``kvtier_contract`` (the shared contract) imports nothing of ``kvtier`` or ``kvtierd``;
* ``kvtierd`` (the daemon) imports nothing of ``kvtier`` (the SDK), only the contract;
* ``kvtier`` never imports ``kvtierd``;
* no import cycles between modules, anywhere;
* no private name (one leading underscore) crosses a module: neither ``from x import _y`` nor
  ``x._y`` on an imported module of ours (tests, which are no module of ours, are not held to it).
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """``line: what`` for every private name (one leading underscore) ``module`` takes from
    another module of ours: ``from x import _y``, and ``x._y`` on a module of ours it imported."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    modules_bound: dict[str, str] = {}  # local name -> a module of ours it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                target = alias.name if alias.asname else alias.name.split(".")[0]
                if target in known:
                    modules_bound[local] = target
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    modules_bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if _resolve(base, known) and _private(alias.name) and base != module:
                    yield f"{node.lineno}: from {base} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain: list[str] = []
            v = node.value
            while isinstance(v, ast.Attribute):
                chain.insert(0, v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in modules_bound:
                target = ".".join([modules_bound[v.id], *chain])
                if target in known and target != module:
                    yield f"{node.lineno}: {target}.{node.attr}"


def test_no_private_name_crosses_a_module() -> None:
    """A private name is the module's own: one another module needs is a seam (make it
    public) or code that belongs where it is used (move it). Tests are not held to this."""
    known = modules()
    bad = [f"{_name(p)}:{hit}" for m, p in sorted(known.items()) for hit in private_imports(m, p, known)]
    assert not bad, f"{len(bad)} private names taken from another module of ours:\n" + "\n".join(bad)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))

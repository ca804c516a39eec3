"""The house rules that are not about imports (issue 27), read from source.

* **Size budget**: every module of ours (client/, server/; generated protobuf code left out) is
  at most ``MAX_MODULE_LINES`` lines and every function or method at most ``MAX_FUNCTION_LINES``
  (from its ``def`` to its last line, docstring included), unless it is listed in ``EXCEPTIONS``
  below with the reason it is bigger. This list is the one place such reasons live; an entry
  that is no longer over its limit must go (the test says so), so the list stays true.
* **Classes are measured with their package bases**: a class of ours counted together with
  every base class defined in our packages (recursively; ABCs and Protocols, the seams, left
  out, as are third-party bases: vLLM's, SGLang's, LMCache's, grpc's generated servicers) is at
  most ``MAX_CLASS_LINES`` lines, or listed in ``EXCEPTIONS`` as ``path::Class``. Cutting a class
  into mixins over several files does not make it smaller, so **no class inherits a mixin from a
  sibling module** (a non-ABC, non-Protocol base of ours defined in another module of the same
  folder that no code or test constructs by itself; specializing a complete class, as
  ``CudaIpcTransport`` does ``ShmTransport``, is not mixing in): a class is decomposed into parts
  that own their state, handed to it explicitly (DESIGN.md §11). Bases are resolved by name
  through each module's imports, read with ``ast``.
* **No sleeps in tests/unit**: unit tests order events with injected clocks and events, never
  by sleeping (a sleep is either too short on a loaded CI machine or wasted time).
* **Integration tests wait on conditions**: at most ``MAX_BARE_SLEEPS`` bare sleeps in
  tests/integration and the helpers in tests/ (a sleep in no poll: see ``bare_sleeps``), each
  with a ``# sleep: reason`` comment; every other wait polls the condition the test needs with
  a deadline (``tests_helpers.wait_for``, ``settled``), waits on an event, or injects a clock.
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
from typing import TypeGuard

ROOT = Path(__file__).resolve().parents[3]
SOURCES = (ROOT / "client", ROOT / "server")
UNIT = ROOT / "tests" / "unit"
INTEGRATION = ROOT / "tests" / "integration"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 40
MAX_CLASS_LINES = 400
MAX_BARE_SLEEPS = 5  # in tests/integration and the shared helpers in tests/

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
    over = {**oversized(), **oversized_classes()}
    stale = sorted(k for k in EXCEPTIONS if k not in over)
    assert not stale, f"within the budget now: remove from EXCEPTIONS: {stale}"
    assert all(len(why.split()) >= 4 for why in EXCEPTIONS.values())


# --- classes measured over their package bases -------------------------------------------------

SEAMS = {"ABC", "Protocol"}  # a class of ours inheriting one of these is an interface, a seam


class Module:
    """One parsed file (a module of ours, or a test: ``name`` None): its top-level classes and
    what its imports bind (local name -> (module, attribute or None for the module itself))."""

    def __init__(self, path: Path, name: str | None, is_package: bool = False) -> None:
        self.path, self.name = path, name
        self.tree = ast.parse(path.read_text(), str(path))
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        self.binds: dict[str, tuple[str, str | None]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:  # ``import a.b`` binds ``a``; ``import a.b as m``, ``a.b``
                    bound = a.name if a.asname else a.name.split(".")[0]
                    self.binds[a.asname or bound] = (bound, None)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level and name is not None:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for a in node.names:
                    self.binds[a.asname or a.name] = (base, a.name)

    def classdefs(self) -> list[ast.ClassDef]:
        return [n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)]


def parsed() -> dict[str, Module]:
    """Dotted name -> every module of ours, parsed."""
    mods: dict[str, Module] = {}
    for path in our_modules():
        base = next(b for b in SOURCES if path.is_relative_to(b))
        parts = list(path.relative_to(base).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        mods[name] = Module(path, name, is_package)
    return mods


def _parts(expr: ast.expr) -> list[str]:
    """``a.b.C`` / ``C`` / ``C[T]`` -> its dotted parts; [] for anything else."""
    if isinstance(expr, ast.Subscript):
        return _parts(expr.value)
    if isinstance(expr, ast.Name):
        return [expr.id]
    if isinstance(expr, ast.Attribute):
        head = _parts(expr.value)
        return [*head, expr.attr] if head else []
    return []


Found = tuple[Module, ast.ClassDef]


def resolve(mods: dict[str, Module], m: Module | None, parts: list[str], depth: int = 0) -> Found | None:
    """The class of ours that ``parts`` names in ``m`` (through its imports and re-exports),
    or None (a third-party or standard-library class, or not a class)."""
    if m is None or not parts or depth > 20:
        return None
    head, rest = parts[0], parts[1:]
    if not rest and head in m.classes:
        return m, m.classes[head]
    if head not in m.binds:
        return resolve(mods, mods.get(f"{m.name}.{head}"), rest, depth + 1)  # a submodule
    source, attr = m.binds[head]
    if attr is None:
        return resolve(mods, mods.get(source), rest, depth + 1)
    if f"{source}.{attr}" in mods:
        return resolve(mods, mods[f"{source}.{attr}"], rest, depth + 1)
    return resolve(mods, mods.get(source), [attr, *rest], depth + 1)


def is_seam(mods: dict[str, Module], m: Module, cls: ast.ClassDef) -> bool:
    """An ABC or a Protocol (or an abstract class over one of ours): an interface to
    implement, not a part to inherit state from."""
    names = [(_parts(b) or ["?"])[-1] for b in cls.bases]
    names += [(_parts(k.value) or ["?"])[-1] for k in cls.keywords if k.arg == "metaclass"]
    if SEAMS.intersection(names) or "ABCMeta" in names:
        return True
    abstract = any(
        (_parts(d) or ["?"])[-1] == "abstractmethod"
        for f in cls.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in f.decorator_list
    )
    bases = [resolve(mods, m, _parts(b)) for b in cls.bases]
    return abstract and any(b is not None and is_seam(mods, *b) for b in bases)


def package_bases(mods: dict[str, Module], m: Module, cls: ast.ClassDef) -> list[Found]:
    """Every base class of ours of ``cls``, recursively, seams left out, each once."""
    out: list[Found] = []
    todo: list[Found] = [(m, cls)]
    while todo:
        mod, c = todo.pop()
        for b in c.bases:
            found = resolve(mods, mod, _parts(b))
            if found and not is_seam(mods, *found) and all(found[1] is not f[1] for f in out):
                out.append(found)
                todo.append(found)
    return out


def _lines(node: ast.ClassDef) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def oversized_classes() -> dict[str, tuple[int, list[str]]]:
    """``path::Class`` of every class of ours over ``MAX_CLASS_LINES`` with its package bases ->
    (those lines, the ``path::Class lines`` it is made of, itself first)."""
    mods = parsed()
    over: dict[str, tuple[int, list[str]]] = {}
    for m in mods.values():
        for cls in m.classdefs():
            made_of = [(m, cls), *package_bases(mods, m, cls)]
            total = sum(_lines(c) for _, c in made_of)
            if total > MAX_CLASS_LINES:
                parts = [f"{_name(mod.path)}::{c.name} {_lines(c)}" for mod, c in made_of]
                over[f"{_name(m.path)}::{cls.name}"] = (total, parts)
    return over


def test_classes_keep_to_the_size_budget_with_their_package_bases() -> None:
    over = {k: v for k, v in oversized_classes().items() if k not in EXCEPTIONS}
    assert not over, (
        f"classes over {MAX_CLASS_LINES} lines counted with their package bases (ABCs and "
        "Protocols left out): decompose by ownership, or list the class in EXCEPTIONS with the "
        "reason:\n" + "\n".join(f"{k}: {n} lines = " + " + ".join(parts) for k, (n, parts) in over.items())
    )


def constructed(mods: dict[str, Module]) -> set[int]:
    """``id`` of every class of ours some code of ours or some test calls by itself."""
    files = [*mods.values(), *(Module(p, None) for p in sorted((ROOT / "tests").rglob("*.py")))]
    out = set()
    for m in files:
        for call in (n for n in ast.walk(m.tree) if isinstance(n, ast.Call)):
            found = resolve(mods, m, _parts(call.func))
            if found:
                out.add(id(found[1]))
    return out


def test_no_class_inherits_a_sibling_module_mixin() -> None:
    """A mixin: a base class of ours, no ABC or Protocol, defined in another module of the same
    folder, that nothing constructs by itself (it exists only as a piece of its subclasses).
    Specializing a complete class (``CudaIpcTransport(ShmTransport)``) is not mixing in."""
    mods = parsed()
    whole = constructed(mods)
    bad = []
    for m in mods.values():
        for cls in m.classdefs():
            for b in cls.bases:
                found = resolve(mods, m, _parts(b))
                if found is None or is_seam(mods, *found) or id(found[1]) in whole:
                    continue
                if found[0] is not m and found[0].path.parent == m.path.parent:
                    bad.append(
                        f"{_name(m.path)}::{cls.name} inherits {_name(found[0].path)}::{found[1].name}"
                    )
    assert not bad, (
        "classes inherit a mixin from a sibling module (hand the class a part that owns its "
        "state instead; ABCs and Protocols are fine):\n" + "\n".join(bad)
    )


def _is_sleep(node: ast.AST) -> TypeGuard[ast.Call]:
    """A call of ``time.sleep(...)``, ``asyncio.sleep(...)``, ``x.sleep(...)`` or ``sleep(...)``."""
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr == "sleep") or (
        isinstance(f, ast.Name) and f.id == "sleep"
    )


def _sleeps(path: Path) -> list[int]:
    """Lines of every sleep call in ``path``."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text(), str(path))) if _is_sleep(n)]


def test_unit_tests_never_sleep() -> None:
    found = {_name(p): _sleeps(p) for p in sorted(UNIT.rglob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"unit tests sleep (inject a clock or wait on an event): {found}"


def _loop_ends_on_a_condition(loop: ast.For | ast.AsyncFor | ast.While) -> bool:
    """A ``while`` on a test, or a loop with a ``break`` of its own or a ``return`` in its body."""
    if isinstance(loop, ast.While) and not isinstance(loop.test, ast.Constant):
        return True
    todo: list[ast.AST] = list(loop.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Return, ast.Break)):
            return True
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):  # its breaks are its own
            todo += [n for n in ast.walk(node) if isinstance(n, ast.Return)]
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo += ast.iter_child_nodes(node)
    return False


def bare_sleeps(path: Path) -> list[tuple[int, str]]:
    """(line, reason) of every bare sleep in ``path``: a sleep call (``time.sleep``,
    ``asyncio.sleep``, ``x.sleep``, ``sleep``) whose innermost loop in its own function does not
    end on a condition (see ``_loop_ends_on_a_condition``), or that is in no loop. A sleep in a
    poll (``while not cond(): sleep(...)``, ``for ...: if cond(): break; sleep(...)``) waits on
    a condition; a bare one waits for time to pass. Its reason: a ``# sleep: why`` comment on
    its line or the line above ("" without one)."""
    source = path.read_text()
    lines = source.splitlines()
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, loop: ast.For | ast.AsyncFor | ast.While | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, None)
                continue
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                visit(child, child)
                continue
            if _is_sleep(child):
                if loop is None or not _loop_ends_on_a_condition(loop):
                    own, above = lines[child.lineno - 1], lines[child.lineno - 2] if child.lineno > 1 else ""
                    why = own.partition("# sleep:")[2] or above.partition("# sleep:")[2]
                    out.append((child.lineno, why.strip()))
            visit(child, loop)

    visit(ast.parse(source, str(path)), None)
    return out


def test_integration_tests_sleep_bare_at_most_five_times_each_with_a_reason() -> None:
    """tests/integration (and the helpers in tests/ it shares) waits on conditions: a poll with
    a deadline on the state the test needs (``tests_helpers.wait_for``, ``settled``), an event,
    an injected clock. A bare sleep is for time itself (an engine's step, a random moment)."""
    files = sorted([*INTEGRATION.rglob("*.py"), *(ROOT / "tests").glob("*.py")])
    # the tests sit in a folder per component (tests/integration/<component>/): all of them counted
    assert any(p.parent.parent == INTEGRATION for p in files), "no tests/integration/<component>/*.py"
    bare = [(_name(p), line, why) for p in files for line, why in bare_sleeps(p)]
    unexplained = [f"{p}:{line}" for p, line, why in bare if not why]
    assert not unexplained, f"bare sleeps without a '# sleep: reason' comment: {unexplained}"
    assert len(bare) <= MAX_BARE_SLEEPS, (
        f"{len(bare)} bare sleeps in tests/integration (at most {MAX_BARE_SLEEPS}): wait on the "
        "condition the test needs instead:\n" + "\n".join(f"{p}:{line}: {why}" for p, line, why in bare)
    )


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

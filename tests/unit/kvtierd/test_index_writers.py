"""The cache is the only writer of the index (DESIGN.md §4), read from source.

Outside ``kvtierd.cache`` (and ``kvtierd.index``, which defines the entries), no daemon module
assigns an entry's fields or changes a namespace's ``entries`` / ``ready`` maps: tiers,
transports, policies and the service only read them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "server" / "kvtierd"
OWNERS = ("cache", "index")
ENTRY_FIELDS = {"state", "offset", "pins", "job", "copies", "flushing", "promoting", "hits"}
MAPS = {"entries", "ready"}
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__"}


def _root(node: ast.expr) -> str:
    """The name an attribute chain starts from (``self`` for ``self.figures.copies``)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for sub in t.elts if isinstance(t, ast.Tuple) else [t]:
                if (
                    isinstance(sub, ast.Attribute) and sub.attr in ENTRY_FIELDS and _root(sub) != "self"
                ):  # an object's own figures are its own
                    found.append((node.lineno, f"assigns .{sub.attr}"))
                if (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr in MAPS
                ):
                    found.append((node.lineno, f"writes .{sub.value.attr}[...]"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr in MAPS
        ):
            found.append((node.lineno, f"calls .{node.func.value.attr}.{node.func.attr}()"))
    return found


def test_the_scan_finds_the_cache_writing() -> None:
    for half in ("stores.py", "reads.py"):  # (TieredCache's two halves)
        cache = ROOT / "cache" / half
        assert writes(ast.parse(cache.read_text()))  # the scan does see writes where they are


def test_only_the_cache_writes_the_index() -> None:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in OWNERS:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in writes(ast.parse(path.read_text()))]
    assert not bad, "index written outside kvtierd.cache:\n" + "\n".join(bad)

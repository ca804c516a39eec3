"""The docs cite only what the repository holds, and say what the code does.

Every relative link in README.md, docs/ and deploy/ resolves to a file of the repository; no doc
cites a file that is not here (the project's DESIGN.md lives outside the repository); no fenced
code block is empty; the README's list of bench suites is the CLI's list; statements a new user
found false (issue 29, item 11: docs and the Kubernetes manifests) stay gone; every install
command names a built wheel with extras it has, never a distribution from an index (issue 39);
the README states the Python and the system the code requires.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kvtier.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOCS = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("deploy/**/*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_no_citation_of_files_outside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    assert "DESIGN.md" not in text and "DESIGN §" not in text, (
        f"{doc.relative_to(ROOT)} cites DESIGN.md, which is not in the repository"
    )


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_no_empty_code_block(doc: Path) -> None:
    empty = re.findall(r"^```[a-z]*\n```$", doc.read_text(), flags=re.M)
    assert not empty, f"{doc.relative_to(ROOT)} has an empty fenced code block"


def _bench_suites() -> list[str]:
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr,index]
    suite = next(a for a in bench._actions if a.dest == "suite")
    return [s.strip() for s in str(suite.help).split("|")]


def test_readme_lists_every_bench_suite() -> None:
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("kvtier bench ["))
    listed = line.split("[", 1)[1].split("]", 1)[0].split("|")
    assert listed == _bench_suites()


@pytest.mark.parametrize(
    "doc, stale",
    [
        ("docs/lmcache.md", "digest checked on every\n  load is not built"),
        ("deploy/kubernetes/README.md", "cross-host `tcp` is not a supported"),
        ("deploy/kubernetes/README.md", "can read and write the whole host tier,\nof every namespace"),
        ("deploy/kubernetes/daemonset.yaml", "TLS\n#   for remote replicas is not built yet"),
        ("deploy/kubernetes/daemonset.yaml", "/metrics listens on the pod's loopback only"),
        ("docs/published_index.md", "there are no tenants yet"),  # issue 39
        ("docs/security.md", "a missing one is\n`INVALID_ARGUMENT` on a daemon with tenants"),
    ],
)
def test_stale_statements_stay_gone(doc: str, stale: str) -> None:
    assert stale not in (ROOT / doc).read_text()


INSTALL_DOCS = sorted({*DOCS, *ROOT.glob("docs/**/*.md"), ROOT / "Dockerfile"})
EXTRAS = {
    name: set(
        tomllib.loads((ROOT / "packaging" / name / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
    )
    for name in ("kvtier", "kvtierd")
}


@pytest.mark.parametrize("doc", INSTALL_DOCS, ids=_ids(INSTALL_DOCS))
def test_installs_name_built_wheels_and_their_real_extras(doc: Path) -> None:
    """Neither distribution is on an index: `pip install 'kvtierd[events]'` finds nothing."""
    text = doc.read_text()
    from_index = re.findall(r"pip install[^`\n]*?['\" ](kvtierd?\[[a-z,]+\])", text)
    assert not from_index, f"{doc.relative_to(ROOT)} installs {from_index} from an index"
    for name, extras in re.findall(r"\b(kvtierd?)-[^\s'\"`]*\.whl\)?\[([a-z,]+)\]", text):
        unknown = set(extras.split(",")) - EXTRAS[name]
        assert not unknown, f"{doc.relative_to(ROOT)}: the {name} wheel has no extra {unknown}"


def test_readme_states_python_and_linux_as_the_packages_require() -> None:
    readme = (ROOT / "README.md").read_text()
    wanted = {
        tomllib.loads(p.read_text())["project"]["requires-python"]
        for p in (ROOT / "pyproject.toml", *ROOT.glob("packaging/*/pyproject.toml"))
    }
    assert len(wanted) == 1 and next(iter(wanted)).startswith(">="), wanted
    assert f"**Python ≥ {next(iter(wanted)).removeprefix('>=')}**" in readme and "**Linux**" in readme


def test_the_published_index_doc_cites_the_tenant_test_that_exists() -> None:
    doc = (ROOT / "docs" / "published_index.md").read_text()
    cited = "test_tenants.py::test_another_tenants_published_index_is_not_handed_out"
    assert cited in doc
    assert (
        "def test_another_tenants_published_index_is_not_handed_out("
        in (ROOT / "tests" / "integration" / "tenancy" / "test_tenants.py").read_text()
    )

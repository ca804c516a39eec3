"""What the fuzz targets share: their hypothesis settings (one profile per run length) and the
corpus of interesting inputs kept under ``tests/fuzz/corpus/``.

Two run lengths, chosen by the environment (the only knob; docs/hardening.md "Fuzzing"):

* default (``make test``): few examples per target, ``derandomize=True`` and no example database,
  so CI runs the same inputs every time and the whole fuzz suite takes well under a minute on
  two cores; every corpus entry is replayed first.
* ``KVTIER_FUZZ=long``: 50 times the short run's examples per target (``KVTIER_FUZZ_SCALE``; or
  ``KVTIER_FUZZ_EXAMPLES`` for one count for every target), random seeds, and failures
  remembered in ``tests/fuzz/.hypothesis/`` (git-ignored) so a rerun replays them first. A
  failure prints its minimal input: add it to the corpus (or as an ``@example``) once it is
  fixed, so the short run guards it from then on.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import InvalidArgument

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"


@dataclass(frozen=True)
class FuzzProfile:
    """One run length of every fuzz target."""

    name: str
    """``ci`` (the default) or ``long`` (``KVTIER_FUZZ=long``)."""
    scale: float = 1.0
    """Multiplies each target's own short-run example count (``examples(n)``)."""
    examples: int | None = None
    """Every target's example count, when set (the long run)."""
    derandomize: bool = True
    """Same inputs on every run (CI); False draws new ones each run."""
    database: bool = False
    """Remember failing inputs in tests/fuzz/.hypothesis/ and replay them first."""


def profile() -> FuzzProfile:
    """The profile the environment asks for (``KVTIER_FUZZ`` = ``ci`` | ``long``)."""
    name = os.environ.get("KVTIER_FUZZ", "ci")
    if name == "long":
        fixed = os.environ.get("KVTIER_FUZZ_EXAMPLES")
        return FuzzProfile(
            "long",
            scale=float(os.environ.get("KVTIER_FUZZ_SCALE", "50")),
            examples=int(fixed) if fixed else None,
            derandomize=False,
            database=True,
        )
    if name != "ci":
        raise ValueError(f"KVTIER_FUZZ={name!r}: expected ci or long")
    return FuzzProfile("ci")


def fuzz_settings(short_examples: int) -> settings:
    """Hypothesis settings for one target whose short run draws ``short_examples`` inputs."""
    p = profile()
    n = p.examples or max(1, round(short_examples * p.scale))
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=p.derandomize,
        print_blob=True,
        database=DirectoryBasedExampleDatabase(str(HERE / ".hypothesis")) if p.database else None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much,
        ],
    )


def corpus_files(target: str, suffix: str) -> list[Path]:
    """The corpus entries of one target (``corpus/<target>/*<suffix>``), sorted by name."""
    return sorted((CORPUS / target).glob(f"*{suffix}"))


def corpus_json(target: str) -> list[dict[str, Any]]:
    """The JSON entries of one target's corpus (each file one object, named for its case)."""
    return [dict(json.loads(p.read_text()), name=p.stem) for p in corpus_files(target, ".json")]


def note(what: str) -> None:
    """Count ``what`` in hypothesis's statistics (``--hypothesis-show-statistics``): what the
    inputs reached. A no-op outside a hypothesis test (a corpus replay)."""
    try:
        event(what)
    except InvalidArgument:
        pass

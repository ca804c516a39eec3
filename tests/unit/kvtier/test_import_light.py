"""``import kvtier`` stays cheap: no torch, cupy or vLLM (STYLE.md rule 8).

Each import runs in a fresh interpreter, since this test process may already hold torch. torch is
installed in the dev environment, so a stray ``import torch`` anywhere on these paths shows up.
The daemon's modules are checked too: the container image (Dockerfile) has no torch at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "cupy", "vllm")
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})))
"""


@pytest.mark.parametrize(
    "module",
    [
        "kvtier",
        "kvtier.cli",
        "kvtier.transports.shm",
        "kvtier.transports.tcp",
        "kvtierd.app",
        "kvtier.integrations.vllm",
        "kvtier.integrations.vllm.connector.planner",
        "kvtier.integrations.vllm.connector.backend",
        "kvtier.integrations.vllm.connector.worker",
    ],
)
def test_import_does_not_load_heavy_modules(module: str, tmp_path: Path) -> None:
    code = PROBE.format(heavy=set(HEAVY))
    out = subprocess.run(
        [sys.executable, "-c", code, module], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"`import {module}` loaded {loaded}"

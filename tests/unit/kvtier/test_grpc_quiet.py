"""gRPC's own C-core log lines (``I1206 ... ssl_transport_security.cc``) stay out of an engine's
logs once it imports kvtier (issue 39), and an operator's GRPC_VERBOSITY still wins.

Each case runs in a fresh interpreter (grpc reads GRPC_VERBOSITY when it is first imported) with
GRPC_TRACE=api, which makes grpc log an INFO line for each call of its API: the client makes a
channel and fails to connect to a socket that does not exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, sys
import kvtier
print(os.environ.get("GRPC_VERBOSITY"))
try:
    kvtier.Client.connect(sys.argv[1], "tcp", timeout_s=0.5)
except kvtier.errors.Unavailable:
    pass
"""
GRPC_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\]", re.M)


def _run(tmp_path: Path, **env: str) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, f"unix://{tmp_path}/none.sock"],
        env={**clean, "GRPC_TRACE": "api", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip(), out.stderr


def test_importing_kvtier_quiets_grpcs_own_log_lines(tmp_path: Path) -> None:
    verbosity, err = _run(tmp_path)
    assert verbosity == "ERROR"
    assert not GRPC_LINE.search(err), err[:2000]


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_an_operators_grpc_verbosity_still_wins(tmp_path: Path, level: str) -> None:
    verbosity, err = _run(tmp_path, GRPC_VERBOSITY=level)
    assert verbosity == level
    assert GRPC_LINE.search(err), err[:2000]  # grpc's tracer lines, as asked

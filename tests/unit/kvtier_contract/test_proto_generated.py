"""The committed protobuf/gRPC modules are exactly what scripts/gen_proto.py generates today.

Edit proto/kvtier/v1/kvtier.proto, then run ``make proto`` (or ``python scripts/gen_proto.py``)
and commit the generated files together; this test fails while they disagree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMMITTED = ROOT / "client" / "kvtier_contract" / "v1"
HAND_WRITTEN = {"__init__.py"}


def load_gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_files() -> set[str]:
    return {p.name for p in COMMITTED.iterdir() if p.is_file() and p.name not in HAND_WRITTEN}


def test_committed_modules_equal_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency (pip install -e '.[dev]')")
    load_gen_proto().generate(tmp_path)
    out = tmp_path / "kvtier_contract" / "v1"
    generated = {p.name for p in out.iterdir()}
    # The messages and the service stubs, at least; whatever else protoc is asked for is compared too.
    assert {"kvtier_pb2.py", "kvtier_pb2_grpc.py"} <= generated
    # Nothing committed that the script no longer generates (a stale .pyi), nothing missing.
    assert committed_files() == generated, (
        "client/kvtier_contract/v1 and a fresh generation differ: run `make proto`"
    )
    stale = sorted(name for name in generated if (out / name).read_bytes() != (COMMITTED / name).read_bytes())
    assert not stale, f"client/kvtier_contract/v1/{stale} differ from a fresh generation: run `make proto`"

"""Regenerate the committed protobuf/gRPC modules from proto/ (run: python scripts/gen_proto.py).

Output lands in client/kvtier_contract/v1/, importable as ``kvtier_contract.v1.kvtier_pb2``: the
shared contract that both the SDK and the daemon import. The proto package stays ``kvtier.v1``
(the wire names are unchanged); protoc names the Python module after the proto path, so the one
import protoc writes into the gRPC stubs is rewritten to the contract package. A test checks that
the committed files equal a fresh generation.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvtier_contract"
_PROTOC_IMPORT = "from kvtier.v1 import kvtier_pb2"


def generate(out_dir: Path) -> None:
    """Write kvtier_pb2.py and kvtier_pb2_grpc.py into ``out_dir``/kvtier_contract/v1/."""
    from grpc_tools import protoc  # build-time only dependency

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            "kvtier/v1/kvtier.proto",
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        dest = out_dir / PACKAGE / "v1"
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / "kvtier" / "v1").iterdir()):
            text = src.read_text()
            if src.name.endswith("_grpc.py"):
                assert _PROTOC_IMPORT in text, "protoc's import line changed: update gen_proto.py"
                text = text.replace(_PROTOC_IMPORT, f"from {PACKAGE}.v1 import kvtier_pb2")
            (dest / src.name).write_text(text)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client"
    generate(out)

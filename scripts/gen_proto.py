"""Regenerate the committed protobuf/gRPC modules from proto/ (run: python scripts/gen_proto.py).

Output lands in client/kvtier/v1/, importable as ``kvtier.v1.kvtier_pb2``. A test checks that the
committed files equal a fresh generation.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # build-time only dependency

    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "kvtier/v1/kvtier.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "client"
    generate(out)

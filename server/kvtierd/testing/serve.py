"""``python -m kvtierd.testing.serve [--read-latency-ms MS] serve ...``: TEST-ONLY.

A real ``kvtierd serve`` (same arguments, same process, same READY line) whose NVMe tier runs on
:class:`~kvtierd.testing.faults.FaultyFileSystem` devices that sleep ``MS`` milliseconds before
every read: a slow disk, so that a test can hold a load in flight (e.g. the vLLM connector's
asynchronous loads, tests/integration/test_vllm_async.py). Never imported by the daemon; the
fault is data on the command line, nothing else of the daemon changes.
"""

from __future__ import annotations

import sys
from typing import Any

from kvtierd.testing.faults import FaultyDevice, FaultyFileSystem


def main(argv: list[str]) -> int:
    read_latency_s = 0.0
    if argv[:1] == ["--read-latency-ms"]:
        read_latency_s = float(argv[1]) / 1000
        argv = argv[2:]

    class SlowReads(FaultyFileSystem):
        def open_file(self, name: str, *, direct: bool | None = None,
                      readonly: bool = False) -> Any:
            dev = super().open_file(name, direct=direct, readonly=readonly)
            assert isinstance(dev, FaultyDevice)
            dev.read_latency_s = read_latency_s
            return dev

    from kvtierd.tiers.nvme import tier

    real_init = tier.NvmeTier.__init__

    def init(self: tier.NvmeTier, cfg: Any, fs_factory: Any = SlowReads) -> None:
        real_init(self, cfg, fs_factory)

    tier.NvmeTier.__init__ = init  # type: ignore[method-assign]
    from kvtierd.cli import main as serve

    return serve(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

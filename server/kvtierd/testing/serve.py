"""``python -m kvtierd.testing.serve [--read-latency-ms MS | --read-latency-file PATH] serve ...``:
TEST-ONLY.

A real ``kvtierd serve`` (same arguments, same process, same READY line) whose NVMe tier runs on
:class:`~kvtierd.testing.faults.FaultyFileSystem` devices that sleep before every read: a slow
disk, so that a test can hold a load in flight (e.g. the vLLM connector's asynchronous loads,
tests/integration/vllm/test_vllm_async.py) or see the daemon's read figures follow a slow tier.

* ``--read-latency-ms MS``: ``MS`` milliseconds before every read, for the daemon's life.
* ``--read-latency-file PATH``: the milliseconds that file holds (a number; missing or empty:
  0), read again at most every 100 ms (:class:`~kvtierd.testing.faults.LatencyFile`): a test or
  the seed experiment slows the disk and lets it recover by writing the file while the daemon
  runs.

Never imported by the daemon; the fault is data on the command line, nothing else of the
daemon changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvtierd.testing.faults import FaultyDevice, FaultyFileSystem, LatencyFile

USAGE = "usage: python -m kvtierd.testing.serve [--read-latency-ms MS | --read-latency-file PATH] serve ..."


def _fault(argv: list[str]) -> tuple[Callable[[], float] | None, float, list[str]]:
    """(latency source or None, fixed read latency in seconds, the daemon's own arguments)."""
    if argv[:1] == ["--read-latency-ms"] and len(argv) > 1:
        return None, float(argv[1]) / 1000, argv[2:]
    if argv[:1] == ["--read-latency-file"] and len(argv) > 1:
        return LatencyFile(argv[1]), 0.0, argv[2:]
    if argv[:1] and argv[0].startswith("--read-latency"):
        raise SystemExit(f"{argv[0]} needs a value\n{USAGE}")
    return None, 0.0, argv


def main(argv: list[str]) -> int:
    source, read_latency_s, argv = _fault(argv)

    class SlowReads(FaultyFileSystem):
        def open_file(self, name: str, *, direct: bool | None = None, readonly: bool = False) -> Any:
            dev = super().open_file(name, direct=direct, readonly=readonly)
            assert isinstance(dev, FaultyDevice)
            dev.read_latency_s = read_latency_s
            dev.read_latency = source
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

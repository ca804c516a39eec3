"""A/B: shm and tcp transfers before and after the control channels and batched slot
allocation (docs/benchmarks.md §19), interleaved in one run with the bench's own pieces.

Per block size, three clients, each against a fresh daemon of its own (2 GiB host tier, 64 MiB
slabs, as ``kvtier bench``): **before** = the daemon of a base commit (``--base``, checked out
by ``git worktree`` into a temporary directory and run from there) with control calls over
gRPC; **gRPC** = this tree's daemon (batched slot allocation) with control calls over gRPC;
**after** = this tree's daemon and its control channel (the default). The SDK is this tree's
for all three: with ``control_channel=False`` its path is the base's. The same three over tcp
(``--transports shm,tcp``; the remote client's control channel is on the data port). Held
against the bench's memcpy (as put, as get) and loopback stream baselines, measured in the same
interleaved rounds; best of ``--repeat`` after a warm-up, as ``kvtier bench``.

Run: ``.venv/bin/python scripts/control_channel_ab.py [--base 9e2b228] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kvtier.bench import measure  # noqa: E402
from kvtier.bench.baselines import SocketStream, memcpy_ops  # noqa: E402
from kvtier.bench.plan import Plan, Results, size_label  # noqa: E402
from kvtier.bench.procs import DaemonProc  # noqa: E402
from kvtier.bench.progress import Progress  # noqa: E402
from kvtier.bench.transfers import KeySource, connect, transfer_ops  # noqa: E402

SIZES = (256 << 10, 1 << 20, 4 << 20)


@contextlib.contextmanager
def daemon(run_dir: Path, server_path: str | None) -> DaemonProc:  # type: ignore[misc]
    """A bench daemon; ``server_path``: put first on its PYTHONPATH (the base's server)."""
    old = os.environ.get("PYTHONPATH")
    if server_path:
        os.environ["PYTHONPATH"] = server_path + (os.pathsep + old if old else "")
    try:
        d = DaemonProc(run_dir, 2 << 30, 64 << 20)
        d.__enter__()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    try:
        yield d
    finally:
        d.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="9e2b228")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transports", default="shm,tcp")
    args = ap.parse_args()
    transports = args.transports.split(",")
    plan = Plan(
        suite="shm",
        block_sizes=SIZES,
        batch_bytes=64 << 20,
        total_bytes=512 << 20,
        repeat=args.repeat,
        redis=False,
        progress=False,
    )
    results = Results()
    progress = Progress(enabled=False, total=1)
    with tempfile.TemporaryDirectory() as tmp, SocketStream() as stream:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base],
            check=True,
            capture_output=True,
        )
        try:
            for block in SIZES:
                with (
                    daemon(Path(tmp) / f"old{block}", str(base / "server")) as old,
                    daemon(Path(tmp) / f"new{block}", None) as new,
                ):
                    keys = KeySource()
                    ops = memcpy_ops(plan, block) if "shm" in transports else []
                    if "tcp" in transports:
                        ops += stream.ops(plan, block)
                    clients = []
                    for t in transports:
                        clients += [
                            connect(old.address(t), t, control_channel=False),
                            connect(new.address(t), t, control_channel=False),
                            connect(new.address(t), t),
                        ]
                        for name, c in zip(("before", "grpc", "after"), clients[-3:], strict=True):
                            ops += transfer_ops(plan, c, block, keys, name=f"{t}_{name}")
                    ops = [
                        op
                        for op in ops
                        if op.name.startswith(("memcpy", "socket")) or not op.name.endswith("_get")
                    ]  # (kvtier's get allocates)
                    measure(plan, block, ops, results, progress)
                    for c in clients:
                        s = getattr(c, "session", c)  # (the baseline tree's Client was its Session)
                        conn = getattr(s, "connection", None)  # (this tree's Session holds one)
                        control = conn.control if conn is not None else s._control
                        wanted = conn.settings.control_channel if conn is not None else s.control_channel
                        assert bool(control and control.calls) == wanted
                        c.close()
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                check=False,
                capture_output=True,
            )
    rows = [
        ("memcpy_put", "memcpy into fresh memory (as put)"),
        ("memcpy_get", "memcpy from distinct memory (as get)"),
        ("socket_put", "loopback stream into fresh memory (as put)"),
        ("socket_get", "loopback stream from distinct memory (as get)"),
    ]
    for t in transports:
        for what in ("put", "get_into"):
            rows += [(f"{t}_{v}_{what}", f"{t} {what}, {v}") for v in ("before", "grpc", "after")]
    rows = [r for r in rows if results.gbps(r[0], SIZES[0]) is not None]
    print("| GB/s | " + " | ".join(size_label(b) for b in SIZES) + " |")
    print("| --- |" + " ---: |" * len(SIZES))
    for name, label in rows:
        print(f"| {label} | " + " | ".join(f"{results.gbps(name, b):.2f}" for b in SIZES) + " |")
    print()
    print("| ratio | " + " | ".join(size_label(b) for b in SIZES) + " |")
    print("| --- |" + " ---: |" * len(SIZES))
    for t in transports:
        base = "memcpy" if t == "shm" else "socket"
        for what, base_name in (("put", f"{base}_put"), ("get_into", f"{base}_get")):
            for v in ("before", "grpc", "after"):
                cells = [
                    results.gbps(f"{t}_{v}_{what}", b)  # type: ignore[operator]
                    / results.gbps(base_name, b)
                    for b in SIZES
                ]
                print(f"| {t} {what}, {v} / {base} | " + " | ".join(f"{x:.2f}x" for x in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())

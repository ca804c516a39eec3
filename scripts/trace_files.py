"""Which of our files one request enters (docs/architecture.md, "Measured, not estimated").

A profiler (``sys.setprofile`` and ``threading.setprofile``, so every thread) records each file
under ``client/`` and ``server/`` that a Python function ran in, in the client and in the daemon,
while one request runs: calls reached from periodic work (the lease sweep, the housekeeper's
stamp, the session's heartbeat, the metrics listener) are left out. The daemon runs under this
script (``python -m trace_files daemon serve ...``), recording between two SIGUSR1s and writing
its files to ``$KVTIER_TRACE_OUT``. An RPC of another kind landing in the window adds its files:
run it twice.

Cases: ``put`` (one default put of 64 blocks of 128 KiB into a full 128 MiB host tier with an
NVMe tier; the group commit's flush included), ``lookup`` (a default ``ns.lookup`` of those 64
keys, answered by the published index), ``lookup-rpc`` (``lookup_detail``: the Lookup RPC).
Run: ``.venv/bin/python scripts/trace_files.py [put|lookup|lookup-rpc ...]``; prints each case's
count and files, grouped by package.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OURS = (str(ROOT / "client") + os.sep, str(ROOT / "server") + os.sep)
PERIODIC = {"_sweep", "sweep", "stamp", "_refresher", "Heartbeat"}  # not the request's work
BACKGROUND = {"kvtier-heartbeat", "kvtier-probe", "kvtier-metrics-listener"}  # threads beside it
BLOCK_BYTES = 128 << 10


class Recorder:
    """The set of our files entered while ``on``; the profile hook of every thread. Ownership:
    any thread calls ``hook``; ``on`` and ``files`` are swapped whole (the GIL)."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or not self.on:
            return
        name = frame.f_code.co_filename
        if name in self.files or not name.startswith(OURS):
            return
        if threading.current_thread().name in BACKGROUND:
            return
        f: FrameType | None = frame
        while f is not None:
            if f.f_code.co_name in PERIODIC:
                return
            f = f.f_back
        self.files.add(name)

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)


def daemon_main() -> None:
    """The daemon under the recorder: SIGUSR1 starts recording, the next writes the files."""
    rec = Recorder()
    out = os.environ["KVTIER_TRACE_OUT"]

    def toggle(_sig: int, _frame: Any) -> None:
        if rec.on:
            rec.on = False
            Path(out).write_text(json.dumps(sorted(rec.files)))
        else:
            rec.files = set()
            rec.on = True

    signal.signal(signal.SIGUSR1, toggle)
    rec.install()
    sys.argv = ["kvtierd", *sys.argv[2:]]
    runpy.run_module("kvtierd", run_name="__main__")


def grouped(files: set[str]) -> str:
    rel = sorted(str(Path(f).relative_to(ROOT)) for f in files)
    lines = []
    for pkg in ("client/kvtier/", "client/kvtier_contract/", "server/kvtierd/"):
        mine = [r[len(pkg) :] for r in rel if r.startswith(pkg)]
        lines.append(f"  {pkg} {len(mine)}: {', '.join(mine)}")
    return "\n".join(lines)


def run(cases: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import DaemonProcess, make_namespace

    import kvtier

    tmp = Path(tempfile.mkdtemp())
    out = tmp / "daemon-files.json"
    os.environ["KVTIER_TRACE_OUT"] = str(out)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    d = DaemonProcess(
        tmp / "d",
        "--host-bytes",
        "128MiB",
        "--slab-bytes",
        "16MiB",
        "--disk-dir",
        str(tmp / "nvme"),
        "--disk-bytes",
        "1GiB",
    )
    d.module = ("trace_files", "daemon")
    d.start()
    rec = Recorder()
    rec.install()
    try:
        with kvtier.Client.connect(d.unix) as c:
            ns = c.register(make_namespace(head_dim=BLOCK_BYTES // 256))
            assert ns.block_bytes == BLOCK_BYTES
            fill = ns.block_keys(list(range(16 * 1100)))
            for i in range(0, len(fill), 64):  # the host tier full, older blocks on NVMe
                ns.put(fill[i : i + 64], [bytes(BLOCK_BYTES)] * len(fill[i : i + 64]))
            keys = ns.block_keys([7] * 16 * 64)
            blocks = [os.urandom(BLOCK_BYTES) for _ in keys]
            if "put" not in cases:
                ns.put(keys, blocks)  # what the lookups find
            ns.lookup(fill[-1:])  # the published index mapped once, before any case
            time.sleep(1.0)  # sleep: the fill's demotions and group commits settle
            for case in cases:
                d.proc.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
                rec.files, rec.on = set(), True
                if case == "put":
                    assert ns.put(keys, blocks).stored == len(keys)
                elif case == "lookup":
                    assert ns.lookup(keys) == len(keys)
                else:
                    assert ns.lookup_detail(keys).hits == len(keys)
                rec.on = False
                time.sleep(1.0)  # sleep: the daemon's follow-up (demotion, group commit) runs
                d.proc.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
                deadline = time.monotonic() + 10
                while not out.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # sleep: the daemon writes its files on the signal
                both = rec.files | set(json.loads(out.read_text()))
                out.unlink()
                print(f"{case}: {len(both)} files")
                print(grouped(both))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        d.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["daemon"]:
        daemon_main()
    else:
        run(sys.argv[1:] or ["put", "lookup", "lookup-rpc"])

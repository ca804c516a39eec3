"""Request bodies that are not protobuf: INVALID_ARGUMENT for each, counted per method, and
only a few log lines (rate-limited), against a real daemon."""

from __future__ import annotations

import random
import re
import urllib.request

import grpc
from conftest import DaemonProcess

N = 1000
METHODS = ("Lookup", "PrepareStore", "OpenSession", "CompleteLoad")


def garbage(rng: random.Random) -> bytes:
    """Bytes no protobuf parser accepts: a field of wire type 7 (undefined), or a length prefix
    running past the end, after some random bytes."""
    tail = rng.randbytes(rng.randrange(0, 64))
    return rng.choice([b"\x0f" + tail, b"\x0a\xff\xff\x03" + tail[:8]])


def rpc_errors(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^kvtier_rpc_errors_total\{code="(\w+)",method="(\w+)"\} (\S+)$', text, re.M):
        out[(m.group(2), m.group(1))] = float(m.group(3))
    return out


def test_garbage_requests_get_invalid_argument_counted_and_few_log_lines(daemon: DaemonProcess) -> None:
    log = daemon.run_dir / "kvtierd.log"
    lines_before = len(log.read_text().splitlines())
    rng = random.Random(12)
    codes: dict[str, int] = {}
    details = ""
    with grpc.insecure_channel(daemon.unix) as channel:
        calls = {m: channel.unary_unary(f"/kvtier.v1.Kvtier/{m}") for m in METHODS}
        for i in range(N):
            try:
                calls[METHODS[i % len(METHODS)]](garbage(rng), timeout=5)
                code = "OK"
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
            codes[code] = codes.get(code, 0) + 1
    assert codes == {"INVALID_ARGUMENT": N}
    assert "could not be decoded" in details
    counted = rpc_errors(daemon.info["metrics"])
    assert {m: counted.get((m, "INVALID_ARGUMENT")) for m in METHODS} == {
        m: N / len(METHODS) for m in METHODS
    }
    # (every call was answered: what the daemon logs for a call, it logged before answering it)
    added = log.read_text().splitlines()[lines_before:]
    assert len(added) < 10, "\n".join(added[:20])

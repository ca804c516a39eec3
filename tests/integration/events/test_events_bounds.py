"""KV events under the daemon's bounds, and private to their owner, with a real daemon.

* A tenant on default quotas floods events (1,024-block puts, the longest adapter id and salt,
  token ids) with no subscriber, then with subscribers that never read and replay requesters
  that never read: the replay buffers hold at most ``events_buffer_bytes`` (its /metrics
  figure) and the daemon's resident memory grows by less than the configured bounds plus
  slack (before the bounds it grew by the flood: every message kept, twice, and queued again
  for each stalled subscriber).
* Event sockets take ``events_socket_mode`` (0600), not the gRPC socket's ``socket_mode``
  (0660 in the chart): another uid of the daemon's group reads no tenant's token ids; a mode
  that would let that group in is refused at start, naming the setting.
* A peer of a tenant's own stream sends distinct subscriptions over a raw ZMTP connection,
  reconnecting whenever it is closed, while the tenant stores: the daemon's resident memory
  stays within slack (before, libzmq kept every subscription in a trie, about 47 bytes a byte:
  3,000 one-KiB subscriptions grew it 138 MiB, 124,700 grew it 5.7 GiB), the drops are counted
  on /metrics, and a stock SUB subscriber on the same socket still receives every put.
"""

from __future__ import annotations

import hashlib
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import event_streams, scrape_metrics, serve_cmd

import kvtier

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

TOKENS = {"team-a": "tok-a-b1", "ops": "tok-ops-b2"}
LONG = "z" * 256  # the longest adapter id and salt
BOUND = 8 << 20  # events_buffer_bytes of the flood test
SLACK = 96 << 20  # the daemon's own churn under 200 puts (allocator, gRPC buffers)


def tenants_toml(path: Path) -> Path:
    path.write_text(
        "".join(
            f'[[tenant]]\nname = "{n}"\ntokens_sha256 = ["{hashlib.sha256(t.encode()).hexdigest()}"]\n'
            + ("operator = true\n\n" if n == "ops" else 'transports = ["tcp"]\n\n')
            for n, t in TOKENS.items()
        )
    )
    return path


def rss_bytes(d: DaemonProcess) -> int:
    assert d.proc is not None
    status = Path(f"/proc/{d.proc.pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def figure(d: DaemonProcess, name: str) -> float:
    code, body = scrape_metrics(d, TOKENS["ops"])
    assert code == 200, body
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    assert m, name
    return float(m.group(1))


def flood(d: DaemonProcess, puts: int, seed: int) -> None:
    """``puts`` puts of 1,024 tiny blocks each, token ids sent, one long chain each."""
    with kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["team-a"]) as c:
        ns = c.register(
            make_namespace(
                tenant="team-a",
                adapter_id=LONG,
                adapter_revision="1",
                cache_salt=LONG,
                num_layers=1,
                num_kv_heads=1,
                head_dim=8,
            )
        )
        blank = [bytes(ns.block_bytes)] * 1024
        for i in range(puts):
            toks = [(seed * 7919 + i * 16 * 1024 + j) % 150_000 for j in range(16 * 1024)]
            assert ns.put(ns.block_keys(toks), blank, token_ids=toks).stored >= 0


def test_an_event_flood_stays_within_the_configured_bytes(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(tenants_toml(tmp_path / "tenants.toml")),
        *event_streams(tmp_path),
        "--events-stream-buffer-bytes",
        "4MiB",
        "--events-buffer-bytes",
        str(BOUND),
        run_dir=tmp_path / "run",
    )
    flood(d, 8, seed=0)  # warm: the daemon's own buffers at their working size
    before = rss_bytes(d)
    t0 = time.monotonic()
    flood(d, 100, seed=1)  # no subscriber
    print(f"100 puts: {time.monotonic() - t0:.1f} s, RSS +{(rss_bytes(d) - before) / 2**20:.0f} MiB")
    assert figure(d, "kvtier_event_buffered_bytes") <= BOUND
    ctx = zmq.Context()
    stalled = []
    try:
        for name in ("ev.sock", "ev-team-a.sock") * 3:  # subscribers that never read
            sub = ctx.socket(zmq.SUB)
            sub.set_hwm(1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp_path}/{name}")
            stalled.append(sub)
        for name in ("replay.sock", "replay-team-a.sock") * 3:  # requesters that never read
            req = ctx.socket(zmq.DEALER)
            req.set_hwm(1)
            req.connect(f"ipc://{tmp_path}/{name}")
            stalled.append(req)
            for _ in range(50):  # as many as its queue takes
                try:
                    req.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
                except zmq.Again:
                    break
        flood(d, 100, seed=2)
        grown = rss_bytes(d) - before
        print(f"stalled: RSS +{grown / 2**20:.0f} MiB")
        held = figure(d, "kvtier_event_buffered_bytes")
        assert held <= BOUND, held
        assert figure(d, "kvtier_event_buffer_dropped_messages_total") > 0
        # 4 sockets x 8 peers x 16 messages x 128 KiB: what subscribers can make it queue
        assert grown <= BOUND + 4 * 8 * 16 * (128 << 10) + SLACK, grown / 2**20
    finally:
        for s in stalled:
            s.close(0)
        ctx.term()


def test_event_sockets_take_their_own_mode_and_never_the_engines_group(
    daemon_factory: Any, tmp_path: Path
) -> None:
    ev = tmp_path / "ev"
    ev.mkdir()
    ev.chmod(0o750)  # the daemon's group may enter (a directory every engine pod mounts)
    events = (
        "--tenants-file",
        str(tenants_toml(tmp_path / "tenants.toml")),
        "--events-endpoint",
        f"ipc://{ev}/ev.sock",
        "--events-block-hashes",
        "bytes",  # whole keys: the test asks the daemon about them
        "--events-tenant-endpoint",
        f"ipc://{ev}/ev-{{tenant}}.sock",
        "--events-tenant-replay-endpoint",
        f"ipc://{ev}/replay-{{tenant}}.sock",
    )
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--socket-mode", "660", *events)
    assert stat.S_IMODE(Path(d.unix.removeprefix("unix:")).stat().st_mode) == 0o660  # gRPC: engines
    for name in ("ev.sock", "ev-team-a.sock", "replay-team-a.sock", "ev-ops.sock"):
        assert stat.S_IMODE((ev / name).stat().st_mode) == 0o600, name  # events: the owner's
    assert d.stop() == 0
    run = tmp_path / "run2"
    run.mkdir()
    out = subprocess.run(
        serve_cmd(
            run, "--host-bytes", "64MiB", "--slab-bytes", "1MiB", *events, "--events-socket-mode", "660"
        ),
        cwd=run,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "events_socket_mode" in out.stderr and "the engines' group" in out.stderr, out.stderr


FLOODER = r"""
import os, socket, struct, sys, time

def connect(path):  # a raw ZMTP 3.0 SUB connection (NULL mechanism), past the daemon's READY
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(path)
        s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
        ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 3) + b"SUB"
        s.sendall(b"\x04" + bytes([len(ready)]) + ready)
        got = b""
        while b"PUB" not in got:
            more = s.recv(1000)
            if not more:
                raise ConnectionResetError
            got += more
        return s
    except OSError:  # closed (refused at the gate: the ones it closed not yet counted gone)
        s.close()
        return None

path, count, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
sent = conns = 0
while sent < count and time.monotonic() < deadline:
    s = connect(path)
    if s is None:
        continue
    conns += 1
    try:
        while sent < count and time.monotonic() < deadline:  # distinct 200-byte subscriptions
            subs = (os.urandom(8).hex().encode() + b"x" * 183 for _ in range(100))
            s.sendall(b"".join(b"\x02" + struct.pack(">Q", 200) + b"\x01" + t for t in subs))
            sent += 100
    except OSError:  # closed by the daemon: connect again
        pass
    finally:
        s.close()
print(sent, conns)
"""
"""A peer of another process flooding distinct subscriptions, reconnecting when closed:
``FLOODER path count seconds`` prints how many it sent, on how many connections."""


def test_subscriptions_a_peer_floods_are_dropped_and_never_held(daemon_factory: Any, tmp_path: Path) -> None:
    ev = f"{tmp_path}/ev-team-a.sock"
    d = daemon_factory(
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--tenants-file",
        str(tenants_toml(tmp_path / "tenants.toml")),
        "--events-tenant-endpoint",
        f"ipc://{tmp_path}/ev-{{tenant}}.sock",
        run_dir=tmp_path / "run",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # a stock subscriber: everything
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{ev}")
    stop = threading.Event()
    churn = threading.Thread(target=lambda: [flood(d, 1, seed=i) for i in range(10_000) if not stop.is_set()])
    try:
        flood(d, 2, seed=0)  # warm
        before = rss_bytes(d)
        churn.start()  # the publisher keeps sending while the peer subscribes
        out = subprocess.run(
            [sys.executable, "-c", FLOODER, ev, "20000", "20"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        sent = int(out.stdout.split()[0])
        stop.set()
        churn.join()
        grown = rss_bytes(d) - before
        print(f"{sent} subscriptions sent: RSS +{grown / 2**20:.0f} MiB")
        assert grown <= 100 << 20, grown / 2**20  # before: ~10 KiB each, +197 MiB
        assert figure(d, "kvtier_event_subscriptions_dropped_total") >= 1
        while sub.poll(0):  # what came during the flood
            sub.recv_multipart()
        flood(d, 1, seed=99_999)
        while True:  # (an idle stream's heartbeat, the last seq with no events, may come first)
            assert sub.poll(20_000), "the stock subscriber received nothing after the flood"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"" and len(seq) == 8 and payload
            if msgpack.unpackb(payload, raw=False)[1]:
                break
    finally:
        stop.set()
        sub.close(0)
        ctx.term()

"""Lookups from the published index (the SDK's default on the daemon's host) against lookups over
gRPC: the same answers in every case, never a block that is gone, nothing stale after a restart.

Each case asks two clients of one daemon: ``local`` (``local_lookups=True``; the test checks
that the published index answered) and ``grpc`` (``local_lookups=False``).
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import wait_for

import kvtier
from kvtier.client import NamespaceHandle
from kvtier_contract import errors, wire
from kvtier_contract import published_index as pi
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

SMALL = {"head_dim": 16}  # 4 KiB blocks


def blocks(n: int, nbytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


def warm(handle: NamespaceHandle, timeout_s: float = 10.0) -> None:
    """Look up until the published index answers (the first lookup fetches it in the
    background and goes over gRPC itself)."""
    c = handle.client.counters
    before, deadline = c.lookups_local, time.monotonic() + timeout_s
    while c.lookups_local == before:
        assert time.monotonic() < deadline, "the published index never answered"
        handle.lookup([b"\1" * 32])
        time.sleep(0.005)


class Pair:
    """One namespace seen by a local-lookup client and a gRPC-only client."""

    def __init__(self, address: str, transport: str = "tcp", **ns: Any) -> None:
        self.local_client = kvtier.Client.connect(address, transport, timeout_s=0.5, backoff_s=(0.05, 0.2))
        self.grpc_client = kvtier.Client.connect(
            address, "tcp", local_lookups=False, timeout_s=0.5, backoff_s=(0.05, 0.2)
        )
        self.local = self.local_client.register(make_namespace(**ns))
        self.grpc = self.grpc_client.register(make_namespace(**ns))
        warm(self.local)

    def lookup(self, keys: Sequence[bytes], *, settle: bool = False) -> int:
        """Both paths' answer (asserted equal); asserts the local one came from the index.
        ``settle``: first wait until the index answers (after a rebuild the client fetches
        the new generation in the background, answering over gRPC meanwhile)."""
        if settle:
            warm(self.local)
        before = self.local_client.counters.lookups_local
        a = self.local.lookup(keys)
        b = self.grpc.lookup(keys)
        assert a == b, f"published index says {a}, gRPC says {b}"
        if keys:
            assert self.local_client.counters.lookups_local == before + 1, (
                "the published index did not answer"
            )
        return a

    def close(self) -> None:
        self.local_client.close()
        self.grpc_client.close()


@pytest.fixture
def pair(daemon: DaemonProcess, transport: str) -> Iterator[Pair]:
    p = Pair(daemon.unix, transport)
    yield p
    p.close()


def test_the_same_hits_as_grpc_in_every_lookup_case(pair: Pair, daemon: DaemonProcess) -> None:
    ns = pair.local
    keys = ns.block_keys(list(range(16 * 6)))
    assert pair.lookup([]) == 0
    assert pair.lookup(keys) == 0  # nothing stored yet
    assert ns.put(keys, blocks(6, ns.block_bytes)).stored == 6
    assert pair.lookup(keys) == 6
    assert pair.lookup(keys[:3] + [b"\0" * 32] + keys[4:]) == 3  # longest prefix only
    assert pair.lookup(keys[1:]) == 5
    assert pair.lookup(keys[:1]) == 1
    assert pair.lookup([b"\0" * 32] + keys) == 0
    assert pair.lookup(ns.block_keys(list(range(1, 16 * 6 + 1)))) == 0  # other tokens
    # Another namespace, even asked for this namespace's keys, finds nothing.
    for other in (
        {"model_revision": "rev2"},
        {"adapter_id": "x", "adapter_revision": "r"},
        {"cache_salt": "x"},
        {"tp_size": 2, "tp_rank": 1},
    ):
        o = Pair(daemon.unix, **other)
        try:
            assert o.lookup(keys) == 0
            assert o.lookup(o.local.block_keys(list(range(16 * 6)))) == 0
        finally:
            o.close()
    with pytest.raises(errors.InvalidArgument):
        ns.lookup([b"short"])
    assert pair.local_client.local is not None and pair.local_client.local.fetched == 1


def test_writing_blocks_are_invisible_on_both_paths(daemon: DaemonProcess) -> None:
    p = Pair(daemon.unix, "shm")
    try:
        keys = p.local.block_keys(list(range(16 * 8)))
        assert p.lookup(keys) == 0
        prep = p.local_client.session.call(
            "PrepareStore",
            pb.PrepareStoreRequest(
                namespace_id=p.local.namespace_id, keys=b"".join(keys), transport=pb.TRANSPORT_SHM
            ),
        )
        assert len(prep.offsets) == 8
        assert p.lookup(keys) == 0  # reserved, WRITING: invisible
        p.local_client.session.call("CompleteStore", pb.CompleteStoreRequest(job_id=prep.job_id, ok=False))
        assert p.lookup(keys) == 0
    finally:
        p.close()


def test_more_keys_than_one_rpc_batch_and_a_table_that_grows_under_the_reader(daemon_factory: Any) -> None:
    d = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB")
    p = Pair(d.unix, **SMALL)
    try:
        ns = p.local
        keys = ns.block_keys(list(range(16 * 5000)))
        assert p.lookup(keys) == 0  # fetched now: a table for no keys (the smallest)
        first = p.local_client.local.fetched  # type: ignore[union-attr]
        data = blocks(1, ns.block_bytes)[0]
        for start in range(0, 5000, 1000):  # > max_batch_blocks (4,096) and the table grows
            assert ns.put(keys[start : start + 1000], [data] * 1000).stored == 1000
            assert p.lookup(keys, settle=True) == start + 1000
        assert p.lookup(keys[2500:]) == 2500
        # The daemon built bigger tables as it went; the client followed each retirement.
        assert p.local_client.local.fetched > first  # type: ignore[union-attr]
    finally:
        p.close()


def test_evicted_blocks_are_misses_on_both_paths_and_a_load_after_eviction_never_gives_wrong_bytes(
    daemon_factory: Any,
) -> None:
    d = daemon_factory("--host-bytes", "4MiB", "--slab-bytes", "1MiB")  # 256 blocks of 16 KiB
    p = Pair(d.unix, "shm")
    try:
        ns = p.local
        keys = ns.block_keys(list(range(16 * 100)))
        data = blocks(100, ns.block_bytes, seed=1)
        assert ns.put(keys, data).stored == 100
        assert p.lookup(keys) == 100
        # Between this lookup and the load, other blocks push these out of the host tier.
        flood = ns.block_keys(list(range(10**6, 10**6 + 16 * 600)))
        for start in range(0, 600, 100):
            ns.put(flood[start : start + 100], blocks(100, ns.block_bytes, seed=2 + start))
        hit = p.lookup(keys)
        assert hit < 100  # (evicted, and the index says so on both paths)
        got = ns.get(keys)
        assert sum(g is not None for g in got) < 100
        for g, want in zip(got, data, strict=True):
            assert g is None or bytes(g) == want.tobytes()  # a miss, never wrong bytes
        assert p.local_client.stats()["total"]["evictions"] > 0
        # and whatever the flood left: both paths agree on it
        p.lookup(flood)
        p.lookup(flood[300:])
    finally:
        p.close()


def test_a_daemon_restart_invalidates_what_the_client_mapped_of_its_index(
    daemon_factory: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "restart"
    d1 = daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
    client = kvtier.Client.connect(d1.unix, "tcp", timeout_s=0.5, backoff_s=(0.05, 0.2))
    try:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        assert ns.put(keys, blocks(4, ns.block_bytes)).stored == 4
        warm(ns)
        local = client.counters.lookups_local
        assert ns.lookup(keys) == 4
        assert client.counters.lookups_local == local + 1
        epoch1 = client.boot_epoch
        d1.kill()
        # At once, not after the stamp goes stale: the index channel closed with the daemon.
        assert ns.lookup(keys) == 0
        assert client.counters.lookups_local == local + 1
        daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
        deadline = time.monotonic() + 10
        while client.boot_epoch == epoch1 and time.monotonic() < deadline:
            ns.lookup(keys)  # misses while away; the probe reopens the session on the new one
            time.sleep(0.05)
        assert client.boot_epoch != epoch1
        local = client.counters.lookups_local
        while client.counters.lookups_local == local and time.monotonic() < deadline:
            assert ns.lookup(keys) == 0  # the new daemon has none of them: nothing stale
            time.sleep(0.02)  # (until the reopen registered the namespace and the new
        assert client.counters.lookups_local == local + 1  # index came): answered by it: 0
        assert ns.put(keys, blocks(4, ns.block_bytes)).stored == 4
        assert ns.lookup(keys) == 4
    finally:
        client.close()


def test_a_frozen_daemon_stops_local_answers_after_the_stamp_goes_stale(daemon: DaemonProcess) -> None:
    client = kvtier.Client.connect(daemon.unix, "tcp", timeout_s=0.3, backoff_s=(0.05, 0.2))
    try:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 4)))
        assert ns.put(keys, blocks(4, ns.block_bytes)).stored == 4
        warm(ns)
        assert ns.lookup(keys) == 4
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            local_index = client.local
            assert local_index is not None and local_index._view.segments
            wait_for(
                "the daemon's stamp stale in the client's eyes",
                lambda: (
                    {seg.state(time.monotonic()) for seg in local_index._view.segments.values()} == {"stale"}
                ),
                timeout=pi.STALE_AFTER_S + 5,
            )
            local = client.counters.lookups_local
            t0 = time.monotonic()
            assert ns.lookup(keys) == 0  # stale index -> gRPC -> no answer in time -> a miss
            assert time.monotonic() - t0 < 1.0
            assert client.counters.lookups_local == local
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        # Thawed: local answers again (after the breaker's probe, maybe on a new session and
        # so a segment fetched anew in the background).
        deadline = time.monotonic() + 10
        local = client.counters.lookups_local
        while client.counters.lookups_local == local and time.monotonic() < deadline:
            hit = ns.lookup(keys)
            assert hit in (0, 4)
            time.sleep(0.02)
        assert client.counters.lookups_local == local + 1 and ns.lookup(keys) == 4
    finally:
        client.close()


def test_local_lookups_are_counted_in_the_namespaces_stats(daemon_factory: Any, tmp_path: Path) -> None:
    conf = tmp_path / "kvtierd.json"
    conf.write_text('{"publish_index_idle_s": 0.5}')
    daemon = daemon_factory("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--config", str(conf))
    client = kvtier.Client.connect(daemon.unix, "tcp", lease_ttl_s=0.6)  # heartbeats ~0.2 s
    # (with heartbeats of 0.2 s the 11th lookup could still be sent by one: either way it counts)
    try:
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 6)))
        assert ns.put(keys[:4], blocks(4, ns.block_bytes)).stored == 4
        warm(ns)  # (1-key lookups, all misses: over gRPC until the index came, then local)
        deadline = time.monotonic() + 5
        base: dict[str, int] = {}
        while time.monotonic() < deadline:  # every warm-up lookup counted
            base = client.stats()["namespaces"][0]["counters"]
            if base["lookups"] == client.counters.lookups:
                break
            time.sleep(0.1)
        assert base["lookups"] == client.counters.lookups
        warmed = client.counters.lookups_local
        for _ in range(10):
            assert ns.lookup(keys) == 4
        assert client.counters.lookups_local == warmed + 10
        c: dict[str, int] = {}
        while time.monotonic() < deadline:
            c = client.stats()["namespaces"][0]["counters"]
            if c.get("local_lookups") == base["local_lookups"] + 10:
                break
            time.sleep(0.1)
        d = {k: c[k] - base[k] for k in c}
        assert d["local_lookups"] == 10 and d["lookups"] == 10
        assert d["blocks_requested"] == 60 and d["blocks_hit_local"] == 40
        assert d["blocks_missed"] == 20
        assert d["tokens_hit"] == 40 * 16 and d["tokens_missed"] == 20 * 16
        text = urllib.request.urlopen(daemon.info["metrics"], timeout=5).read().decode()
        assert any(
            line.startswith("kvtier_local_lookup_blocks_hit_total")
            and line.endswith(f" {c['blocks_hit_local']:.1f}")
            for line in text.splitlines()
        )
        assert 'tier="unknown"' not in text  # a local hit is in the host or NVMe tier
        assert any(
            line.startswith("kvtier_local_lookups_total") and line.endswith(f" {c['local_lookups']:.1f}")
            for line in text.splitlines()
        )
        assert "kvtier_published_indexes 1.0" in text
        assert 'kvtier_connections{transport="index"} 1.0' in text
        # Tallies still pending when the client closes are sent before the session ends.
        assert ns.lookup(keys) == 4
    finally:
        client.close()
    with kvtier.Client.connect(daemon.unix, "tcp", local_lookups=False) as other:
        assert other.stats()["total"]["local_lookups"] == c["local_lookups"] + 1
    # Its only reader gone, the index is retired once idle (0.5 s here): no longer published.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(daemon.info["metrics"], timeout=5).read().decode()
        if "kvtier_published_indexes 0.0" in text:
            break
        time.sleep(0.05)
    assert "kvtier_published_indexes 0.0" in text
    assert 'kvtier_connections{transport="index"} 0.0' in text


def _stub(daemon: DaemonProcess) -> tuple[grpc.Channel, Any, int, list[int]]:
    """A raw session and two registered namespaces."""
    channel = grpc.insecure_channel(daemon.unix)
    stub = pb_grpc.KvtierStub(channel)
    s = stub.OpenSession(
        pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=5000, transport=pb.TRANSPORT_TCP), timeout=5
    )
    from kvtier_contract.protoutil import namespace_spec

    ids = []
    for ns in (make_namespace(), make_namespace(model_revision="rev2")):
        r = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(spec=namespace_spec(ns), digest=ns.digest), timeout=5
        )
        ids.append(r.namespace_id)
    _SECRETS[s.session_id] = s.data_secret
    return channel, stub, s.session_id, ids


_SECRETS: dict[int, bytes] = {}  # session id -> data secret, of the sessions _stub opened


def _index_request(session_id: int, namespace_id: int) -> bytes:
    """A KVI2 request with the session's data secret (32 zero bytes for one _stub did not open)."""
    return pi.INDEX_REQUEST.pack(
        pi.INDEX_MAGIC, session_id, namespace_id, _SECRETS.get(session_id, bytes(32))
    )


@pytest.mark.parametrize(
    "tally, code, field",
    [
        (
            {"blocks_requested": 4, "blocks_hit": 5, "lookups": 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "local_lookups[0]",
        ),
        (
            {"blocks_requested": 4, "blocks_hit": 1, "lookups": 5},
            grpc.StatusCode.INVALID_ARGUMENT,
            "local_lookups[0]",
        ),
        (
            {"blocks_requested": (1 << 32) + 1, "blocks_hit": 1, "lookups": 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "local_lookups[0]",
        ),
        # (INVALID_ARGUMENT, not NOT_FOUND: the SDK reads a NOT_FOUND naming a namespace as a
        # daemon that forgot it and reopens its session)
        (
            {"namespace_id": 12345, "blocks_requested": 4, "blocks_hit": 1, "lookups": 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "local_lookups[0].namespace_id",
        ),
    ],
)
def test_a_bad_lookup_tally_is_refused_and_counts_nothing(
    daemon: DaemonProcess, tally: dict[str, int], code: grpc.StatusCode, field: str
) -> None:
    channel, stub, sid, (ns_id, ns2) = _stub(daemon)
    try:
        good = pb.LookupTally(namespace_id=ns2, lookups=1, blocks_requested=2, blocks_hit=1)
        bad = pb.LookupTally(**{"namespace_id": ns_id, **tally})
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(session_id=sid, local_lookups=[bad, good]), timeout=5)
        assert e.value.code() == code
        assert field in (e.value.details() or "")
        stats = stub.Stats(pb.StatsRequest(), timeout=5)
        assert stats.total.lookups == 0 and stats.total.local_lookups == 0  # not even `good`
        stub.Heartbeat(pb.HeartbeatRequest(session_id=sid, local_lookups=[good]), timeout=5)
        assert stub.Stats(pb.StatsRequest(), timeout=5).total.local_lookups == 1
    finally:
        channel.close()


def _ask_index(path: str, session_id: int, namespace_id: int) -> tuple[bytes, list[int]]:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(_index_request(session_id, namespace_id))
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    return msg, fds


def test_the_index_is_handed_only_to_a_live_session_for_a_registered_namespace(daemon: DaemonProcess) -> None:
    import os

    channel, _stub_, sid, (ns_id, _) = _stub(daemon)
    try:
        shm = daemon.info["shm"]
        msg, fds = _ask_index(shm, 999_999, ns_id)
        assert msg.startswith(wire.SHM_REFUSED) and b"session" in msg and not fds
        msg, fds = _ask_index(shm, sid, 424242)
        assert msg.startswith(wire.SHM_REFUSED) and b"namespace" in msg and not fds
        msg, fds = _ask_index(shm, sid, ns_id)
        try:
            assert msg.startswith(pi.INDEX_MAGIC) and len(fds) == 1
            flags = __import__("fcntl").fcntl(fds[0], __import__("fcntl").F_GETFL)
            assert flags & os.O_ACCMODE == os.O_RDONLY
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        channel.close()


def test_a_lookup_for_an_unregistered_handle_goes_over_grpc(daemon: DaemonProcess) -> None:
    client = kvtier.Client.connect(daemon.unix, "tcp")
    try:
        handle = NamespaceHandle(client, make_namespace())  # never registered: the daemon says so
        with pytest.raises(errors.NotFound):
            handle.lookup(handle.block_keys(list(range(32))))
        assert client.counters.lookups_local == 0
    finally:
        client.close()


def test_garbage_or_another_sessions_id_on_an_index_channel_closes_only_that_channel(
    daemon: DaemonProcess,
) -> None:
    import os
    import socket

    channel, _s, sid, (ns_id, _) = _stub(daemon)
    channel2, _s2, sid2, _ = _stub(daemon)
    try:
        for follow_up in (b"\xff" * pi.INDEX_REQUEST.size, _index_request(sid2, ns_id)):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(daemon.info["shm"])
                s.sendall(_index_request(sid, ns_id))
                msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
                for fd in fds:
                    os.close(fd)
                assert msg.startswith(pi.INDEX_MAGIC)
                s.sendall(_index_request(sid, 424242))  # refused, kept
                assert s.recv(4096).startswith(wire.SHM_REFUSED)
                s.sendall(follow_up)
                assert s.recv(4096) == b""  # closed by the daemon
        msg, fds = _ask_index(daemon.info["shm"], sid, ns_id)  # the daemon still serves
        for fd in fds:
            os.close(fd)
        assert msg.startswith(pi.INDEX_MAGIC)
    finally:
        channel.close()
        channel2.close()


def test_a_namespace_twice_in_one_heartbeat_is_refused(daemon: DaemonProcess) -> None:
    channel, stub, sid, (ns_id, _) = _stub(daemon)
    try:
        t = pb.LookupTally(namespace_id=ns_id, lookups=1, blocks_requested=4, blocks_hit=1)
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.HeartbeatRequest(session_id=sid, local_lookups=[t, t]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "local_lookups[1].namespace_id" in (e.value.details() or "")
        assert stub.Stats(pb.StatsRequest(), timeout=5).total.lookups == 0
    finally:
        channel.close()


def test_lookup_tiers_answers_a_miss_from_the_index_and_a_hit_with_its_tiers(pair: Pair) -> None:
    """``lookup_tiers`` (the adaptive integrations' lookup, issue 30): a miss takes no round
    trip, a hit gives each block's tier, and each call is counted once."""
    ns, c = pair.local, pair.local_client.counters
    keys = ns.block_keys(list(range(16 * 4)))
    before = (c.lookups, c.lookups_local)
    assert ns.lookup_tiers(keys).hits == 0
    assert (c.lookups, c.lookups_local) == (before[0] + 1, before[1] + 1)  # the index answered
    assert ns.put(keys[:3], blocks(3, ns.block_bytes)).stored == 3
    got = ns.lookup_tiers(keys)
    assert (got.hits, got.tiers) == (3, ["host"] * 3)
    assert c.lookups_local == before[1] + 1  # the hit asked the daemon for the tiers

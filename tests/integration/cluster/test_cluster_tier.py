"""The cluster tier end to end: real daemons sharing a real Redis Cluster (3 masters, 3 replicas
on loopback, started by the tests: tests/redis_cluster.py).

Two daemons with separate host tiers act as two nodes: what node A stores reaches the cluster,
and node B serves it byte-exact over shm and tcp. A master killed with ``kill -9``, a value
altered or copied under another key, a cluster past ``maxmemory``, a cluster unreachable at
start or lost at run time: misses, never an error and never a wrong byte. redis-server and
redis-cli are required (the Makefile installs them): these tests fail, not skip, without them.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import xxhash
from conftest import DaemonProcess, make_namespace, shm_handshake
from redis_cluster import RedisCluster
from tests_helpers import wait_for

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.tiers.cluster.format import HEADER, HEADER_BYTES, SIGNED
from kvtierd.tiers.cluster.format import redis_key as realm_key
from kvtierd.tiers.cluster.keys import FleetKeys, Realm

HOST = ("--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--lease-ttl-s", "5")
FLEET_KEY = hashlib.sha256(b"the test fleet").digest()
CLUSTER_REALM = "tests.engines"  # the cluster_realm of daemons without tenants (by default)
REALM = FleetKeys(FLEET_KEY).untenanted(CLUSTER_REALM)


def redis_key(digest: bytes, key: bytes, realm: Realm = REALM) -> bytes:
    return realm_key(realm, digest, key)


def fleet_line(tmp_path: Path, key: bytes = FLEET_KEY, realm: str = CLUSTER_REALM) -> str:
    """The config lines giving a daemon ``key`` as its fleet key (a file per key) and, unless
    ``realm`` is "" (a daemon with tenants), ``realm`` as its cluster_realm."""
    path = tmp_path / f"fleet-{key[:4].hex()}.key"
    path.write_text(key.hex() + "\n")
    return f'cluster_fleet_key_file = "{path}"\n' + (f'cluster_realm = "{realm}"\n' if realm else "")


def block(tag: str, i: int, nbytes: int) -> bytes:
    return hashlib.shake_256(b"cluster %s %d" % (tag.encode(), i)).digest(nbytes)


def node(
    daemon_factory: Any,
    tmp_path: Path,
    name: str,
    url: str,
    *extra: str,
    host: tuple[str, ...] = HOST,
    defaults: bool = False,
    connect: bool = True,
    fleet_key: bytes = FLEET_KEY,
    token: str | None = None,
    realm: str = CLUSTER_REALM,
) -> DaemonProcess:
    """A daemon using the cluster at ``url`` with ``fleet_key`` and, without a tenants file in
    ``extra``, ``realm`` as its cluster_realm (deadlines generous for a loaded
    2-core CI, unless ``defaults``: the shipped ones), returned once its cluster tier is
    connected unless not ``connect`` (asked with ``token`` when it has tenants). (The daemon
    serves before its tier has the slot map: until then a store is not written to the cluster
    and a lookup does not ask it, by design, and a loaded CI machine made that the first store
    of a test.)"""
    cfg = tmp_path / f"{name}.toml"
    generous = (
        ""
        if defaults
        else ("cluster_lookup_timeout_ms = 1000\ncluster_fetch_timeout_ms = 3000\ncluster_breaker_s = 0.2\n")
    )
    tenanted = any(line.startswith("tenants_file") for line in extra)
    cfg.write_text(
        f'cluster = "{url}"\n'
        + fleet_line(tmp_path, fleet_key, "" if tenanted else realm)
        + generous
        + "".join(f"{line}\n" for line in extra)
    )
    d: DaemonProcess = daemon_factory("--config", str(cfg), *host, run_dir=tmp_path / name)
    if connect:
        wait_for(f"{name}'s cluster tier connected", lambda: cluster_stats(d, token)["connected"])
    return d


def wait_unreachable(tmp_path: Path, *names: str) -> None:
    """Until each of the daemons ``names`` (started with ``node(..., connect=False)``) has tried
    the cluster and logged it unreachable: a refusal, not a connection not tried yet."""
    for name in names:
        log = tmp_path / name / "kvtierd.log"
        wait_for(
            f"{name}'s cluster tier unreachable", lambda p=log: "cluster tier unreachable" in p.read_text()
        )


def cluster_stats(d: DaemonProcess, token: str | None = None) -> dict[str, Any]:
    with kvtier.Client.connect(d.unix, transport="tcp", token=token) as c:
        out: dict[str, Any] = c.stats()["cluster"]
        return out


def store(
    d: DaemonProcess,
    tag: str,
    n: int,
    *,
    token: str | None = None,
    admin: str | None = None,
    fill: bytes | None = None,
    **ns_fields: Any,
) -> tuple[list[bytes], list[bytes]]:
    """Put ``n`` blocks through ``d`` (8 MiB at a time: the write queue is a quarter of the
    host tier) and wait until the cluster has each part. With tenants: as ``token``'s tenant
    (over tcp), the daemon's figures read with ``admin``'s token. ``fill``: the byte every block
    is made of, instead of the tag's blocks."""
    with kvtier.Client.connect(d.unix, transport="tcp" if token else "shm", token=token) as c:
        ns = c.register(make_namespace(**ns_fields))
        keys = ns.block_keys([hash_token(tag, i) for i in range(16 * n)])
        data = [fill * ns.block_bytes if fill else block(tag, i, ns.block_bytes) for i in range(n)]
        step = max(1, (8 << 20) // ns.block_bytes)
        for i in range(0, n, step):
            before = cluster_stats(d, admin)["writes"]
            part = min(step, n - i)
            assert ns.put(keys[i : i + part], data[i : i + part]).stored == part
            wait_for(
                "the cluster writes", lambda b=before, p=part: cluster_stats(d, admin)["writes"] >= b + p
            )
    return keys, data


def hash_token(tag: str, i: int) -> int:
    """Token ids of a prompt per tag (tags never share a key)."""
    return (int.from_bytes(hashlib.sha256(tag.encode()).digest()[:2], "little") * 7919 + i) % 30000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path_factory.mktemp("redis")) as rc:
        yield rc


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_blocks_put_on_node_a_are_served_byte_exact_by_node_b(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path, transport: str
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    keys, data = store(a, f"ab-{transport}", 24)
    with kvtier.Client.connect(b.unix, transport=transport) as c:
        ns = c.register(make_namespace())
        seen = ns.lookup_detail(keys)
        assert seen.hits == 24 and set(seen.tiers) == {"cluster"}
        assert not any(seen.durable)
        # a lookup from B's published index (shm clients) does not stop at B's own tiers
        assert ns.lookup(keys) == 24
        got = ns.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == data
        assert set(ns.lookup_detail(keys).tiers) == {"host"}  # imported: served locally now
        st = c.stats()
        total = st["total"]
        assert total["cluster_imports"] == 24 and total["cluster_corrupt"] == 0
        assert total["corrupt_blocks"] == 0  # every import got its digest, and every load matched
        with grpc.insecure_channel(b.grpc) as ch:  # each imported block's digest: its xxh3_64
            stub = pb_grpc.KvtierStub(ch)
            sid = stub.OpenSession(pb.OpenSessionRequest(transport=pb.TRANSPORT_TCP), timeout=5).session_id
            rep = stub.PrepareLoad(
                pb.PrepareLoadRequest(
                    session_id=sid,
                    namespace_id=ns.namespace_id,
                    keys=b"".join(keys),
                    transport=pb.TRANSPORT_TCP,
                ),
                timeout=5,
            )
            assert list(rep.digests) == [xxhash.xxh3_64_intdigest(d) for d in data]
            stub.CompleteLoad(pb.CompleteLoadRequest(session_id=sid, job_id=rep.job_id), timeout=5)
        assert total["blocks_hit_cluster"] >= 24
        cl = st["cluster"]
        assert cl["enabled"] and cl["connected"] and len(cl["nodes"]) == 3
        assert sum(n["hits"] for n in cl["nodes"]) >= 48  # EXISTS, then GET
        assert sum(n["bytes_read"] for n in cl["nodes"]) == 24 * (HEADER_BYTES + ns.block_bytes)
        assert cl["writes"] == 0  # imported blocks are not written back
        # the imports are the cluster tier's read figures (issue 30), in Stats and heartbeats
        (fig,) = st["tier_figures"]
        assert fig["tier"] == pb.TIER_CLUSTER and fig["reads"] >= 1 and fig["bytes_per_s"] > 0
        assert 0 <= fig["latency_us"] < 10_000_000
        c.session.call("Heartbeat", pb.HeartbeatRequest())
        assert c.tier_figures()["cluster"].reads == fig["reads"]
    with kvtier.Client.connect(a.unix, transport="tcp") as c:
        assert c.stats()["cluster"]["writes"] == 24
    with urllib.request.urlopen(b.info["metrics"], timeout=10) as r:
        metrics = r.read().decode()
    assert any(
        line.startswith("kvtier_lookup_blocks_hit_total{")
        and 'tier="cluster"' in line
        and not line.endswith(" 0.0")
        for line in metrics.splitlines()
    )
    assert "kvtier_cluster_node_keys_total{node=" in metrics
    assert "kvtier_cluster_connected 1.0" in metrics
    assert 'kvtier_tier_read_latency_seconds{tier="cluster"}' in metrics


def test_a_flipped_byte_and_a_value_under_another_namespace_are_misses_counted_and_deleted(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    keys, data = store(a, "corrupt", 8)
    spec, other = make_namespace(), make_namespace(model_revision="rev2")
    rc = cluster.cluster_client()
    victim = redis_key(spec.digest, keys[3])
    value = rc.get(victim)
    assert value is not None
    flipped = bytes([value[HEADER_BYTES + 100] ^ 0x01])
    rc.setrange(victim, HEADER_BYTES + 100, flipped)
    # a valid value of `spec`, copied under the same block key of another namespace
    with kvtier.Client.connect(b.unix, transport="tcp") as c:
        ns2 = c.register(other)
        keys2 = ns2.block_keys([hash_token("corrupt", i) for i in range(16 * 8)])
    stolen = rc.get(redis_key(spec.digest, keys[0]))
    rc.set(redis_key(other.digest, keys2[0]), stolen)

    with kvtier.Client.connect(b.unix, transport="shm") as c:
        ns = c.register(spec)
        got = ns.get(keys)
        assert got[3] is None  # a miss, never the altered bytes
        assert [bytes(g) for i, g in enumerate(got) if i != 3 and g is not None] == data[:3] + data[4:]
        ns2 = c.register(other)
        assert ns2.get(keys2[:1]) == [None]
        st = c.stats()
        assert st["cluster"]["corrupt_values"] == 2
        assert st["total"]["cluster_corrupt"] == 2
    wait_for(
        "the bad values deleted",
        lambda: rc.exists(victim) == 0 and rc.exists(redis_key(other.digest, keys2[0])) == 0,
    )
    assert rc.exists(redis_key(spec.digest, keys[0])) == 1  # the good one stays


def test_kill_9_of_a_master_costs_misses_then_its_replica_serves(daemon_factory: Any, tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "redis") as rc:
        a = node(daemon_factory, tmp_path, "a", rc.url)
        keys, data = store(a, "failover", 48)
        spec = make_namespace()
        owner = {k: rc.master_for_key(redis_key(spec.digest, k)) for k in keys}
        dead = owner[keys[0]]
        wait_for(
            "replication",
            lambda: all(
                rc.client(r).dbsize() == rc.client(m).dbsize()
                for m in rc.masters()
                for r in rc.replicas_of(m)
            ),
        )
        b = node(daemon_factory, tmp_path, "b", rc.url)
        with kvtier.Client.connect(b.unix, transport="tcp") as c:
            ns = c.register(spec)
            first = ns.get(keys[:8])  # mid-run: B is serving from the cluster when it dies
            assert [bytes(g) if g else None for g in first] == data[:8]
            keys, data = keys[8:], data[8:]
            rc.kill(dead)
            for k, want in zip(keys, data, strict=True):  # one by one: every key is asked
                got = ns.get([k])  # never raises
                if got[0] is not None:
                    assert bytes(got[0]) == want
                    assert owner[k] != dead
                else:
                    assert owner[k] == dead
            assert any(owner[k] == dead for k in keys)
            rc.wait_failover(dead)

            def all_served() -> bool:
                got = ns.get(keys)
                assert [bytes(g) for g in got if g is not None] == [
                    d for g, d in zip(got, data, strict=True) if g is not None
                ]
                return all(g is not None for g in got)

            wait_for("the promoted replica serving", all_served, timeout=30)
            assert c.stats()["total"]["cluster_corrupt"] == 0


def test_a_cluster_past_maxmemory_makes_misses_not_errors(daemon_factory: Any, tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "redis", maxmemory="8mb") as rc:
        a = node(daemon_factory, tmp_path, "a", rc.url)
        big = dict(num_layers=16)  # 128 KiB blocks; 320 of them: 40 MiB into 3 x 8 MB
        keys, data = store(a, "lru", 320, **big)
        b = node(daemon_factory, tmp_path, "b", rc.url)
        with kvtier.Client.connect(b.unix, transport="shm") as c:
            ns = c.register(make_namespace(**big))
            got = []
            for i in range(0, len(keys), 32):
                got += ns.get(keys[i : i + 32])
            served = [i for i, g in enumerate(got) if g is not None]
            assert 0 < len(served) < len(keys)  # the cluster evicted some, kept some
            assert all(bytes(got[i]) == data[i] for i in served)
            st = c.stats()
            assert st["cluster"]["corrupt_values"] == 0
            assert all(n["errors"] == 0 for n in st["cluster"]["nodes"])
        assert sum(int(rc.client(p).info("stats")["evicted_keys"]) for p in rc.masters()) > 0


def test_a_cluster_unreachable_at_start_and_lost_at_run_time_leaves_the_local_tiers_serving(
    daemon_factory: Any, tmp_path: Path
) -> None:
    with RedisCluster(tmp_path / "redis") as rc:
        url = rc.url
        rc.stop_all()
        a = node(daemon_factory, tmp_path, "a", url, connect=False)
        assert not cluster_stats(a)["connected"]
        with kvtier.Client.connect(a.unix, transport="shm") as c:
            ns = c.register(make_namespace())
            keys = ns.block_keys([hash_token("down", i) for i in range(16 * 8)])
            data = [block("down", i, ns.block_bytes) for i in range(8)]
            assert ns.put(keys, data).stored == 8  # the host tier serves alone
            assert ns.lookup(keys) == 8
            assert [bytes(g) for g in ns.get(keys) if g is not None] == data
            assert c.stats()["cluster"]["write_drops"] == 8

        rc.start_all()
        wait_for("the cluster tier back", lambda: cluster_stats(a)["connected"], timeout=30)
        keys2, data2 = store(a, "back", 8)
        b = node(daemon_factory, tmp_path, "b", url)
        with kvtier.Client.connect(b.unix, transport="tcp") as c:
            ns = c.register(make_namespace())
            assert [bytes(g) if g else None for g in ns.get(keys2[:4])] == data2[:4]

        rc.stop_all()  # lost at run time
        with kvtier.Client.connect(b.unix, transport="tcp") as c:
            ns = c.register(make_namespace())
            t0 = time.monotonic()
            assert ns.lookup(keys2) == 4  # the imported ones, from B's host tier
            got = ns.get(keys2)
            assert [bytes(g) for g in got[:4] if g is not None] == data2[:4]
            assert got[4:] == [None] * 4  # cluster-only blocks: misses, not errors
            assert time.monotonic() - t0 < 10
        rc.start_all()
        wait_for("the cluster tier back again", lambda: cluster_stats(b)["connected"], timeout=30)


def test_a_pinned_lookup_imports_the_cluster_blocks_and_holds_them(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    keys, data = store(a, "pinned", 12)
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        local = store_local(ns, keys[:4], data[:4])  # B holds the first 4 itself
        assert local == 4
        res = ns.lookup_pinned(keys)
        assert res.hits == 12 and res.pin
        assert set(ns.lookup_detail(keys).tiers) == {"host"}
        assert c.release(res.pin, res.epoch)
        assert [bytes(g) if g else None for g in ns.get(keys)] == data
        total = c.stats()["total"]
        assert total["cluster_imports"] == 8
        assert total["blocks_hit_cluster"] == 8  # the imported ones, once (not as host hits)


def store_local(ns: Any, keys: list[bytes], data: list[bytes]) -> int:
    stored: int = ns.put(keys, data).stored
    return stored


def test_the_evict_policy_writes_only_blocks_leaving_the_host_tier(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text(
        f'cluster = "{cluster.url}"\ncluster_write_policy = "evict"\n'
        "cluster_lookup_timeout_ms = 1000\ncluster_fetch_timeout_ms = 3000\n" + fleet_line(tmp_path)
    )
    a = daemon_factory(
        "--config", str(cfg), "--host-bytes", "2MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "a"
    )  # 128 blocks of 16 KiB
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    # A's tier connects in the background: a block evicted before it knows the slot map is a
    # drop (a loaded machine made that the first few puts' blocks)
    wait_for("A's cluster tier connected", lambda: cluster_stats(a)["connected"])
    spec = make_namespace()
    with kvtier.Client.connect(a.unix, transport="shm") as c:
        ns = c.register(spec)
        keys = ns.block_keys([hash_token("evict", i) for i in range(16 * 256)])
        data = [block("evict", i, ns.block_bytes) for i in range(256)]
        for i in range(0, 256, 16):
            # the write queue is a quarter of this 2 MiB host tier (32 blocks): let it empty
            # between puts, as the test is about which blocks are written, not about overload
            # (a loaded machine dropped a few; the next test is the one about drops)
            wait_for("the write queue empty", lambda: cluster_stats(a)["queued_blocks"] == 0)
            assert ns.put(keys[i : i + 16], data[i : i + 16]).stored == 16
        wait_for(
            "the evicted blocks written",
            lambda: cluster_stats(a)["writes"] + cluster_stats(a)["write_drops"] >= 128,
        )
        assert cluster_stats(a)["write_drops"] == 0, repr(cluster_stats(a))
        resident = ns.lookup_detail(keys[-64:])
        assert resident.hits == 64  # the newest are still in A's host tier...
    rc = cluster.cluster_client()
    assert not any(rc.exists(redis_key(spec.digest, k)) for k in keys[-64:])  # ...not written
    with kvtier.Client.connect(b.unix, transport="tcp") as c:
        ns = c.register(spec)
        got = ns.get(keys[:64])  # the oldest left A's host tier: B finds them in the cluster
        assert [bytes(g) if g else None for g in got] == data[:64]


def test_a_block_altered_in_the_host_tier_is_never_exported(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """A committed block's slot overwritten (through an shm mapping) before the evict policy
    writes it out: its bytes no longer match its digest, so it is not written (counted), and
    the cluster never serves them; its neighbours are written as usual."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        cluster.url,
        'cluster_write_policy = "evict"',
        host=("--host-bytes", "2MiB", "--slab-bytes", "1MiB"),
    )  # 128 blocks of 16 KiB
    spec = make_namespace()
    with kvtier.Client.connect(a.unix, transport="shm") as c:
        ns = c.register(spec)
        keys = ns.block_keys([hash_token("altered", i) for i in range(16 * 144)])
        data = [block("altered", i, ns.block_bytes) for i in range(144)]
        assert ns.put(keys[:16], data[:16]).stored == 16
        with grpc.insecure_channel(a.grpc) as ch:  # overwrite block 3's committed slot
            stub = pb_grpc.KvtierStub(ch)
            opened = stub.OpenSession(
                pb.OpenSessionRequest(client_name="poison", lease_ttl_ms=30_000, transport=pb.TRANSPORT_SHM),
                timeout=5,
            )
            sid = opened.session_id
            load = stub.PrepareLoad(
                pb.PrepareLoadRequest(
                    session_id=sid, namespace_id=ns.namespace_id, keys=keys[3], transport=pb.TRANSPORT_SHM
                ),
                timeout=5,
            )
            msg, fds = shm_handshake(a, sid, opened.data_secret)
            assert fds, msg
            try:
                with mmap.mmap(fds[0], 0, flags=mmap.MAP_SHARED) as mm:
                    off = load.offsets[0]
                    mm[off : off + ns.block_bytes] = b"\xee" * ns.block_bytes
            finally:
                os.close(fds[0])
            stub.CompleteLoad(pb.CompleteLoadRequest(session_id=sid, job_id=load.job_id), timeout=5)
        for i in range(16, 144, 16):  # the first 16 leave the host tier
            wait_for("the write queue empty", lambda: cluster_stats(a)["queued_blocks"] == 0)
            assert ns.put(keys[i : i + 16], data[i : i + 16]).stored == 16
        wait_for(
            "the evicted blocks written",
            lambda: cluster_stats(a)["writes"] + cluster_stats(a)["write_drops"] >= 16,
        )
        assert cluster_stats(a)["corrupt_exports"] == 1
    rc = cluster.cluster_client()
    assert not rc.exists(redis_key(spec.digest, keys[3]))
    assert all(rc.exists(redis_key(spec.digest, k)) for n, k in enumerate(keys[:16]) if n != 3)


def test_every_block_leaving_under_the_evict_policy_is_written_queued_or_counted_dropped(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """One master hung and a 16-block write queue: the queue fills with that master's blocks, and
    the blocks evicted meanwhile leave unwritten; each is counted a drop (it was counted nowhere,
    so `writes + write_drops` never reached the evictions: a CI flake of the test above)."""
    a = node(
        daemon_factory,
        tmp_path,
        "a",
        cluster.url,
        'cluster_write_policy = "evict"',
        "cluster_queue_bytes = 262144",
        "cluster_write_timeout_ms = 30000",
        host=("--host-bytes", "2MiB", "--slab-bytes", "1MiB"),
    )  # 128 blocks of 16 KiB
    hung = cluster.masters()[0]
    cluster.pause(hung)
    try:
        with kvtier.Client.connect(a.unix, transport="shm") as c:
            ns = c.register(make_namespace())
            keys = ns.block_keys([hash_token("leave", i) for i in range(16 * 256)])
            for i in range(0, 256, 16):
                assert ns.put(keys[i : i + 16], [b"\x07" * ns.block_bytes] * 16).stored == 16

        def accounted() -> int:
            s = cluster_stats(a)
            return int(s["writes"] + s["write_drops"] + s["queued_blocks"])

        wait_for("every evicted block accounted for", lambda: accounted() >= 128, timeout=10)
        assert cluster_stats(a)["write_drops"] > 0
    finally:
        cluster.resume(hung)
        # Paused past the node timeout (1 s), its replica took its slots over: the next test
        # needs the failover settled (CI saw the next test's writes time out meanwhile).
        cluster.wait_ready()


def test_a_password_protected_cluster_needs_the_password_file(daemon_factory: Any, tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "redis", password="s3cret-pw") as rc:
        secret = tmp_path / "redis-password"
        secret.write_text("s3cret-pw\n")
        a = node(daemon_factory, tmp_path, "a", rc.url, f'cluster_password_file = "{secret}"')
        b = node(daemon_factory, tmp_path, "b", rc.url, f'cluster_password_file = "{secret}"')
        keys, data = store(a, "password", 6)
        with kvtier.Client.connect(b.unix, transport="tcp") as c:
            ns = c.register(make_namespace())
            assert [bytes(g) if g else None for g in ns.get(keys)] == data
        nopw = node(daemon_factory, tmp_path, "nopw", rc.url, connect=False)  # refused by the cluster: misses
        wait_unreachable(tmp_path, "nopw")
        assert not cluster_stats(nopw)["connected"]
        with kvtier.Client.connect(nopw.unix, transport="tcp") as c:
            ns = c.register(make_namespace())
            assert ns.get(keys) == [None] * 6
        assert "s3cret-pw" not in (tmp_path / "a" / "kvtierd.log").read_text()


def test_a_tls_cluster_with_client_certificates(daemon_factory: Any, tmp_path: Path) -> None:
    with RedisCluster(tmp_path / "redis", tls=True, tls_auth_clients="yes") as rc:
        assert rc.url.startswith("rediss://")
        tls = (
            f'cluster_tls_ca = "{rc.ca_file}"',
            f'cluster_tls_cert = "{rc.client_cert_file}"',
            f'cluster_tls_key = "{rc.client_key_file}"',
        )
        a = node(daemon_factory, tmp_path, "a", rc.url, *tls)
        b = node(daemon_factory, tmp_path, "b", rc.url, *tls)
        keys, data = store(a, "tls", 6)
        with kvtier.Client.connect(b.unix, transport="shm") as c:
            ns = c.register(make_namespace())
            assert [bytes(g) if g else None for g in ns.get(keys)] == data
        plain = node(
            daemon_factory, tmp_path, "plain", rc.url.replace("rediss://", "redis://"), connect=False
        )
        nocert = node(daemon_factory, tmp_path, "nocert", rc.url, tls[0], connect=False)
        wait_unreachable(tmp_path, "plain", "nocert")
        for d in (plain, nocert):  # plaintext to a TLS port; TLS without a client certificate
            assert not cluster_stats(d)["connected"]
            with kvtier.Client.connect(d.unix, transport="tcp") as c:
                assert c.register(make_namespace()).get(keys) == [None] * 6


def test_an_import_into_a_full_host_tier_never_evicts_the_prefix_it_extends(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    cfg = tmp_path / "b.toml"
    cfg.write_text(
        f'cluster = "{cluster.url}"\ncluster_lookup_timeout_ms = 1000\n'
        "cluster_fetch_timeout_ms = 3000\n" + fleet_line(tmp_path)
    )
    b = daemon_factory(
        "--config", str(cfg), "--host-bytes", "2MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "b"
    )  # 128 blocks of 16 KiB
    wait_for("B's cluster tier connected", lambda: cluster_stats(b)["connected"])
    keys, data = store(a, "guard", 12)
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        ns = c.register(make_namespace())
        assert ns.put(keys[:4], data[:4]).stored == 4  # B's own prefix: the coldest blocks
        filler = ns.block_keys([hash_token("filler", i) for i in range(16 * 124)])
        for i in range(0, 124, 31):
            part = filler[i : i + 31]
            assert ns.put(
                part, [block("filler", j, ns.block_bytes) for j in range(i, i + len(part))]
            ).stored == len(part)
        wait_for(
            "B's writes (or drops: its queue is a quarter of its host tier)",
            lambda: cluster_stats(b)["writes"] + cluster_stats(b)["write_drops"] >= 128,
        )
        res = ns.lookup_pinned(keys)  # imports 8 blocks into a full host tier
        assert res.hits == 12
        assert c.release(res.pin, res.epoch)
        assert [bytes(g) if g else None for g in ns.get(keys)] == data


def test_a_large_import_with_the_shipped_deadlines_opens_no_breaker(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(
        daemon_factory,
        tmp_path,
        "b",
        cluster.url,
        defaults=True,
        host=("--host-bytes", "320MiB", "--slab-bytes", "1MiB"),
    )
    big = dict(num_layers=128)  # 1 MiB blocks: 192 of them in one get, 3x inflight_bytes
    keys, data = store(a, "large", 192, **big)
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        ns = c.register(make_namespace(**big))
        got = ns.get(keys)
        assert [bytes(g) if g else None for g in got] == data
        nodes = c.stats()["cluster"]["nodes"]
        assert all(n["errors"] == 0 and n["healthy"] for n in nodes), nodes


def test_a_hung_master_never_stalls_local_stores_or_lookups(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url, defaults=True)  # 64 MiB host
    spec = make_namespace(num_layers=16)  # 128 KiB blocks
    hung = cluster.masters()[0]
    cluster.pause(hung)
    try:
        with kvtier.Client.connect(a.unix, transport="shm") as c:
            ns = c.register(spec)
            keys = ns.block_keys([hash_token("hung", i) for i in range(16 * 1024)])
            data = [block("hung", i, ns.block_bytes) for i in range(1024)]  # 2x the host tier
            slowest = 0.0
            for i in range(0, 1024, 32):
                t0 = time.monotonic()
                assert ns.put(keys[i : i + 32], data[i : i + 32]).stored == 32  # never rejected
                assert ns.lookup(keys[i : i + 32]) == 32
                slowest = max(slowest, time.monotonic() - t0)
            assert slowest < 2.0, slowest
            got = ns.get(keys[-64:])  # the newest are in the host tier (a quarter may be
            assert [bytes(g) if g else None for g in got] == data[-64:]  # pinned by writes)
            st = c.stats()
            assert st["total"]["stores_rejected"] == 0
            assert st["cluster"]["writes"] > 0  # the other masters took theirs

            def hung_node_tripped() -> bool:  # or the cluster failed it over meanwhile
                nodes = {n["address"]: n for n in cluster_stats(a)["nodes"]}
                n = nodes.get(f"127.0.0.1:{hung}")
                return n is None or bool(n["errors"] >= 1)

            wait_for("the hung master's breaker", hung_node_tripped, timeout=10)
            assert cluster_stats(a)["write_drops"] > 0
    finally:
        cluster.resume(hung)
        # Paused past the node timeout (1 s), its replica took its slots over: the next test
        # needs the failover settled (CI saw the next test's writes time out meanwhile).
        cluster.wait_ready()


def test_a_store_job_larger_than_the_write_queue_is_written_in_part(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)  # queue: a quarter of 64 MiB
    with kvtier.Client.connect(a.unix, transport="shm") as c:
        ns = c.register(make_namespace(num_layers=16))  # 128 KiB blocks
        keys = ns.block_keys([hash_token("part", i) for i in range(16 * 256)])
        assert ns.put(keys, [block("part", i, ns.block_bytes) for i in range(256)]).stored == 256
    wait_for("the queue to drain", lambda: cluster_stats(a)["queued_blocks"] == 0)
    st = cluster_stats(a)
    assert st["writes"] == 128 and st["write_drops"] == 128  # 16 MiB of 32 MiB admitted


def test_a_drain_with_writes_stuck_on_a_hung_master_ends_in_time(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url, defaults=True)
    hung = cluster.masters()[1]
    cluster.pause(hung)
    try:
        with kvtier.Client.connect(a.unix, transport="shm") as c:
            ns = c.register(make_namespace())
            keys = ns.block_keys([hash_token("drain", i) for i in range(16 * 64)])
            assert ns.put(keys, [block("drain", i, ns.block_bytes) for i in range(64)]).stored == 64
        t0 = time.monotonic()
        assert a.stop(signal.SIGTERM) == 0
        assert time.monotonic() - t0 < 12  # drain_timeout_s (5) + the tier's close
    finally:
        cluster.resume(hung)
        # Paused past the node timeout (1 s), its replica took its slots over: the next test
        # needs the failover settled (CI saw the next test's writes time out meanwhile).
        cluster.wait_ready()


# -- who may write what the fleet serves (docs/cluster.md "Trust"; issue 26, finding 1) ----------


def forged(authentic: bytes, payload: bytes) -> bytes:
    """``authentic``'s header over ``payload`` instead: length and digest recomputed, as anyone
    with write access to the cluster can; its MAC kept (no one can make one without the key)."""
    fields = HEADER.unpack_from(authentic)
    signed = SIGNED.pack(*fields[:3], len(payload), *fields[4:6], xxhash.xxh3_128_digest(payload))
    return signed + authentic[SIGNED.size : HEADER_BYTES] + payload


def planted(digest: bytes, key: bytes, payload: bytes) -> bytes:
    """A value made from scratch for block ``key``: every header field right but the MAC."""
    return (
        SIGNED.pack(b"KVC1", 2, 0, len(payload), digest, key, xxhash.xxh3_128_digest(payload))
        + bytes(HEADER_BYTES - SIGNED.size)
        + payload
    )


def log_of(d: DaemonProcess) -> str:
    return (d.run_dir / "kvtierd.log").read_text()


def test_a_forged_value_is_a_miss_counted_logged_once_and_never_served(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    keys, data = store(a, "forged", 8)
    spec, rc = make_namespace(), cluster.cluster_client()
    evil = b"\x66" * len(data[0])
    for i in (2, 5):  # A's values, their bytes replaced
        rk = redis_key(spec.digest, keys[i])
        rc.set(rk, forged(rc.get(rk), evil))
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        ns = c.register(spec)
        extra = ns.block_keys([hash_token("forged", i) for i in range(16 * 10)])[8:]
        assert extra[0] not in keys
        for k in extra:  # blocks no daemon stored: values planted from scratch
            rc.set(redis_key(spec.digest, k), planted(spec.digest, k, evil))
        got = ns.get(keys + extra)
        assert [i for i, g in enumerate(got) if g is None] == [2, 5, 8, 9]
        assert [bytes(g) for g in got if g is not None] == [
            d for i, d in enumerate(data) if i not in (2, 5)
        ]  # 0 wrong bytes
        st = c.stats()
        assert st["cluster"]["mac_failures"] == 4 and st["cluster"]["corrupt_values"] == 4
        assert st["total"]["cluster_corrupt"] == 4
    with urllib.request.urlopen(b.info["metrics"], timeout=10) as r:
        assert "kvtier_cluster_mac_failures_total 4.0" in r.read().decode().splitlines()
    wait_for(
        "the forged values deleted",
        lambda: not any(rc.exists(redis_key(spec.digest, k)) for k in (keys[2], keys[5], *extra)),
    )
    refused = [line for line in log_of(b).splitlines() if "cluster value" in line]
    assert len(refused) == 1 and "bad MAC" in refused[0], refused  # once, not per value
    for d in (a, b):
        assert FLEET_KEY.hex() not in log_of(d)


def test_a_value_planted_before_the_real_store_does_not_outlive_it(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    b = node(daemon_factory, tmp_path, "b", cluster.url)
    spec, rc = make_namespace(), cluster.cluster_client()
    with kvtier.Client.connect(b.unix, transport="tcp") as c:
        ns = c.register(spec)
        keys = ns.block_keys([hash_token("early", i) for i in range(16 * 6)])
        for k in keys:  # planted first, for blocks A is about to store
            rc.set(redis_key(spec.digest, k), planted(spec.digest, k, b"\x99" * ns.block_bytes))
    stored, data = store(a, "early", 6)
    assert stored == keys
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        got = c.register(spec).get(keys)
        assert [bytes(g) if g is not None else None for g in got] == data
        assert c.stats()["cluster"]["mac_failures"] == 0  # A's store replaced every one


TENANT_TOKENS = {"team-a": "tok-cl-a", "team-b": "tok-cl-b", "ops": "tok-cl-ops"}


def tenants_line(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(
        "".join(
            f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{hashlib.sha256(t.encode()).hexdigest()}"]\n'
            + ("operator = true\n" if name == "ops" else "")
            + "\n"
            for name, t in TENANT_TOKENS.items()
        )
        + extra
    )
    return f'tenants_file = "{path}"'


def test_a_tenants_blocks_are_served_only_from_values_of_its_own_realm(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """Two daemons with tenants and one without, one fleet key. A client of the untenanted
    daemon naming team-a's tenant (as any may there) makes team-a's namespace digest and block
    keys, but its values are in the untenanted realm: under other Redis keys, and their MAC
    fails under team-a's; team-b's authentic values copied under team-a's keys fail too; what
    team-a itself stores replaces them all."""
    ops = TENANT_TOKENS["ops"]
    t1 = node(daemon_factory, tmp_path, "t1", cluster.url, tenants_line(tmp_path), token=ops)
    t2 = node(daemon_factory, tmp_path, "t2", cluster.url, tenants_line(tmp_path), token=ops)
    open_ = node(daemon_factory, tmp_path, "open", cluster.url)  # no tenants file
    fleet, rc = FleetKeys(FLEET_KEY), cluster.cluster_client()
    ra = fleet.realm("team-a")
    spec_a, spec_b = make_namespace(tenant="team-a"), make_namespace(tenant="team-b")
    keys, _ = store(open_, "realm", 4, fill=b"\x13", tenant="team-a")
    assert all(rc.exists(redis_key(spec_a.digest, k)) for k in keys)  # untenanted realm
    assert not any(rc.exists(redis_key(spec_a.digest, k, ra)) for k in keys)

    def team_a_gets() -> list[bytes | None]:
        with kvtier.Client.connect(t2.unix, transport="tcp", token=TENANT_TOKENS["team-a"]) as c:
            return [bytes(g) if g is not None else None for g in c.register(spec_a).get(keys)]

    assert team_a_gets() == [None] * 4  # never even asked for: another realm's keys
    for k in keys:
        rc.set(redis_key(spec_a.digest, k, ra), rc.get(redis_key(spec_a.digest, k)))
    assert team_a_gets() == [None] * 4  # copied under team-a's keys: the MAC fails
    assert cluster_stats(t2, ops)["mac_failures"] == 4
    keys_b, _ = store(t1, "realm", 4, token=TENANT_TOKENS["team-b"], admin=ops, tenant="team-b")
    for kb, ka in zip(keys_b, keys, strict=True):  # team-b's authentic values, team-a's keys
        rc.set(redis_key(spec_a.digest, ka, ra), rc.get(redis_key(spec_b.digest, kb, fleet.realm("team-b"))))
    assert team_a_gets() == [None] * 4
    assert cluster_stats(t2, ops)["corrupt_values"] == 8
    wait_for(
        "the refused values deleted",
        lambda: (
            not any(  # (before team-a's own store)
                rc.exists(redis_key(spec_a.digest, k, ra)) for k in keys
            )
        ),
    )
    _, data = store(t1, "realm", 4, token=TENANT_TOKENS["team-a"], admin=ops, tenant="team-a")
    assert team_a_gets() == data
    assert all(rc.exists(redis_key(spec_a.digest, k, ra)) for k in keys)
    assert all(redis_key(spec_a.digest, k, ra).startswith(ra.prefix) for k in keys)


def test_a_groups_blocks_are_written_under_its_own_realm_and_read_by_its_members_on_other_nodes(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """Issue 43: what a publisher of group ``acme`` stores through one node goes to the cluster
    under the group's realm (its own MAC key and Redis keys: neither the publisher's nor those
    of a tenant named ``acme`` in another daemon's file); a member on another node, where no
    publisher registered the group's namespace, loads it from there; team-a's own authentic
    values copied under the group's keys are refused."""
    ops = TENANT_TOKENS["ops"]
    group = '[[group]]\nname = "acme"\npublishers = ["team-a"]\nmembers = ["team-b"]\n'
    t1 = node(daemon_factory, tmp_path, "g1", cluster.url, tenants_line(tmp_path, group), token=ops)
    t2 = node(daemon_factory, tmp_path, "g2", cluster.url, tenants_line(tmp_path, group), token=ops)
    fleet, rc = FleetKeys(FLEET_KEY), cluster.cluster_client()
    rg, spec = fleet.group("acme"), make_namespace(group="acme")
    keys, data = store(t1, "group", 4, token=TENANT_TOKENS["team-a"], admin=ops, group="acme")
    assert all(rc.exists(redis_key(spec.digest, k, rg)) for k in keys)
    for other in (fleet.realm("team-a"), fleet.realm("acme")):
        assert not any(rc.exists(redis_key(spec.digest, k, other)) for k in keys)
    with kvtier.Client.connect(t2.unix, transport="tcp", token=TENANT_TOKENS["team-b"]) as c:
        assert [bytes(g) if g is not None else None for g in c.register(spec).get(keys)] == data
    # team-a's own authentic values, copied under the group's keys on a third node: refused
    t3 = node(daemon_factory, tmp_path, "g3", cluster.url, tenants_line(tmp_path, group), token=ops)
    keys_a, _ = store(t1, "group-a", 4, token=TENANT_TOKENS["team-a"], admin=ops, tenant="team-a")
    spec_a = make_namespace(tenant="team-a")
    for ka, kg in zip(keys_a, keys, strict=True):
        rc.set(redis_key(spec.digest, kg, rg), rc.get(redis_key(spec_a.digest, ka, fleet.realm("team-a"))))
    with kvtier.Client.connect(t3.unix, transport="tcp", token=TENANT_TOKENS["team-b"]) as c:
        assert c.register(spec).get(keys) == [None] * 4
    assert cluster_stats(t3, ops)["corrupt_values"] + cluster_stats(t3, ops)["mac_failures"] == 4


def test_a_daemon_with_another_fleet_key_neither_serves_nor_is_served(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    other_key = hashlib.sha256(b"another fleet").digest()
    a = node(daemon_factory, tmp_path, "a", cluster.url)
    x = node(daemon_factory, tmp_path, "x", cluster.url, fleet_key=other_key)
    spec, rc = make_namespace(), cluster.cluster_client()
    keys, _ = store(a, "fleets", 4)
    keys_x, _ = store(x, "fleets-x", 4)
    for d, theirs in ((x, keys), (a, keys_x)):
        with kvtier.Client.connect(d.unix, transport="tcp") as c:
            assert c.register(spec).get(theirs) == [None] * 4
    rx = FleetKeys(other_key).untenanted(CLUSTER_REALM)
    for k in keys:  # A's authentic values under X's keys
        rc.set(redis_key(spec.digest, k, rx), rc.get(redis_key(spec.digest, k)))
    with kvtier.Client.connect(x.unix, transport="tcp") as c:
        assert c.register(spec).get(keys) == [None] * 4
        assert c.stats()["cluster"]["mac_failures"] == 4


def test_untenanted_daemons_of_another_realm_serve_none_of_each_others_values(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """Issue 39: untenanted daemons sharing one fleet key shared one realm, so what an engine of
    one sidecar pod stored (its own bytes under another's keys) another pod's daemon served,
    4 of 4. Each trust domain has its cluster_realm now: a daemon of another realm never asks
    for those values, and serves none copied under its own keys (the MAC is another realm's);
    daemons of one realm still share."""
    poisoner = node(daemon_factory, tmp_path, "poisoner", cluster.url, realm="ns-b.engine")
    victim = node(daemon_factory, tmp_path, "victim", cluster.url, realm="ns-a.engine")
    peer = node(daemon_factory, tmp_path, "peer", cluster.url, realm="ns-a.engine")
    spec, rc = make_namespace(), cluster.cluster_client()
    keys, _ = store(poisoner, "poison", 4, fill=b"\x66")  # the keys the victim's engines ask for
    with kvtier.Client.connect(victim.unix, transport="tcp") as c:
        assert c.register(spec).get(keys) == [None] * 4
    fleet = FleetKeys(FLEET_KEY)
    va, vb = fleet.untenanted("ns-a.engine"), fleet.untenanted("ns-b.engine")
    for k in keys:  # the poisoner's authentic values under the victim realm's keys
        rc.set(redis_key(spec.digest, k, va), rc.get(redis_key(spec.digest, k, vb)))
    with kvtier.Client.connect(victim.unix, transport="tcp") as c:
        assert c.register(spec).get(keys) == [None] * 4
        assert c.stats()["cluster"]["mac_failures"] == 4
    keys, data = store(victim, "shared", 4)
    with kvtier.Client.connect(peer.unix, transport="tcp") as c:  # the same realm: served
        assert [bytes(g) if g is not None else None for g in c.register(spec).get(keys)] == data


def test_a_redis_acl_user_held_to_its_realms_key_pattern_is_all_a_daemon_needs(
    cluster: RedisCluster, daemon_factory: Any, tmp_path: Path
) -> None:
    """docs/cluster.md "Redis ACL users per tenant": the user the docs show, on every node."""
    acl = [
        "on",
        ">node-pw",
        "resetkeys",
        REALM.acl_pattern,
        "resetchannels",
        "-@all",
        "+get",
        "+set",
        "+exists",
        "+del",
        "+cluster|slots",
        "+ping",
        "+auth",
        "+hello",
    ]
    for port in cluster.live_ports():
        cluster.client(port).execute_command("ACL", "SETUSER", "kvt-node", *acl)
    pw = tmp_path / "node-pw"
    pw.write_text("node-pw\n")
    creds = ('cluster_username = "kvt-node"', f'cluster_password_file = "{pw}"')
    a = node(daemon_factory, tmp_path, "a", cluster.url, *creds)
    b = node(daemon_factory, tmp_path, "b", cluster.url, *creds)
    keys, data = store(a, "acl", 6)
    with kvtier.Client.connect(b.unix, transport="shm") as c:
        assert [bytes(g) if g is not None else None for g in c.register(make_namespace()).get(keys)] == data
    other = redis_key(make_namespace().digest, keys[0], FleetKeys(FLEET_KEY).realm("team-a"))
    user = redis.Redis(
        host="127.0.0.1", port=cluster.master_for_key(other), username="kvt-node", password="node-pw"
    )
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.set(other, b"x")  # another realm's keys: refused by Redis itself
    finally:
        user.close()

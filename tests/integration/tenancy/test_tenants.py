"""Tenants from credentials (issue 11): a real daemon with a tenants file.

Every Kvtier RPC needs a bearer token of a tenant (UNAUTHENTICATED otherwise; the health service
stays open); a tenant sees, registers, looks up, loads, counts and lists only its own namespaces
and sessions, and another tenant's id answers exactly like an absent one; an operator sees all;
quotas refuse fast (RESOURCE_EXHAUSTED naming the quota) and one tenant at its limits never makes
another's register, put or get fail; shm handshakes come only from the tenant's Unix peers; the
file is re-read on SIGHUP.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests_helpers import TokenStub, scrape_metrics, until_unauthenticated, wait_for

import kvtier
from kvtier_contract import errors, wire
from kvtier_contract import published_index as pi
from kvtier_contract.v1 import kvtier_pb2 as pb

TOKENS = {
    "team-a": "tok-a-7f3e",
    "team-b": "tok-b-91c2",
    "ops": "tok-ops-55aa",
    "team-c": "tok-c-0b0b",
    "team-d": "tok-d-3c3c",
}


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenants_file(path: Path, *, extra: str = "", drop: tuple[str, ...] = ()) -> Path:
    body = ""
    quotas = {
        "team-a": "sessions = 3\nnamespaces = 2\nsession_open_jobs = 4\n"
        'host_bytes = "2MiB"\npinned_bytes = "256KiB"\nnvme_bytes = "1MiB"\n'
    }
    for name, token in TOKENS.items():
        if name in drop:
            continue
        body += f'[[tenant]]\nname = "{name}"\ntokens_sha256 = ["{digest(token)}"]\n'
        if name == "ops":
            body += "operator = true\n"
        if name == "team-c":
            body += "unix_uids = [12345]\n"
        if name == "team-b":
            body += 'transports = ["tcp", "shm"]\n'
        if name == "team-d":
            body += 'transports = ["tcp"]\nmax_lease_s = 2.5\n'
        if name in quotas:
            body += "[tenant.quotas]\n" + quotas[name]
        body += "\n"
    path.write_text(body + extra)
    return path


@pytest.fixture
def tenants(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tenants_file(tmp_path / "tenants.toml")}"\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )
    return d


def client(d: DaemonProcess, tenant: str, transport: str = "tcp") -> kvtier.Client:
    return kvtier.Client.connect(d.unix, transport=transport, token=TOKENS[tenant])  # type: ignore[arg-type]


def ns_of(tenant: str, **kw: Any) -> kvtier.Namespace:
    return make_namespace(tenant=tenant, **kw)


class Raw(TokenStub):
    """A raw stub with (or without) a token: what any process can send."""

    def __init__(self, d: DaemonProcess, token: str | None) -> None:
        super().__init__(d.grpc, token)

    def session(self, transport: int = pb.TRANSPORT_TCP) -> int:
        return int(self.open(transport).session_id)

    def open(self, transport: int = pb.TRANSPORT_TCP) -> Any:
        """An OpenSessionReply (its session_id and data_secret)."""
        return self(
            "OpenSession", pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=30_000, transport=transport)
        )


@pytest.fixture
def raw(tenants: DaemonProcess) -> Iterator[Any]:
    opened: list[Raw] = []

    def make(tenant: str | None) -> Raw:
        r = Raw(tenants, TOKENS[tenant] if tenant else None)
        opened.append(r)
        return r

    yield make
    for r in opened:
        r.channel.close()


def test_every_rpc_needs_a_credential_and_health_stays_open(tenants: DaemonProcess, raw: Any) -> None:
    for who in (raw(None), Raw(tenants, "not-a-token")):
        for method, request in (
            ("OpenSession", pb.OpenSessionRequest(client_name="x")),
            ("Stats", pb.StatsRequest()),
            ("RegisterNamespace", pb.RegisterNamespaceRequest()),
            (
                "LookupSlices",
                pb.LookupSlicesRequest(session_id=1, namespace_ids=[1], keys=[bytes(32)], pin=True),
            ),
        ):
            code, details = who.code(method, request)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method, details)
    with grpc.insecure_channel(tenants.grpc) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(errors.Unauthenticated, match="gave no credential") as e:
        kvtier.Client.connect(tenants.unix, transport="tcp", timeout_s=2)
    assert e.value.field == "token"
    with kvtier.Client.connect(tenants.unix, transport="tcp", timeout_s=2, lazy=True) as c:
        with pytest.raises(errors.Unauthenticated):
            c.stats()


def test_another_tenants_namespace_and_session_answer_like_absent_ones(
    tenants: DaemonProcess, raw: Any
) -> None:
    with client(tenants, "team-a", "shm") as a:
        ns = a.register(ns_of("team-a"))
        keys = ns.block_keys(list(range(16 * 4)))
        assert ns.put(keys, [b"\x05" * ns.block_bytes] * 4).stored == 4
        b = raw("team-b")
        sid = b.session()
        absent = 4242424242
        for method, build in (
            ("Lookup", lambda n: pb.LookupRequest(session_id=sid, namespace_id=n, keys=b"".join(keys))),
            (
                "Lookup",
                lambda n: pb.LookupRequest(session_id=sid, namespace_id=n, keys=b"".join(keys), pin=True),
            ),
            ("Prefetch", lambda n: pb.PrefetchRequest(session_id=sid, namespace_id=n, keys=b"".join(keys))),
            (
                "PrepareLoad",
                lambda n: pb.PrepareLoadRequest(
                    session_id=sid, namespace_id=n, keys=b"".join(keys), transport=pb.TRANSPORT_TCP
                ),
            ),
            (
                "PrepareStore",
                lambda n: pb.PrepareStoreRequest(
                    session_id=sid, namespace_id=n, keys=b"".join(keys), transport=pb.TRANSPORT_TCP
                ),
            ),
        ):
            theirs = b.code(method, build(ns.namespace_id))
            nothing = b.code(method, build(absent))
            assert theirs[0] == nothing[0] == grpc.StatusCode.NOT_FOUND
            assert theirs[1].replace(str(ns.namespace_id), "N") == nothing[1].replace(str(absent), "N")
        # a's session, used with b's credential: unknown
        a_sid = a.session.connection.session_id
        theirs = b.code("Heartbeat", pb.HeartbeatRequest(session_id=a_sid))
        nothing = b.code("Heartbeat", pb.HeartbeatRequest(session_id=absent))
        assert theirs[0] == nothing[0] == grpc.StatusCode.NOT_FOUND
        assert theirs[1].replace(str(a_sid), "S") == nothing[1].replace(str(absent), "S")
        # b's Stats: none of a's namespaces or counters; the operator's: everything
        st = b("Stats", pb.StatsRequest())
        assert not st.namespaces and st.total.stores_accepted == 0
        with client(tenants, "ops") as ops:
            everything = ops.stats()
        assert [n["namespace_id"] for n in everything["namespaces"]] == [ns.namespace_id]
        assert everything["total"]["stores_accepted"] == 4
        # a's own view
        mine = a.stats()
        assert [n["namespace_id"] for n in mine["namespaces"]] == [ns.namespace_id]
        # still a's: nothing b did changed it
        assert [bytes(g) if g else None for g in ns.get(keys)] == [b"\x05" * ns.block_bytes] * 4


def test_a_tenant_registers_only_namespaces_naming_it(tenants: DaemonProcess, raw: Any) -> None:
    b = raw("team-b")
    for spec, code, field in (
        (ns_of("team-a"), grpc.StatusCode.PERMISSION_DENIED, "spec.tenant"),
        (make_namespace(), grpc.StatusCode.INVALID_ARGUMENT, "spec.tenant"),
        (make_namespace(group="team-b"), grpc.StatusCode.PERMISSION_DENIED, "spec.group"),
        (make_namespace(group="shared"), grpc.StatusCode.PERMISSION_DENIED, "spec.group"),
    ):
        fields = {k: v for k, v in spec.to_dict().items() if v is not None}
        got, details = b.code(
            "RegisterNamespace",
            pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**fields), digest=spec.digest),
        )
        assert got == code and details.startswith(f"{field}: "), details
    with client(tenants, "ops") as ops:  # the operator may register any tenant's
        assert ops.register(ns_of("team-a")).namespace_id
        with pytest.raises(errors.PermissionDenied, match="spec.group"):  # but no group's yet
            ops.register(make_namespace(group="shared"))


def test_a_hog_at_every_quota_never_fails_another_tenant(tenants: DaemonProcess, raw: Any) -> None:
    a = raw("team-a")
    sessions = [a.session(pb.TRANSPORT_SHM) for _ in range(3)]
    code, details = a.code("OpenSession", pb.OpenSessionRequest(client_name="4th"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota sessions" in details
    specs = [ns_of("team-a", model_revision=f"r{i}") for i in range(3)]
    ids = []
    for i, spec in enumerate(specs):
        fields = {k: v for k, v in spec.to_dict().items() if v is not None}
        request = pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**fields), digest=spec.digest)
        if i < 2:
            ids.append(a("RegisterNamespace", request).namespace_id)
        else:
            code, details = a.code("RegisterNamespace", request)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota namespaces" in details
    sid = sessions[0]
    for i in range(4):  # session_open_jobs = 4: the fifth store job of one session is refused
        a(
            "PrepareStore",
            pb.PrepareStoreRequest(
                session_id=sid, namespace_id=ids[0], keys=bytes([i + 1]) * 32, transport=pb.TRANSPORT_SHM
            ),
        )
    code, details = a.code(
        "PrepareStore",
        pb.PrepareStoreRequest(
            session_id=sid, namespace_id=ids[0], keys=b"\x09" * 32, transport=pb.TRANSPORT_SHM
        ),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota session_open_jobs" in details
    for sid in sessions:  # (room for the SDK clients below under the sessions quota)
        a("CloseSession", pb.CloseSessionRequest(session_id=sid))
    # host_bytes = 2 MiB: team-a's puts evict team-a's own oldest blocks, never team-b's
    with client(tenants, "team-b", "shm") as b, client(tenants, "team-a", "shm") as a2:
        nb = b.register(ns_of("team-b"))
        bkeys = nb.block_keys(list(range(16 * 32)))
        bdata = [hashlib.shake_256(b"b%d" % i).digest(nb.block_bytes) for i in range(32)]
        assert nb.put(bkeys, bdata).stored == 32
        na = a2.register(specs[1])
        akeys = na.block_keys(list(range(16 * 256)))  # 4 MiB: twice team-a's quota
        for i in range(0, 256, 32):
            assert na.put(akeys[i : i + 32], [b"\x01" * na.block_bytes] * 32).stored == 32
        assert na.lookup(akeys[-64:]) == 64 and na.lookup(akeys) < 256
        mine = a2.stats()
        assert sum(n["counters"]["resident_bytes"] for n in mine["namespaces"]) <= 2 << 20
        # team-b, meanwhile: registers, puts and gets as if team-a were not there
        nb2 = b.register(ns_of("team-b", model_revision="other"))
        k2 = nb2.block_keys(list(range(16 * 4)))
        assert nb2.put(k2, [b"\x02" * nb2.block_bytes] * 4).stored == 4
        assert [bytes(g) if g else None for g in nb.get(bkeys)] == bdata
        assert b.stats()["total"]["stores_rejected"] == 0


def test_lookup_slices_is_all_or_nothing_under_quota_and_tenant_scoping(
    tenants: DaemonProcess, raw: Any
) -> None:
    """team-a's pinned_bytes quota (256 KiB = 16 blocks) passed at its second slice: the first
    slice's pins are released too; a slice naming team-b's namespace is NOT_FOUND, as for
    Lookup, and pins nothing of team-a's either."""
    with client(tenants, "team-a", "shm") as sdk:
        handles = [sdk.register(ns_of("team-a", tp_rank=r, tp_size=2)) for r in range(2)]
        chains = [h.block_keys(list(range(16 * 12))) for h in handles]
        for h, keys in zip(handles, chains, strict=True):
            assert h.put(keys, [b"a" * h.block_bytes] * 12).stored == 12
        ids = [h.namespace_id for h in handles]
    with client(tenants, "team-b", "shm") as sdk:
        hb = sdk.register(ns_of("team-b"))
        kb = hb.block_keys(list(range(16 * 2)))
        assert hb.put(kb, [b"b" * hb.block_bytes] * 2).stored == 2
        b_id = hb.namespace_id
    a = raw("team-a")
    sid = a.session(pb.TRANSPORT_SHM)

    def pinned() -> int:
        return int(raw("ops")("Stats", pb.StatsRequest()).pinned_blocks)

    code, details = a.code(
        "LookupSlices",
        pb.LookupSlicesRequest(
            session_id=sid, namespace_ids=ids, keys=[b"".join(k) for k in chains], pin=True
        ),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota pinned_bytes" in details
    assert pinned() == 0
    code, details = a.code(
        "LookupSlices",
        pb.LookupSlicesRequest(
            session_id=sid,
            namespace_ids=[ids[0], b_id],
            keys=[b"".join(chains[0][:4]), b"".join(kb)],
            pin=True,
        ),
    )
    assert code == grpc.StatusCode.NOT_FOUND and "namespace" in details
    assert pinned() == 0
    got = a(
        "LookupSlices",
        pb.LookupSlicesRequest(
            session_id=sid, namespace_ids=ids, keys=[b"".join(k[:8]) for k in chains], pin=True
        ),
    )
    assert got.hit_blocks == 8 and [r.hit_blocks for r in got.slices] == [8, 8]
    assert pinned() == 16


def test_pinned_bytes_quota_refuses_the_pin_and_keeps_nothing_pinned(
    tenants: DaemonProcess, raw: Any
) -> None:
    """pinned_bytes = 256 KiB (16 blocks of 16 KiB) for team-a: a pinned lookup or a load that
    would hold more is RESOURCE_EXHAUSTED naming the quota and leaves nothing pinned; team-b is
    not limited by it."""
    spec = ns_of("team-a")
    with client(tenants, "team-a", "shm") as sdk:
        ns = sdk.register(spec)
        keys = ns.block_keys(list(range(16 * 32)))
        assert ns.put(keys, [bytes([i]) * ns.block_bytes for i in range(32)]).stored == 32
    a = raw("team-a")
    sid = a.session(pb.TRANSPORT_SHM)
    fields = {k: v for k, v in spec.to_dict().items() if v is not None}
    nid = a(
        "RegisterNamespace", pb.RegisterNamespaceRequest(spec=pb.NamespaceSpec(**fields), digest=spec.digest)
    ).namespace_id

    def pinned() -> int:
        return int(raw("ops")("Stats", pb.StatsRequest()).pinned_blocks)

    code, details = a.code(
        "Lookup", pb.LookupRequest(session_id=sid, namespace_id=nid, keys=b"".join(keys), pin=True)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota pinned_bytes" in details
    assert pinned() == 0
    held = a("Lookup", pb.LookupRequest(session_id=sid, namespace_id=nid, keys=b"".join(keys[:16]), pin=True))
    assert held.hit_blocks == 16 and held.job_id and pinned() == 16
    code, details = a.code(
        "PrepareLoad",
        pb.PrepareLoadRequest(session_id=sid, namespace_id=nid, keys=keys[16], transport=pb.TRANSPORT_SHM),
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota pinned_bytes" in details
    assert pinned() == 16
    assert raw("ops")("Stats", pb.StatsRequest()).total.loads == 0  # a refusal moved nothing
    a("CompleteLoad", pb.CompleteLoadRequest(session_id=sid, job_id=held.job_id))
    assert pinned() == 0
    load = a(
        "PrepareLoad",
        pb.PrepareLoadRequest(
            session_id=sid, namespace_id=nid, keys=b"".join(keys[16:32]), transport=pb.TRANSPORT_SHM
        ),
    )
    assert load.job_id and load.found == b"\x01" * 16
    # team-b has no such quota: it pins 32 blocks of its own meanwhile
    with client(tenants, "team-b", "shm") as b:
        nb = b.register(ns_of("team-b"))
        bkeys = nb.block_keys(list(range(16 * 32)))
        assert nb.put(bkeys, [b"\x07" * nb.block_bytes] * 32).stored == 32
        p = nb.lookup_pinned(bkeys)
        assert p.hits == 32
        b.release(p.pin, p.epoch)


def test_nvme_bytes_quota_keeps_a_tenants_disk_share(daemon_factory: Any, tmp_path: Path) -> None:
    """nvme_bytes = 1 MiB for team-a (64 blocks of 16 KiB), write-through: team-a's blocks beyond
    it stay in the host tier only, its own coldest copies make room; team-b's are all written."""
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tenants_file(tmp_path / "tenants.toml")}"\n')
    d: DaemonProcess = daemon_factory(
        "--config",
        str(cfg),
        "--host-bytes",
        "64MiB",
        "--slab-bytes",
        "1MiB",
        "--disk-dir",
        str(tmp_path / "nvme"),
        "--disk-bytes",
        "16MiB",
        "--write-policy",
        "write-through",
        run_dir=tmp_path / "d",
    )

    def on_disk(c: kvtier.Client) -> tuple[int, int]:
        n = c.stats()["namespaces"]
        return (
            sum(x["counters"]["nvme_resident_blocks"] for x in n),
            sum(x["counters"]["nvme_resident_bytes"] for x in n),
        )

    with client(d, "team-a", "shm") as a, client(d, "team-b", "shm") as b:
        na, nb = a.register(ns_of("team-a")), b.register(ns_of("team-b"))
        akeys = na.block_keys(list(range(16 * 96)))
        for i in range(0, 96, 32):
            assert na.put(akeys[i : i + 32], [bytes([i]) * na.block_bytes] * 32).stored == 32
        bkeys = nb.block_keys(list(range(16 * 80)))
        assert nb.put(bkeys, [b"\x05" * nb.block_bytes] * 80).stored == 80
        deadline = time.monotonic() + 20
        while on_disk(b)[0] < 80 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert on_disk(b) == (80, 80 * nb.block_bytes)
        blocks, nbytes = on_disk(a)
        assert 32 <= blocks <= 64 and nbytes <= 1 << 20
        # the newest of team-a's blocks are there (its oldest copies made room), all still hit
        detail = na.lookup_detail(akeys)
        assert detail.hits == 96 and detail.tiers[-1] == "host"


def test_an_idle_empty_namespace_expires_and_frees_the_tenants_quota(
    daemon_factory: Any, tmp_path: Path
) -> None:
    """namespace_idle_s = 1: team-a (namespaces = 2) registers two, the third is refused; once
    the two are idle and empty they are forgotten and the third fits; a namespace holding blocks
    never expires; an SDK handle whose namespace expired registers it again by itself."""
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tenants_file(tmp_path / "tenants.toml")}"\nnamespace_idle_s = 1.0\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )
    # (no published index: a client reading a namespace's index keeps it from expiring)
    a = kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS["team-a"], local_lookups=False)
    with a, client(d, "team-b", "tcp") as b:
        idle = a.register(ns_of("team-a", model_revision="idle"))
        kept = a.register(ns_of("team-a", model_revision="kept"))
        assert idle.lookup(idle.block_keys(list(range(16)))) == 0
        keys = kept.block_keys(list(range(16 * 2)))
        assert kept.put(keys, [b"\x03" * kept.block_bytes] * 2).stored == 2
        third = a.register(ns_of("team-a", model_revision="third"))
        assert third.lookup(keys) == 0 and "quota namespaces" in a.counters.last_error
        nb = b.register(ns_of("team-b"))
        assert nb.lookup(keys) == 0

        def registered() -> set[str]:
            return {n["model_revision"] for n in a.stats()["namespaces"]}

        deadline = time.monotonic() + 20
        while "idle" in registered() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert registered() == {"kept"}  # (it holds blocks: never expires)
        # the SDK's handles still work: a refused one registers when it fits, and one whose
        # namespace the daemon forgot registers again (or misses, never raises, when refused).
        # (The refused one tries again at most once per REGISTER_RETRY_S (1 s) after its
        # refusal, which can be later than "idle" expired: until then its store is a drop.)
        wait_for(
            "the refused namespace's store",
            lambda: third.put(keys, [b"\x04" * third.block_bytes] * 2).stored == 2,
        )
        assert idle.lookup(idle.block_keys(list(range(16)))) == 0
        assert "quota namespaces" in a.counters.last_error
        assert registered() == {"kept", "third"}
        assert [bytes(g or b"") for g in kept.get(keys)] == [b"\x03" * kept.block_bytes] * 2
        assert [bytes(g or b"") for g in third.get(keys)] == [b"\x04" * third.block_bytes] * 2
        assert nb.lookup(keys) == 0 and b.counters.reconnects == 0


def test_the_tenants_lease_ceiling_bounds_its_sessions(raw: Any) -> None:
    """team-d's max_lease_s = 2.5: its sessions never get a longer lease, whatever they ask;
    team-b's get what they ask within the daemon's bounds."""
    for ask_ms in (0, 1_000, 60_000):
        d = raw("team-d")(
            "OpenSession",
            pb.OpenSessionRequest(client_name="d", lease_ttl_ms=ask_ms, transport=pb.TRANSPORT_TCP),
        )
        assert d.lease_ttl_ms == min(ask_ms or 2_500, 2_500)
    b = raw("team-b")(
        "OpenSession", pb.OpenSessionRequest(client_name="b", lease_ttl_ms=60_000, transport=pb.TRANSPORT_TCP)
    )
    assert b.lease_ttl_ms == 60_000


def test_shm_handshakes_only_from_the_tenants_unix_peers(tenants: DaemonProcess, raw: Any) -> None:
    c = raw("team-c")  # unix_uids = [12345]; this test runs as another uid
    assert os.getuid() != 12345
    opened = c.open(pb.TRANSPORT_SHM)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(tenants.info["shm"])
        s.sendall(wire.shm_request(wire.SHM_MAGIC, opened.session_id, opened.data_secret))
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    for fd in fds:
        os.close(fd)
    assert not fds and b"unknown or expired session" in msg
    b = raw("team-b")  # no list: any peer
    opened = b.open(pb.TRANSPORT_SHM)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(tenants.info["shm"])
        s.sendall(wire.shm_request(wire.SHM_MAGIC, opened.session_id, opened.data_secret))
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    for fd in fds:
        os.close(fd)
    assert len(fds) == 1


def test_a_tenant_limited_to_tcp_cannot_open_an_shm_session(raw: Any) -> None:
    d = raw("team-d")  # transports = ["tcp"]: never maps the shared arena
    assert d.session(pb.TRANSPORT_TCP)
    for transport in (pb.TRANSPORT_SHM, pb.TRANSPORT_UNSPECIFIED):
        code, details = d.code("OpenSession", pb.OpenSessionRequest(client_name="x", transport=transport))
        assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("transport: ")


def test_another_tenants_published_index_is_not_handed_out(tenants: DaemonProcess, raw: Any) -> None:
    with client(tenants, "team-a", "shm") as a:
        ns = a.register(ns_of("team-a"))
        opened = raw("team-b").open(pb.TRANSPORT_SHM)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(tenants.info["shm"])
            s.sendall(
                pi.INDEX_REQUEST.pack(pi.INDEX_MAGIC, opened.session_id, ns.namespace_id, opened.data_secret)
            )
            msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
        for fd in fds:
            os.close(fd)
        assert not fds and b"unknown namespace" in msg


def test_the_tenants_file_is_reread_on_sighup(tenants: DaemonProcess, tmp_path: Path, raw: Any) -> None:
    b = raw("team-b")
    assert b("Stats", pb.StatsRequest())
    tenants_file(
        tmp_path / "tenants.toml",
        drop=("team-b",),
        extra=f'[[tenant]]\nname = "team-e"\ntokens_sha256 = ["{digest("tok-e")}"]\n',
    )
    assert tenants.proc is not None
    tenants.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        try:
            Raw(tenants, "tok-e")("Stats", pb.StatsRequest())
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert b.code("Stats", pb.StatsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    (tmp_path / "tenants.toml").write_text("[[tenant]]\nname = 3\n")  # a bad file: kept as is
    tenants.proc.send_signal(signal.SIGHUP)
    log_file = tmp_path / "d" / "kvtierd.log"
    wait_for("the bad file refused", lambda: "tenants file not reloaded" in log_file.read_text())
    assert Raw(tenants, "tok-e")("Stats", pb.StatsRequest())
    assert "tok-e" not in log_file.read_text()


def test_kvtier_stats_takes_a_token_file(tenants: DaemonProcess, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKENS["team-a"] + "\n")
    with client(tenants, "team-a") as a:
        a.register(ns_of("team-a"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "stats",
            "--address",
            tenants.unix,
            "--token-file",
            str(token),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r'"model_id": "test/model"', out.stdout)
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", tenants.unix],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "credential" in out.stderr


def test_metrics_show_a_tenant_only_its_own_namespaces(tenants: DaemonProcess) -> None:
    for tenant, model in (("team-a", "org/model-of-a"), ("team-b", "org/model-of-b")):
        with client(tenants, tenant) as c:
            ns = c.register(ns_of(tenant, model_id=model))
            keys = ns.block_keys(list(range(16 * 2)))
            assert ns.put(keys, [b"\1" * ns.block_bytes] * 2).stored == 2
    for token in (None, "not-a-token"):
        code, body = scrape_metrics(tenants, token)
        assert code == 401 and "model-of" not in body
    code, a = scrape_metrics(tenants, TOKENS["team-a"])
    assert code == 200
    assert 'model="org/model-of-a"' in a and "model-of-b" not in a
    assert 'method="' not in a  # nothing daemon-wide: no other tenant's RPCs
    assert "kvtier_host_capacity_bytes 2.097152e+06" in a  # its own arena (host_bytes quota)
    code, ops = scrape_metrics(tenants, TOKENS["ops"])
    assert code == 200 and 'model="org/model-of-a"' in ops and 'model="org/model-of-b"' in ops
    assert 'method="RegisterNamespace"' in ops


def _login_file(path: Path, uid: int) -> Path:
    path.write_text(
        f'[[tenant]]\nname = "team-u"\nunix_login = true\nunix_uids = [{uid}]\n\n'
        f'[[tenant]]\nname = "team-a"\ntokens_sha256 = ["{digest(TOKENS["team-a"])}"]\n'
    )
    return path


@pytest.fixture
def logins(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{_login_file(tmp_path / "tenants.toml", os.getuid())}"\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "16MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )
    return d


def _raw_login(d: DaemonProcess) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(d.info["shm"])
        s.sendall(wire.SHM_REQUEST.pack(wire.LOGIN_MAGIC, 0))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_unix_peer_logs_in_as_its_tenant_without_a_token(logins: DaemonProcess, transport: str) -> None:
    with kvtier.Client.connect(
        logins.unix,
        transport=transport,  # type: ignore[arg-type]
        unix_login=True,
    ) as u:
        ns = u.register(ns_of("team-u"))
        keys = ns.block_keys(list(range(16 * 4)))
        data = [bytes([i]) * ns.block_bytes for i in range(4)]
        assert ns.put(keys, data).stored == 4
        assert [bytes(g) if g else None for g in ns.get(keys)] == data
        assert [n["model_id"] for n in u.stats()["namespaces"]] == ["test/model"]
    with client(logins, "team-a") as a:  # another tenant sees none of team-u's
        a.register(ns_of("team-a"))
        assert len(a.stats()["namespaces"]) == 1
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "stats", "--address", logins.unix, "--unix-login", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert '"namespaces"' in out.stdout


def test_a_minted_token_is_a_credential_only_while_its_tenant_logs_in_so(
    logins: DaemonProcess, tmp_path: Path
) -> None:
    reply = _raw_login(logins)
    magic, n = wire.LOGIN_REPLY.unpack_from(reply)
    token = reply[wire.LOGIN_REPLY.size :].decode()
    assert magic == wire.LOGIN_MAGIC and n == len(token) and token.startswith("unix.")
    ok = Raw(logins, None)
    ok.md = (("authorization", f"Bearer {token}"),)
    assert ok("Stats", pb.StatsRequest()).boot_epoch
    forged = Raw(logins, None)
    forged.md = (("authorization", f"Bearer {token[:-4]}AAAA"),)
    assert forged.code("Stats", pb.StatsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    # a reload that stops team-u logging in by uid: its minted tokens stop working at once
    _login_file(tmp_path / "tenants.toml", os.getuid() + 1)
    assert logins.proc is not None
    logins.proc.send_signal(signal.SIGHUP)
    until_unauthenticated(lambda: ok("Stats", pb.StatsRequest()))
    # ...and this uid no longer logs in: refused, naming why; an SDK client gets misses
    refused = _raw_login(logins)
    assert refused.startswith(wire.SHM_REFUSED) and b"no tenant logs in Unix peer" in refused
    with pytest.raises(errors.PermissionDenied, match="no tenant logs in Unix peer") as e:
        kvtier.Client.connect(logins.unix, transport="shm", unix_login=True)
    assert e.value.field == "unix_login"
    with kvtier.Client.connect(logins.unix, transport="shm", unix_login=True, lazy=True) as u:
        ns = u.register(ns_of("team-u"))
        keys = ns.block_keys(list(range(16)))
        assert ns.put(keys, [b"\0" * ns.block_bytes]).stored == 0
        assert ns.get(keys) == [None]
        assert "no tenant logs in Unix peer" in (u.counters.last_error or "")
    ok.channel.close()
    forged.channel.close()


def test_unix_login_is_refused_without_tenants_and_with_a_token(daemon: DaemonProcess) -> None:
    refused = _raw_login(daemon)
    assert refused.startswith(wire.SHM_REFUSED) and b"no tenants" in refused
    with pytest.raises(errors.InvalidArgument) as e:
        kvtier.Client.connect(daemon.unix, token="t", unix_login=True)
    assert e.value.field == "unix_login"
    with pytest.raises(errors.InvalidArgument):
        kvtier.Client.connect(daemon.grpc, transport="tcp", unix_login=True)


def test_a_single_tenant_daemon_takes_a_groups_namespace_as_any_other(daemon: DaemonProcess) -> None:
    """Without tenants nobody is kept apart, so a group's namespace (docs/hashing.md §7) is one
    more namespace: the SDK sends ``group`` and the daemon's digest of it agrees."""
    from kvtier_contract.scopes import Region, scoped_block_keys

    group, mine = make_namespace(group="shared"), make_namespace()
    tokens = list(range(64))  # 4 blocks: 2 shared, 2 private
    keys = scoped_block_keys([Region(0, group), Region(32, mine)], tokens)
    with kvtier.Client.connect(daemon.unix) as c:
        g, m = c.register(group), c.register(mine)
        assert g.namespace_id != m.namespace_id
        block = b"\x07" * g.block_bytes
        assert g.put(keys[:2], [block] * 2).stored == 2
        assert m.put(keys[2:], [block] * 2, parent=keys[1]).stored == 2
        assert g.lookup(keys[:2]) == 2 and m.lookup(keys[2:]) == 2
        assert g.lookup(keys[2:]) == 0  # a tenant's blocks are not the group's
        assert [bytes(b) for b in g.get(keys[:2]) if b is not None] == [block] * 2

"""Groups of tenants (issue 43): a prefix one publisher stores once, read by the group's members
with the same bytes; a member's store into it, a non-member's read and every cross-tenant
suffix refused or missed; the group's quota charged, not the readers'; membership revoked at a
reload. Real daemon, real sockets, the tenants file of docs/security.md § Groups."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import TokenStub, scrape_metrics, tenants_text, wait_for

import kvtier
from kvtier.stats_format import stats_json
from kvtier_contract import errors
from kvtier_contract.scopes import Region, scoped_block_keys
from kvtier_contract.v1 import kvtier_pb2 as pb

TOKENS = {"pub": "tok-pub-1", "member": "tok-member-2", "outsider": "tok-out-3", "ops": "tok-ops-4"}
GROUP = "acme-shared"
SHARED = list(range(7, 7 + 64))  # 4 blocks of 16 tokens: the group's system prompt
BLOCK = 16 * 1024


def tenants_toml(members: tuple[str, ...] = ("member",)) -> str:
    return tenants_text(
        TOKENS,
        operators=["ops"],
        group=GROUP,
        publishers=["pub"],
        members=members,
        group_quotas="namespaces = 1\n",
    )


@pytest.fixture
def groups(daemon_factory: Any, tmp_path: Path) -> DaemonProcess:
    (tmp_path / "tenants.toml").write_text(tenants_toml())
    cfg = tmp_path / "kvtierd.toml"
    cfg.write_text(f'tenants_file = "{tmp_path / "tenants.toml"}"\n')
    d: DaemonProcess = daemon_factory(
        "--config", str(cfg), "--host-bytes", "64MiB", "--slab-bytes", "1MiB", run_dir=tmp_path / "d"
    )
    return d


def client(d: DaemonProcess, tenant: str) -> kvtier.Client:
    return kvtier.Client.connect(d.unix, transport="tcp", token=TOKENS[tenant])


def raw_register(d: DaemonProcess, tenant: str, ns: kvtier.Namespace) -> tuple[grpc.StatusCode, str]:
    """RegisterNamespace as the tenant's raw call, expected to fail: (status, details). (The
    SDK keeps a registered namespace and takes a quota refusal as "register again later".)"""
    stub = TokenStub(d.grpc, TOKENS[tenant])
    try:
        spec = pb.NamespaceSpec(**{k: v for k, v in ns.to_dict().items() if v is not None})
        return stub.code("RegisterNamespace", pb.RegisterNamespaceRequest(spec=spec))
    finally:
        stub.channel.close()


def group_ns() -> kvtier.Namespace:
    return make_namespace(group=GROUP)


def block(i: int) -> bytes:
    return bytes([i + 1]) * BLOCK


def test_members_read_the_prefix_a_publisher_stored_once_and_miss_each_others_suffixes(
    groups: DaemonProcess,
) -> None:
    shared_keys = group_ns().block_keys(SHARED)
    with client(groups, "pub") as pub, client(groups, "member") as member:
        g_pub, g_member = pub.register(group_ns()), member.register(group_ns())
        assert g_pub.namespace_id == g_member.namespace_id  # one namespace, the group's
        assert g_pub.put(shared_keys, [block(i) for i in range(4)]).stored == 4
        assert g_member.lookup(shared_keys) == 4
        assert [bytes(b) for b in g_member.get(shared_keys)] == [block(i) for i in range(4)]
        # private suffixes: each tenant's own namespace, chained from the last shared key
        suffix = list(range(900, 932))
        keys = {}
        for name, c in (("pub", pub), ("member", member)):
            mine = c.register(make_namespace())  # the SDK names the credential's tenant
            regions = [Region(0, group_ns()), Region(64, mine.namespace)]
            keys[name] = scoped_block_keys(regions, SHARED + suffix)
            assert keys[name][:4] == shared_keys  # the shared part: the group's keys
            assert mine.put(keys[name][4:], [block(9), block(10)], parent=shared_keys[-1]).stored == 2
            assert mine.lookup(keys[name][4:]) == 2
        assert not set(keys["pub"][4:]) & set(keys["member"][4:])
        theirs = member.register(make_namespace())
        assert theirs.lookup(keys["pub"][4:]) == 0  # the publisher's suffix is not the member's
        # a member's figures are its own: the group's count the other members' use too
        assert [n["tenant"] for n in member.stats()["namespaces"]] == ["member"]


def test_a_members_store_into_the_group_is_refused_and_counted(groups: DaemonProcess) -> None:
    keys = group_ns().block_keys(SHARED)
    with client(groups, "member") as member, client(groups, "ops") as ops, client(groups, "pub") as pub:
        pub.register(group_ns())  # (a publisher makes it)
        g = member.register(group_ns())
        with pytest.raises(errors.PermissionDenied, match="only its publishers") as e:
            g.put(keys, [block(0)] * 4)
        assert str(e.value).startswith("namespace_id: ")
        assert g.lookup(keys) == 0  # nothing was stored
        figures = {t["name"]: t for t in ops.stats()["tenants"]}
        assert figures["member"]["group_stores_refused"] == 1 and figures["pub"]["group_stores_refused"] == 0
        assert figures[GROUP]["group"] and not figures["member"]["group"]
        status, body = scrape_metrics(groups, TOKENS["ops"])
        assert status == 200 and 'kvtier_group_stores_refused_total{tenant="member"}' in body


def test_an_outsider_can_neither_register_nor_reach_the_group(groups: DaemonProcess) -> None:
    keys = group_ns().block_keys(SHARED)
    with client(groups, "pub") as pub:
        g = pub.register(group_ns())
        assert g.put(keys, [block(i) for i in range(4)]).stored == 4
        with client(groups, "outsider") as out:
            with pytest.raises(errors.PermissionDenied, match="spec.group"):
                out.register(group_ns())
        stub = TokenStub(groups.grpc, TOKENS["outsider"])
        try:  # the namespace id, guessed or leaked: answered as an absent one
            sid = stub(
                "OpenSession", pb.OpenSessionRequest(client_name="x", transport=pb.TRANSPORT_TCP)
            ).session_id
            code, details = stub.code(
                "Lookup", pb.LookupRequest(session_id=sid, namespace_id=g.namespace_id, keys=b"".join(keys))
            )
            assert code == grpc.StatusCode.NOT_FOUND and "unknown namespace" in details
            # naming the group as a tenant is no way in either
            code, details = raw_register(groups, "outsider", make_namespace(tenant=GROUP))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("spec.tenant: ")
        finally:
            stub.channel.close()


def test_the_groups_quota_is_charged_not_the_readers(groups: DaemonProcess) -> None:
    other = make_namespace(group=GROUP, model_id="other/model")
    with client(groups, "pub") as pub, client(groups, "member") as member, client(groups, "ops") as ops:
        pub.register(group_ns())
        member.register(group_ns())
        code, details = raw_register(groups, "pub", other)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reached by group acme-shared" in details
        member.register(make_namespace())  # the member's own quota is untouched
        figures = {t["name"]: t for t in ops.stats()["tenants"]}
        assert figures[GROUP]["namespaces"] == 1 and figures["member"]["namespaces"] == 1
        shown = {ns["tenant"]: ns["spec"] for ns in stats_json(ops.stats())["namespaces"]}  # `kvtier stats`
        assert shown[GROUP]["group"] == GROUP and shown[GROUP]["tenant"] is None
        assert "group" not in shown["member"] and shown["member"]["tenant"] == "member"


def test_a_member_registering_its_groups_namespace_first_pays_for_it_itself(groups: DaemonProcess) -> None:
    """A member may register a namespace of its group no publisher made yet (its engine may
    start first, or the blocks are on another node: the cluster tier), charged to its own
    ``namespaces`` quota, never the group's: a member cannot fill its group's quota with empty
    ones. A publisher registering it moves the charge to the group, within the group's quota."""
    junk = make_namespace(group=GROUP, model_id="junk/model")
    keys = group_ns().block_keys(SHARED)
    with client(groups, "member") as member, client(groups, "pub") as pub, client(groups, "ops") as ops:
        member.register(junk)
        early = member.register(group_ns())
        assert early.lookup(keys) == 0
        figures = {t["name"]: t for t in ops.stats()["tenants"]}
        assert figures[GROUP]["namespaces"] == 0 and figures["member"]["namespaces"] == 2
        g = pub.register(group_ns())  # the group's quota (1) was whole: now the charge is its
        assert g.namespace_id == early.namespace_id
        figures = {t["name"]: t for t in ops.stats()["tenants"]}
        assert figures[GROUP]["namespaces"] == 1 and figures["member"]["namespaces"] == 1
        assert g.put(keys, [block(i) for i in range(4)]).stored == 4
        assert early.lookup(keys) == 4
        code, details = raw_register(groups, "pub", make_namespace(group=GROUP, model_id="pub/model"))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reached by group acme-shared" in details
        code, details = raw_register(groups, "pub", junk)  # the member's: the group's quota is full
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "reached by group acme-shared" in details
        with pytest.raises(errors.PermissionDenied, match="namespace_id"):  # still a reader only
            early.put(keys, [block(i) for i in range(4)])


def test_a_reload_that_drops_a_member_cuts_it_off_at_once(groups: DaemonProcess, tmp_path: Path) -> None:
    keys = group_ns().block_keys(SHARED)
    with client(groups, "pub") as pub, client(groups, "member") as member:
        g = pub.register(group_ns())
        assert g.put(keys, [block(i) for i in range(4)]).stored == 4
        mine = member.register(group_ns())
        assert mine.lookup(keys) == 4
        (tmp_path / "tenants.toml").write_text(tenants_toml(members=()))
        os.kill(groups.proc.pid, signal.SIGHUP)

        def cut_off() -> bool:  # its session is closed: the SDK's next one cannot register it
            try:
                return mine.lookup(keys) == 0
            except (errors.NotFound, errors.PermissionDenied):
                return True

        wait_for("the member is no longer a reader", cut_off)
        code, details = raw_register(groups, "member", group_ns())
        assert code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("spec.group: ")
        assert g.lookup(keys) == 4  # the publisher's reads go on

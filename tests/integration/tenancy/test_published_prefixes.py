"""Published prefixes (issue 43): a group's publisher publishes a prefix (its length and digest,
never its tokens) under a name, every member lists it, nobody else sees it or publishes; bad
input is refused naming the field and changes nothing; a reload that removes the group drops
its prefixes; with an NVMe tier they outlive a restart; ``kvtier prefix`` does the same from
a shell. Real daemons, the tenants file of docs/security.md § Groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess
from tests_helpers import TokenStub, scrape_metrics, tenants_text, wait_for

import kvtier
from kvtier.prefixes import PublishedPrefix, prefix_digest
from kvtier_contract import errors
from kvtier_contract.v1 import kvtier_pb2 as pb

TOKENS = {"pub": "tok-pub-1", "member": "tok-member-2", "outsider": "tok-out-3", "ops": "tok-ops-4"}
GROUP = "acme-shared"
SYSTEM = list(range(1000, 1000 + 300))  # the group's system prompt: 300 token ids
Code = grpc.StatusCode


def tenants_toml(with_group: bool = True) -> str:
    group = {"group": GROUP, "publishers": ["pub"], "members": ["member"]} if with_group else {}
    return tenants_text(TOKENS, operators=["ops"], **group)


def serve_args(work: Path) -> list[str]:
    """A daemon with the tenants file of ``work`` and an NVMe tier (the prefixes' durable home)."""
    (work / "kvtierd.toml").write_text(f'tenants_file = "{work / "tenants.toml"}"\n')
    disk = ["--disk-dir", str(work / "nvme"), "--disk-bytes", "8MiB"]
    return ["--config", str(work / "kvtierd.toml"), "--host-bytes", "16MiB", "--slab-bytes", "1MiB", *disk]


def start(work: Path) -> DaemonProcess:
    if not (work / "tenants.toml").exists():
        (work / "tenants.toml").write_text(tenants_toml())
    return DaemonProcess(work / "run", *serve_args(work)).start()


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start(tmp_path_factory.mktemp("prefixes"))
    yield d
    d.kill()


def client(d: DaemonProcess, tenant: str) -> kvtier.Client:
    """A client that opens no session: the prefix calls need none."""
    return kvtier.Client(d.unix, "tcp", token=TOKENS[tenant], heartbeat=False)


def listed(d: DaemonProcess, tenant: str) -> list[PublishedPrefix]:
    with client(d, tenant) as c:
        return c.published_prefixes()


def publish(group: str = GROUP, withdraw: bool = False) -> Any:
    """A PublishPrefixRequest valid but for whom it comes from."""
    return pb.PublishPrefixRequest(
        group=group, name="system", tokens=300, digest=bytes(32), withdraw=withdraw
    )


def publishes(d: DaemonProcess, tenant: str) -> bool:
    """Whether ``tenant`` publishes into the group now (a withdrawal of nothing is refused
    only while it does not)."""
    with client(d, tenant) as c:
        try:
            c.withdraw_prefix(GROUP, "nothing")
        except errors.PermissionDenied:
            return False
    return True


def refused(d: DaemonProcess, tenant: str, request: Any) -> tuple[grpc.StatusCode, str]:
    stub = TokenStub(d.grpc, TOKENS[tenant])
    try:
        return stub.code("PublishPrefix", request)
    finally:
        stub.channel.close()


@pytest.fixture
def clean(groups: DaemonProcess) -> Iterator[DaemonProcess]:
    """The module's daemon, every prefix of the group withdrawn after the test."""
    yield groups
    with client(groups, "pub") as pub:
        for p in pub.published_prefixes():
            pub.withdraw_prefix(p.group, p.name)


def test_a_publisher_publishes_and_every_member_lists_it(clean: DaemonProcess) -> None:
    with client(clean, "pub") as pub:
        published = pub.publish_prefix(GROUP, "system", SYSTEM)
    assert published == PublishedPrefix(GROUP, "system", 300, prefix_digest(SYSTEM), publisher=True)
    assert listed(clean, "pub") == [published]
    assert listed(clean, "member") == [PublishedPrefix(GROUP, "system", 300, prefix_digest(SYSTEM), False)]
    assert listed(clean, "ops") == [published]  # the operator publishes into every group
    assert listed(clean, "outsider") == []  # not a member: nothing, not even that the group exists
    status, body = scrape_metrics(clean, TOKENS["ops"])
    assert status == 200 and f'kvtier_published_prefixes{{group="{GROUP}"}} 1.0' in body
    status, body = scrape_metrics(clean, TOKENS["member"])  # a tenant's scrape: not daemon-wide
    assert status == 200 and "kvtier_published_prefixes" not in body


def test_republishing_a_name_replaces_it_and_withdrawing_is_idempotent(clean: DaemonProcess) -> None:
    with client(clean, "pub") as pub:
        pub.publish_prefix(GROUP, "system", SYSTEM)
        pub.publish_prefix(GROUP, "system", SYSTEM[:200])  # the prompt changed
        assert [(p.name, p.tokens) for p in listed(clean, "member")] == [("system", 200)]
        assert pub.withdraw_prefix(GROUP, "system") is True
        assert pub.withdraw_prefix(GROUP, "system") is False  # (nothing there: no error)
    assert listed(clean, "member") == []


def test_a_member_an_outsider_and_an_unknown_group_are_refused_alike(clean: DaemonProcess) -> None:
    with client(clean, "pub") as pub:
        pub.publish_prefix(GROUP, "system", SYSTEM)
    before = listed(clean, "ops")
    answers = {
        (who, group, withdraw): refused(clean, who, publish(withdraw=withdraw, group=group))
        for who, group in (
            ("member", GROUP),
            ("outsider", GROUP),
            ("pub", "no-such-group"),
            ("pub", "member"),
        )
        for withdraw in (False, True)
    }
    assert len(set(answers.values())) == 1, answers  # which groups exist is not told
    code, details = next(iter(answers.values()))
    assert code == Code.PERMISSION_DENIED and details.startswith("group: "), details
    assert listed(clean, "ops") == before
    with client(clean, "member") as member, pytest.raises(errors.PermissionDenied) as e:
        member.publish_prefix(GROUP, "mine", [1, 2, 3])
    assert e.value.field == "group"


def test_a_caller_without_a_credential_neither_publishes_nor_lists(clean: DaemonProcess) -> None:
    """No token, or one the file does not hold: UNAUTHENTICATED for both calls, and nothing
    changes (a peer that reaches the socket learns no group, no prefix)."""
    with client(clean, "pub") as pub:
        pub.publish_prefix(GROUP, "system", SYSTEM)
    before = listed(clean, "ops")
    for token in (None, "tok-not-in-the-file"):
        stub = TokenStub(clean.grpc, token)
        try:
            for method, request in (
                ("PublishPrefix", publish()),
                ("PublishPrefix", publish(withdraw=True)),
                ("ListPrefixes", pb.ListPrefixesRequest()),
            ):
                assert stub.code(method, request)[0] == Code.UNAUTHENTICATED, (token, method)
        finally:
            stub.channel.close()
    assert listed(clean, "ops") == before


@pytest.mark.parametrize(
    ("request_fields", "code", "field"),
    [
        ({"name": ""}, Code.INVALID_ARGUMENT, "name"),
        ({"name": "n" * 129}, Code.INVALID_ARGUMENT, "name"),
        ({"group": ""}, Code.INVALID_ARGUMENT, "group"),
        ({"tokens": 0}, Code.INVALID_ARGUMENT, "tokens"),
        ({"tokens": (1 << 20) + 1}, Code.INVALID_ARGUMENT, "tokens"),
        ({"digest": bytes(31)}, Code.INVALID_ARGUMENT, "digest"),
        ({"digest": bytes(33)}, Code.INVALID_ARGUMENT, "digest"),
    ],
    ids=["no-name", "name-of-129", "no-group", "tokens-0", "tokens-over", "digest-31", "digest-33"],
)
def test_bad_input_is_refused_naming_the_field_and_changes_nothing(
    clean: DaemonProcess, request_fields: dict[str, Any], code: grpc.StatusCode, field: str
) -> None:
    with client(clean, "pub") as pub:
        pub.publish_prefix(GROUP, "system", SYSTEM)
    before = listed(clean, "ops")
    fields = {"group": GROUP, "name": "system", "tokens": 7, "digest": bytes(32), **request_fields}
    got, details = refused(clean, "pub", pb.PublishPrefixRequest(**fields))
    assert got == code and details.startswith(f"{field}: "), (got, details)
    assert listed(clean, "ops") == before


def test_a_17th_name_is_refused_and_changes_nothing(clean: DaemonProcess) -> None:
    with client(clean, "pub") as pub:
        for i in range(16):
            pub.publish_prefix(GROUP, f"p{i:02d}", [i] * (i + 1))
        before = listed(clean, "member")
        assert [p.name for p in before] == [f"p{i:02d}" for i in range(16)]  # by (group, name)
        with pytest.raises(errors.ResourceExhausted) as e:
            pub.publish_prefix(GROUP, "p16", [16])
        assert e.value.field == "name" and "16 prefixes" in str(e.value)
        assert listed(clean, "member") == before
        pub.publish_prefix(GROUP, "p00", [99, 98])  # republishing one of the 16 replaces it
        assert listed(clean, "member")[0].tokens == 2


def test_the_sdk_refuses_token_ids_no_prefix_has_before_sending(clean: DaemonProcess) -> None:
    with client(clean, "pub") as pub:
        for ids in ([], [1, 1 << 32], [-1], [1.5]):
            with pytest.raises(errors.InvalidArgument) as e:
                pub.publish_prefix(GROUP, "system", ids)  # type: ignore[arg-type]
            assert e.value.field == "token_ids"
    assert listed(clean, "ops") == []


def kvtier_cli(d: DaemonProcess, token_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "prefix",
            *args,
            "--address",
            d.unix,
            "--token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvtier_prefix_publishes_lists_and_withdraws(clean: DaemonProcess, tmp_path: Path) -> None:
    pub_token, member_token = tmp_path / "pub.token", tmp_path / "member.token"
    pub_token.write_text(TOKENS["pub"] + "\n")
    member_token.write_text(TOKENS["member"] + "\n")
    (tmp_path / "system.json").write_text(json.dumps(SYSTEM))
    (tmp_path / "tools.txt").write_text("5, 6,7\n8 9\n")
    named = ["--group", GROUP, "--name"]
    r = kvtier_cli(
        clean, pub_token, "publish", *named, "system", "--tokens-file", str(tmp_path / "system.json")
    )
    assert r.returncode == 0 and "300 tokens" in r.stdout, r.stderr
    r = kvtier_cli(clean, pub_token, "publish", *named, "tools", "--tokens-file", str(tmp_path / "tools.txt"))
    assert r.returncode == 0, r.stderr
    r = kvtier_cli(clean, member_token, "list")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0].split() == ["group", "name", "tokens", "digest", "you"], r.stdout
    assert lines[1].split() == [GROUP, "system", "300", prefix_digest(SYSTEM).hex()[:16], "read"]
    assert lines[2].split() == [GROUP, "tools", "5", prefix_digest([5, 6, 7, 8, 9]).hex()[:16], "read"]
    r = kvtier_cli(clean, pub_token, "list", "--json")
    assert [(p["name"], p["digest"], p["publisher"]) for p in json.loads(r.stdout)] == [
        ("system", prefix_digest(SYSTEM).hex(), True),
        ("tools", prefix_digest([5, 6, 7, 8, 9]).hex(), True),
    ]
    r = kvtier_cli(clean, member_token, "withdraw", *named, "tools")
    assert r.returncode == 1 and r.stderr.startswith("kvtier prefix withdraw: group: "), r.stderr
    r = kvtier_cli(clean, pub_token, "withdraw", *named, "tools")
    assert r.returncode == 0 and "withdrew" in r.stdout
    (tmp_path / "bad.txt").write_text("1 2 three\n")
    r = kvtier_cli(clean, pub_token, "publish", *named, "bad", "--tokens-file", str(tmp_path / "bad.txt"))
    assert r.returncode == 2 and str(tmp_path / "bad.txt") in r.stderr and "'three'" in r.stderr
    assert [p.name for p in listed(clean, "member")] == ["system"]


def test_prefixes_outlive_a_restart_and_go_with_their_group(tmp_path: Path) -> None:
    d = start(tmp_path)
    try:
        with client(d, "pub") as pub:
            pub.publish_prefix(GROUP, "system", SYSTEM)
        assert d.stop() == 0
        d = start(tmp_path)  # the same NVMe directory: the prefix is read back
        assert listed(d, "member") == [PublishedPrefix(GROUP, "system", 300, prefix_digest(SYSTEM), False)]
        (tmp_path / "tenants.toml").write_text(tenants_toml(with_group=False))
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGHUP)
        kept = tmp_path / "nvme" / "published-prefixes.json"
        wait_for(
            "the group's prefixes are dropped", lambda: GROUP not in json.loads(kept.read_text())["groups"]
        )
        assert listed(d, "ops") == [] and not publishes(d, "pub")
        (tmp_path / "tenants.toml").write_text(tenants_toml())  # the group again, its prefixes not
        os.kill(d.proc.pid, signal.SIGHUP)
        wait_for("the group is back", lambda: publishes(d, "pub"))
        assert listed(d, "ops") == []
        assert d.stop() == 0
        fsck = subprocess.run(
            [sys.executable, "-m", "kvtierd", "fsck", str(tmp_path / "nvme")], capture_output=True, text=True
        )
        assert fsck.returncode == 0, fsck.stdout  # the prefixes' file is no foreign file
    finally:
        d.kill()


def test_a_daemon_without_tenants_takes_any_group_up_to_16(daemon: DaemonProcess) -> None:
    with kvtier.Client(daemon.unix, "tcp", heartbeat=False) as c:
        for i in range(16):
            c.publish_prefix(f"group-{i:02d}", "system", [i])
        with pytest.raises(errors.ResourceExhausted) as e:
            c.publish_prefix("group-16", "system", [16])
        assert e.value.field == "group"
        c.publish_prefix("group-00", "tools", [1, 2])  # a group that has prefixes takes more
        found = c.published_prefixes()
    assert [(p.group, p.name) for p in found][:3] == [
        ("group-00", "system"),
        ("group-00", "tools"),
        ("group-01", "system"),
    ]
    assert len(found) == 17 and all(p.publisher for p in found)

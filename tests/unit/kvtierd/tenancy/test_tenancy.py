"""kvtierd.tenancy: who a credential is, which sessions a reload revokes, every quota's default
(a fair share of what the daemon shares) and the ledger of held bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier_contract.errors import FailedPrecondition, PermissionDenied
from kvtierd.domain import Transport
from kvtierd.tenancy import NO_CREDENTIAL, QUOTA_NAMES, Credential, Ledger, Shares, Tenancy
from kvtierd.tenancy.tenancy import DEFAULT_BUFFERED_BYTES
from kvtierd.tenants import Tenants, token_digest
from kvtierd.tenants_file import load_tenants

MiB = 1 << 20
SHARES = Shares(
    max_sessions=100,
    max_namespaces=10,
    shared_arena_bytes=64 * MiB,
    disk_bytes=300 * MiB,
    tenant_arena_bytes=8 * MiB,
)


def tenants(tmp_path: Path, body: str) -> Tenants:
    p = tmp_path / "tenants.toml"
    p.write_text(body)
    return load_tenants(p)


def entry(name: str, *tokens: str, extra: str = "") -> str:
    digests = ", ".join(f'"{token_digest(t)}"' for t in tokens)
    return f'[[tenant]]\nname = "{name}"\ntokens_sha256 = [{digests}]\n{extra}\n'


TCP = 'transports = ["tcp"]\n'
FILE = (
    entry("a", "ta", "ta2", extra=TCP)
    + entry("b", "tb", extra=TCP)
    + entry("c", "tc", extra='arena_bytes = "16MiB"\n')
    + entry("peer", "tp", extra="unix_uids = [4000]\nunix_login = true\n")
    + entry("q", "tq", extra=TCP + '[tenant.quotas]\nhost_bytes = "1MiB"\nsessions = 2\n')
)


@dataclass
class Held:
    """What ``revoked`` reads of a session."""

    tenant: str | None
    credential: Credential
    transport: Transport = Transport.TCP


def test_defaults_are_a_fair_share_and_the_file_wins(tmp_path: Path) -> None:
    t = Tenancy(tenants(tmp_path, FILE), SHARES)
    # 5 tenants: sessions, namespaces and disk split five ways
    assert t.quota("a", "sessions") == 20 and t.quota("a", "namespaces") == 2
    assert t.quota("a", "nvme_bytes") == 60 * MiB
    # a, b and q live in the shared arena (tcp only): a third of it each, pins included
    assert t.quota("a", "host_bytes") == t.quota("b", "host_bytes") == 64 * MiB // 3
    assert t.quota("a", "pinned_bytes") == 64 * MiB // 3
    # c has an arena of its own: bounded there, by nobody else's share
    assert t.quota("c", "host_bytes") is None and t.quota("c", "pinned_bytes") == 16 * MiB
    # the file's values win over the defaults
    assert t.quota("q", "host_bytes") == MiB and t.quota("q", "sessions") == 2
    assert t.quota("q", "pinned_bytes") == 64 * MiB // 3
    for name in QUOTA_NAMES:  # every quota of a shared-arena tenant is on
        assert t.quota("a", name) is not None, name
    assert t.quota("a", "buffered_bytes") == DEFAULT_BUFFERED_BYTES


def test_a_single_tenant_daemon_bounds_only_buffered_bytes() -> None:
    t = Tenancy(None, SHARES)
    assert t.quota(None, "buffered_bytes") == DEFAULT_BUFFERED_BYTES
    assert all(t.quota(None, n) is None for n in QUOTA_NAMES if n != "buffered_bytes")
    assert t.allows_peer(None, 1, 1) and t.may_see(None, "x")
    with pytest.raises(FailedPrecondition):
        t.unix_login(1, 1)


def test_who_a_credential_is(tmp_path: Path) -> None:
    t = Tenancy(tenants(tmp_path, FILE), SHARES)
    found = t.authenticate("ta2")
    assert found is not None and found[0].name == "a" and found[1].kind == "token"
    assert t.authenticate("nope") is None and t.authenticate(None) is None
    token = t.unix_login(4000, 1)
    found = t.authenticate(token)
    assert found is not None and found[0].name == "peer"
    assert found[1] == Credential("unix", uid=4000, gid=1)
    with pytest.raises(PermissionDenied):
        t.unix_login(4001, 1)
    assert t.allows_peer("peer", 4000, 0) and not t.allows_peer("peer", 4001, 0)
    assert not t.allows_peer("gone", 4000, 0)  # a tenant not in the file allows no one
    assert t.may_see("a", "a") and not t.may_see("a", "b")


def test_a_reload_revokes_what_the_new_file_no_longer_honours(tmp_path: Path) -> None:
    t = Tenancy(tenants(tmp_path, FILE), SHARES)
    cred = {tok: t.authenticate(tok) for tok in ("ta", "ta2", "tb", "tc")}
    held = {tok: Held(found[0].name, found[1]) for tok, found in cred.items() if found}
    login = t.authenticate(t.unix_login(4000, 7))
    assert login is not None
    held["peer"] = Held("peer", login[1])
    held["none"] = Held("a", NO_CREDENTIAL)  # (a session of no credential on a tenants daemon)
    assert [h for h in held.values() if h not in t.revoked(held.values())] == [
        held[k] for k in ("ta", "ta2", "tb", "tc", "peer")
    ]
    # "ta" rotated out, b removed, the peer no longer logs in; c and ta2 stay
    t.reload(
        tenants(
            tmp_path,
            entry("a", "ta2", extra=TCP)
            + entry("c", "tc", extra='arena_bytes = "16MiB"\n')
            + entry("peer", "tp", extra="unix_uids = [4000]\n"),
        )
    )
    assert t.revoked(held.values()) == [held[k] for k in ("ta", "tb", "peer", "none")]
    # and the defaults are sized for the new file: a alone in the shared arena now
    assert t.quota("a", "host_bytes") == 64 * MiB and t.quota("a", "sessions") == 33


def test_the_ledger_refuses_past_the_limit_and_changes_nothing() -> None:
    led = Ledger()
    assert led.take("a", "buffered_bytes", 6, 10)
    assert not led.take("a", "buffered_bytes", 5, 10)  # 11 > 10: refused, nothing taken
    assert led.held("a", "buffered_bytes") == 6
    assert led.take("b", "buffered_bytes", 10, 10)  # another tenant's own count
    assert led.take(None, "buffered_bytes", 1 << 40, None)  # no limit
    led.give("a", "buffered_bytes", 6)
    assert led.held("a", "buffered_bytes") == 0 and led.total("buffered_bytes") == 10 + (1 << 40)


def test_an_operator_does_not_shrink_the_tenants_shares(tmp_path: Path) -> None:
    """A file with one tenant and a monitoring operator: the tenant keeps the whole daemon."""
    t = Tenancy(
        tenants(tmp_path, entry("a", "ta", extra=TCP) + entry("ops", "to", extra=TCP + "operator = true\n")),
        SHARES,
    )
    assert t.quota("a", "sessions") == 100 and t.quota("a", "host_bytes") == 64 * MiB
    assert t.quota("ops", "sessions") == 100  # (a tenant's share, without shrinking it)


def test_a_late_arena_tenants_shared_namespaces_get_a_share(tmp_path: Path) -> None:
    """A tcp-only tenant given shm by a reload keeps its older namespaces in the shared arena:
    they get a share of it (its own-arena default says none), counted among the sharers."""
    t = Tenancy(tenants(tmp_path, entry("a", "ta", extra=TCP) + entry("c", "tc")), SHARES)
    c = t.tenant("c")
    assert t.quota(c, "host_bytes") is None and t.shared_share(c) == 32 * MiB
    assert Tenancy(None, SHARES).shared_share(None) is None


def test_a_reload_revokes_sessions_of_a_transport_it_no_longer_allows(tmp_path: Path) -> None:
    t = Tenancy(tenants(tmp_path, entry("c", "tc")), SHARES)
    found = t.authenticate("tc")
    assert found is not None
    shm, tcp = Held("c", found[1], Transport.SHM), Held("c", found[1], Transport.TCP)
    assert t.revoked([shm, tcp]) == []
    t.reload(tenants(tmp_path, entry("c", "tc", extra=TCP)))  # shm taken away
    assert t.revoked([shm, tcp]) == [shm]


def test_members_read_publishers_store_and_a_reload_cuts_off_who_it_takes_out(tmp_path: Path) -> None:
    def file(members: str) -> str:
        group = f'[[group]]\nname = "g"\npublishers = ["a"]\nmembers = {members}\n'
        return (
            entry("a", "ta")
            + entry("b", "tb")
            + entry("c", "tc")
            + entry("ops", "to", extra="operator = true\n")
            + group
        )

    t = Tenancy(tenants(tmp_path, file('["b"]')), SHARES)
    assert t.may_see("b", "g") and t.may_see("a", "g") and t.may_see("ops", "g") and not t.may_see("c", "g")
    assert t.may_store("a", "g") and t.may_store("ops", "g") and not t.may_store("b", "g")
    assert not t.may_see("b", "a")  # a group's member sees no other member's own
    held = {n: Held(n, t.authenticate(f"t{n[0]}")[1]) for n in ("a", "b", "c")}  # type: ignore[index]
    t.reload(tenants(tmp_path, file('["b", "c"]')))  # c joins: nothing to revoke
    assert t.revoked(held.values()) == []
    t.reload(tenants(tmp_path, file('["c"]')))  # b leaves the group
    assert t.revoked(held.values()) == [held["b"]] and not t.may_see("b", "g") and t.may_see("c", "g")
    t.reload(tenants(tmp_path, file('["c"]')))  # an unchanged file revokes no one again
    assert t.revoked(held.values()) == []

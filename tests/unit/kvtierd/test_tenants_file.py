"""The tenants file (kvtierd.tenants_file): every bad entry is refused naming its field; tokens are
kept and compared only as SHA-256 digests."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kvtierd.tenants import UnixLogins, token_digest
from kvtierd.tenants_file import load_tenants

GOOD = hashlib.sha256(b"tok").hexdigest()


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "tenants.toml"
    p.write_text(body)
    return p


def test_a_good_file(tmp_path: Path) -> None:
    t = load_tenants(
        write(
            tmp_path,
            f'''
[[tenant]]
name = "a"
tokens_sha256 = ["{GOOD}", "{token_digest("next")}"]
unix_uids = [1000]
[tenant.quotas]
sessions = 2
host_bytes = "1GiB"
pinned_bytes = "64MiB"

[[tenant]]
name = "ops"
tokens_sha256 = ["{token_digest("ops")}"]
operator = true
''',
        )
    )
    a = t.authenticate("tok")
    assert a is not None and a.name == "a" and a.quotas.host_bytes == 1 << 30
    assert a.quotas.pinned_bytes == 64 << 20
    assert t.authenticate("next") is a  # two tokens: rotation
    assert t.authenticate("nope") is None and t.authenticate("") is None
    ops = t.authenticate("ops")
    assert ops is not None and ops.operator and ops.quotas.sessions is None
    assert a.allows_peer(1000, 5) and not a.allows_peer(1001, 5) and ops.allows_peer(7, 7)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("", "tenant"),
        ('[[tenant]]\nname = ""\n', "tenant[0].name"),
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD[:-2]}"]\n', "tenant[0].tokens_sha256[0]"),
        ('[[tenant]]\nname = "a"\n', "tenant[0].tokens_sha256"),
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\nunix_uids = [-1]\n', "tenant[0].unix_uids"),
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\noperator = "yes"\n', "tenant[0].operator"),
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\ncolour = 1\n', "tenant[0]"),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\nsessions = -1\n',
            "tenant[0].quotas.sessions",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\nhost_bytes = "x"\n',
            "tenant[0].quotas.host_bytes",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\nram = 1\n',
            "tenant[0].quotas",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n'
            f'[[tenant]]\nname = "b"\ntokens_sha256 = ["{GOOD}"]\n',
            "tenant[1].tokens_sha256[0]",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n'
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{token_digest("x")}"]\n',
            "tenant",
        ),
        ("not toml [", "tenants_file"),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\ntransports = ["udp"]\n',
            "tenant[0].transports",
        ),
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\nmax_lease_s = 0\n', "tenant[0].max_lease_s"),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\nmax_lease_s = "1h"\n',
            "tenant[0].max_lease_s",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\npinned_bytes = -1\n',
            "tenant[0].quotas.pinned_bytes",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\narena_bytes = "lots"\n',
            "tenant[0].arena_bytes",
        ),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\nbuffered_bytes = "1MiB"\n',
            "tenant[0].quotas.buffered_bytes",
        ),  # under one frame
        (f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\narena_bytes = 0\n', "tenant[0].arena_bytes"),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\ntransports = ["tcp"]\n'
            'arena_bytes = "1GiB"\n',
            "tenant[0].arena_bytes",
        ),
    ],
)
def test_a_bad_file_names_the_field(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ValueError) as e:
        load_tenants(write(tmp_path, body))
    assert str(e.value).startswith(f"{field}:"), str(e.value)


@pytest.mark.parametrize(
    ("body", "field", "guess"),
    [
        (f'[[tenants]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n', "tenants_file", "'tenant'"),
        (f'[[tenant]]\nname = "a"\ntoken_sha256 = ["{GOOD}"]\n', "tenant[0]", "'tokens_sha256'"),
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n[tenant.quotas]\nhost_byte = "1GiB"\n',
            "tenant[0].quotas",
            "'host_bytes'",
        ),
    ],
)
def test_a_misspelt_key_gets_the_key_it_was_meant_to_be(
    tmp_path: Path, body: str, field: str, guess: str
) -> None:
    # a misspelt quota must not pass for no quota, and the error says which key was meant
    with pytest.raises(ValueError) as e:
        load_tenants(write(tmp_path, body))
    assert str(e.value).startswith(f"{field}: unknown keys "), str(e.value)
    assert f"(did you mean {guess}?)" in str(e.value)


def test_hash_token_prints_the_digest_a_file_holds() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtierd", "hash-token"],
        input="s3cret\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == token_digest("s3cret")
    assert "s3cret" not in out.stdout


def test_a_tenant_that_maps_memory_has_an_arena_of_its_own(tmp_path: Path) -> None:
    t = load_tenants(
        write(
            tmp_path,
            f'''
[[tenant]]
name = "sized"
tokens_sha256 = ["{token_digest("1")}"]
arena_bytes = "3GiB"
[tenant.quotas]
host_bytes = "1GiB"

[[tenant]]
name = "quota"
tokens_sha256 = ["{token_digest("2")}"]
transports = ["shm"]
[tenant.quotas]
host_bytes = "1GiB"

[[tenant]]
name = "default"
tokens_sha256 = ["{token_digest("3")}"]
transports = ["cuda_ipc", "tcp"]

[[tenant]]
name = "remote"
tokens_sha256 = ["{token_digest("4")}"]
transports = ["tcp"]
''',
        )
    )
    by = t.by_name
    assert [by[n].maps_memory for n in ("sized", "quota", "default", "remote")] == [True, True, True, False]
    assert by["sized"].arena_size(7) == 3 << 30
    assert by["quota"].arena_size(7) == 1 << 30
    assert by["default"].arena_size(7) == 7


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('[[tenant]]\nname = "u"\nunix_login = true\n', "tenant[0].unix_login"),
        ('[[tenant]]\nname = "u"\nunix_login = "yes"\nunix_uids = [5]\n', "tenant[0].unix_login"),
        (
            '[[tenant]]\nname = "u"\nunix_login = true\nunix_uids = [5]\n'
            '[[tenant]]\nname = "v"\nunix_login = true\nunix_uids = [5]\n',
            "tenant[1].unix_uids",
        ),
    ],
)
def test_a_bad_unix_login_names_the_field(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ValueError) as e:
        load_tenants(write(tmp_path, body))
    assert str(e.value).startswith(f"{field}:"), str(e.value)


def test_unix_peers_log_in_by_uid_then_gid(tmp_path: Path) -> None:
    t = load_tenants(
        write(
            tmp_path,
            f'''
[[tenant]]
name = "by-uid"
unix_login = true
unix_uids = [1000]
unix_gids = [50]

[[tenant]]
name = "by-gid"
unix_login = true
unix_gids = [60, 70]

[[tenant]]
name = "other"
unix_login = true
unix_gids = [70]

[[tenant]]
name = "tokens-only"
tokens_sha256 = ["{GOOD}"]
unix_uids = [2000]
''',
        )
    )
    assert t.by_unix_peer(1000, 60).name == "by-uid"  # type: ignore[union-attr]
    assert t.by_unix_peer(1, 60).name == "by-gid"  # type: ignore[union-attr]
    assert t.by_unix_peer(1, 70) is None  # two tenants log in by gid 70: neither
    assert t.by_unix_peer(2000, 1) is None  # its uid only gates shm handshakes


def test_minted_tokens_are_bounded_per_tenant_and_expire_when_idle() -> None:
    now = [0.0]
    logins = UnixLogins(idle_s=10.0, per_tenant=2, clock=lambda: now[0])
    a1, a2 = logins.login("a", 1, 1), logins.login("a", 1, 1)
    b1 = logins.login("b", 2, 2)
    assert a1.startswith("unix.") and a1 != a2
    assert logins.authenticate(a1) == ("a", 1, 1) and logins.authenticate(b1) == ("b", 2, 2)
    a3 = logins.login("a", 1, 1)  # a's least recently used (a2) goes; b's stays
    assert logins.authenticate(a2) is None and logins.authenticate(b1) == ("b", 2, 2)
    assert logins.authenticate(a3) == ("a", 1, 1) and len(logins) == 3
    now[0] = 9.0
    assert logins.authenticate(a1) is not None  # used: renewed
    now[0] = 15.0
    assert logins.authenticate(a1) is not None and logins.authenticate(b1) is None  # idle 15 s
    assert logins.authenticate("unix.forged") is None and logins.authenticate(GOOD) is None


def test_scrape_tokens_are_no_tenants_credential(tmp_path: Path) -> None:
    t = load_tenants(
        write(
            tmp_path,
            f'''
metrics_tokens_sha256 = ["{token_digest("scrape-1")}", "{token_digest("scrape-2")}"]

[[tenant]]
name = "a"
tokens_sha256 = ["{GOOD}"]
operator = true
''',
        )
    )
    assert t.is_metrics_token("scrape-1") and t.is_metrics_token("scrape-2")  # rotation
    assert t.authenticate("scrape-1") is None  # no tenant, not even the operator
    assert not t.is_metrics_token("tok") and not t.is_metrics_token(None)
    assert not t.is_metrics_token("") and not t.is_metrics_token("nope")
    assert len(t) == 1 and t.metrics_digests == (
        hashlib.sha256(b"scrape-1").digest(),
        hashlib.sha256(b"scrape-2").digest(),
    )
    without = load_tenants(write(tmp_path, f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n'))
    assert without.metrics_digests == () and not without.is_metrics_token("scrape-1")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            f'metrics_tokens_sha256 = ["{GOOD[:-2]}"]\n[[tenant]]\nname = "a"\n'
            f'tokens_sha256 = ["{token_digest("x")}"]\n',
            "metrics_tokens_sha256[0]",
        ),
        (
            f'metrics_tokens_sha256 = "{GOOD}"\n[[tenant]]\nname = "a"\n'
            f'tokens_sha256 = ["{token_digest("x")}"]\n',
            "metrics_tokens_sha256",
        ),
        (
            f'metrics_tokens_sha256 = ["{GOOD}", 7]\n[[tenant]]\nname = "a"\n'
            f'tokens_sha256 = ["{token_digest("x")}"]\n',
            "metrics_tokens_sha256[1]",
        ),
        (
            f'metrics_tokens_sha256 = ["{GOOD}", "{GOOD}"]\n[[tenant]]\nname = "a"\n'
            f'tokens_sha256 = ["{token_digest("x")}"]\n',
            "metrics_tokens_sha256[1]",
        ),
        # a digest that is also a tenant's token: which would it be?
        (
            f'metrics_tokens_sha256 = ["{GOOD}"]\n[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n',
            "tenant[0].tokens_sha256[0]",
        ),
        # written after a [[tenant]] header, TOML makes it that tenant's key
        (
            f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n'
            f'metrics_tokens_sha256 = ["{token_digest("x")}"]\n',
            "tenant[0].metrics_tokens_sha256",
        ),
        (f'metrics_tokens_sha256 = ["{GOOD}"]\n', "tenant"),  # scrape tokens alone: no tenant
    ],
)
def test_a_bad_scrape_token_list_names_the_field(tmp_path: Path, body: str, field: str) -> None:
    with pytest.raises(ValueError) as e:
        load_tenants(write(tmp_path, body))
    assert str(e.value).startswith(f"{field}:"), str(e.value)


TWO_TENANTS = (
    f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\n\n[[tenant]]\nname = "b"\nmtls_names = ["b"]\n\n'
)


def test_a_group_is_an_owner_no_one_can_be(tmp_path: Path) -> None:
    t = load_tenants(
        write(
            tmp_path,
            TWO_TENANTS + '[[group]]\nname = "g"\npublishers = ["a"]\nmembers = ["b"]\n'
            '[group.quotas]\nhost_bytes = "1MiB"\nnamespaces = 2\n',
        )
    )
    g = t.by_name["g"]
    assert g.group and g.publishers == {"a"} and g.members == {"a", "b"}  # a publisher reads too
    assert g.quotas.host_bytes == 1 << 20 and g.quotas.namespaces == 2
    assert not g.maps_memory and not g.token_sha256 and not g.mtls_names and not g.unix_login
    assert t.reads("b", "g") and t.reads("a", "g") and not t.reads("c", "g")
    assert t.writes("a", "g") and not t.writes("b", "g")
    assert not t.reads("a", "b") and not t.writes("a", "b")  # a tenant is no group
    assert t.groups_of("b") == {"g"} and t.groups_of("c") == frozenset()
    assert t.authenticate("tok").name == "a"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("group", "field"),
    [
        ('name = "a"\npublishers = ["a"]\n', "group[0].name"),  # a tenant's name
        ('name = ""\npublishers = ["a"]\n', "group[0].name"),
        ('name = "g"\npublishers = []\nmembers = ["a"]\n', "group[0].publishers"),  # no writer
        ('name = "g"\npublishers = ["zed"]\n', "group[0].publishers"),
        ('name = "g"\npublishers = ["a"]\nmembers = ["b", "zed"]\n', "group[0].members"),
        ('name = "g"\npublishers = "a"\n', "group[0].publishers"),
        ('name = "g"\npublishers = ["a"]\ntokens_sha256 = []\n', "group[0]"),  # a group has no credential
        ('name = "g"\npublishers = ["a"]\n[group.quotas]\nsessions = 4\n', "group[0].quotas"),  # a member's
        ('name = "g"\npublishers = ["a"]\n\n[[group]]\nname = "g"\npublishers = ["b"]\n', "group[1].name"),
        ('name = "g"\npublishers = ["a"]\narena_bytes = 0\n', "group[0].arena_bytes"),
        ('name = "g"\npublishers = ["a"]\narena_bytes = "lots"\n', "group[0].arena_bytes"),
    ],
)
def test_a_bad_group_names_the_field(tmp_path: Path, group: str, field: str) -> None:
    with pytest.raises(ValueError) as e:
        load_tenants(write(tmp_path, TWO_TENANTS + "[[group]]\n" + group))
    assert str(e.value).startswith(f"{field}:") or str(e.value).startswith(f"{field} "), str(e.value)


def test_a_group_has_an_arena_when_one_of_its_readers_maps_memory(tmp_path: Path) -> None:
    """Its readers map it read-only (docs/security.md § Groups, "Group arenas"): ``arena_bytes``,
    else its host_bytes quota, else the daemon's tenant_arena_bytes; none for tcp-only readers."""
    body = (
        f'[[tenant]]\nname = "a"\ntokens_sha256 = ["{GOOD}"]\ntransports = ["shm"]\n\n'
        '[[tenant]]\nname = "b"\nmtls_names = ["b"]\ntransports = ["tcp"]\n\n'
        '[[group]]\nname = "g"\npublishers = ["b"]\nmembers = ["a"]\narena_bytes = "3MiB"\n\n'
        '[[group]]\nname = "h"\npublishers = ["b"]\n[group.quotas]\nhost_bytes = "5MiB"\n'
    )
    t = load_tenants(write(tmp_path, body))
    assert t.maps_memory(t.by_name["g"]) and not t.maps_memory(t.by_name["h"])  # h: b only, tcp
    assert t.by_name["g"].arena_size(1 << 20) == 3 << 20

"""The cluster tier's pure parts: value format, MACs and realms, key names, URLs, settings, slot
grouping, the fleet key file.

The tier against a real Redis Cluster: tests/integration/cluster/test_cluster_tier.py.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import xxhash
from redis.crc import key_slot

from kvtierd.config import DaemonConfig
from kvtierd.tiers.cluster.format import (
    HEADER,
    HEADER_BYTES,
    SIGNED,
    CorruptValue,
    encode_header,
    payload_digest,
    redis_key,
    verify,
)
from kvtierd.tiers.cluster.keys import FleetKeys, Realm, main, read_fleet_key
from kvtierd.tiers.cluster.nodes import SLOTS, Topology
from kvtierd.tiers.cluster.settings import Credentials, parse_url

DIGEST = hashlib.sha256(b"ns").digest()
KEY = hashlib.sha256(b"block").digest()
PAYLOAD = hashlib.shake_256(b"payload").digest(16384)
FLEET = FleetKeys(hashlib.sha256(b"fleet key").digest())
REALM = FLEET.untenanted("prod.engines")


def value(digest: bytes = DIGEST, key: bytes = KEY, payload: bytes = PAYLOAD, realm: Realm = REALM) -> bytes:
    return encode_header(realm, digest, key, payload) + payload


def test_key_names_carry_their_realm_and_no_hash_tag_so_blocks_spread_over_every_slot() -> None:
    k = redis_key(REALM, DIGEST, KEY)
    assert k == REALM.prefix + DIGEST.hex().encode() + b":" + KEY.hex().encode()
    assert k.startswith(b"kvt2:") and len(REALM.prefix) == 22
    assert b"{" not in k and len(k) == 151
    slots = {key_slot(redis_key(REALM, DIGEST, hashlib.sha256(b"%d" % i).digest())) for i in range(2000)}
    assert len(slots) > 1800  # one model's blocks land on (nearly) every shard


def test_a_value_round_trips_and_its_header_echoes_identity() -> None:
    v = value()
    assert len(v) == HEADER_BYTES + len(PAYLOAD) and HEADER_BYTES == 128
    assert bytes(verify(v, REALM, DIGEST, KEY, len(PAYLOAD))) == PAYLOAD
    magic, version, flags, n, digest, key, _, _mac = HEADER.unpack_from(v)
    assert (magic, version, flags, n, digest, key) == (b"KVC1", 2, 0, len(PAYLOAD), DIGEST, KEY)


def test_realms_are_derived_from_the_fleet_key_and_tenant_and_never_show_it() -> None:
    fleet_key = hashlib.sha256(b"fleet key").digest()
    a, b, none = FLEET.realm("team-a"), FLEET.realm("team-b"), FLEET.untenanted("team-a")
    other = FLEET.untenanted("staging.engines")
    assert len({a.mac_key, b.mac_key, none.mac_key, other.mac_key, fleet_key}) == 5
    assert len({a.prefix, b.prefix, none.prefix, other.prefix}) == 4
    assert FleetKeys(fleet_key).realm("team-a") == a  # every daemon of the fleet agrees
    assert FleetKeys(fleet_key).untenanted("team-a") == none
    assert FleetKeys(bytes(32)).realm("team-a").mac_key != a.mac_key  # another fleet
    assert b"team-a" not in a.prefix and a.acl_pattern == f"~{a.prefix.decode()}*"
    for shown in (repr(a), repr(FLEET), repr(none)):
        assert a.mac_key.hex() not in shown and fleet_key.hex() not in shown
    with pytest.raises(ValueError, match="cluster_fleet_key_file"):
        FleetKeys(bytes(31))


def forge(
    v: bytes, *, mac: bytes | None = None, version: int = 2, digest: bytes = DIGEST, key: bytes = KEY
) -> bytes:
    """``v`` with its signed fields changed and everything else recomputed as an attacker
    can (payload digest), but not the MAC (``mac``: what to put there; default: keep it)."""
    payload = v[HEADER_BYTES:]
    signed = SIGNED.pack(b"KVC1", version, 0, len(payload), digest, key, payload_digest(payload))
    return signed + (mac if mac is not None else v[SIGNED.size : HEADER_BYTES]) + payload


@pytest.mark.parametrize(
    ("planted", "reason"),
    [
        (lambda: forge(value(), mac=bytes(32)), "bad MAC"),  # a valid header and digest, no MAC
        (
            lambda: forge(value()[:HEADER_BYTES] + b"\x55" * len(PAYLOAD)),
            "bad MAC",
        ),  # other bytes, their digest recomputed, the authentic MAC kept
        (lambda: value(realm=FLEET.realm("team-b")), "bad MAC"),  # another tenant's authentic value
        (lambda: value(realm=FleetKeys(bytes(32)).untenanted("prod.engines")), "bad MAC"),  # another fleet's
        (lambda: value(realm=FLEET.untenanted("staging.engines")), "bad MAC"),  # another realm's
        (lambda: forge(value(), version=1), "unknown version"),
    ],
)
def test_a_value_this_realm_did_not_write_is_refused_as_forged(planted: object, reason: str) -> None:
    with pytest.raises(CorruptValue) as e:
        verify(planted(), REALM, DIGEST, KEY, len(PAYLOAD))  # type: ignore[operator]
    assert reason in e.value.reason
    assert e.value.forged == (reason == "bad MAC")


def test_the_payload_digest_is_blake3_and_binds_the_payload() -> None:
    """The MAC covers the payload through this digest: it must be cryptographic (BLAKE3, 128
    bits), not xxh3, whose secret is public (an authentic header could be paired with another
    payload of the same xxh3)."""
    assert payload_digest(b"abc").hex() == "6437b3ac38465133ffb63b75273a8db5"  # BLAKE3("abc")
    v = value()
    with pytest.raises(CorruptValue, match="payload digest mismatch"):  # header kept, one bit
        verify(v[:-1] + bytes([v[-1] ^ 1]), REALM, DIGEST, KEY, len(PAYLOAD))


def test_a_version_1_value_without_a_mac_is_refused() -> None:
    payload = PAYLOAD
    v1 = (
        struct.pack(
            "<4sHHQ32s32s16s", b"KVC1", 1, 0, len(payload), DIGEST, KEY, xxhash.xxh3_128_digest(payload)
        )
        + payload
    )
    with pytest.raises(CorruptValue, match="length"):  # 96-byte header: the size is off
        verify(v1, REALM, DIGEST, KEY, len(PAYLOAD))
    with pytest.raises(CorruptValue, match="unknown version 1"):  # even padded to size
        verify(v1[:96] + bytes(32) + payload, REALM, DIGEST, KEY, len(PAYLOAD))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda v: v[:50], "short value"),
        (lambda v: b"XXXX" + v[4:], "bad magic"),
        (lambda v: v[:4] + struct.pack("<H", 3) + v[6:], "unknown version"),
        (lambda v: v[: HEADER_BYTES - 1] + bytes([v[HEADER_BYTES - 1] ^ 1]) + v[HEADER_BYTES:], "bad MAC"),
        (lambda v: v[:-1], "length"),
        (lambda v: v + b"\0", "length"),
        (
            lambda v: v[: HEADER_BYTES + 7] + bytes([v[HEADER_BYTES + 7] ^ 1]) + v[HEADER_BYTES + 8 :],
            "payload digest mismatch",
        ),
    ],
)
def test_a_damaged_value_is_refused_naming_the_check(mutate: object, reason: str) -> None:
    with pytest.raises(CorruptValue) as e:
        verify(mutate(value()), REALM, DIGEST, KEY, len(PAYLOAD))  # type: ignore[operator]
    assert reason in e.value.reason


def test_a_valid_value_under_another_key_or_namespace_is_refused() -> None:
    other = hashlib.sha256(b"other").digest()
    for digest, key in ((other, KEY), (DIGEST, other)):
        with pytest.raises(CorruptValue, match="another block's key"):
            verify(value(), REALM, digest, key, len(PAYLOAD))
        with pytest.raises(CorruptValue, match="bad MAC"):  # its identity rewritten too
            verify(forge(value(), digest=digest, key=key), REALM, digest, key, len(PAYLOAD))
    with pytest.raises(CorruptValue, match="length"):  # a block of another size
        verify(value(), REALM, DIGEST, KEY, len(PAYLOAD) // 2)


def test_cluster_urls() -> None:
    assert parse_url("redis://10.0.0.1:7000,10.0.0.2:7001") == (("10.0.0.1:7000", "10.0.0.2:7001"), False)
    assert parse_url("rediss://redis.svc:6379/") == (("redis.svc:6379",), True)
    for bad in (
        "10.0.0.1:7000",
        "http://h:1",
        "redis://h",
        "redis://h:0",
        "redis://h:x",
        "redis://:7000",
        "redis://h:1,",
    ):
        with pytest.raises(ValueError, match="cluster"):
            parse_url(bad)


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("cluster", "redis://nohost", "cluster"),
        ("cluster", "redis://127.0.0.1:7000", "cluster_fleet_key_file: required with cluster"),
        ("cluster_write_policy", "sometimes", "cluster_write_policy"),
        ("cluster_lookup_timeout_ms", 0, "cluster_lookup_timeout_ms"),
        ("cluster_inflight_bytes", 1024, "cluster_inflight_bytes"),
        ("cluster_ttl_s", 0, "cluster_ttl_s"),
        ("cluster_breaker_s", -1.0, "cluster_breaker_s"),
    ],
)
def test_bad_cluster_settings_name_the_field(field: str, bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DaemonConfig.from_flat(**{field: bad})  # type: ignore[arg-type]


def test_the_default_config_has_no_cluster_and_make_serve_needs_none() -> None:
    cfg = DaemonConfig()
    assert cfg.cluster_tier.cluster == "" and cfg.cluster_tier.cluster_write_policy == "commit"
    assert cfg.cluster_tier.cluster_fleet_key_file == ""


def test_the_fleet_key_file_is_hex_of_at_least_32_bytes(tmp_path: Path) -> None:
    good = tmp_path / "fleet.key"
    good.write_text(hashlib.sha256(b"k").hexdigest() + "\n")
    assert read_fleet_key(good) == hashlib.sha256(b"k").digest()
    spaced = tmp_path / "spaced.key"
    spaced.write_text(" ".join(hashlib.sha512(b"k").hexdigest()[i : i + 8] for i in range(0, 128, 8)))
    assert read_fleet_key(spaced) == hashlib.sha512(b"k").digest()  # 64 bytes, whitespace ignored
    for text, match in (
        ("ab" * 31, "31 bytes of key; at least 32"),
        ("zz" * 32, "hex digits"),
        ("", "0 bytes of key"),
    ):
        bad = tmp_path / "bad.key"
        bad.write_text(text)
        with pytest.raises(ValueError, match=f"cluster_fleet_key_file: .*{match}") as e:
            read_fleet_key(bad)
        assert not text or text not in str(e.value)  # the content is never quoted
    with pytest.raises(ValueError, match="cluster_fleet_key_file: cannot read"):
        read_fleet_key(tmp_path / "missing.key")


def test_the_keys_tool_prints_a_realms_acl_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "fleet.key"
    key.write_text(hashlib.sha256(b"k").hexdigest())
    assert main([str(key), "team-a"]) == 0
    realm = FleetKeys(hashlib.sha256(b"k").digest()).realm("team-a")
    assert capsys.readouterr().out == realm.acl_pattern + "\n"
    assert main([str(key), "--realm", "prod.engines"]) == 0
    assert (
        capsys.readouterr().out
        == FleetKeys(hashlib.sha256(b"k").digest()).untenanted("prod.engines").acl_pattern + "\n"
    )
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(key)]) == 2 and main([str(key), "--realm"]) == 2


def test_a_groups_realm_is_derived_as_documented_and_is_no_tenants_nor_untenanted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cluster.md: BLAKE2b-256(key = fleet key, "kvtier/fleet/group/v1\\0" + group): group
    ``x`` never has the realm (MAC key, Redis keys) of tenant ``x`` nor of cluster_realm ``x``,
    so a tenants file that names a tenant like another file's group shares nothing with it."""
    fleet_key = hashlib.sha256(b"fleet key").digest()
    fleet = FleetKeys(fleet_key)
    g = fleet.group("acme-shared")
    want = hashlib.blake2b(b"kvtier/fleet/group/v1\0acme-shared", key=fleet_key, digest_size=32).digest()
    assert g.mac_key == want and g.name == "acme-shared" and g.group and g == fleet.group("acme-shared")
    others = (fleet.realm("acme-shared"), fleet.untenanted("acme-shared"))
    assert all(g.mac_key != o.mac_key and g.prefix != o.prefix for o in others)
    assert "acme-shared" not in g.acl_pattern and fleet_key.hex() not in repr(g)
    key = tmp_path / "fleet.key"
    key.write_text(fleet_key.hex())
    assert main([str(key), "--group", "acme-shared"]) == 0
    assert capsys.readouterr().out == g.acl_pattern + "\n"
    assert main([str(key), "--group"]) == 2


def test_the_untenanted_realm_key_is_derived_from_cluster_realm_as_documented() -> None:
    """docs/cluster.md: BLAKE2b-256(key = fleet key, "kvtier/fleet/untenanted/v2\\0" + cluster_realm)."""
    fleet_key = hashlib.sha256(b"fleet key").digest()
    want = hashlib.blake2b(
        b"kvtier/fleet/untenanted/v2\0prod.engines", key=fleet_key, digest_size=32
    ).digest()
    assert REALM.mac_key == want and REALM.name is None and REALM.cluster_realm == "prod.engines"
    tag = hashlib.blake2b(b"kvtier/fleet/tag/v1", key=want, digest_size=8).hexdigest()
    assert REALM.prefix == f"kvt2:{tag}:".encode()


@pytest.mark.parametrize("bad", ["", "-x", "a b", "a/b", "é", "x" * 129])
def test_a_bad_cluster_realm_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="cluster_realm"):
        FLEET.untenanted(bad)


def test_a_daemon_without_tenants_needs_a_cluster_realm_and_one_with_tenants_refuses_it(
    tmp_path: Path,
) -> None:
    """Issue 39: untenanted daemons sharing a fleet key shared one realm, so an engine of one
    deployment planted blocks another served. A realm per trust domain is required now."""
    key = tmp_path / "fleet.key"
    key.write_text("ab" * 32)
    base = {"cluster": "redis://127.0.0.1:7000", "cluster_fleet_key_file": str(key)}
    with pytest.raises(ValueError, match="cluster_realm: required with cluster without a tenants_file"):
        DaemonConfig.from_flat(**base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cluster_realm: expected"):
        DaemonConfig.from_flat(**base, cluster_realm="a b")  # type: ignore[arg-type]
    assert DaemonConfig.from_flat(**base, cluster_realm="ns.app").cluster_tier.cluster_realm == "ns.app"  # type: ignore[arg-type]
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\ntokens_sha256 = ["' + "0" * 64 + '"]\n')
    DaemonConfig.from_flat(**base, tenants_file=str(tenants))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cluster_realm: not with a tenants_file"):
        DaemonConfig.from_flat(**base, tenants_file=str(tenants), cluster_realm="ns.app")  # type: ignore[arg-type]


def test_keys_are_grouped_by_the_master_owning_their_slot() -> None:
    topo = Topology(["127.0.0.1:7000"], Credentials(), breaker_s=1.0)
    third = SLOTS // 3
    topo._apply(
        [
            [0, third - 1, [b"127.0.0.1", 7000, b"a"]],
            [third, 2 * third - 1, [b"127.0.0.1", 7001, b"b"]],
            [2 * third, SLOTS - 2, [b"", 7002, b"c"]],
        ],
        via="127.0.0.1:7000",
    )
    assert sorted(n.address for n in topo.masters()) == [
        "127.0.0.1:7000",
        "127.0.0.1:7001",
        "127.0.0.1:7002",
    ]  # "" host: the node asked
    rkeys = [redis_key(REALM, DIGEST, hashlib.sha256(b"%d" % i).digest()) for i in range(3000)]
    groups = topo.group(rkeys)
    for node, idx in groups.items():
        for i in idx:
            s = key_slot(rkeys[i])
            if node is None:
                assert s == SLOTS - 1  # the one slot no master serves: a miss, never sent
            else:
                assert node.address == f"127.0.0.1:{7000 + min(2, s // third)}"
    assert sum(map(len, groups.values())) == 3000


def test_a_failing_node_is_skipped_with_a_doubling_breaker_capped_at_8x() -> None:
    import time

    topo = Topology(["127.0.0.1:7000"], Credentials(), breaker_s=10.0)
    n = topo.node("127.0.0.1:7000")
    assert n.healthy
    for factor in (1, 2, 4, 8, 8):
        n.fail("refused")
        left = n._open_until - time.monotonic()
        assert 10.0 * factor - 1 < left <= 10.0 * factor, (factor, left)
        assert not n.healthy
    assert n.errors == 5

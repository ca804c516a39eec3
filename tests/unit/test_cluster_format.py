"""The cluster tier's pure parts: value format, key names, URLs, settings, slot grouping.

The tier against a real Redis Cluster: tests/integration/test_cluster_tier.py.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
from redis.crc import key_slot

from kvtierd.config import DaemonConfig
from kvtierd.tiers.cluster.format import (
    HEADER,
    HEADER_BYTES,
    CorruptValue,
    encode_header,
    redis_key,
    verify,
)
from kvtierd.tiers.cluster.nodes import SLOTS, Topology
from kvtierd.tiers.cluster.settings import Credentials, parse_url

DIGEST = hashlib.sha256(b"ns").digest()
KEY = hashlib.sha256(b"block").digest()
PAYLOAD = hashlib.shake_256(b"payload").digest(16384)


def value(digest: bytes = DIGEST, key: bytes = KEY, payload: bytes = PAYLOAD) -> bytes:
    return encode_header(digest, key, payload) + payload


def test_key_names_carry_no_hash_tag_so_blocks_spread_over_every_slot() -> None:
    k = redis_key(DIGEST, KEY)
    assert k == b"kvt1:" + DIGEST.hex().encode() + b":" + KEY.hex().encode()
    assert b"{" not in k and len(k) == 134
    slots = {key_slot(redis_key(DIGEST, hashlib.sha256(b"%d" % i).digest())) for i in range(2000)}
    assert len(slots) > 1800  # one model's blocks land on (nearly) every shard


def test_a_value_round_trips_and_its_header_echoes_identity() -> None:
    v = value()
    assert len(v) == HEADER_BYTES + len(PAYLOAD) and HEADER_BYTES == 96
    assert bytes(verify(v, DIGEST, KEY, len(PAYLOAD))) == PAYLOAD
    magic, version, flags, n, digest, key, _ = HEADER.unpack_from(v)
    assert (magic, version, flags, n, digest, key) == (b"KVC1", 1, 0, len(PAYLOAD), DIGEST, KEY)


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda v: v[:50], "short value"),
    (lambda v: b"XXXX" + v[4:], "bad magic"),
    (lambda v: v[:4] + struct.pack("<H", 2) + v[6:], "unknown version"),
    (lambda v: v[:-1], "length"),
    (lambda v: v + b"\0", "length"),
    (lambda v: v[:HEADER_BYTES + 7] + bytes([v[HEADER_BYTES + 7] ^ 1]) + v[HEADER_BYTES + 8:],
     "payload digest mismatch"),
])
def test_a_damaged_value_is_refused_naming_the_check(mutate: object, reason: str) -> None:
    with pytest.raises(CorruptValue) as e:
        verify(mutate(value()), DIGEST, KEY, len(PAYLOAD))  # type: ignore[operator]
    assert reason in e.value.reason


def test_a_valid_value_under_another_key_or_namespace_is_refused() -> None:
    other = hashlib.sha256(b"other").digest()
    for digest, key in ((other, KEY), (DIGEST, other)):
        with pytest.raises(CorruptValue, match="another block's key"):
            verify(value(), digest, key, len(PAYLOAD))
    with pytest.raises(CorruptValue, match="length"):  # a block of another size
        verify(value(), DIGEST, KEY, len(PAYLOAD) // 2)


def test_cluster_urls() -> None:
    assert parse_url("redis://10.0.0.1:7000,10.0.0.2:7001") == (
        ("10.0.0.1:7000", "10.0.0.2:7001"), False)
    assert parse_url("rediss://redis.svc:6379/") == (("redis.svc:6379",), True)
    for bad in ("10.0.0.1:7000", "http://h:1", "redis://h", "redis://h:0", "redis://h:x",
                "redis://:7000", "redis://h:1,"):
        with pytest.raises(ValueError, match="cluster"):
            parse_url(bad)


@pytest.mark.parametrize(("field", "bad", "match"), [
    ("cluster", "redis://nohost", "cluster"),
    ("cluster_write_policy", "sometimes", "cluster_write_policy"),
    ("cluster_lookup_timeout_ms", 0, "cluster_lookup_timeout_ms"),
    ("cluster_inflight_bytes", 1024, "cluster_inflight_bytes"),
    ("cluster_ttl_s", 0, "cluster_ttl_s"),
    ("cluster_breaker_s", -1.0, "cluster_breaker_s"),
])
def test_bad_cluster_settings_name_the_field(field: str, bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DaemonConfig(**{field: bad})  # type: ignore[arg-type]


def test_the_default_config_has_no_cluster_and_make_serve_needs_none() -> None:
    cfg = DaemonConfig()
    assert cfg.cluster == "" and cfg.cluster_write_policy == "commit"


def test_keys_are_grouped_by_the_master_owning_their_slot() -> None:
    topo = Topology(["127.0.0.1:7000"], Credentials(), breaker_s=1.0)
    third = SLOTS // 3
    topo._apply([[0, third - 1, [b"127.0.0.1", 7000, b"a"]],
                 [third, 2 * third - 1, [b"127.0.0.1", 7001, b"b"]],
                 [2 * third, SLOTS - 2, [b"", 7002, b"c"]]], via="127.0.0.1:7000")
    assert sorted(n.address for n in topo.masters()) == [
        "127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]  # "" host: the node asked
    rkeys = [redis_key(DIGEST, hashlib.sha256(b"%d" % i).digest()) for i in range(3000)]
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

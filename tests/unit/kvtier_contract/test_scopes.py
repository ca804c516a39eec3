"""Salt regions (docs/hashing.md §7): golden vectors three ways, the properties a shared prefix
needs, and every bad input refused naming its field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from ref_hashing import ref_block_key, run_fresh

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import Namespace, block_keys
from kvtier_contract.scopes import MAX_REGIONS, Region, scoped_block_keys

REPO = Path(__file__).resolve().parents[3]
GOLDEN_PATH = REPO / "tests" / "data" / "hashing_regions_golden.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
NAMESPACES = {name: Namespace.from_dict(e["fields"]) for name, e in GOLDEN["namespaces"].items()}


def _regions(seq: dict[str, Any]) -> list[Region]:
    return [
        Region(r["offset"], NAMESPACES[r["namespace"]], None if r["key"] is None else bytes.fromhex(r["key"]))
        for r in seq["regions"]
    ]


def _args(seq: dict[str, Any]) -> dict[str, Any]:
    return {
        "parent": None if seq["parent"] is None else bytes.fromhex(seq["parent"]),
        "extras": None if seq["extras"] is None else [bytes.fromhex(e) for e in seq["extras"]],
    }


# --- golden vectors -----------------------------------------------------------------------------


def test_the_golden_file_covers_the_cases() -> None:
    names = {s["name"] for s in GOLDEN["sequences"]}
    assert {"boundary_inside_a_block", "two_boundaries_in_one_block", "one_region_is_the_flat_case"} <= names
    seqs = GOLDEN["sequences"]
    assert any(s["parent"] and s["extras"] and all(r["key"] for r in s["regions"]) for s in seqs)
    assert any(NAMESPACES[r["namespace"]].group for s in GOLDEN["sequences"] for r in s["regions"])


@pytest.mark.parametrize("name", sorted(GOLDEN["namespaces"]))
def test_golden_namespaces(name: str) -> None:
    assert NAMESPACES[name].digest.hex() == GOLDEN["namespaces"][name]["digest"]


@pytest.mark.parametrize("seq", GOLDEN["sequences"], ids=lambda s: s["name"])
def test_golden_keys(seq: dict[str, Any]) -> None:
    keys = scoped_block_keys(_regions(seq), seq["token_ids"], **_args(seq))
    assert [k.hex() for k in keys] == seq["keys"]


def ref_scoped_keys(seq: dict[str, Any]) -> list[bytes]:
    """docs/hashing.md §7 from scratch: hashlib, hmac and int.to_bytes, the digests as given."""
    regions = seq["regions"]
    B = GOLDEN["namespaces"][regions[0]["namespace"]]["fields"]["tokens_per_block"]
    tokens = seq["token_ids"]
    prev = bytes.fromhex(seq["parent"]) if seq["parent"] else bytes(32)
    keys = []
    for i in range(len(tokens) // B):
        lo, hi = i * B, (i + 1) * B
        owner = [r for r in regions if r["offset"] <= hi - 1][-1]
        digest = bytes.fromhex(GOLDEN["namespaces"][owner["namespace"]]["digest"])
        extra = bytes.fromhex(seq["extras"][i]) if seq["extras"] else b""
        inside = [r for r in regions if lo < r["offset"] < hi]
        record = b""
        if inside:
            digests = [bytes.fromhex(GOLDEN["namespaces"][r["namespace"]]["digest"]) for r in inside]
            body = b"".join(
                (r["offset"] - lo).to_bytes(4, "little") + d for r, d in zip(inside, digests, strict=True)
            )
            record = bytes([1]) + len(body).to_bytes(4, "little") + body
        key = bytes.fromhex(owner["key"]) if owner["key"] else None
        prev = ref_block_key(digest, prev, tokens[lo:hi], extra, key, record)
        keys.append(prev)
    return keys


@pytest.mark.parametrize("seq", GOLDEN["sequences"], ids=lambda s: s["name"])
def test_golden_keys_match_an_independent_implementation(seq: dict[str, Any]) -> None:
    assert [k.hex() for k in ref_scoped_keys(seq)] == seq["keys"]


_RECOMPUTE = """
import json, sys
from kvtier_contract.identity import Namespace
from kvtier_contract.scopes import Region, scoped_block_keys
g = json.load(open(sys.argv[1], encoding="utf-8"))
nss = {n: Namespace.from_dict(e["fields"]) for n, e in g["namespaces"].items()}
h = lambda v: None if v is None else bytes.fromhex(v)
out = []
for s in g["sequences"]:
    regions = [Region(r["offset"], nss[r["namespace"]], h(r["key"])) for r in s["regions"]]
    ex = None if s["extras"] is None else [bytes.fromhex(e) for e in s["extras"]]
    keys = scoped_block_keys(regions, s["token_ids"], parent=h(s["parent"]), extras=ex)
    out.append([k.hex() for k in keys])
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", ["0", "12345", "random"])
def test_fresh_interpreters_agree(seed: str) -> None:
    assert run_fresh(_RECOMPUTE, GOLDEN_PATH, seed) == [s["keys"] for s in GOLDEN["sequences"]]


# --- properties ---------------------------------------------------------------------------------

GROUP, A, B = NAMESPACES["group_acme"], NAMESPACES["tenant_a"], NAMESPACES["tenant_b"]
TOKENS = list(range(5000, 5024))  # 6 blocks of 4


def test_one_region_hashes_exactly_as_block_keys() -> None:
    parent, extras = bytes([9]) * 32, [bytes([i]) for i in range(6)]
    for key in (None, b"k"):
        flat = A.block_keys(TOKENS, parent=parent, extras=extras, tenant_key=key)
        assert scoped_block_keys([Region(0, A, key)], TOKENS, parent=parent, extras=extras) == flat


def test_tenants_share_the_shared_part_and_nothing_after_it() -> None:
    for boundary in (8, 10):  # at a block edge, and inside block 2
        a = scoped_block_keys([Region(0, GROUP), Region(boundary, A)], TOKENS)
        b = scoped_block_keys([Region(0, GROUP), Region(boundary, B)], TOKENS)
        assert a[:2] == b[:2] == GROUP.block_keys(TOKENS[:8])  # the group's own keys
        assert not set(a[2:]) & set(b[2:])
        assert not set(a[2:]) & set(A.block_keys(TOKENS))  # nor a flat tenant prompt's


def test_the_first_private_block_chains_from_the_last_shared_key() -> None:
    shared = GROUP.block_keys(TOKENS[:8])
    keys = scoped_block_keys([Region(0, GROUP), Region(8, A)], TOKENS)
    assert keys[2:] == A.block_keys(TOKENS[8:], parent=shared[-1])  # a continuation, as §2


def test_a_boundary_inside_a_block_makes_it_the_later_scope_and_is_hashed() -> None:
    at_edge = scoped_block_keys([Region(0, GROUP), Region(8, A)], TOKENS)
    inside = scoped_block_keys([Region(0, GROUP), Region(9, A)], TOKENS)
    later = scoped_block_keys([Region(0, GROUP), Region(10, A)], TOKENS)
    assert at_edge[:2] == inside[:2] == later[:2]
    assert len({at_edge[2], inside[2], later[2]}) == 3  # the offset is part of block 2's key
    assert inside[2] != A.block_keys(TOKENS[8:12], parent=at_edge[1])[0]  # never a plain block's
    # a region starting inside the partial tail changes no key
    assert scoped_block_keys([Region(0, GROUP), Region(22, A)], TOKENS[:23]) == GROUP.block_keys(TOKENS[:23])


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    regions = [Region(0, GROUP, b"g"), Region(6, A, b"a")]
    full = scoped_block_keys(regions, TOKENS)
    for n in range(7, len(TOKENS)):
        assert scoped_block_keys(regions, TOKENS[:n]) == full[: n // 4]


def test_the_scope_key_keys_its_blocks_only() -> None:
    plain = scoped_block_keys([Region(0, GROUP), Region(8, A)], TOKENS)
    keyed = scoped_block_keys([Region(0, GROUP), Region(8, A, b"team-a secret")], TOKENS)
    assert plain[:2] == keyed[:2] and not set(plain[2:]) & set(keyed[2:])


# --- bad input ----------------------------------------------------------------------------------

OTHER_MODEL = dataclasses.replace(A, model_id="other/model")
WIDER = dataclasses.replace(A, tokens_per_block=8)


@pytest.mark.parametrize(
    ("regions", "field"),
    [
        ([], "regions"),
        ("abc", "regions"),
        ([Region(0, GROUP)] * (MAX_REGIONS + 1), "regions"),
        ([(0, GROUP)], "regions[0]"),
        ([Region(1, GROUP)], "regions[0].offset"),
        ([Region(0, GROUP), Region(8, A), Region(8, B)], "regions[2].offset"),
        ([Region(0, GROUP), Region(8, A), Region(4, B)], "regions[2].offset"),
        ([Region(0, GROUP), Region(24, A)], "regions[1].offset"),  # past the last token
        ([Region(0, GROUP), Region(True, A)], "regions[1].offset"),
        ([Region(0, GROUP), Region(8, A.to_dict())], "regions[1].namespace"),  # type: ignore[arg-type]
        ([Region(0, GROUP), Region(8, OTHER_MODEL)], "regions[1].namespace.model_id"),
        ([Region(0, GROUP), Region(8, WIDER)], "regions[1].namespace.tokens_per_block"),
        ([Region(0, GROUP, b"")], "regions[0].key"),
        ([Region(0, GROUP), Region(8, A, "secret")], "regions[1].key"),  # type: ignore[arg-type]
    ],
)
def test_bad_regions_are_refused_naming_the_field(regions: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        scoped_block_keys(regions, TOKENS)
    assert err.value.field == field


def test_bad_tokens_parent_and_extras_are_refused_as_block_keys_refuses_them() -> None:
    regions = [Region(0, GROUP), Region(8, A)]
    for kwargs, field in (
        ({"token_ids": [*TOKENS[:-1], -1]}, "token_ids"),
        ({"token_ids": TOKENS, "parent": b"short"}, "parent"),
        ({"token_ids": TOKENS, "extras": [b""] * 5}, "extras"),
    ):
        with pytest.raises(InvalidArgument) as err:
            scoped_block_keys(regions, **kwargs)
        assert err.value.field == field
    with pytest.raises(InvalidArgument):
        block_keys(GROUP.digest, [-1], 4)  # (the same rule)

"""Namespace identity and block keys: golden vectors, determinism, validation, chaining.

The golden vectors in ``tests/data/hashing_golden.json`` were generated once with
``kvtier_contract.identity``; ``test_golden_vectors_match_reference`` recomputes every one of them with a
from-scratch implementation of ``docs/hashing.md`` written here, so they are not self-confirming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from ref_hashing import ref_block_key, run_fresh

from kvtier_contract.errors import InvalidArgument
from kvtier_contract.identity import KV_DTYPES, Namespace, block_keys, namespace_digest

REPO = Path(__file__).resolve().parents[3]
GOLDEN_PATH = REPO / "tests" / "data" / "hashing_golden.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))

# A small valid namespace; tests override one field at a time.
SMALL: dict[str, Any] = dict(
    model_id="tiny",
    model_revision="r0",
    tokenizer_digest="none",
    kv_dtype="float16",
    layout="contiguous",
    tokens_per_block=4,
    num_layers=2,
    num_kv_heads=1,
    head_dim=8,
)


def ns(**overrides: Any) -> Namespace:
    return Namespace(**{**SMALL, **overrides})


def golden_cases() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(n, s) for n in GOLDEN["namespaces"] for s in n["sequences"]]


def _opt_hex(value: str | None) -> bytes | None:
    return None if value is None else bytes.fromhex(value)


def _keys_for(namespace: Namespace, seq: dict[str, Any]) -> list[str]:
    extras = seq["extras"]
    keys = namespace.block_keys(
        seq["token_ids"],
        parent=_opt_hex(seq["parent"]),
        extras=None if extras is None else [bytes.fromhex(e) for e in extras],
        tenant_key=_opt_hex(seq["tenant_key"]),
    )
    return [k.hex() for k in keys]


# --- golden vectors -------------------------------------------------------------------------------


def test_golden_file_covers_the_required_cases() -> None:
    names = [n["name"] for n in GOLDEN["namespaces"]]
    seqs = [s for _, s in golden_cases()]
    assert len(names) >= 6
    assert any(s["tenant_key"] for s in seqs)
    assert any(s["extras"] for s in seqs)
    assert any(len(s["token_ids"]) % n["fields"]["tokens_per_block"] for n, s in golden_cases())


@pytest.mark.parametrize("entry", GOLDEN["namespaces"], ids=lambda e: e["name"])
def test_golden_namespace(entry: dict[str, Any]) -> None:
    namespace = Namespace.from_dict(entry["fields"])
    assert namespace.digest.hex() == entry["digest"]
    assert namespace_digest(namespace).hex() == entry["digest"]
    assert namespace.namespace_id == entry["namespace_id"]
    assert namespace.block_bytes == entry["block_bytes"]
    assert namespace.bytes_per_token == entry["bytes_per_token"]
    assert namespace.to_dict() == entry["fields"]


@pytest.mark.parametrize(
    ("entry", "seq"), golden_cases(), ids=[f"{n['name']}/{s['name']}" for n, s in golden_cases()]
)
def test_golden_keys(entry: dict[str, Any], seq: dict[str, Any]) -> None:
    namespace = Namespace.from_dict(entry["fields"])
    assert _keys_for(namespace, seq) == seq["keys"]


# --- independent reference (docs/hashing.md, written without kvtier_contract.identity) --------------------

# (tag, field name, type) exactly as the table in docs/hashing.md.
REF_FIELDS = [
    (1, "model_id", "str"),
    (2, "model_revision", "str"),
    (3, "tokenizer_digest", "str"),
    (4, "kv_dtype", "str"),
    (5, "layout", "str"),
    (6, "tokens_per_block", "int"),
    (7, "num_layers", "int"),
    (8, "num_kv_heads", "int"),
    (9, "head_dim", "int"),
    (10, "tp_size", "int"),
    (11, "tp_rank", "int"),
    (12, "pp_size", "int"),
    (13, "pp_rank", "int"),
    (14, "adapter_id", "str?"),
    (15, "adapter_revision", "str?"),
    (16, "cache_salt", "str?"),
    (17, "tenant", "str?"),
]
REF_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}


def ref_namespace_digest(fields: dict[str, Any]) -> bytes:
    """docs/hashing.md §1, from scratch; a ``group`` (§7) is record 17 of type 3."""
    out = bytearray(b"kvtier/ns/v1")
    for tag, name, kind in REF_FIELDS:
        value = fields[name]
        out.append(tag)
        if tag == 17 and fields.get("group") is not None:
            raw = fields["group"].encode("utf-8")
            out += bytes([3]) + len(raw).to_bytes(4, "little") + raw
        elif value is None:
            assert kind == "str?"
            out += bytes([0]) + (0).to_bytes(4, "little")
        elif kind == "int":
            out += bytes([2]) + (8).to_bytes(4, "little") + value.to_bytes(8, "little", signed=True)
        else:
            raw = value.encode("utf-8")
            out += bytes([1]) + len(raw).to_bytes(4, "little") + raw
    return hashlib.sha256(bytes(out)).digest()


def ref_block_keys(ns_digest: bytes, seq: dict[str, Any], tpb: int) -> list[bytes]:
    tokens = seq["token_ids"]
    parent = bytes.fromhex(seq["parent"]) if seq["parent"] else b"\x00" * 32
    key = bytes.fromhex(seq["tenant_key"]) if seq["tenant_key"] else None
    keys = []
    for i in range(len(tokens) // tpb):
        extra = bytes.fromhex(seq["extras"][i]) if seq["extras"] else b""
        parent = ref_block_key(ns_digest, parent, tokens[i * tpb : (i + 1) * tpb], extra, key)
        keys.append(parent)
    return keys


@pytest.mark.parametrize("entry", GOLDEN["namespaces"], ids=lambda e: e["name"])
def test_golden_vectors_match_reference(entry: dict[str, Any]) -> None:
    fields = entry["fields"]
    digest = ref_namespace_digest(fields)
    assert digest.hex() == entry["digest"]
    assert int.from_bytes(digest[:8], "little") & (2**63 - 1) == entry["namespace_id"]
    per_token = 2 * fields["num_layers"] * fields["num_kv_heads"] * fields["head_dim"]
    assert per_token * REF_ITEMSIZE[fields["kv_dtype"]] == entry["bytes_per_token"]
    for seq in entry["sequences"]:
        keys = ref_block_keys(digest, seq, fields["tokens_per_block"])
        assert [k.hex() for k in keys] == seq["keys"], seq["name"]


def test_hand_built_namespace_bytes() -> None:
    # SMALL with cache_salt="x", every record spelled out: tag, type, u32le length, value.
    def s(tag: int, raw: bytes) -> bytes:
        return bytes([tag, 1]) + struct.pack("<I", len(raw)) + raw

    def i(tag: int, v: int) -> bytes:
        return bytes([tag, 2]) + b"\x08\x00\x00\x00" + struct.pack("<q", v)

    def absent(tag: int) -> bytes:
        return bytes([tag, 0, 0, 0, 0, 0])

    encoded = (
        b"kvtier/ns/v1"
        + s(1, b"tiny")
        + s(2, b"r0")
        + s(3, b"none")
        + s(4, b"float16")
        + s(5, b"contiguous")
        + i(6, 4)
        + i(7, 2)
        + i(8, 1)
        + i(9, 8)
        + i(10, 1)
        + i(11, 0)
        + i(12, 1)
        + i(13, 0)
        + absent(14)
        + absent(15)
        + s(16, b"x")
        + absent(17)
    )
    expected = hashlib.sha256(encoded).digest()
    assert ns(cache_salt="x").digest == expected
    golden = {n["name"]: n for n in GOLDEN["namespaces"]}["cache_salt_x"]
    assert golden["digest"] == expected.hex()


# --- determinism across interpreters ------------------------------------------------------------

_RECOMPUTE = """
import json, sys
from kvtier_contract.identity import Namespace
golden = json.load(open(sys.argv[1], encoding="utf-8"))
out = []
for entry in golden["namespaces"]:
    ns = Namespace.from_dict(entry["fields"])
    keys = []
    for s in entry["sequences"]:
        h = lambda v: None if v is None else bytes.fromhex(v)
        ex = None if s["extras"] is None else [bytes.fromhex(e) for e in s["extras"]]
        ks = ns.block_keys(s["token_ids"], parent=h(s["parent"]), extras=ex,
                           tenant_key=h(s["tenant_key"]))
        keys.append([k.hex() for k in ks])
    out.append([ns.digest.hex(), ns.namespace_id, keys])
print(json.dumps({"out": out, "heavy": sorted({"numpy", "torch"} & set(sys.modules))}))
"""


@pytest.mark.parametrize("seed", ["0", "1", "12345", "random"])
def test_fresh_interpreters_agree(seed: str) -> None:
    result = run_fresh(_RECOMPUTE, GOLDEN_PATH, seed)
    expected = [
        [n["digest"], n["namespace_id"], [s["keys"] for s in n["sequences"]]] for n in GOLDEN["namespaces"]
    ]
    assert result["out"] == expected
    assert result["heavy"] == []  # importing kvtier_contract.identity pulls in neither numpy nor torch


# --- namespace validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_revision": "   "}, "model_revision"),
        ({"tokenizer_digest": ""}, "tokenizer_digest"),
        ({"layout": "x" * 257}, "layout"),
        ({"model_id": "a\x00b"}, "model_id"),
        ({"model_id": "\ud800"}, "model_id"),  # lone surrogate: not UTF-8 encodable
        ({"model_revision": 123}, "model_revision"),
        ({"num_layers": True}, "num_layers"),
        ({"head_dim": 8.0}, "head_dim"),
        ({"tp_size": "2"}, "tp_size"),
        ({"kv_dtype": "float64"}, "kv_dtype"),
        ({"kv_dtype": 2}, "kv_dtype"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"tokens_per_block": 65537}, "tokens_per_block"),
        ({"num_layers": -1}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"head_dim": 2**40}, "head_dim"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_rank": -1}, "tp_rank"),
        ({"tp_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"pp_size": 4, "pp_rank": 4}, "pp_rank"),
        ({"pp_rank": 1}, "pp_rank"),
        ({"adapter_id": "lora"}, "adapter_revision"),
        ({"adapter_revision": "v1"}, "adapter_id"),
        ({"adapter_id": "", "adapter_revision": "v1"}, "adapter_id"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"tenant": " "}, "tenant"),
        ({"tenant": 7}, "tenant"),
        ({"group": ""}, "group"),
        ({"group": "g\x00"}, "group"),
        ({"tenant": "t", "group": "g"}, "group"),  # a tenant's or a group's, never both
    ],
)
def test_invalid_namespace_names_its_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        ns(**overrides)
    assert err.value.field == f"namespace.{field}"
    assert f"namespace.{field}" in str(err.value)


def test_unknown_dtype_message_lists_allowed() -> None:
    with pytest.raises(InvalidArgument, match="bfloat16") as err:
        ns(kv_dtype="fp64")
    assert all(name in str(err.value) for name in KV_DTYPES)


@pytest.mark.parametrize("missing", ["model_revision", "tokenizer_digest", "num_kv_heads"])
def test_missing_identity_field_fails_closed(missing: str) -> None:
    kwargs = {k: v for k, v in SMALL.items() if k != missing}
    with pytest.raises(TypeError):
        Namespace(**kwargs)
    with pytest.raises(InvalidArgument) as err:
        Namespace.from_dict(kwargs)
    assert err.value.field == f"namespace.{missing}"


def test_from_dict_rejects_unknown_key_and_round_trips() -> None:
    with pytest.raises(InvalidArgument) as err:
        Namespace.from_dict({**SMALL, "lora": "x"})
    assert err.value.field == "namespace.lora"
    full = ns(tp_size=2, tp_rank=1, tenant="t")
    assert Namespace.from_dict(full.to_dict()) == full
    assert Namespace.from_dict(SMALL) == ns()  # defaulted fields may be omitted


def test_namespace_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ns().model_id = "other"  # type: ignore[misc]


def test_sizes_and_id_range() -> None:
    qwen = ns(kv_dtype="bfloat16", tokens_per_block=16, num_layers=28, num_kv_heads=8, head_dim=128)
    assert qwen.bytes_per_token == 114_688  # DESIGN.md §1
    assert qwen.block_bytes == 16 * 114_688
    assert ns(kv_dtype="float8_e5m2").bytes_per_token == 2 * 2 * 1 * 8 * 1
    assert 0 <= qwen.namespace_id < 2**63


# --- digest sensitivity -------------------------------------------------------------------------


def test_adapter_x_salt_x_and_tenant_x_differ() -> None:
    digests = {
        ns(adapter_id="x", adapter_revision="x").digest,
        ns(cache_salt="x").digest,
        ns(tenant="x").digest,
        ns(group="x").digest,  # record 17 of type 3: never a tenant's namespace of that name
        ns(cache_salt="xx").digest,
        ns().digest,
    }
    assert len(digests) == 6


def test_a_group_is_record_17_of_type_3() -> None:
    """Not an 18th record: every namespace without a group keeps its digest (the golden
    vectors), and the group's bytes sit where the tenant's would, typed apart."""
    assert ref_namespace_digest(ns().to_dict()) == ns().digest
    assert ref_namespace_digest(ns(group="x").to_dict()) == ns(group="x").digest
    assert ns(group="x").digest != ns(tenant="x").digest


def test_group_round_trips_and_is_left_out_when_absent() -> None:
    g = ns(group="acme-shared")
    assert g.to_dict()["group"] == "acme-shared"
    assert Namespace.from_dict(g.to_dict()) == g
    assert "group" not in ns().to_dict()  # a reader that predates groups reads it
    assert len(ns().to_dict()) == 17


CHANGES: dict[str, Any] = {
    "model_id": "tiny2",
    "model_revision": "r1",
    "tokenizer_digest": "sha256:01",
    "kv_dtype": "bfloat16",  # same itemsize as float16: the digest must still differ
    "layout": "vllm.LBNHC",
    "tokens_per_block": 8,
    "num_layers": 3,
    "num_kv_heads": 2,
    "head_dim": 16,
    "tp_size": 2,
    "tp_rank": 1,
    "pp_size": 2,
    "pp_rank": 1,
    "adapter_id": "lora",
    "adapter_revision": "v2",
    "cache_salt": "s",
    "tenant": "t",
    "group": "g",
}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Namespace)])
def test_changing_any_field_changes_digest(name: str) -> None:
    base = ns(tp_size=4, pp_size=4, adapter_id="a", adapter_revision="v1")
    changed = dataclasses.replace(base, **{name: CHANGES[name]})
    assert changed.digest != base.digest
    assert changed.namespace_id != base.namespace_id


# --- block keys ---------------------------------------------------------------------------------

DIGEST = ns().digest


def test_only_full_blocks_get_keys() -> None:
    assert block_keys(DIGEST, [], 4) == []
    assert block_keys(DIGEST, [1, 2, 3], 4) == []
    assert len(block_keys(DIGEST, list(range(11)), 4)) == 2
    # the partial tail does not change the keys of the full blocks
    assert block_keys(DIGEST, list(range(11)), 4) == block_keys(DIGEST, list(range(8)), 4)


def test_keys_chain() -> None:
    tokens = list(range(100, 140))
    keys = block_keys(DIGEST, tokens, 4)
    assert len(keys) == 10 and len(set(keys)) == 10
    for n in range(0, 41, 4):
        assert block_keys(DIGEST, tokens[:n], 4) == keys[: n // 4]
    # resuming from a parent gives the same tail
    assert block_keys(DIGEST, tokens[12:], 4, parent=keys[2]) == keys[3:]
    # a different first block changes every later key
    other = block_keys(DIGEST, [0, *tokens[1:]], 4)
    assert all(a != b for a, b in zip(keys, other, strict=True))


def test_same_block_at_different_positions_differs() -> None:
    keys = block_keys(DIGEST, [5, 5, 5, 5] * 3, 4)
    assert len(set(keys)) == 3


def test_namespace_changes_keys() -> None:
    tokens = list(range(8))
    assert ns().block_keys(tokens) != ns(cache_salt="s").block_keys(tokens)
    assert ns().block_keys(tokens) == block_keys(DIGEST, tokens, 4)


def test_tenant_key_changes_keys() -> None:
    tokens = list(range(8))
    plain = block_keys(DIGEST, tokens, 4)
    a = block_keys(DIGEST, tokens, 4, tenant_key=b"tenant-a")
    b = block_keys(DIGEST, tokens, 4, tenant_key=b"tenant-b")
    assert len({*plain, *a, *b}) == 6
    assert a == block_keys(DIGEST, tokens, 4, tenant_key=b"tenant-a")


def test_extras_change_keys_from_their_block_on() -> None:
    tokens = list(range(12))
    plain = block_keys(DIGEST, tokens, 4)
    assert block_keys(DIGEST, tokens, 4, extras=[b"", b"", b""]) == plain
    img = block_keys(DIGEST, tokens, 4, extras=[b"", b"img", b""])
    assert img[0] == plain[0] and img[1] != plain[1] and img[2] != plain[2]
    # the length prefix separates an extra from the next block's bytes
    assert block_keys(DIGEST, tokens, 4, extras=[b"", b"\x00", b""]) != plain


def test_array_and_tensor_inputs() -> None:
    np = pytest.importorskip("numpy")
    tokens = [0, 1, 2**32 - 1, 7, 151643, 9, 10, 11, 12]
    expected = block_keys(DIGEST, tokens, 4)
    assert block_keys(DIGEST, np.asarray(tokens, dtype=np.uint32), 4) == expected
    assert block_keys(DIGEST, np.asarray(tokens, dtype=np.int64), 4) == expected
    assert block_keys(DIGEST, tuple(tokens), 4) == expected
    small = [t for t in tokens if t < 2**31]
    assert block_keys(DIGEST, np.asarray(small, dtype=np.int32), 4) == block_keys(DIGEST, small, 4)
    torch = pytest.importorskip("torch")
    assert block_keys(DIGEST, torch.tensor(tokens, dtype=torch.int64), 4) == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_ids": [1, 2, 3, -1]}, "token_ids"),
        ({"token_ids": [1, 2, 3, 2**32]}, "token_ids"),
        ({"token_ids": [1, 2, 3, 4, 5, 1.5]}, "token_ids"),  # bad id in the partial tail too
        ({"token_ids": [1, 2, "3", 4]}, "token_ids"),
        ({"token_ids": "abcd"}, "token_ids"),
        ({"token_ids": 17}, "token_ids"),
        ({"namespace_digest": b"\x00" * 31}, "namespace_digest"),
        ({"namespace_digest": "00" * 32}, "namespace_digest"),
        ({"parent": b"\x00" * 33}, "parent"),
        ({"extras": [b""]}, "extras"),
        ({"extras": [b"", "x"]}, "extras"),
        ({"tenant_key": b""}, "tenant_key"),
        ({"tenant_key": "secret"}, "tenant_key"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
    ],
)
def test_invalid_block_keys_arguments(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"namespace_digest": DIGEST, "token_ids": list(range(8))}
    args["tokens_per_block"] = 4
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as err:
        block_keys(**args)
    assert err.value.field == field


def test_numpy_float_array_is_rejected() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(InvalidArgument) as err:
        block_keys(DIGEST, np.arange(8, dtype=np.float32), 4)
    assert err.value.field == "token_ids"


def test_hashing_is_fast() -> None:
    # 10,000 tokens at 16 tokens per block (625 keys); typically ~1 ms.
    tokens = [(i * 2654435761) % 2**32 for i in range(10_000)]
    qwen = ns(tokens_per_block=16)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        keys = qwen.block_keys(tokens)
        best = min(best, time.perf_counter() - start)
    assert len(keys) == 625
    assert best < 0.010

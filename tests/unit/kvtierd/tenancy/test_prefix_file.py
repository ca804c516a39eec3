"""kvtierd.tenancy.prefix_file: the published prefixes' file (its grammar: the module docstring
and docs/block_format.md §1) round-trips, refuses what it does not read, and is replaced whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier_contract.errors import Unavailable
from kvtierd.tenancy.prefix_file import Prefix, PrefixFile, decode, encode

D = bytes(range(32))


def raw(groups: Any, version: Any = 1) -> bytes:
    return json.dumps({"format_version": version, "groups": groups}).encode()


def test_a_registry_round_trips_and_equal_registries_write_equal_bytes() -> None:
    groups = {"g": {"b": Prefix(2, D), "a": Prefix(1, D[::-1])}, "h": {"x": Prefix(1 << 20, D)}}
    assert decode(encode(groups)) == groups
    assert encode(groups) == encode({"h": groups["h"], "g": {"a": groups["g"]["a"], "b": groups["g"]["b"]}})
    assert decode(encode({"empty": {}})) == {}  # a group without prefixes is not written


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        raw({}, version=2),
        raw([]),
        json.dumps({"format_version": 1, "groups": {}, "more": 1}).encode(),
        raw({"": {"a": {"tokens": 1, "digest": D.hex()}}}),  # no group name
        raw({"g": {}}),  # a group with no prefix
        raw({"g": {f"n{i}": {"tokens": 1, "digest": D.hex()} for i in range(17)}}),
        raw({"g": {"a": {"tokens": 0, "digest": D.hex()}}}),
        raw({"g": {"a": {"tokens": True, "digest": D.hex()}}}),
        raw({"g": {"a": {"tokens": (1 << 20) + 1, "digest": D.hex()}}}),
        raw({"g": {"a": {"tokens": 1, "digest": D.hex()[:62]}}}),
        raw({"g": {"a": {"tokens": 1, "digest": "zz" * 32}}}),
        raw({"g": {"a": {"tokens": 1}}}),
        raw({"g": {"n" * 129: {"tokens": 1, "digest": D.hex()}}}),
    ],
)
def test_anything_else_is_refused_never_guessed_at(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_the_file_is_replaced_whole_and_read_back(tmp_path: Path) -> None:
    f = PrefixFile(str(tmp_path))
    assert f.load() is None  # none yet
    f.save({"g": {"a": Prefix(3, D)}})
    f.save({"g": {"b": Prefix(4, D)}})
    assert f.load() == {"g": {"b": Prefix(4, D)}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["published-prefixes.json"]  # no .tmp left


def test_no_directory_is_no_file_to_read_and_a_refused_write(tmp_path: Path) -> None:
    f = PrefixFile(str(tmp_path / "not-made"))
    assert f.load() is None
    with pytest.raises(Unavailable, match="could not be written to .*not-made/published-prefixes.json"):
        f.save({"g": {"a": Prefix(3, D)}})
    assert not (tmp_path / "not-made").exists()  # the tier makes its directory, not this

"""`kvtier prefix`: what a tokens file may hold (a clear error naming the file otherwise) and the
table `kvtier prefix list` prints; the SDK's bound is the contract's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import build_parser
from kvtier.cli_prefix import format_prefixes, read_tokens_file


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("[1, 2, 3]", [1, 2, 3]),
        ("  [4294967295]\n", [4294967295]),
        ("1 2 3", [1, 2, 3]),
        ("1,2,3\n", [1, 2, 3]),
        ("1, 2,\n3\t4 ,5", [1, 2, 3, 4, 5]),
    ],
)
def test_a_json_array_or_integers_apart(tmp_path: Path, text: str, ids: list[int]) -> None:
    f = tmp_path / "tokens"
    f.write_text(text)
    assert read_tokens_file(str(f)) == ids


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "0 token ids"),
        ("[]", "0 token ids"),
        ("[1, 2", "not a JSON array"),
        ('[1, "2"]', "not a JSON array of integers"),
        ("[1, true]", "not a JSON array of integers"),
        ("1 2 x3", "'x3' is not a token id"),
        ("1 -2", "'-2' is not a token id"),
        ("1.5", "'1.5' is not a token id"),
        ("4294967296", "outside 0..4294967295"),
        ("[-1]", "outside 0..4294967295"),
    ],
)
def test_anything_else_is_refused_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    f = tmp_path / "tokens"
    f.write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        read_tokens_file(str(f))
    assert str(e.value).startswith(f"{f}: ")


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^{tmp_path / 'none'}: cannot read it"):
        read_tokens_file(str(tmp_path / "none"))


def test_the_list_table() -> None:
    table = format_prefixes(
        [("acme", "system", 4096, bytes(range(32)), True), ("acme", "t", 5, bytes(32), False)]
    )
    assert table.splitlines() == [
        "group  name    tokens  digest            you",
        "acme   system  4096    0001020304050607  publish",
        "acme   t       5       0000000000000000  read",
    ]
    assert format_prefixes([]).startswith("no published prefixes")


def test_the_verbs_take_the_daemon_flags() -> None:
    args = build_parser().parse_args(
        ["prefix", "publish", "--group", "g", "--name", "n", "--tokens-file", "f", "--token-file", "t"]
    )
    assert (args.verb, args.group, args.name, args.tokens_file, args.token_file) == (
        "publish",
        "g",
        "n",
        "f",
        "t",
    )
    assert build_parser().parse_args(["prefix", "list", "--json", "--unix-login"]).unix_login
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefix", "withdraw", "--group", "g"])  # --name is required

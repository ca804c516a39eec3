"""``kvtier prefix``: the published prefixes of groups of tenants (docs/security.md § Groups).

* ``kvtier prefix publish --group G --name N --tokens-file F``: publish the token ids of ``F``
  (a system prompt the group's tenants' requests begin with) for group ``G`` under ``N``
  (``Client.publish_prefix``: the daemon keeps its length and digest, never the tokens);
* ``kvtier prefix withdraw --group G --name N``: withdraw it (none there is no error);
* ``kvtier prefix list [--json]``: group, name, tokens, the digest's first 16 hex digits and
  whether this credential publishes into the group, of every group it reads.

Each takes the address and credential flags of ``kvtier stats`` (:mod:`kvtier.cli_daemon`). A
tokens file holds a JSON array of integers, or integers separated by whitespace and/or commas
(:func:`read_tokens_file`). Exit status: 0 done, 1 the daemon could not be reached or refused,
2 a bad flag or tokens file. Part of the ``kvtier`` command (:mod:`kvtier.cli`); no state.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.cli_daemon import add_daemon_flags, call_daemon
from kvtier_contract.prefixes import MAX_PREFIX_TOKENS

if TYPE_CHECKING:
    from kvtier.client import Client

__all__ = ["add_prefix_parser", "format_prefixes", "read_tokens_file", "run_prefix"]

MAX_TOKEN_ID = (1 << 32) - 1
_INTEGER = re.compile(r"\d+")


def add_prefix_parser(sub: Any) -> None:
    """``kvtier prefix`` and its verbs, on the ``kvtier`` command's subparsers ``sub``."""
    p = sub.add_parser("prefix", help="publish, withdraw or list the published prefixes of groups of tenants")
    verbs = p.add_subparsers(dest="verb", required=True)
    publish = verbs.add_parser("publish", help="publish a prefix for a group (a publisher of it)")
    _names(publish)
    publish.add_argument(
        "--tokens-file",
        required=True,
        help="the prefix's token ids: a JSON array of integers, or integers separated by "
        "whitespace and/or commas",
    )
    add_daemon_flags(publish, "PublishPrefix")
    withdraw = verbs.add_parser("withdraw", help="withdraw a group's prefix (a publisher of it)")
    _names(withdraw)
    add_daemon_flags(withdraw, "PublishPrefix")
    listing = verbs.add_parser("list", help="the prefixes of every group this credential reads")
    listing.add_argument("--json", action="store_true", help="machine-readable output (full digests)")
    add_daemon_flags(listing, "ListPrefixes")


def _names(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", required=True, help="a [[group]] of the daemon's tenants file")
    p.add_argument("--name", required=True, help="the prefix's name in the group")


def read_tokens_file(path: str) -> list[int]:
    """The token ids a tokens file holds; ValueError naming the file and what is wrong."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    text = text.strip()
    if text.startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON array of integers ({e})") from None
        if not all(type(i) is int for i in ids):
            raise ValueError(f"{path}: not a JSON array of integers (an element is not an integer)")
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
        bad = next((w for w in words if not _INTEGER.fullmatch(w)), None)
        if bad is not None:
            raise ValueError(
                f"{path}: {bad[:20]!r} is not a token id (expected a JSON array of integers, or "
                "integers separated by whitespace and/or commas)"
            )
        ids = [int(w) for w in words]
    if not 0 < len(ids) <= MAX_PREFIX_TOKENS:
        raise ValueError(f"{path}: {len(ids)} token ids (expected 1..{MAX_PREFIX_TOKENS})")
    out_of_range = next((i for i in ids if not 0 <= i <= MAX_TOKEN_ID), None)
    if out_of_range is not None:
        raise ValueError(f"{path}: token id {out_of_range} is outside 0..{MAX_TOKEN_ID}")
    return list(ids)


def run_prefix(args: argparse.Namespace) -> int:
    """Run ``kvtier prefix VERB`` (see the module docstring); its exit status."""
    what = f"kvtier prefix {args.verb}"
    ids: list[int] = []
    if args.verb == "publish":
        try:
            ids = read_tokens_file(args.tokens_file)
        except ValueError as e:
            print(f"{what}: --tokens-file {e}", file=sys.stderr)
            return 2
    status, said = call_daemon(what, args, lambda client: _VERBS[args.verb](client, args, ids))
    if not status:
        print(said)
    return status


def _publish(client: Client, args: argparse.Namespace, ids: list[int]) -> str:
    p = client.publish_prefix(args.group, args.name, ids)
    return f"published {p.name!r} for group {p.group!r}: {p.tokens} tokens, digest {p.digest.hex()[:16]}"


def _withdraw(client: Client, args: argparse.Namespace, ids: list[int]) -> str:
    if client.withdraw_prefix(args.group, args.name):
        return f"withdrew {args.name!r} of group {args.group!r}"
    return f"{args.name!r} of group {args.group!r} was not published: nothing to withdraw"


def _list(client: Client, args: argparse.Namespace, ids: list[int]) -> str:
    prefixes = client.published_prefixes()
    if args.json:
        rows = [
            {
                "group": p.group,
                "name": p.name,
                "tokens": p.tokens,
                "digest": p.digest.hex(),
                "publisher": p.publisher,
            }
            for p in prefixes
        ]
        return json.dumps(rows, indent=2)
    return format_prefixes([(p.group, p.name, p.tokens, p.digest, p.publisher) for p in prefixes])


def format_prefixes(rows: list[tuple[str, str, int, bytes, bool]]) -> str:
    """The table of ``kvtier prefix list``: (group, name, tokens, digest, publisher) a row."""
    if not rows:
        return "no published prefixes (in the groups this credential reads)"
    table = [("group", "name", "tokens", "digest", "you")]
    table += [(g, n, str(t), d.hex()[:16], "publish" if pub else "read") for g, n, t, d, pub in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)


_VERBS: dict[str, Callable[[Client, argparse.Namespace, list[int]], str]] = {
    "publish": _publish,
    "withdraw": _withdraw,
    "list": _list,
}

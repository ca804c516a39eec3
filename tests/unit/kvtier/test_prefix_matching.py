"""Matching requests against published prefixes (kvtier.prefixes): the longest one a request
begins with, the prefix alone included; nothing for ids no prefix can hold; the engines' watch
fetches the list at most every ``refresh_s`` and keeps the last one when the daemon is away."""

from __future__ import annotations

import hashlib
import struct

import pytest
from tests_helpers import ManualClock

from kvtier.prefixes import (
    MAX_PREFIX_TOKENS,
    PrefixMatcher,
    PrefixWatch,
    PublishedPrefix,
    SharedPrefixes,
    prefix_digest,
)
from kvtier_contract import errors

SYSTEM = list(range(100, 140))
TOOLS = SYSTEM + list(range(500, 520))


def published(name: str, tokens: list[int], group: str = "g") -> PublishedPrefix:
    return PublishedPrefix(group, name, len(tokens), prefix_digest(tokens))


def test_the_digest_is_sha256_of_the_ids_as_u32le() -> None:
    assert prefix_digest([1, 2**32 - 1]) == hashlib.sha256(struct.pack("<II", 1, 2**32 - 1)).digest()
    with pytest.raises(struct.error):
        prefix_digest([2**32])


def test_the_longest_published_prefix_wins() -> None:
    m = PrefixMatcher([published("system", SYSTEM), published("tools", TOOLS)])
    assert m.match(TOOLS + [7, 8]) == published("tools", TOOLS)
    assert m.match(SYSTEM + [7, 8]) == published("system", SYSTEM)
    assert m.match(TOOLS) == published("tools", TOOLS)  # the prefix alone: a publisher warms it
    assert m.match(SYSTEM[:-1]) is None  # shorter than any prefix
    assert m.match([99] + SYSTEM) is None
    assert m.match([]) is None


def test_ids_no_prefix_can_hold_match_nothing() -> None:
    m = PrefixMatcher([published("system", SYSTEM)])
    assert m.match([2**40] + SYSTEM[1:] + [1]) is None
    assert m.match([-1] * 50) is None


def test_prefixes_of_no_tokens_or_past_the_bound_are_left_out() -> None:
    odd = [
        PublishedPrefix("g", "empty", 0, b"\0" * 32),
        PublishedPrefix("g", "huge", MAX_PREFIX_TOKENS + 1, b""),
    ]
    assert len(PrefixMatcher(odd)) == 0


class Source:
    """A daemon's ListPrefixes as a PrefixWatch reads it: counted, away when told."""

    def __init__(self, prefixes: list[PublishedPrefix]) -> None:
        self.prefixes = prefixes
        self.connected = True
        self.groups = {"g"}  # those whose blocks the client moves
        self.calls = 0
        self.fail: errors.KvtierError | None = None

    def reaches_group(self, group: str) -> bool:
        return group in self.groups

    def published_prefixes(self) -> list[PublishedPrefix]:
        self.calls += 1
        if self.fail is not None:
            raise self.fail
        return list(self.prefixes)


def test_the_watch_fetches_at_most_every_refresh_and_keeps_the_last_list() -> None:
    clock, source = ManualClock(), Source([published("system", SYSTEM)])
    watch = PrefixWatch(source, 5.0, clock=clock)
    request = SYSTEM + [1, 2, 3]
    assert watch.match(request) is not None and source.calls == 1
    source.prefixes = [published("tools", TOOLS)]  # published meanwhile
    assert watch.match(request) is not None and source.calls == 1  # not due yet
    clock.advance(5.0)
    assert watch.match(request) is None and source.calls == 2  # "system" withdrawn
    assert watch.match(TOOLS + [1]) is not None
    clock.advance(5.0)
    source.fail = errors.Unavailable("daemon away")
    assert watch.match(TOOLS + [1]) is not None and source.calls == 3  # the last list kept
    clock.advance(5.0)
    source.connected = False  # a closed session is not asked
    assert watch.match(TOOLS + [1]) is not None and source.calls == 3


def test_a_prefix_published_in_two_groups_matches_the_one_this_tenant_stores_into() -> None:
    reads = PublishedPrefix("a-reads", "system", len(SYSTEM), prefix_digest(SYSTEM), publisher=False)
    stores = PublishedPrefix("b-stores", "system", len(SYSTEM), prefix_digest(SYSTEM), publisher=True)
    for order in ([reads, stores], [stores, reads]):
        assert PrefixMatcher(order).match(SYSTEM + [1]) == stores


def test_one_hash_pass_finds_the_longest_of_many_lengths() -> None:
    prefixes = [published(f"p{n}", TOOLS[:n]) for n in range(1, len(TOOLS) + 1, 3)]
    m = PrefixMatcher(prefixes)
    for n in range(1, len(TOOLS) + 1):
        want = max((p for p in prefixes if p.tokens <= n), key=lambda p: p.tokens)
        assert m.match(TOOLS[:n]) == want


def test_the_shared_prefix_rules_every_integration_takes() -> None:
    """kvtier.prefixes.SharedPrefixes: a prefix of at least one block, where the client moves
    its groups' blocks; a group the daemon refused set aside for one refresh period."""
    clock, source = ManualClock(), Source([published("system", SYSTEM)])
    rules = SharedPrefixes(source, 5.0, clock=clock)
    assert rules.match(SYSTEM + [1], tokens_per_block=16) == published("system", SYSTEM)
    assert rules.match(SYSTEM + [1], tokens_per_block=len(SYSTEM) + 1) is None  # under a block
    source.groups = set()  # shm, the group's arena not mapped
    assert rules.match(SYSTEM + [1], tokens_per_block=16) is None
    calls: list[str] = []

    def register() -> str:
        calls.append("register")
        if len(calls) == 1:
            raise errors.PermissionDenied("not a group of this credential's tenant", field="spec.group")
        return "handles"

    assert rules.open("scope", "g", register) is None and len(calls) == 1
    clock.advance(4.9)
    assert rules.open("scope", "g", register) is None and len(calls) == 1  # set aside, not asked
    assert rules.open("other", "h", register) == "handles"  # another scope is not
    clock.advance(0.2)
    assert rules.open("scope", "g", register) == "handles" and len(calls) == 3

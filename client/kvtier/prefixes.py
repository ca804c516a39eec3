"""Published prefixes: the shared prompts of a group of tenants, as the engines match them.

A publisher of a group (docs/security.md § Groups) publishes a prefix, a system prompt or a
tool schema its tenants' requests begin with, under a name: the daemon keeps its length and
digest (never its tokens) and tells every member. Until an engine names salt regions itself
(vLLM's ``salt_regions``), an engine integration whose request begins with a published prefix
of one of its groups keys those tokens in the group's scope and the rest in its own
(:func:`regions_of`; docs/hashing.md §7): the group's blocks are stored once, by a publisher,
and every member loads them; the private suffixes still chain from them and never match
another tenant's.

* :class:`PublishedPrefix`: one published prefix as the daemon lists it.
* :func:`prefix_digest`: SHA-256 over the token ids as u32le (what is published and matched).
* :class:`PrefixMatcher`: the longest published prefix a request begins with. Immutable; safe to
  share between threads (a refresh builds a new one).
* :class:`PrefixWatch`: an engine's matcher, fetched again from the daemon every ``refresh_s``.
* :class:`SharedPrefixes`: the rules every integration takes a published prefix by (the vLLM
  connector's plans, :mod:`kvtier.shared_scopes`), stated once.

Lifecycle: ``Client.published_prefixes()`` -> ``PrefixMatcher(prefixes)`` -> ``match(tokens)``
per request; rebuilt when the list is fetched again (``PrefixWatch``: the engines refresh it
every few seconds, so a prefix published or withdrawn reaches them within that).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvtier_contract import errors
from kvtier_contract.prefixes import MAX_PREFIX_TOKENS

__all__ = [
    "MAX_PREFIX_TOKENS",
    "PrefixMatcher",
    "PrefixWatch",
    "PublishedPrefix",
    "SharedPrefixes",
    "prefix_digest",
]

log = logging.getLogger("kvtier.prefixes")
T = TypeVar("T")


@dataclass(frozen=True)
class PublishedPrefix:
    """A prefix published for ``group`` under ``name``: its first ``tokens`` token ids hash to
    ``digest`` (:func:`prefix_digest`). ``publisher``: the caller's tenant stores into the
    group's namespaces (a member only loads from them)."""

    group: str
    name: str
    tokens: int
    digest: bytes
    publisher: bool = False


def prefix_digest(token_ids: Sequence[int]) -> bytes:
    """SHA-256 of ``token_ids`` packed as little-endian u32 (ids outside 0..2**32-1 raise
    ``struct.error``)."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


class PrefixMatcher:
    """Which published prefix a request's token ids begin with (see the module docstring)."""

    def __init__(self, prefixes: Iterable[PublishedPrefix] = ()) -> None:
        by_length: dict[int, dict[bytes, PublishedPrefix]] = {}
        for p in prefixes:
            if 0 < p.tokens <= MAX_PREFIX_TOKENS:
                same = by_length.setdefault(p.tokens, {})
                if p.digest not in same or (p.publisher and not same[p.digest].publisher):
                    same[p.digest] = p  # (published in two groups: one this tenant stores into)
        self._by_length = sorted(by_length.items())  # shortest first: one hash pass over them
        self.prefixes = tuple(p for _, d in self._by_length for p in d.values())

    def __len__(self) -> int:
        return len(self.prefixes)

    def match(self, token_ids: Sequence[int]) -> PublishedPrefix | None:
        """The longest published prefix that ``token_ids`` begin with (a request that is the
        prefix alone, a publisher warming it, matches too), or None. One SHA-256 pass over the
        leading tokens, up to the longest published length that fits."""
        h, done, found = hashlib.sha256(), 0, None
        for length, digests in self._by_length:
            if length > len(token_ids):
                break
            try:
                h.update(struct.pack(f"<{length - done}I", *token_ids[done:length]))
            except struct.error:
                return found  # not token ids a prefix can be published for
            done = length
            found = digests.get(h.copy().digest(), found)
        return found


class PrefixSource(Protocol):
    """What a :class:`PrefixWatch` reads of its :class:`kvtier.Client` (which is one)."""

    @property
    def connected(self) -> bool: ...

    def reaches_group(self, group: str) -> bool: ...

    def published_prefixes(self) -> list[PublishedPrefix]: ...


class PrefixWatch:
    """The published prefixes of the groups a client's tenant belongs to, as one engine thread
    matches its requests against them: fetched from the daemon on that thread when ``match``
    finds the last fetch ``refresh_s`` old and the session open (a daemon away keeps the last
    list: its lookups miss anyway; a daemon older than ``ListPrefixes`` lists none). Owns its
    matcher and the time of the next fetch; single-threaded (the caller's thread, e.g. the
    vLLM connector's lookup thread)."""

    def __init__(
        self, source: PrefixSource, refresh_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self.clock = clock
        self.matcher = PrefixMatcher()
        self._next = 0.0

    def match(self, token_ids: Sequence[int]) -> PublishedPrefix | None:
        """``PrefixMatcher.match`` on the current list (fetched first when due)."""
        now = self.clock()
        if now >= self._next and self.source.connected:
            self._next = now + self.refresh_s
            self._fetch()
        return self.matcher.match(token_ids) if self.matcher.prefixes else None

    def _fetch(self) -> None:
        try:
            self.matcher = PrefixMatcher(self.source.published_prefixes())
        except errors.KvtierError as e:  # away, refused or older: keep the last list
            log.debug("kvtier: published prefixes not fetched: %s", e)


class SharedPrefixes:
    """When an integration keys a request's leading tokens in a group's scope, stated once for
    all of them: the longest published prefix of one of the client's groups the request begins
    with (its :class:`PrefixWatch`), unless the client cannot move that group's blocks
    (``Client.reaches_group``: an shm client that does not map the group's arena) or the prefix
    is shorter than one block (it would share no block and change every key); and a group whose
    namespace the daemon refused (a tenant taken out of the group, a quota) is set aside for
    one refresh period, meanwhile the requests are keyed in their own scope.

    Lifecycle: ``SharedPrefixes(client, refresh_s)`` -> ``match(token_ids, tokens_per_block)``
    per request, ``open(scope, group, register)`` for the group's namespaces. Owns its watch
    and the set-aside scopes; single-threaded (the thread that hashes requests)."""

    def __init__(
        self, source: PrefixSource, refresh_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self.clock = clock
        self._watch: PrefixWatch | None = None  # (made at the first match: no call before)
        self._refused: dict[Hashable, float] = {}  # a scope the daemon refused -> until when

    def match(self, token_ids: Sequence[int], tokens_per_block: int) -> PublishedPrefix | None:
        """The published prefix the request is keyed in a group's scope up to, or None."""
        if self._watch is None:
            self._watch = PrefixWatch(self.source, self.refresh_s, clock=self.clock)
        found = self._watch.match(token_ids)
        if found is None or found.tokens < tokens_per_block or not self.source.reaches_group(found.group):
            return None
        return found

    def open(self, scope: Hashable, group: str, register: Callable[[], T]) -> T | None:
        """``register()`` (the group's namespaces, ``scope`` naming them), or None while the
        daemon's refusal of ``scope`` sets it aside; a refusal now (a KvtierError) sets it aside
        for ``refresh_s``."""
        if self._refused.get(scope, 0.0) > self.clock():
            return None
        try:
            return register()
        except errors.KvtierError as e:
            self.refuse(scope, group, e)
            return None

    def refuse(self, scope: Hashable, group: str, error: errors.KvtierError) -> None:
        """The daemon refused ``scope`` (``group``'s namespaces) in a call after ``open``
        (a lookup): set aside for ``refresh_s``, logged."""
        log.warning("kvtier: group %s not used for %.0f s: %s", group, self.refresh_s, error)
        self._refused[scope] = self.clock() + self.refresh_s

"""Published prefixes: what each group's publishers published, by name (docs/security.md
§ Groups, "Published prefixes").

A publisher of a group publishes a prefix, a system prompt its tenants' requests begin with,
under a name: the daemon keeps its length in tokens and its digest (SHA-256 of the token ids as
u32le), never its tokens, and lists it to every member, whose engines then key the requests
that begin with it in the group's scope.

Primitives of :class:`PublishedPrefixes`:

* ``listed(caller)``: the prefixes of every group the caller reads (``Tenancy.may_see``: all of
  them for the operator and on a single-tenant daemon), by (group, name), each saying whether
  the caller publishes into its group (``Tenancy.may_store``); a group the tenants file no
  longer has is never listed;
* ``publish(caller, group, name, tokens, digest)`` / ``withdraw(caller, group, name)`` (async):
  whether a prefix of that name was there (replaced, withdrawn). Every check first, then the
  file written, then the change: a check that fails, or a write that fails (UNAVAILABLE),
  changes nothing. Republishing a name with the same length and digest writes nothing;
* ``prune()`` (a task, after a reload): forget the groups the tenants file no longer has;
* each caller's changes that write the file (each an fsync'd replace of it, twice fsync'd) are
  bounded: ``WRITES_PER_S`` a second sustained, bursts of ``WRITE_BURST`` (a token bucket per
  tenant; RESOURCE_EXHAUSTED naming ``group`` beyond, nothing changed), so a publisher cannot
  keep the NVMe directory and the executor busy with fsyncs. Changes that write nothing (a
  republish of the same prefix, a memory-only registry) are not counted;
* ``counts()``: prefixes per group (/metrics).

Groups: with a tenants file, its ``[[group]]`` tables, published into by their publishers and
the operator; anyone else, for any name, gets the same PERMISSION_DENIED (field ``group``: which
groups exist is not told). Without one (a single-tenant daemon), any name a ``[[group]]`` could
have (``kvtierd.tenants_file.NAME_RULE``), at most ``MAX_PREFIX_GROUPS`` groups. Names follow the
same rule; at most ``MAX_PREFIXES_PER_GROUP`` a group; ``tokens`` in 1..``MAX_PREFIX_TOKENS``;
a digest of ``PREFIX_DIGEST_BYTES`` (:mod:`kvtier_contract.prefixes`).

Persistence: with an NVMe tier, in ``published-prefixes.json`` of its directory
(:class:`~kvtierd.tenancy.prefix_file.PrefixFile`), read at start (a file that cannot be read is
logged once and the daemon starts with none); without one, in memory only (a restart forgets
them: the publishers publish again).

Ownership: the daemon owns one (beside the Tenancy, whose groups it reads); the service's
:class:`~kvtierd.service.prefixes.PrefixHandlers` call it. Event-loop thread only: changes are
serialized by an asyncio.Lock held across the file's write (on the loop's default executor),
and each runs to its end even when its caller is cancelled, so the file and the registry agree;
``listed`` and ``counts`` read the current mapping, which a change replaces whole.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier_contract.errors import InvalidArgument, KvtierError, PermissionDenied, ResourceExhausted
from kvtier_contract.prefixes import (
    MAX_PREFIX_GROUPS,
    MAX_PREFIX_TOKENS,
    MAX_PREFIXES_PER_GROUP,
    PREFIX_DIGEST_BYTES,
)
from kvtierd.tenancy.prefix_file import MAX_FILE_BYTES, Groups, Prefix, PrefixFile, encode
from kvtierd.tenancy.tenancy import Tenancy
from kvtierd.tenants import Tenant
from kvtierd.tenants_file import NAME_RULE, is_name
from kvtierd.tiers.nvme.device import DiskError

__all__ = ["NOT_A_PUBLISHER", "Listed", "PublishedPrefixes"]

log = logging.getLogger("kvtierd.prefixes")

NOT_A_PUBLISHER = "no group of this daemon that this credential publishes into (a [[group]]'s publishers)"
"""The one refusal for a group that is not there and a group the caller does not publish."""

WRITES_PER_S = 8.0
"""A caller's changes that write the prefix file, a second, sustained (module docstring)."""
WRITE_BURST = 64
"""... at once, after a quiet while (a publisher publishing its names at start)."""

Plan = Callable[[Groups], tuple[Groups | None, bool]]
"""A change: the registry after it (None: nothing to change) and whether the name existed."""


@dataclass(frozen=True)
class Listed:
    """One prefix as a caller is told of it (``publisher``: it publishes into the group)."""

    group: str
    name: str
    tokens: int
    digest: bytes
    publisher: bool


class PublishedPrefixes:
    """See the module docstring."""

    def __init__(
        self, tenancy: Tenancy, file: PrefixFile | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tenancy = tenancy
        self.file = file  # None: memory only (no durable directory)
        self.clock = clock
        self._budget: dict[str, tuple[float, float]] = {}  # caller -> (writes left, at); a
        # tenant's name ("" on a single-tenant daemon): as many keys as the tenants file has
        self._groups: Groups = {}
        self._lock = asyncio.Lock()
        self._pruning: asyncio.Task[bool] | None = None
        if file is not None:
            self._load(file)

    def _load(self, file: PrefixFile) -> None:
        """The file's prefixes of the groups there are (start); a file that cannot be read is
        logged and none are kept (the next change replaces it)."""
        try:
            found = file.load() or {}
        except (ValueError, DiskError) as e:
            log.error("published prefixes not read from %s (the daemon starts with none): %s", file.path, e)
            return
        kept = {g: names for g, names in found.items() if self._exists(g)}
        self._groups = kept
        if len(kept) != len(found):  # groups the tenants file no longer has: not kept
            try:
                file.save(kept)
            except KvtierError as e:
                log.error("%s", e)
        if kept:
            log.info("published prefixes: %d of %d groups read from %s", len(kept), len(found), file.path)

    # -- reading ----------------------------------------------------------------------------------

    def listed(self, caller: Tenant | None) -> list[Listed]:
        """The prefixes ``caller`` is told of, by (group, name) (see the module docstring)."""
        viewer = None if caller is None else caller.name
        out: list[Listed] = []
        for group in sorted(self._groups):
            if not self._exists(group) or not self.tenancy.may_see(viewer, group):
                continue
            publisher = self.tenancy.may_store(viewer, group)
            names = self._groups[group]
            out += [Listed(group, n, names[n].tokens, names[n].digest, publisher) for n in sorted(names)]
        return out

    def counts(self) -> dict[str, int]:
        """Prefixes per group (the groups there are)."""
        return {g: len(names) for g, names in self._groups.items() if self._exists(g)}

    def _exists(self, group: str) -> bool:
        """Whether ``group`` may hold prefixes: a ``[[group]]`` of the tenants file (any name
        on a single-tenant daemon)."""
        tenants = self.tenancy.tenants
        if tenants is None:
            return True
        found = tenants.by_name.get(group)
        return found is not None and found.group

    # -- changes ----------------------------------------------------------------------------------

    async def publish(self, caller: Tenant | None, group: str, name: str, tokens: int, digest: bytes) -> bool:
        """Publish (or replace) ``name`` in ``group``; whether it existed."""
        _check_names(group, name)
        if not 0 < tokens <= MAX_PREFIX_TOKENS:
            raise InvalidArgument(f"expected 1..{MAX_PREFIX_TOKENS} token ids, got {tokens}", field="tokens")
        if len(digest) != PREFIX_DIGEST_BYTES:
            raise InvalidArgument(
                f"expected {PREFIX_DIGEST_BYTES} bytes (SHA-256 of the token ids as u32le), "
                f"got {len(digest)}",
                field="digest",
            )
        prefix = Prefix(tokens, digest)

        def plan(groups: Groups) -> tuple[Groups | None, bool]:
            self._check_publisher(caller, group)
            names = groups.get(group, {})
            if name in names:
                return (None if names[name] == prefix else _with(groups, group, name, prefix)), True
            if len(names) >= MAX_PREFIXES_PER_GROUP:
                raise ResourceExhausted(
                    f"group {group!r} has {MAX_PREFIXES_PER_GROUP} prefixes, the most it may "
                    "(withdraw one, or republish one of its names)",
                    field="name",
                )
            if not names and self.tenancy.tenants is None and len(groups) >= MAX_PREFIX_GROUPS:
                raise ResourceExhausted(
                    f"{MAX_PREFIX_GROUPS} groups have published prefixes, the most a daemon "
                    "without a tenants file keeps (withdraw a group's prefixes first)",
                    field="group",
                )
            return _with(groups, group, name, prefix), False

        return await self._change(plan, caller)

    async def withdraw(self, caller: Tenant | None, group: str, name: str) -> bool:
        """Withdraw ``name`` from ``group`` (idempotent); whether it existed."""
        _check_names(group, name)

        def plan(groups: Groups) -> tuple[Groups | None, bool]:
            self._check_publisher(caller, group)
            if name not in groups.get(group, {}):
                return None, False
            return _with(groups, group, name, None), True

        return await self._change(plan, caller)

    def prune(self) -> asyncio.Task[bool]:
        """Forget, soon, the groups the tenants file no longer has (a reload; event loop):
        the change runs as a task of its own, returned (a write the disk refuses is logged)."""

        def plan(groups: Groups) -> tuple[Groups | None, bool]:
            kept = {g: names for g, names in groups.items() if self._exists(g)}
            return (None if len(kept) == len(groups) else kept), False

        async def run() -> bool:
            try:
                return await self._change(plan, bounded=False)
            except KvtierError as e:
                log.error("groups removed from the tenants file: their prefixes stay on disk: %s", e)
                return False

        self._pruning = asyncio.get_running_loop().create_task(run())  # (held: not collected)
        return self._pruning

    def _check_publisher(self, caller: Tenant | None, group: str) -> None:
        """PermissionDenied (field ``group``) unless ``caller`` publishes into ``group``, a
        group that may hold prefixes: the same words whether or not the group is there."""
        viewer = None if caller is None else caller.name
        if self.tenancy.tenants is not None and (caller is None or not self._exists(group)):
            raise PermissionDenied(NOT_A_PUBLISHER, field="group")
        if not self.tenancy.may_store(viewer, group):
            raise PermissionDenied(NOT_A_PUBLISHER, field="group")

    async def _change(self, plan: Plan, caller: Tenant | None = None, *, bounded: bool = True) -> bool:
        """Apply ``plan`` under the lock, the file written before the registry changes; it
        runs to its end even when the caller is cancelled. ``bounded``: a write counts against
        ``caller``'s budget (not a reload's pruning)."""
        who = (caller.name if caller is not None else "") if bounded else None
        task = asyncio.get_running_loop().create_task(self._apply(plan, who))
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    async def _apply(self, plan: Plan, who: str | None) -> bool:
        async with self._lock:
            after, existed = plan(self._groups)  # every check: raises, nothing changed
            if after is not None:
                if self.file is not None and len(encode(after)) > MAX_FILE_BYTES:
                    raise ResourceExhausted(  # (a start reads no more: it would keep none)
                        f"the published prefixes would not fit their file ({MAX_FILE_BYTES} "
                        "bytes): withdraw some first",
                        field="name",
                    )
                if self.file is not None:
                    if who is not None:
                        self._spend(who)
                    await asyncio.get_running_loop().run_in_executor(None, self.file.save, after)
                self._groups = after
            return existed

    def _spend(self, who: str) -> None:
        """One of ``who``'s file writes, or RESOURCE_EXHAUSTED (field ``group``) when its
        bucket is empty (nothing spent)."""
        now = self.clock()
        left, at = self._budget.get(who, (float(WRITE_BURST), now))
        left = min(float(WRITE_BURST), left + (now - at) * WRITES_PER_S)
        if left < 1.0:
            wait_ms = math.ceil((1.0 - left) / WRITES_PER_S * 1000)
            raise ResourceExhausted(
                f"published prefixes changed too often: at most {WRITES_PER_S:g} changes a second "
                f"per tenant, bursts of {WRITE_BURST} (each is written to disk); retry in {wait_ms} ms",
                field="group",
            )
        self._budget[who] = (left - 1.0, now)


def _check_names(group: str, name: str) -> None:
    for field, value in (("group", group), ("name", name)):
        if not is_name(value):
            raise InvalidArgument(f"expected {NAME_RULE}, got {len(value)} characters", field=field)


def _with(groups: Groups, group: str, name: str, prefix: Prefix | None) -> Groups:
    """``groups`` with ``name`` of ``group`` set to ``prefix`` (None: removed; a group left
    with none is dropped)."""
    names = {n: p for n, p in groups.get(group, {}).items() if n != name}
    if prefix is not None:
        names[name] = prefix
    out = {g: v for g, v in groups.items() if g != group}
    if names:
        out[group] = names
    return out


def _retrieved(task: asyncio.Task[bool]) -> None:
    """Mark a change's outcome seen (its caller may have gone: a cancelled RPC)."""
    if not task.cancelled():
        task.exception()

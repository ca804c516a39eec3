"""kvtierd.tenancy.prefixes: who publishes into a group and who is told, the bounds, every
check before any change (the file written before the registry changes), a reload's groups,
and a file read back at start. Tenants: ``pub`` publishes into ``g``, ``mem`` reads it,
``out`` is in no group, ``ops`` is the operator."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvtier_contract.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from kvtierd.tenancy import Tenancy
from kvtierd.tenancy.prefix_file import MAX_FILE_BYTES, Groups, Prefix, PrefixFile, encode
from kvtierd.tenancy.prefixes import NOT_A_PUBLISHER, WRITE_BURST, WRITES_PER_S, Listed, PublishedPrefixes
from kvtierd.tenants import Tenant, Tenants

T = TypeVar("T")
D = bytes(range(32))  # a digest


def people(group: bool = True) -> Tenants:
    who = [Tenant(n, token_sha256=(bytes([i]) * 32,)) for i, n in enumerate(("pub", "mem", "out"))]
    who.append(Tenant("ops", token_sha256=(b"o" * 32,), operator=True))
    if group:
        who.append(Tenant("g", group=True, members=frozenset({"pub", "mem"}), publishers=frozenset({"pub"})))
    return Tenants(who)


class Recorded(PrefixFile):
    """A prefix file that keeps what it was asked to write (``fail``: the disk refuses)."""

    def __init__(self) -> None:
        super().__init__("/nowhere")
        self.saved: list[Groups] = []
        self.fail = False

    def save(self, groups: Groups) -> None:
        if self.fail:
            raise Unavailable("the disk refused")
        self.saved.append(groups)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def registry(tenants: Tenants | None = None, file: PrefixFile | None = None) -> PublishedPrefixes:
    return PublishedPrefixes(Tenancy(tenants if tenants is not None else people()), file)


def caller(reg: PublishedPrefixes, name: str) -> Tenant:
    found = reg.tenancy.tenant(name)
    assert found is not None
    return found


def test_a_publisher_publishes_and_each_caller_is_told_what_it_reads() -> None:
    reg = registry()
    assert run(reg.publish(caller(reg, "pub"), "g", "system", 300, D)) is False  # (new)
    assert reg.listed(caller(reg, "pub")) == [Listed("g", "system", 300, D, publisher=True)]
    assert reg.listed(caller(reg, "mem")) == [Listed("g", "system", 300, D, publisher=False)]
    assert reg.listed(caller(reg, "ops")) == [Listed("g", "system", 300, D, publisher=True)]
    assert reg.listed(caller(reg, "out")) == []
    assert reg.counts() == {"g": 1}


@pytest.mark.parametrize(("who", "group"), [("mem", "g"), ("out", "g"), ("pub", "nope"), ("pub", "mem")])
def test_anyone_but_a_publisher_is_refused_in_the_same_words(who: str, group: str) -> None:
    file = Recorded()
    reg = registry(file=file)
    for change in (
        reg.publish(caller(reg, who), group, "system", 300, D),
        reg.withdraw(caller(reg, who), group, "system"),
    ):
        with pytest.raises(PermissionDenied) as e:
            run(change)
        assert e.value.field == "group" and str(e.value) == f"group: {NOT_A_PUBLISHER}"
    assert file.saved == [] and reg.counts() == {}


@pytest.mark.parametrize(
    ("group", "name", "tokens", "digest", "field"),
    [
        ("g", "", 1, D, "name"),
        ("g", "n" * 129, 1, D, "name"),
        ("", "system", 1, D, "group"),
        ("g", "system", 0, D, "tokens"),
        ("g", "system", (1 << 20) + 1, D, "tokens"),
        ("g", "system", 1, D[:31], "digest"),
    ],
)
def test_bad_input_names_its_field_and_writes_nothing(
    group: str, name: str, tokens: int, digest: bytes, field: str
) -> None:
    file = Recorded()
    reg = registry(file=file)
    run(reg.publish(caller(reg, "pub"), "g", "kept", 5, D))
    with pytest.raises(InvalidArgument) as e:
        run(reg.publish(caller(reg, "out"), group, name, tokens, digest))  # (checked before who asks)
    assert e.value.field == field
    assert len(file.saved) == 1 and reg.counts() == {"g": 1}


def test_sixteen_names_a_group_and_republishing_replaces() -> None:
    file = Recorded()
    reg = registry(file=file)
    pub = caller(reg, "pub")
    for i in range(16):
        run(reg.publish(pub, "g", f"p{i:02d}", i + 1, D))
    with pytest.raises(ResourceExhausted) as e:
        run(reg.publish(pub, "g", "p16", 1, D))
    assert e.value.field == "name" and len(file.saved) == 16
    assert run(reg.publish(pub, "g", "p00", 1, D)) is True  # the same again: nothing written
    assert len(file.saved) == 16
    assert run(reg.publish(pub, "g", "p00", 7, D)) is True  # replaced
    assert reg.listed(pub)[0] == Listed("g", "p00", 7, D, True) and len(file.saved) == 17


def test_withdraw_is_idempotent() -> None:
    reg = registry()
    pub = caller(reg, "pub")
    run(reg.publish(pub, "g", "system", 3, D))
    assert run(reg.withdraw(pub, "g", "system")) is True
    assert run(reg.withdraw(pub, "g", "system")) is False
    assert reg.listed(pub) == [] and reg.counts() == {}


def test_without_a_tenants_file_any_group_up_to_sixteen() -> None:
    reg = PublishedPrefixes(Tenancy(None))
    for i in range(16):
        run(reg.publish(None, f"group-{i:02d}", "system", 1, D))
    with pytest.raises(ResourceExhausted) as e:
        run(reg.publish(None, "group-16", "system", 1, D))
    assert e.value.field == "group"
    run(reg.publish(None, "group-00", "tools", 1, D))  # a group that has prefixes takes more
    assert len(reg.listed(None)) == 17 and all(p.publisher for p in reg.listed(None))


def test_a_write_the_disk_refuses_changes_nothing() -> None:
    file = Recorded()
    reg = registry(file=file)
    pub = caller(reg, "pub")
    run(reg.publish(pub, "g", "system", 3, D))
    file.fail = True
    with pytest.raises(Unavailable):
        run(reg.publish(pub, "g", "system", 9, D))
    with pytest.raises(Unavailable):
        run(reg.withdraw(pub, "g", "system"))
    assert reg.listed(pub) == [Listed("g", "system", 3, D, True)]


def test_a_cancelled_caller_still_sees_its_change_through() -> None:
    """The write runs on an executor thread; the RPC is cancelled while it runs: the registry
    still takes the change once the file has it (file and registry agree)."""
    writing, release = threading.Event(), threading.Event()

    class Slow(Recorded):
        def save(self, groups: Groups) -> None:
            writing.set()
            release.wait(10)
            super().save(groups)

    file = Slow()
    reg = registry(file=file)

    async def scenario() -> None:
        call = asyncio.ensure_future(reg.publish(caller(reg, "pub"), "g", "system", 3, D))
        await asyncio.get_running_loop().run_in_executor(None, writing.wait, 10)
        call.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await reg.withdraw(caller(reg, "pub"), "g", "other")  # (queued behind the change: after it)

    run(scenario())
    assert [dict(g) for g in file.saved] == [{"g": {"system": Prefix(3, D)}}]
    assert reg.counts() == {"g": 1}


def test_a_reload_without_the_group_drops_its_prefixes() -> None:
    file = Recorded()
    reg = registry(file=file)
    pub = caller(reg, "pub")

    async def scenario() -> None:
        await reg.publish(pub, "g", "system", 3, D)
        reg.tenancy.reload(people(group=False))
        assert reg.listed(caller(reg, "ops")) == [] and reg.counts() == {}  # at once
        assert await reg.prune() is False

    run(scenario())
    assert file.saved[-1] == {}
    reg.tenancy.reload(people())  # the group again: its prefixes are gone
    assert reg.listed(pub) == []


def test_the_file_is_read_at_start_less_the_groups_that_are_gone(tmp_path: Path) -> None:
    file = PrefixFile(str(tmp_path))
    (tmp_path / "published-prefixes.json").write_bytes(
        encode({"g": {"system": Prefix(3, D)}, "gone": {"x": Prefix(1, D)}})
    )
    reg = registry(file=file)
    assert reg.listed(caller(reg, "mem")) == [Listed("g", "system", 3, D, False)]
    assert file.load() == {"g": {"system": Prefix(3, D)}}  # written again without "gone"


def test_a_file_that_cannot_be_read_starts_empty_and_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "published-prefixes.json").write_text("{not json")
    file = PrefixFile(str(tmp_path))
    reg = registry(file=file)
    assert reg.counts() == {}
    run(reg.publish(caller(reg, "pub"), "g", "system", 3, D))
    assert file.load() == {"g": {"system": Prefix(3, D)}}
    assert registry(file=PrefixFile(str(tmp_path / "missing"))).counts() == {}  # no directory yet


def test_a_publish_that_would_outgrow_the_file_a_start_reads_is_refused(tmp_path: Path) -> None:
    """The file is read back at start up to MAX_FILE_BYTES (more: none kept), so a publish
    past it is refused and changes nothing (a file of many groups' long names, nearly full)."""
    groups = [f"g{i:03d}" for i in range(400)]
    many = [Tenant(g, group=True, members=frozenset({"pub"}), publishers=frozenset({"pub"})) for g in groups]
    names = {f"{n:02d}" + "n" * 126: Prefix(3, D) for n in range(16)}
    step = len(encode({g: names for g in groups[:2]})) - len(encode({groups[0]: names}))
    near: Groups = {g: names for g in groups[: (MAX_FILE_BYTES - len(encode({}))) // step]}
    assert len(encode(near)) <= MAX_FILE_BYTES < len(encode(near)) + step  # less than a group left
    (tmp_path / "published-prefixes.json").write_bytes(encode(near))
    file = PrefixFile(str(tmp_path))
    reg = registry(Tenants([*people().by_name.values(), *many]), file)
    assert reg.counts() == {g: 16 for g in near}
    full = next(g for g in groups if g not in near)
    with pytest.raises(ResourceExhausted) as refused:
        for n in range(16):
            run(reg.publish(caller(reg, "pub"), full, f"{n:02d}" + "n" * 126, 3, D))
    assert refused.value.field == "name"
    saved = file.load()
    assert saved is not None and reg.counts() == {g: len(n) for g, n in saved.items()}  # agree
    assert len(encode(saved)) <= MAX_FILE_BYTES and reg.counts().get(full, 0) < 16


def test_a_callers_writes_of_the_file_are_bounded_and_a_refusal_changes_nothing() -> None:
    """A token bucket a tenant: WRITE_BURST at once, then WRITES_PER_S a second; a change that
    writes nothing (the same prefix again) costs nothing; another tenant has its own."""
    now = [0.0]
    file = Recorded()
    reg = PublishedPrefixes(Tenancy(people()), file, clock=lambda: now[0])
    pub, ops = caller(reg, "pub"), caller(reg, "ops")
    for i in range(WRITE_BURST):  # publish and withdraw one name: a write each
        if i % 2:
            run(reg.withdraw(pub, "g", "system"))
        else:
            run(reg.publish(pub, "g", "system", 10, D))
    assert len(file.saved) == WRITE_BURST
    with pytest.raises(ResourceExhausted, match="retry in 125 ms") as e:
        run(reg.publish(pub, "g", "system", 10, D))
    assert e.value.field == "group"
    assert len(file.saved) == WRITE_BURST and reg.listed(pub) == []  # nothing changed
    run(reg.publish(ops, "g", "tools", 5, D))  # the operator's bucket is its own
    run(reg.publish(ops, "g", "tools", 5, D))  # the same again: no write, nothing spent
    now[0] += 1 / WRITES_PER_S
    assert run(reg.publish(pub, "g", "system", 10, D)) is False
    assert [p.name for p in reg.listed(pub)] == ["system", "tools"]

"""The shm transport's arenas (issue 43): a KVS3 reply's arenas checked against their fds, mapped
one after another in one range (the session's own read-write, its groups' read-only), offsets
counted across them; nothing written past the session's own arena. No daemon: memfds made here,
one sealed as the daemon seals a group's arena."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator

import pytest

from kvtier.transports import shm, shm_arenas
from kvtier_contract import wire
from kvtier_contract.errors import TransportError

PAGE = mmap.PAGESIZE
OWN, GROUP = 16 * PAGE, 8 * PAGE


def memfd(size: int, fill: bytes, *, sealed: bool = False) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, fill * size, 0)
    if sealed:  # as kvtierd.tiers.host.Arena(read_only=True), once the daemon mapped it
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x0010 | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def reply(*arenas: tuple[int, int], names: tuple[bytes, ...] | None = None) -> bytes:
    head = wire.SHM_REPLY_V3.pack(wire.SHM_MAGIC_V3, sum(n for n, _f in arenas), 7, len(arenas))
    body = b"".join(wire.SHM_ARENA.pack(n, f) for n, f in arenas)
    names = (b"g",) * (len(arenas) - 1) if names is None else names
    return head + body + b"".join(wire.SHM_GROUP_NAME.pack(len(n)) + n for n in names)


@pytest.fixture
def fds() -> Iterator[list[int]]:
    made = [memfd(OWN, b"o"), memfd(GROUP, b"g", sealed=True)]
    yield made
    for fd in made:
        os.close(fd)


def test_a_reply_whose_arenas_match_their_fds_is_taken(fds: list[int]) -> None:
    assert shm_arenas.arenas_of(reply((OWN, 1), (GROUP, 0)), fds) == [(OWN, True, ""), (GROUP, False, "g")]
    assert shm_arenas.arenas_of(wire.SHM_REPLY.pack(wire.SHM_MAGIC, OWN, 7), fds[:1]) == [(OWN, True, "")]


@pytest.mark.parametrize(
    "bad",
    [
        reply((OWN, 1)),  # one arena for two fds
        reply((OWN, 0), (GROUP, 0)),  # the first not writable
        reply((OWN, 1), (GROUP, 1)),  # a group's writable
        reply((OWN, 1), (GROUP + PAGE, 0)),  # a size that is not its fd's
        reply((OWN, 1), (GROUP, 0))[:-1],  # cut short
        reply((OWN, 1), (GROUP, 0)) + b"x",  # more than it says
        reply((OWN, 1), (GROUP, 0), names=(b"",)),  # a group's arena without its name
        reply((OWN, 1), (GROUP, 0), names=(b"\xff",)),  # not utf-8
        reply((OWN, 1), (0, 0)),  # an empty arena
        wire.SHM_REPLY_V3.pack(wire.SHM_MAGIC_V3, 0, 7, 0),  # no arena
        b"KVS9" + reply((OWN, 1), (GROUP, 0))[4:],
    ],
    ids=[
        "count",
        "first-read-only",
        "group-writable",
        "size",
        "short",
        "long",
        "nameless",
        "utf8",
        "empty",
        "none",
        "magic",
    ],
)
def test_a_reply_that_does_not_match_is_refused(fds: list[int], bad: bytes) -> None:
    with pytest.raises(TransportError, match="bad reply"):
        shm_arenas.arenas_of(bad, fds)


def test_arenas_map_one_after_another_and_only_the_own_one_is_written(fds: list[int]) -> None:
    t = shm.ShmTransport()
    arenas = shm_arenas.arenas_of(reply((OWN, 1), (GROUP, 0)), fds)
    t._mm = shm_arenas.map_arenas(arenas, fds)
    t._view = memoryview(t._mm)
    t._base, t.arena_bytes, t.writable_bytes = shm._address(t._view), len(t._mm), OWN
    try:
        assert t.arena_bytes == OWN + GROUP
        assert bytes(t._view[OWN - 2 : OWN + 2]) == b"oogg"  # the group's arena right after
        slot = bytearray(PAGE)
        t.read(1, [(0, OWN + PAGE, memoryview(slot))])  # a load from the group's part
        assert slot == b"g" * PAGE
        t.write(1, [(0, PAGE, memoryview(b"x" * PAGE))])
        assert os.pread(fds[0], 1, PAGE) == b"x"  # the mapping is the memfd's
        with pytest.raises(TransportError, match="past the session's own arena"):
            t.write(1, [(0, OWN, memoryview(b"y" * PAGE))])  # never a fault
        assert bytes(t._view[OWN : OWN + 1]) == b"g"
    finally:
        t.close()

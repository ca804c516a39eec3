"""SessionTable: leases on an injected clock (no sleeps), close, limits, release callback.

Leases default to 1 s within [0.5 s, 4 s]; ``clock.now`` is advanced by hand.
"""

from __future__ import annotations

import pytest

from kvtier_contract.errors import NotFound, ResourceExhausted
from kvtierd.sessions import Session, SessionTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Released(list[tuple[int, bool]]):
    """The release callback: records (session id, whether it held jobs)."""

    def __call__(self, s: Session) -> None:
        self.append((s.id, bool(s.store_jobs or s.load_jobs)))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def released() -> Released:
    return Released()


@pytest.fixture
def table(clock: FakeClock, released: Released) -> SessionTable:
    return SessionTable(
        max_sessions=3, default_ttl_s=1.0, min_ttl_s=0.5, max_ttl_s=4.0, on_release=released, clock=clock
    )


def test_open_clamps_the_lease_to_the_daemon_range(table: SessionTable, clock: FakeClock) -> None:
    assert table.open("a", None).ttl_s == 1.0  # default
    assert table.open("b", 0).ttl_s == 1.0  # 0 = default
    c = table.open("c", 0.01)
    assert c.ttl_s == 0.5 and c.deadline == clock.now + 0.5
    table.close(c.id)
    assert table.open("d", 1000.0).ttl_s == 4.0


def test_sessions_have_distinct_nonzero_ids_and_bounded_names(table: SessionTable) -> None:
    a, b = table.open("x" * 1000, None), table.open("", None, transport=2)
    assert a.id != b.id and 0 not in (a.id, b.id) and a.id < 2**63
    assert len(a.client_name) == 128
    assert b.transport == 2
    assert table.get(a.id) is a and len(table) == 2


def test_a_lease_expires_without_renewal(table: SessionTable, clock: FakeClock, released: Released) -> None:
    s = table.open("a", 1.0)
    clock.advance(1.0)
    assert table.get(s.id) is s  # exactly at the deadline: still alive, and renewed
    clock.advance(1.01)
    with pytest.raises(NotFound) as exc:
        table.get(s.id)
    assert exc.value.field == "session_id"
    assert released == [(s.id, False)]
    assert table.expired_total == 1 and len(table) == 0
    with pytest.raises(NotFound):  # stays gone; released only once
        table.get(s.id)
    assert released == [(s.id, False)] and table.expired_total == 1


def test_every_get_renews_the_lease(table: SessionTable, clock: FakeClock, released: Released) -> None:
    s = table.open("a", 1.0)
    for _ in range(5):
        clock.advance(0.9)
        assert table.get(s.id) is s
    # 4.5 s after open, alive because it was used every 0.9 s
    assert s.deadline == pytest.approx(clock.now + 1.0)
    assert table.sweep() == 0 and released == []


def test_sweep_expires_only_the_sessions_past_their_deadline(
    table: SessionTable, clock: FakeClock, released: Released
) -> None:
    short, long = table.open("short", 0.5), table.open("long", 4.0)
    short.store_jobs.add(7)
    clock.advance(0.6)
    assert table.sweep() == 1
    # short went with its job (the cache's callback frees it); long stays
    assert released == [(short.id, True)]
    assert table.get(long.id) is long
    assert table.expired_total == 1 and len(table) == 1
    assert table.sweep() == 0


def test_close_releases_without_counting_an_expiry(table: SessionTable, released: Released) -> None:
    s = table.open("a", None)
    s.load_jobs.add(3)
    table.close(s.id)
    assert released == [(s.id, True)]
    assert table.expired_total == 0 and len(table) == 0
    with pytest.raises(NotFound) as exc:
        table.close(s.id)
    assert exc.value.field == "session_id"
    with pytest.raises(NotFound):
        table.get(s.id)
    assert released == [(s.id, True)]


def test_unknown_ids_are_not_found(table: SessionTable) -> None:
    table.open("a", None)
    for sid in (0, 1, 2**63 - 1):
        with pytest.raises(NotFound, match="session"):
            table.get(sid)


def test_max_sessions(table: SessionTable, released: Released) -> None:
    a = table.open("a", None)
    table.open("b", None)
    table.open("c", None)
    with pytest.raises(ResourceExhausted) as exc:
        table.open("d", None)
    assert exc.value.field == "session"
    assert len(table) == 3 and released == []
    table.close(a.id)
    assert table.open("d", None).client_name == "d"


def test_expired_sessions_do_not_count_against_the_limit(
    table: SessionTable, clock: FakeClock, released: Released
) -> None:
    dead = [table.open(name, 0.5) for name in "abc"]
    clock.advance(1.0)
    # all three leases lapsed; the sweeper has not run yet
    s = table.open("d", None)
    assert len(table) == 1 and table.get(s.id) is s
    assert sorted(sid for sid, _ in released) == sorted(d.id for d in dead)
    assert table.expired_total == 3


def test_close_all_releases_every_session(table: SessionTable, released: Released) -> None:
    ids = {table.open(name, None).id for name in "ab"}
    table.close_all()
    assert {sid for sid, _ in released} == ids and len(table) == 0
    assert table.expired_total == 0


def test_only_the_data_secret_renews_a_lease_through_a_handshake(
    table: SessionTable, clock: FakeClock
) -> None:
    """Issue 26: a handshake naming a live session with a wrong secret renewed its lease (a
    stranger holding only the id could keep a dead engine's pins alive)."""
    s = table.open("e", 1.0)
    clock.advance(0.8)
    assert table.with_secret(s.id, b"\0" * len(s.data_secret)) is None
    assert table.with_secret(s.id + 1, s.data_secret) is None
    clock.advance(0.3)  # 1.1 s after the open: the wrong secret renewed nothing
    assert table.with_secret(s.id, s.data_secret) is None
    t = table.open("f", 1.0)
    clock.advance(0.8)
    assert table.with_secret(t.id, t.data_secret) is t  # the right one renews
    clock.advance(0.8)
    assert table.get(t.id) is t


def test_a_lowered_lease_ceiling_cuts_live_leases_short(table: SessionTable, clock: FakeClock) -> None:
    """Issue 26: a reload that shortened a tenant's max_lease_s left its sessions' leases."""
    s = table.open("e", 4.0)
    table.clamp(s, 0.6)
    assert s.ttl_s == 0.6
    clock.advance(0.7)
    with pytest.raises(NotFound):
        table.get(s.id)
    t = table.open("f", 4.0)
    table.clamp(t, 0.1)  # never below the daemon's minimum (0.5 s)
    assert t.ttl_s == 0.5

"""LookupSlices: one pinned lookup in the namespaces of an engine's parallel slices (one per TP
rank), against a real daemon: the answers of one pinned Lookup per slice, in one round trip;
all or nothing; bad input refused with the field named and nothing pinned.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import DaemonProcess, make_namespace
from tests_helpers import wait_for

import kvtier
from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtier_contract.v1 import kvtier_pb2_grpc as pb_grpc

TOKENS = list(range(16 * 8))  # 8 blocks of 16 tokens


def slices(c: kvtier.Client, stored: list[int]) -> tuple[list[Any], list[list[bytes]]]:
    """One namespace per TP rank; rank r holds the first ``stored[r]`` blocks of TOKENS."""
    handles, chains = [], []
    for r, n in enumerate(stored):
        h = c.register(make_namespace(tp_rank=r, tp_size=len(stored)))
        keys = h.block_keys(TOKENS)
        if n:
            assert h.put(keys[:n], [bytes([r + 1]) * h.block_bytes] * n).stored == n
        handles.append(h)
        chains.append(keys)
    return handles, chains


def pinned(d: DaemonProcess) -> int:
    with kvtier.Client.connect(d.unix) as c:
        return int(c.stats()["pinned_blocks"])


@pytest.mark.parametrize("control", [True, False], ids=["control", "grpc"])
def test_the_same_answer_as_one_pinned_lookup_per_slice(daemon: DaemonProcess, control: bool) -> None:
    with kvtier.Client.connect(daemon.unix, "shm", control_channel=control) as c:
        handles, chains = slices(c, [6, 4, 5])
        calls = c.session.connection.control.calls if c.session.connection.control is not None else 0
        got = c.lookup_slices(handles, chains)
        if control:
            ctl = c.session.connection.control
            assert ctl is not None and ctl.calls == calls + 1  # one round trip
        # per slice, its keys cut at the hit so far: 6, then 4 of 6, then 4 of 4
        one_by_one = [handles[0].lookup_pinned(chains[0])]
        one_by_one.append(handles[1].lookup_pinned(chains[1][:6]))
        one_by_one.append(handles[2].lookup_pinned(chains[2][:4]))
        assert got.hits == 4
        assert [s.hits for s in got.slices] == [s.hits for s in one_by_one] == [6, 4, 4]
        assert [s.tiers for s in got.slices] == [s.tiers for s in one_by_one]
        assert all(s.pin and s.epoch == c.boot_epoch for s in got.slices)
        assert pinned(daemon) == 2 * 14
        for s in got.slices + one_by_one:
            assert c.release(s.pin, s.epoch)
        assert pinned(daemon) == 0


def test_a_slice_without_a_hit_ends_the_call_and_nothing_stays_pinned(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, "tcp") as c:
        handles, chains = slices(c, [5, 0, 5])
        got = c.lookup_slices(handles, chains)
        assert got.hits == 0 and [s.hits for s in got.slices] == [5, 0]  # slice 2 not looked at
        assert all(s.pin == 0 for s in got.slices)
        assert pinned(daemon) == 0
        # and a chain that misses at its first block in slice 0
        got = c.lookup_slices(handles[:1], [chains[0][5:]])
        assert got.hits == 0 and pinned(daemon) == 0


def test_an_older_daemon_gets_one_lookup_per_slice_with_the_same_answer(daemon: DaemonProcess) -> None:
    with kvtier.Client.connect(daemon.unix, "shm") as c:
        handles, chains = slices(c, [6, 4, 5])
        c.session.lookup_slices_served = False  # as an OpenSessionReply without lookup_slices says
        got = c.lookup_slices(handles, chains)
        assert got.hits == 4 and [s.hits for s in got.slices] == [6, 4, 4]
        for s in got.slices:
            c.release(s.pin, s.epoch)
        assert pinned(daemon) == 0


class Raw:
    def __init__(self, d: DaemonProcess) -> None:
        self.channel = grpc.insecure_channel(d.grpc)
        self.stub = pb_grpc.KvtierStub(self.channel)

    def code(self, request: pb.LookupSlicesRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as e:
            self.stub.LookupSlices(request, timeout=5)
        return e.value.code(), e.value.details() or ""


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[Raw]:
    r = Raw(daemon)
    yield r
    r.channel.close()


def test_bad_input_names_the_field_and_pins_nothing(daemon: DaemonProcess, raw: Raw) -> None:
    with kvtier.Client.connect(daemon.unix, "tcp") as c:
        handles, chains = slices(c, [6, 6])
        sid = c.session.connection.session_id
        ids = [h.namespace_id for h in handles]
        keys = [b"".join(k) for k in chains]
        assert raw.stub.OpenSession(pb.OpenSessionRequest(client_name="raw")).session_id
        cases: list[tuple[pb.LookupSlicesRequest, grpc.StatusCode, str]] = [
            (
                pb.LookupSlicesRequest(session_id=sid, pin=True),
                grpc.StatusCode.INVALID_ARGUMENT,
                "namespace_ids",
            ),
            (
                pb.LookupSlicesRequest(
                    session_id=sid, namespace_ids=list(range(1, 66)), keys=[b""] * 65, pin=True
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "namespace_ids",
            ),
            (
                pb.LookupSlicesRequest(
                    session_id=sid, namespace_ids=[ids[0], ids[0]], keys=keys[:1] * 2, pin=True
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "namespace_ids",
            ),
            (
                pb.LookupSlicesRequest(session_id=sid, namespace_ids=ids, keys=keys[:1], pin=True),
                grpc.StatusCode.INVALID_ARGUMENT,
                "keys",
            ),
            # the second slice's chain is bad: the first is not pinned either
            (
                pb.LookupSlicesRequest(
                    session_id=sid, namespace_ids=ids, keys=[keys[0], keys[1][:-1]], pin=True
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "keys",
            ),
            (
                pb.LookupSlicesRequest(
                    session_id=sid, namespace_ids=ids, keys=[keys[0], bytes(32 * 5000)], pin=True
                ),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "keys",
            ),
            (
                pb.LookupSlicesRequest(session_id=sid, namespace_ids=[ids[0], 999_999], keys=keys, pin=True),
                grpc.StatusCode.NOT_FOUND,
                "namespace",
            ),
            (
                pb.LookupSlicesRequest(session_id=987_654, namespace_ids=ids, keys=keys, pin=True),
                grpc.StatusCode.NOT_FOUND,
                "session",
            ),
        ]
        for request, code, word in cases:
            got, details = raw.code(request)
            assert got == code and word in details, (request, got, details)
            assert pinned(daemon) == 0
        # the same request, well formed, pins both slices
        got = c.lookup_slices(handles, chains)
        assert got.hits == 6 and pinned(daemon) == 12


def test_a_restarted_daemon_is_looked_up_afresh(daemon_factory: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "restart"
    d1 = daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
    c = kvtier.Client.connect(d1.unix, "tcp", timeout_s=0.5, backoff_s=(0.05, 0.2))
    try:
        handles, chains = slices(c, [3, 3])
        first = c.lookup_slices(handles, chains)
        assert first.hits == 3
        d1.kill()
        assert c.lookup_slices(handles, chains).hits == 0  # away: a miss, at once
        daemon_factory("--host-bytes", "32MiB", "--slab-bytes", "1MiB", run_dir=run_dir)
        # Misses (no slices: the daemon is away) until the probe has reopened the session and
        # closed the breaker. (Not until ``boot_epoch`` changes: the probe learns the new epoch
        # from OpenSession and registers the namespaces before the breaker closes, and a lookup
        # in that window is still a miss.)
        wait_for("a lookup answered", lambda: bool(c.lookup_slices(handles, chains).slices))
        got = c.lookup_slices(handles, chains)
        assert got.hits == 0 and got.slices and got.slices[0].epoch != first.slices[0].epoch
        for h, keys in zip(handles, chains, strict=True):
            assert h.put(keys[:2], [b"z" * h.block_bytes] * 2).stored == 2
        assert c.lookup_slices(handles, chains).hits == 2
        assert not c.release(first.slices[0].pin, first.slices[0].epoch)  # the old boot's pin
    finally:
        c.close()

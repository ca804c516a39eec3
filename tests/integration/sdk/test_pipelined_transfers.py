"""Pipelined puts and gets (kvtier.batches, docs/benchmarks.md §14) against a real daemon.

A call larger than ``Client.pipeline_bytes`` runs as several jobs: the Prepare* of the next jobs
goes out while one job's bytes are copied, and each job's Complete* is collected before the call
returns. Here blocks are 16 KiB and jobs hold at most 4 keys (``pipeline_bytes`` = 64 KiB), the
first and the last a quarter of that: 10 keys make jobs 0 (key 0), 1 (keys 1-4), 2 (5-8) and
3 (9). Faults are injected into the client's own gRPC stub (its control channel off) and
transport, where the daemon's answers would come from.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import DaemonProcess, make_namespace

import kvtier
from kvtier_contract.errors import TransportError

JOB = 4  # keys per job


def blocks(n: int, nbytes: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture
def client(daemon: DaemonProcess, transport: str) -> Iterator[kvtier.Client]:
    # (control calls over gRPC: faults are injected into the client's gRPC stub)
    with kvtier.Client.connect(daemon.address(transport), transport=transport, control_channel=False) as c:
        c.pipeline_bytes = JOB * make_namespace().block_bytes
        yield c


def record(client: kvtier.Client) -> list[str]:
    """The order in which the caller's thread starts RPCs and copies: ``PrepareStore``,
    ``write 3`` (a copy of 3 blocks), ``CompleteStore``, ..."""
    log: list[str] = []
    start, complete = client.session.start, client.session.start_completion
    transport = client.session.data()

    def _start(method: str, request: Any, **kwargs: Any) -> Any:
        log.append(method)
        return start(method, request, **kwargs)

    def _start_completion(method: str, *args: Any, **kwargs: Any) -> Any:
        log.append(method)
        return complete(method, *args, **kwargs)

    client.session.start = _start  # type: ignore[method-assign]
    client.session.start_completion = _start_completion  # type: ignore[method-assign]

    def logged(name: str) -> Callable[..., Any]:
        real = getattr(transport, name)

        def copy(job_id: int, items: Any, *args: Any, **kw: Any) -> Any:
            log.append(f"{name} {len(items)}")
            return real(job_id, items, *args, **kw)

        return copy

    for name in ("write", "read"):
        setattr(transport, name, logged(name))
    return log


def fail_copy(
    client: kvtier.Client,
    name: str,
    nth: int,
    error: Callable[[], Exception] = lambda: TransportError("injected"),
) -> None:
    """The ``nth`` copy (1-based) of the attached transport's ``name`` ("write"/"read") fails."""
    transport = client.session.data()
    real, calls = getattr(transport, name), [0]

    def copy(job_id: int, items: Any, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise error()
        return real(job_id, items, *args, **kw)

    setattr(transport, name, copy)


class Silent(grpc.RpcError):
    """What gRPC raises for an RPC the daemon did not answer in time."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "injected: no answer"


class SilentFor:
    """The client's stub, except that ``method`` calls whose request ``matches`` go unanswered."""

    def __init__(self, stub: Any, method: str, matches: Callable[[Any], bool]) -> None:
        self._stub, self._method, self._matches = stub, method, matches

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._stub, name)
        if name != self._method:
            return real

        def call(request: Any, timeout: float | None = None) -> Any:
            if self._matches(request):
                raise Silent()
            return real(request, timeout=timeout)

        return call


def daemon_state(client: kvtier.Client) -> tuple[int, int]:
    """(writing_blocks, pinned_blocks) on the daemon now."""
    stats = client.stats()
    return stats["writing_blocks"], stats["pinned_blocks"]


def test_jobs_are_prepared_ahead_of_the_copies_and_keep_every_position(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 22)))  # 22 keys: jobs of 1, 4, 4, 4, 4, 4, 1 keys
    data = blocks(22, ns.block_bytes)
    assert ns.put([keys[i] for i in (1, 9, 20)], [data[i] for i in (1, 9, 20)]).stored == 3
    log = record(client)
    assert ns.put(keys, data) == kvtier.PutResult(stored=19, already_present=3)
    # Three PrepareStore before the first copy; each later one goes out before the copy that
    # follows it; every CompleteStore right after its copy, none waited for in between.
    assert log == ["PrepareStore"] * 3 + [
        "write 1",
        "CompleteStore",
        "PrepareStore",
        "write 3",
        "CompleteStore",
        "PrepareStore",
        "write 4",
        "CompleteStore",
        "PrepareStore",
        "write 3",
        "CompleteStore",
        "PrepareStore",
        "write 4",
        "CompleteStore",
        "write 3",
        "CompleteStore",
        "write 1",
        "CompleteStore",
    ]
    assert daemon_state(client) == (0, 0)

    log.clear()
    query = list(keys)
    query[5], query[17] = b"\x05" * 32, b"\x11" * 32  # unknown keys in jobs 2 and 5
    into = np.zeros((22, ns.block_bytes), dtype=np.uint8)
    found = ns.get_into(query, list(into))
    assert found == [i not in (5, 17) for i in range(22)]
    for i in range(22):
        assert (into[i] == (0 if i in (5, 17) else data[i])).all(), i
    assert log == ["PrepareLoad"] * 3 + [
        "read 1",
        "CompleteLoad",
        "PrepareLoad",
        "read 4",
        "CompleteLoad",
        "PrepareLoad",
        "read 3",
        "CompleteLoad",
        "PrepareLoad",
        "read 4",
        "CompleteLoad",
        "PrepareLoad",
        "read 4",
        "CompleteLoad",
        "read 3",
        "CompleteLoad",
        "read 1",
        "CompleteLoad",
    ]
    assert daemon_state(client) == (0, 0)
    assert client.counters.bytes_got == 20 * ns.block_bytes


def test_a_later_job_the_daemon_does_not_answer_loses_no_earlier_job(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 10)))
    data = blocks(10, ns.block_bytes)
    client.session.connection.channel.stub = SilentFor(
        client.session.connection.channel.stub, "PrepareStore", lambda request: request.keys[:32] == keys[5]
    )
    # Jobs 0 and 1 are stored; job 2 went unanswered; job 3, prepared ahead, is aborted, not
    # copied, and only then does the breaker trip: no slot stays reserved until the lease ends.
    assert ns.put(keys, data) == kvtier.PutResult(stored=5, dropped=5)
    assert client.breaker.trips == 1 and client.breaker.is_open
    assert daemon_state(client) == (0, 0)
    assert client.breaker.wait_closed(10)
    assert ns.lookup(keys) == 5
    assert ns.put(keys[:5], data[:5]) == kvtier.PutResult(already_present=5)


def test_a_failed_transfer_aborts_every_job_prepared_ahead(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 10)))
    data = blocks(10, ns.block_bytes)
    fail_copy(client, "write", 3)  # job 2
    assert ns.put(keys, data) == kvtier.PutResult(stored=5, dropped=5)
    assert daemon_state(client) == (0, 0)  # jobs 2 and 3 aborted before the put returned
    assert client.breaker.trips == 1
    assert client.breaker.wait_closed(10)
    assert ns.put(keys, data) == kvtier.PutResult(stored=5, already_present=5)

    fail_copy(client, "read", 3)  # the transport was reattached: wrap the new one
    into = np.zeros((10, ns.block_bytes), dtype=np.uint8)
    assert ns.get_into(keys, list(into)) == [False] * 10  # jobs 0, 1 copied, yet all misses
    assert daemon_state(client) == (0, 0)  # every job unpinned before the get returned
    assert client.counters.gets_failed == 1 and client.breaker.trips == 2
    assert client.breaker.wait_closed(10)
    assert ns.get_into(keys, list(into)) == [True] * 10
    assert all((into[i] == data[i]).all() for i in range(10))


def test_a_failed_copy_fails_its_job_only(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 10)))
    fail_copy(client, "write", 3, lambda: RuntimeError("injected: a CUDA error"))  # job 2
    assert ns.put(keys, blocks(10, ns.block_bytes)) == kvtier.PutResult(stored=6, dropped=4)
    assert daemon_state(client) == (0, 0)
    assert client.breaker.trips == 0


def test_a_deadline_reached_during_a_copy_stops_the_jobs_after_it(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 10)))
    data = blocks(10, ns.block_bytes)
    transport = client.session.data()
    real_write, real_read = transport.write, transport.read

    ends = [0.0]  # the deadline of the call under way

    def slow(real: Any) -> Callable[..., Any]:
        def copy(job_id: int, items: Any, *args: Any, **kw: Any) -> Any:
            out = real(job_id, items, *args, **kw)
            while time.monotonic() <= ends[0]:  # the engine's budget runs out during job 0
                time.sleep(0.01)
            return out

        return copy

    transport.write = slow(real_write)  # type: ignore[method-assign]
    ends[0] = time.monotonic() + 0.2
    result = ns.put(keys, data, deadline=ends[0])
    # Job 0 stored; jobs 1 and 2, prepared ahead, aborted; job 3 too late to be prepared.
    assert result == kvtier.PutResult(stored=1, dropped=9)
    assert daemon_state(client) == (0, 0)
    transport.write = real_write  # type: ignore[method-assign]
    assert ns.put(keys, data).stored == 9

    transport.read = slow(real_read)  # type: ignore[method-assign]
    into = np.zeros((10, ns.block_bytes), dtype=np.uint8)
    ends[0] = time.monotonic() + 0.2
    found = ns.get_into(keys, list(into), deadline=ends[0])
    assert found == [True] + [False] * 9  # job 0 confirmed; what came after it: misses
    assert (into[0] == data[0]).all()
    assert daemon_state(client) == (0, 0)
    assert client.breaker.trips == 0 and client.counters.out_of_time >= 2


def test_a_lease_lapsing_during_a_later_job_turns_the_whole_get_into_misses(
    daemon_factory: Any, transport: str
) -> None:
    d = daemon_factory("--host-bytes", "16MiB", "--slab-bytes", "1MiB")
    with kvtier.Client.connect(
        d.address(transport), transport=transport, lease_ttl_s=1.0, heartbeat=False
    ) as client:
        client.pipeline_bytes = JOB * make_namespace().block_bytes
        ns = client.register(make_namespace())
        keys = ns.block_keys(list(range(16 * 10)))
        assert ns.put(keys, blocks(10, ns.block_bytes)).stored == 10
        target = client.session.data()
        real_read, reads = target.read, [0]

        def stalled_read(job_id: int, items: Any, *args: Any) -> list[int]:
            bad = real_read(job_id, items, *args)
            reads[0] += 1
            deadline = time.monotonic() + 10  # the engine stalls past its lease in job 1
            while reads[0] == 2 and client.stats()["sessions"] and time.monotonic() < deadline:
                time.sleep(0.05)
            return bad

        target.read = stalled_read  # type: ignore[method-assign]
        assert ns.get(keys) == [None] * 10  # job 1's pins were not confirmed: nothing is
        assert client.counters.gets_failed == 1


def test_threads_sharing_a_client_each_get_their_own_bytes(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            keys = ns.block_keys(list(range(seed * 10_000, seed * 10_000 + 16 * 30)))
            data = blocks(30, ns.block_bytes, seed)
            for _ in range(3):
                assert ns.put(keys, data).dropped == 0
                into = np.zeros((30, ns.block_bytes), dtype=np.uint8)
                assert ns.get_into(keys, list(into)) == [True] * 30
                assert all((into[i] == data[i]).all() for i in range(30))
        except BaseException as e:  # noqa: BLE001  (reported by the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert daemon_state(client) == (0, 0)


def test_without_pipelining_each_batch_is_one_job_after_the_other(client: kvtier.Client) -> None:
    client.pipeline_bytes = 0
    client.session.connection.max_batch = 6  # what the daemon would say in OpenSession; two batches here
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * 10)))
    log = record(client)
    assert ns.put(keys, blocks(10, ns.block_bytes)).stored == 10
    assert ns.get_into(keys, list(np.zeros((10, ns.block_bytes), dtype=np.uint8))) == [True] * 10
    assert log == [
        "PrepareStore",
        "write 6",
        "CompleteStore",
        "PrepareStore",
        "write 4",
        "CompleteStore",
        "PrepareLoad",
        "read 6",
        "CompleteLoad",
        "PrepareLoad",
        "read 4",
        "CompleteLoad",
    ]
    assert client.session._rpc._pool is None  # every RPC made on the caller's thread, in order


def test_a_call_of_one_job_makes_its_rpcs_on_the_callers_thread(client: kvtier.Client) -> None:
    ns = client.register(make_namespace())
    keys = ns.block_keys(list(range(16 * JOB)))
    data = blocks(JOB, ns.block_bytes)
    assert ns.put(keys, data).stored == JOB
    into = np.zeros((JOB, ns.block_bytes), dtype=np.uint8)
    assert ns.get_into(keys, list(into)) == [True] * JOB
    assert all((into[i] == data[i]).all() for i in range(JOB))
    assert client.session._rpc._pool is None  # nothing to overlap: no hand-off to an RPC thread

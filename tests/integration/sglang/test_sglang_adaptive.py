"""The SGLang HiCache backend's load-or-recompute decision (``load_policy``, issue 30).

SGLang's real storage classes (``sglang_driver.py``, as in test_sglang_backend.py) and a real
daemon. ``prefetch`` does what SGLang's prefetch thread does: ``batch_exists`` (the hit query),
then ``batch_get_v1`` of the pages it answered. The engine's prefill rate is the operator's
``prefill_seconds_per_token`` (SGLang's storage interface shows the backend no engine step).

* slow tier: the daemon's NVMe reads are slowed (``kvtierd.testing.serve --read-latency-ms``)
  and its host tier is tiny, so the stored pages sit on NVMe only. ``always`` answers and loads
  every held page; the daemon times those reads and hands its NVMe figure to every session, so
  ``adaptive`` answers 0 (SGLang recomputes) from its first prefetch on: the tier is slower than
  the prefill; ``never`` answers 0. Loaded pages are byte-exact.
* fast tier (the host tier): ``adaptive`` answers what ``always`` answers; without
  ``prefill_seconds_per_token`` it answers every held page too (nothing to weigh the load
  against).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess, make_namespace
from test_sglang_backend import SHAPES, Driver, _need_env, keys

import kvtier

pytestmark = pytest.mark.timeout(180)

READ_LATENCY_MS = 300  # per NVMe read: an 8-page load >= 300 ms
SPT = 0.001  # the operator's prefill rate: 8 pages of 4 tokens recompute in 32 ms
GEO = dict(SHAPES["mha-page_first"], pages=64)  # 512-byte pages of 4 tokens
PAGES = 8  # per prefix


class SlowReadDaemon(DaemonProcess):
    module = ("kvtierd.testing.serve", "--read-latency-ms", str(READ_LATENCY_MS))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang_adaptive")


@pytest.fixture(scope="module")
def drv(work: Path) -> Iterator[Driver]:
    _need_env()
    driver = Driver(work / "driver.log")
    driver.ask("pool", name="src", seed=1, **GEO)
    driver.ask("pool", name="dst", seed=None, **GEO)
    yield driver
    driver.close()


def prefixes(tag: str, n: int) -> list[list[str]]:
    return [keys(f"{tag}{i}", *range(PAGES)) for i in range(n)]


def store(drv: Driver, d: DaemonProcess, tag: str, n: int) -> list[list[str]]:
    """``n`` prefixes stored from source pages ``8i .. 8i+7``."""
    drv.backend(f"{tag}/W", "src", d.unix, extra={"load_policy": "never"})
    ps = prefixes(tag, n)
    for i, p in enumerate(ps):
        assert (
            drv.call(f"{tag}/W", "batch_set_v1", p, list(range(PAGES * i, PAGES * i + PAGES)))
            == [True] * PAGES
        )
    return ps


def prefetch(drv: Driver, backend: str, prefix: list[str], src_first: int) -> tuple[int, float]:
    """SGLang's prefetch of ``prefix`` into dst pages 0..7; the pages it answered (checked
    byte-exact against the source pages) and the seconds it took."""
    r = drv.ask("call", backend=backend, method="prefetch", keys=prefix, pages=list(range(PAGES)))
    assert r["raised"] is None, r["raised"]
    n = r["result"]["reported"]
    assert r["result"]["found"] == [True] * n
    if n:
        assert drv.digests("dst", list(range(n))) == drv.digests("src", list(range(src_first, src_first + n)))
    return n, r["seconds"]


def counters(drv: Driver, backend: str) -> dict[str, Any]:
    return drv.ask("counters", backend=backend)["counters"]


def test_slow_tier_adaptive_answers_less_than_always(drv: Driver, work: Path) -> None:
    d = SlowReadDaemon(
        work / "slow",
        "--host-bytes",
        "1MiB",
        "--slab-bytes",
        "256KiB",
        "--disk-dir",
        str(work / "nvme"),
        "--disk-bytes",
        "64MiB",
        "--write-policy",
        "write-through",
    ).start()
    try:
        ps = store(drv, d, "slow", 6)
        with kvtier.Client.connect(d.unix) as c:  # push them out of the 1 MiB host tier
            h = c.register(make_namespace(model_id="test/filler"))
            h.put(h.block_keys(list(range(160 * 16))), [bytes([i % 251]) * (16 << 10) for i in range(160)])
        deadline = time.monotonic() + 20
        while True:
            tiers = [t for p in ps for t in drv.call("slow/W", "tiers", p)]
            if tiers == ["nvme"] * (6 * PAGES) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert tiers == ["nvme"] * (6 * PAGES), tiers

        extra = {"prefill_seconds_per_token": SPT}
        drv.backend("slow/A", "dst", d.unix, extra={"load_policy": "always", **extra})
        always = [prefetch(drv, "slow/A", ps[i], PAGES * i) for i in (0, 1)]
        assert [n for n, _ in always] == [PAGES, PAGES]

        drv.backend("slow/B", "dst", d.unix, extra=extra)  # adaptive, the default
        # the daemon's figure of A's slow reads reaches B's session (OpenSession, heartbeats):
        # adaptive cuts from the first prefetch on
        adaptive = [prefetch(drv, "slow/B", ps[i], PAGES * i) for i in (2, 3, 4)]
        assert [n for n, _ in adaptive] == [0, 0, 0]  # SGLang recomputes these
        c = counters(drv, "slow/B")
        assert c["tokens_reported"] == 0
        assert c["tokens_recomputed_slower"] == 3 * PAGES * 4
        assert c["pages_loaded"] == 0 and c["errors"] == 0
        print(
            f"\nslow NVMe tier, per prefetch of 8 pages: always "
            f"{[round(s, 3) for _, s in always]} s, adaptive {[round(s, 3) for _, s in adaptive]} s"
        )
        assert sum(s for _, s in adaptive) / 3 < sum(s for _, s in always) / 2

        drv.backend("slow/N", "dst", d.unix, extra={"load_policy": "never"})
        assert prefetch(drv, "slow/N", ps[5], PAGES * 5)[0] == 0
        c = counters(drv, "slow/N")
        assert c["tokens_recomputed_policy"] == PAGES * 4 and c["pages_loaded"] == 0
    finally:
        d.kill()


def test_fast_tier_adaptive_answers_what_always_answers(drv: Driver, work: Path) -> None:
    d = DaemonProcess(work / "fast", "--host-bytes", "64MiB").start()
    try:
        ps = store(drv, d, "fast", 3)
        answered = {}
        for name, extra in (
            ("always", {"load_policy": "always", "prefill_seconds_per_token": SPT}),
            ("adaptive", {"prefill_seconds_per_token": SPT}),
            ("no-rate", {}),
        ):
            drv.backend(f"fast/{name}", "dst", d.unix, extra=extra)
            answered[name] = [prefetch(drv, f"fast/{name}", p, PAGES * i)[0] for i, p in enumerate(ps)]
            assert counters(drv, f"fast/{name}")["tokens_recomputed_slower"] == 0
        assert answered == {name: [PAGES] * 3 for name in ("always", "adaptive", "no-rate")}
    finally:
        d.kill()

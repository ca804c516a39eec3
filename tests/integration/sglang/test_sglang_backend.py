"""SGLang's HiCache storage seam with the kvtier backend (``kvtier.integrations.sglang``).

SGLang (``sglang==0.5.23 --no-deps``, its own environment built by ``make test``) has no CPU
build, so it does not serve here: ``sglang_driver.py`` runs SGLang's real ``HiCacheStorage``
base class, ``HiCacheStorageConfig`` and dynamic backend loader, over CPU host pools whose
page-addressing methods are SGLang's own (lifted from the installed source; see the driver), with
a real ``kvtierd`` process:

* every page shape (MHA and MLA, page-first, page-first-direct, layer-first, page-head) round-trips
  byte-exact between two pools (two SGLang processes), at other page slots, through the zero-copy
  path and through the plain path, which store the same bytes under the same key; over ``tcp``
  too;
* malformed arguments are misses, never exceptions;
* ``batch_exists`` counts leading hits only; a page not found is left untouched;
* a daemon that never was, or that dies: ``False``s, 0 and misses, no exception, within the
  deadline; back when the daemon is;
* two TP ranks never read each other's pages (MHA); MLA ranks share one copy;
* identity is fail-closed: a missing revision or tokenizer digest, an unknown key, refuse startup;
  another revision gets no hits;
* 128 pages stored and loaded (GB/s printed);
* storage v2 (hybrid models: a KV pool with Mamba / SWA / indexer side pools, SGLang's
  ``MambaPoolHost`` page methods): the same calls on SGLang's own ``HiCacheFile`` and on kvtier
  give the same answers and bytes, also for a 4,160-page prompt asked in one ``batch_exists_v2``
  (as SGLang's hybrid controller asks); pools never share keys; which pools TP ranks share;
  misses without a daemon;
* the reference backend's contract (``HiCacheFile``): an empty plain ``batch_set`` is True;
  ``clear()`` is True only when nothing is left (kvtier: False, said once).

The SGLang environment is found at ``$KVTIER_SGLANG_PYTHON`` (set by ``make test``) or
``.venv-sglang/bin/python``; without it these tests fail (run ``make sglang-env``) unless
``KVTIER_SKIP_SGLANG=1`` says to skip them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, DaemonProcess
from driver_process import DriverProcess, require_env

from kvtier.integrations.sglang.config import page_key

HERE = Path(__file__).resolve().parent
SGLANG_PYTHON = os.environ.get("KVTIER_SGLANG_PYTHON") or str(ROOT / ".venv-sglang" / "bin" / "python")
REQUEST_TIMEOUT_MS = 500

pytestmark = pytest.mark.timeout(300)

# name -> pool geometry: 16 pages of 4 tokens, 2 layers (MHA: 2 heads x 8; MLA: a 24-wide row).
SHAPES = {
    f"{kind}-{layout}": dict(
        kind=kind, layout=layout, pages=16, page_size=4, layers=2, heads=2, head_dim=8, kv_cache_dim=24
    )
    for kind, layouts in (
        ("mha", ("page_first", "page_first_direct", "layer_first", "page_head")),
        ("mla", ("page_first", "page_first_direct", "layer_first")),
    )
    for layout in layouts
}


def _need_env() -> None:
    require_env(SGLANG_PYTHON, "SGLang", "sglang-env", "KVTIER_SKIP_SGLANG")


class Driver(DriverProcess):
    """One SGLang-environment process driven over stdin/stdout (see sglang_driver.py)."""

    def __init__(self, log: Path) -> None:
        # This checkout's kvtier first (the environment's editable install may be another one).
        path = os.pathsep.join([str(HERE), str(ROOT / "client"), str(ROOT / "server")])
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        super().__init__(
            [SGLANG_PYTHON, str(HERE / "sglang_driver.py")], log, env=env, cwd=log.parent, ready_timeout_s=120
        )

    def ask(self, op: str, timeout_s: float = 60, **kw: Any) -> dict[str, Any]:
        answer = self.request({"op": op, **kw}, timeout_s)
        assert not str(answer.get("error", "")).startswith("driver:"), answer
        return answer

    def call(self, backend: str, method: str, keys: list[str], pages: list[int] | None = None) -> Any:
        """The backend's answer; the test fails if the backend raised into SGLang."""
        r = self.ask("call", backend=backend, method=method, keys=keys, pages=pages or [])
        assert r["raised"] is None, r["raised"]
        return r["result"]

    def backend(
        self, name: str, pool: str, address: str, *, fails: bool = False, **kw: Any
    ) -> dict[str, Any]:
        """Start a backend as SGLang does (its loader, then ``register_mem_pool_host``); unless
        ``fails``, the test fails when that raised."""
        extra = {
            "address": address,
            "model_revision": "rev-a",
            "tokenizer_digest": "none",
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            **kw.pop("extra", {}),
        }
        answer = self.ask("backend", name=name, pool=pool, extra=extra, **kw)
        assert fails or answer.get("ok"), answer
        return answer

    def digests(self, pool: str, pages: list[int]) -> list[str]:
        return list(self.ask("digests", pool=pool, pages=pages)["digests"])

    def close(self, *, quit_cmd: dict[str, Any] | None = None, wait_s: float = 30) -> None:
        super().close(quit_cmd=quit_cmd or {"op": "quit"}, wait_s=wait_s)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang")


@pytest.fixture(scope="module")
def shared_daemon(workdir: Path) -> Iterator[DaemonProcess]:
    _need_env()
    d = DaemonProcess(workdir / "daemon", "--host-bytes", "256MiB").start()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def drv(workdir: Path, shared_daemon: DaemonProcess) -> Iterator[Driver]:
    driver = Driver(workdir / "driver.log")
    yield driver
    driver.close()


def keys(tag: str, *ids: int) -> list[str]:
    """SGLang-style page keys (hex SHA-256 strings), distinct per test."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in ids]


# -- the page contract ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_pages_round_trip_byte_exact_between_two_pools(
    drv: Driver, shared_daemon: DaemonProcess, shape: str
) -> None:
    geo = SHAPES[shape]
    drv.ask("pool", name=f"{shape}/src", seed=1, **geo)
    drv.ask("pool", name=f"{shape}/dst", seed=None, **geo)
    drv.backend(f"{shape}/A", f"{shape}/src", shared_daemon.unix)
    drv.backend(f"{shape}/B", f"{shape}/dst", shared_daemon.unix)
    k = keys(shape, 0, 1, 2, 3)
    zero = drv.digests(f"{shape}/dst", [0])[0]

    # A stores source pages 3, 5, 7 over the zero-copy path, and page 9 over the plain one.
    assert drv.call(f"{shape}/A", "batch_set_v1", k[:3], [3, 5, 7]) == [True] * 3
    assert drv.call(f"{shape}/A", "set_page", k[3:], [9]) is True
    # B (another process's pool) finds all four, and loads them into other slots.
    assert drv.call(f"{shape}/B", "batch_exists", k) == 4
    assert drv.call(f"{shape}/B", "batch_get_v1", k[:2] + k[3:], [12, 0, 6]) == [True] * 3
    assert drv.call(f"{shape}/B", "get_page", k[2:3], [1]) is True

    src = drv.digests(f"{shape}/src", [3, 5, 7, 9])
    assert drv.digests(f"{shape}/dst", [12, 0, 1, 6]) == [src[0], src[1], src[2], src[3]]
    # Pages nobody loaded are untouched.
    assert drv.digests(f"{shape}/dst", [2, 11, 13]) == [zero] * 3


def test_tcp_transport_moves_the_same_bytes(drv: Driver, shared_daemon: DaemonProcess) -> None:
    """A pool on another host: gRPC over TCP and the framed data channel, no shared memory."""
    geo = SHAPES["mla-layer_first"]
    drv.ask("pool", name="tcp/src", seed=7, **geo)
    drv.ask("pool", name="tcp/dst", seed=None, **geo)
    addr = shared_daemon.address("tcp")
    drv.backend("tcp/A", "tcp/src", addr, extra={"transport": "tcp"})
    drv.backend("tcp/B", "tcp/dst", addr, extra={"transport": "tcp"})
    k = keys("tcp", 0, 1, 2)
    assert drv.call("tcp/A", "batch_set_v1", k, [1, 2, 3]) == [True] * 3
    assert drv.call("tcp/B", "batch_exists", k) == 3
    assert drv.call("tcp/B", "batch_get_v1", k, [15, 14, 13]) == [True] * 3
    assert drv.digests("tcp/dst", [15, 14, 13]) == drv.digests("tcp/src", [1, 2, 3])


def test_batch_exists_counts_leading_hits_and_misses_leave_pages_untouched(
    drv: Driver, shared_daemon: DaemonProcess
) -> None:
    geo = SHAPES["mha-page_first"]
    drv.ask("pool", name="lead/src", seed=2, **geo)
    drv.ask("pool", name="lead/dst", seed=None, **geo)
    drv.backend("lead/A", "lead/src", shared_daemon.unix)
    drv.backend("lead/B", "lead/dst", shared_daemon.unix)
    k = keys("lead", 0, 1, 2, 3)
    # Stored: 0, 1 and 3; page 2 never was.
    assert drv.call("lead/A", "batch_set_v1", [k[0], k[1], k[3]], [0, 1, 3]) == [True] * 3
    assert drv.call("lead/B", "batch_exists", k) == 2
    assert drv.call("lead/B", "batch_exists", k[2:]) == 0
    assert drv.call("lead/B", "exists", k[3:]) is True
    assert drv.call("lead/B", "exists", k[2:3]) is False
    zero = drv.digests("lead/dst", [0])[0]
    assert drv.call("lead/B", "batch_get_v1", k, [4, 5, 6, 7]) == [True, True, False, True]
    src, dst = drv.digests("lead/src", [0, 1, 3]), drv.digests("lead/dst", [4, 5, 6, 7])
    assert dst == [src[0], src[1], zero, src[2]]
    assert drv.call("lead/B", "get_page", k[2:3], [8]) is False
    c = drv.ask("counters", backend="lead/B")["counters"]
    assert (c["pages_hit"], c["pages_loaded"], c["pages_load_failed"], c["errors"]) == (3, 3, 2, 0)


def test_host_indices_that_are_not_whole_pages_are_refused(drv: Driver, shared_daemon: DaemonProcess) -> None:
    drv.ask("pool", name="idx/p", seed=3, **SHAPES["mha-layer_first"])
    drv.backend("idx/A", "idx/p", shared_daemon.unix)
    k = keys("idx", 0, 1)
    # Two keys, one page of indices; then a page beyond the pool.
    assert drv.call("idx/A", "batch_set_v1", k, [0]) == [False, False]
    assert drv.call("idx/A", "batch_set_v1", k[:1], [16]) == [False]
    assert drv.call("idx/A", "batch_exists", k) == 0
    assert drv.ask("counters", backend="idx/A")["counters"]["pages_store_failed"] == 3


def test_malformed_arguments_are_misses_not_exceptions(drv: Driver, shared_daemon: DaemonProcess) -> None:
    drv.ask("pool", name="junk/p", seed=6, **SHAPES["mha-page_first"])
    # With SGLang's storage metrics on: its StorageMetrics cannot be imported in this CPU
    # environment, so get_stats() answers None too.
    drv.backend("junk/A", "junk/p", shared_daemon.unix, metrics=True)
    got = drv.call("junk/A", "garbage", keys("junk", 0, 1))
    assert got == [
        "0",
        "[]",
        "[False, False]",
        "[False, False]",
        "[False, False]",
        "None",
        "False",
        "False",
        "PoolTransferResult(kv_hit_pages=0, extra_pool_hit_pages={}, restorable_prefix_pages=[])",
        "{}",
        "{}",
        "None",
    ], got
    assert drv.ask("counters", backend="junk/A")["counters"]["errors"] >= 3


# -- failure behaviour ----------------------------------------------------------------------------


def _all_misses(drv: Driver, b: str, k: list[str]) -> float:
    """Every verb answers a miss without raising; returns the slowest call's seconds."""
    slowest = 0.0
    expect: list[tuple[str, list[str], list[int], Any]] = [
        ("batch_exists", k, [], 0),
        ("batch_get_v1", k, [0, 1], [False, False]),
        ("batch_set_v1", k, [2, 3], [False, False]),
        ("exists", k[:1], [], False),
        ("get_page", k[:1], [4], False),
        ("set_page", k[:1], [5], False),
    ]
    for method, kk, pages, want in expect:
        r = drv.ask("call", backend=b, method=method, keys=kk, pages=pages)
        assert r["raised"] is None, r["raised"]
        assert r["result"] == want, (method, r)
        slowest = max(slowest, r["seconds"])
    return slowest


def test_no_daemon_gives_misses_and_never_raises(drv: Driver, workdir: Path) -> None:
    drv.ask("pool", name="none/p", seed=4, **SHAPES["mha-page_first"])
    drv.backend("none/A", "none/p", f"unix:{workdir}/no-daemon.sock")  # the daemon may come later
    assert _all_misses(drv, "none/A", keys("none", 0, 1)) < 2 * REQUEST_TIMEOUT_MS / 1000
    assert _all_misses(drv, "none/A", keys("none", 2, 3)) < 2 * REQUEST_TIMEOUT_MS / 1000
    # ...and the cause is said once (WARNING, naming the fix), not once per call
    log = (workdir / "driver.log").read_text()
    assert log.count(f"no socket file {workdir}/no-daemon.sock: is kvtierd running?") == 1, log


def test_daemon_killed_mid_run_gives_misses_then_recovers(drv: Driver, workdir: Path) -> None:
    d = DaemonProcess(workdir / "dies", "--host-bytes", "64MiB").start()
    try:
        drv.ask("pool", name="dies/p", seed=5, **SHAPES["mla-page_first"])
        drv.backend("dies/A", "dies/p", d.unix)
        k = keys("dies", 0, 1)
        assert drv.call("dies/A", "batch_set_v1", k, [0, 1]) == [True, True]
        d.kill()
        assert _all_misses(drv, "dies/A", k) < 3 * REQUEST_TIMEOUT_MS / 1000
        c = drv.ask("counters", backend="dies/A")["counters"]
        assert c["errors"] == 0 and c["pages_store_failed"] >= 3
        d = DaemonProcess(workdir / "dies", "--host-bytes", "64MiB").start()  # same socket
        deadline = time.monotonic() + 20
        while drv.call("dies/A", "batch_set_v1", k, [0, 1]) != [True, True]:
            assert time.monotonic() < deadline, "the backend never came back to the daemon"
            time.sleep(0.2)  # poll: the breaker's probe reopens the session by itself
        assert drv.call("dies/A", "batch_exists", k) == 2
    finally:
        d.kill()


# -- identity -------------------------------------------------------------------------------------


def test_two_mha_ranks_never_mix(drv: Driver, shared_daemon: DaemonProcess) -> None:
    geo = SHAPES["mha-page_first"]
    for r in (0, 1):
        drv.ask("pool", name=f"tp/src{r}", seed=10 + r, **geo)
        drv.ask("pool", name=f"tp/dst{r}", seed=None, **geo)
        for role in ("src", "dst"):
            drv.backend(f"tp/{role}{r}", f"tp/{role}{r}", shared_daemon.unix, tp_rank=r, tp_size=2)
    k = keys("tp", 0, 1)
    assert drv.call("tp/src0", "batch_set_v1", k, [0, 1]) == [True, True]
    assert drv.call("tp/dst1", "batch_exists", k) == 0  # rank 0's pages are not rank 1's
    assert drv.call("tp/src1", "batch_set_v1", k, [0, 1]) == [True, True]
    for r in (0, 1):
        assert drv.call(f"tp/dst{r}", "batch_get_v1", k, [2, 3]) == [True, True]
        assert drv.digests(f"tp/dst{r}", [2, 3]) == drv.digests(f"tp/src{r}", [0, 1])
    assert drv.digests("tp/src0", [0]) != drv.digests("tp/src1", [0])


def test_mla_ranks_share_one_copy(drv: Driver, shared_daemon: DaemonProcess) -> None:
    geo = SHAPES["mla-layer_first"]
    drv.ask("pool", name="mlatp/src", seed=20, **geo)
    drv.ask("pool", name="mlatp/dst", seed=None, **geo)
    drv.backend("mlatp/w", "mlatp/src", shared_daemon.unix, tp_rank=0, tp_size=2)
    drv.backend("mlatp/r", "mlatp/dst", shared_daemon.unix, tp_rank=1, tp_size=2)
    k = keys("mlatp", 0)
    assert drv.call("mlatp/w", "batch_set_v1", k, [6]) == [True]
    assert drv.call("mlatp/r", "batch_get_v1", k, [9]) == [True]
    assert drv.digests("mlatp/dst", [9]) == drv.digests("mlatp/src", [6])


def test_another_revision_or_salt_gets_no_hits(drv: Driver, shared_daemon: DaemonProcess) -> None:
    geo = SHAPES["mha-page_first"]
    drv.ask("pool", name="rev/p", seed=30, **geo)
    drv.backend("rev/a", "rev/p", shared_daemon.unix)
    drv.backend("rev/b", "rev/p", shared_daemon.unix, extra={"model_revision": "rev-b"})
    drv.backend("rev/s", "rev/p", shared_daemon.unix, extra={"cache_salt": "s"})
    k = keys("rev", 0, 1)
    assert drv.call("rev/a", "batch_set_v1", k, [0, 1]) == [True, True]
    assert drv.call("rev/a", "batch_exists", k) == 2
    assert drv.call("rev/b", "batch_exists", k) == 0
    assert drv.call("rev/s", "batch_exists", k) == 0


def test_missing_identity_refuses_to_start(drv: Driver, workdir: Path) -> None:
    drv.ask("pool", name="cfg/p", seed=None, **SHAPES["mha-page_first"])
    addr = f"unix:{workdir}/no-daemon.sock"
    no_rev = drv.ask(
        "backend", name="cfg/1", pool="cfg/p", extra={"address": addr, "tokenizer_digest": "none"}
    )
    assert "extra_config.model_revision" in no_rev["error"]
    model = workdir / "models--org--m" / "snapshots" / ("a" * 40)
    model.mkdir(parents=True)
    no_tok = drv.ask("backend", name="cfg/2", pool="cfg/p", model_name=str(model), extra={"address": addr})
    assert "extra_config.tokenizer_digest" in no_tok["error"]
    (model / "tokenizer.json").write_text("{}")
    assert drv.ask("backend", name="cfg/3", pool="cfg/p", model_name=str(model), extra={"address": addr})[
        "ok"
    ]  # revision and digest from the snapshot
    typo = drv.backend("cfg/4", "cfg/p", addr, fails=True, extra={"adress": addr})
    assert "extra_config.adress" in typo["error"]
    bad = drv.backend("cfg/5", "cfg/p", addr, fails=True, extra={"request_timeout_ms": 0})
    assert "extra_config.request_timeout_ms" in bad["error"]


def test_a_pool_it_cannot_store_exactly_refuses_to_start(drv: Driver, workdir: Path) -> None:
    drv.ask("pool", name="f64/p", seed=None, dtype="float64", **SHAPES["mha-page_first"])
    addr = f"unix:{workdir}/no-daemon.sock"
    r = drv.backend("f64/A", "f64/p", addr, fails=True)
    assert "KV dtype float64" in r["error"], r
    # The v2 registration of the KV pool must be the pool registered first (no logical anchors).
    drv.ask("pool", name="anchor/kv", seed=None, **SHAPES["mha-page_first"])
    drv.ask("pool", name="anchor/other", seed=None, **SHAPES["mha-page_first"])
    r = drv.backend("anchor/A", "anchor/kv", addr, fails=True, sides={"kv": "anchor/other"})
    assert "not the pool registered by register_mem_pool_host" in r["error"], r


# -- storage interface v2: hybrid models (a KV pool and side pools) -------------------------------

# A hybrid model's host pools: the KV pool (MHA page-first), a Mamba state pool (SGLang's
# MambaPoolHost: one slot a page, fp32 SSM state and a bf16 conv state in separate buffers) and
# an SWA window pool (an MHA host pool of its own geometry, layer-first).
KV = SHAPES["mha-page_first"]
MAMBA = dict(
    kind="mamba",
    layout="page_first",
    pages=8,
    layers=2,
    temporal=[2, 3, 4],
    convs=[[3, 8]],
    temporal_dtype="float32",
    dtype="bfloat16",
)
SWA = dict(kind="mha", layout="layer_first", pages=12, page_size=4, layers=1, heads=1, head_dim=16)


def _hybrid(drv: Driver, tag: str, seed: int | None) -> dict[str, str]:
    names = {"kv": f"{tag}/kv", "mamba": f"{tag}/mamba", "swa": f"{tag}/swa"}
    for i, (pool, geo) in enumerate(((names["kv"], KV), (names["mamba"], MAMBA), (names["swa"], SWA))):
        drv.ask("pool", name=pool, seed=None if seed is None else seed + i, **geo)
    return names


def _v2(
    drv: Driver,
    backend: str,
    method: str,
    keys: list[str] | None = None,
    transfers: list[dict[str, Any]] | None = None,
) -> Any:
    r = drv.ask("call", backend=backend, method=method, keys=keys or [], pages=[], transfers=transfers or [])
    assert r["raised"] is None, r["raised"]
    return r["result"]


def test_v2_hybrid_round_trip_agrees_with_sglang_file_backend(
    drv: Driver, shared_daemon: DaemonProcess, workdir: Path
) -> None:
    """The same v2 calls on SGLang's own HiCacheFile and on kvtier: the same answers, and the
    same bytes in every pool of another process's pools."""
    k = keys("v2", 0, 1, 2, 3, 4)  # k[4] is never stored
    src = _hybrid(drv, "v2/src", seed=50)
    store = [  # KV pages 0-3; Mamba state after pages 2 and 4 (1 trailing page each);
        # the SWA window (2 trailing pages) of the 4-page prefix
        {"name": "kv", "keys": k[:4], "pages": [3, 5, 7, 9]},
        {"name": "mamba", "keys": [k[1]], "pages": [6], "policy": "trailing_pages"},
        {"name": "mamba", "keys": [k[3]], "pages": [2], "policy": "trailing_pages"},
        {"name": "swa", "keys": k[2:4], "pages": [4, 6], "policy": "trailing_pages"},
    ]
    queries = {
        "mamba+swa": [
            {"name": "mamba", "keys": [k[4]], "policy": "trailing_pages"},
            {"name": "swa", "keys": k[3:5], "policy": "trailing_pages"},
        ],
        "mamba": [{"name": "mamba", "keys": [k[4]], "policy": "trailing_pages"}],
        "swa-all": [{"name": "swa", "keys": k[:5], "policy": "all_pages"}],
        "kv-only": [],
    }
    load = [
        {"name": "kv", "keys": k[:4], "pages": [0, 1, 2, 3]},
        {"name": "mamba", "keys": [k[3]], "pages": [5], "policy": "trailing_pages"},
        {"name": "swa", "keys": k[2:4], "pages": [8, 9], "policy": "trailing_pages"},
        {"name": "mamba", "keys": [k[0]], "pages": [1], "policy": "trailing_pages"},
    ]
    answers = {}
    for impl in ("file", "kvtier"):
        dst = _hybrid(drv, f"v2/{impl}/dst", seed=None)
        kw: dict[str, Any] = {"file": str(workdir / "hicache-file")} if impl == "file" else {}
        w, r = f"v2/{impl}/w", f"v2/{impl}/r"
        drv.backend(w, src["kv"], shared_daemon.unix, sides={"mamba": src["mamba"], "swa": src["swa"]}, **kw)
        drv.backend(r, dst["kv"], shared_daemon.unix, sides={"mamba": dst["mamba"], "swa": dst["swa"]}, **kw)
        stored = [_v2(drv, w, "batch_set_v2", transfers=[t]) for t in store]
        hits = {q: _v2(drv, r, "batch_exists_v2", k, t) for q, t in queries.items()}
        loaded = _v2(drv, r, "batch_get_v2", transfers=load[:3])
        missed = _v2(drv, r, "batch_get_v2", transfers=load[3:])
        answers[impl] = (stored, hits, loaded, missed)
        # Every pool's pages arrived byte-exact in the other process's pools.
        assert drv.digests(dst["kv"], [0, 1, 2, 3]) == drv.digests(src["kv"], [3, 5, 7, 9])
        assert drv.digests(dst["mamba"], [5]) == drv.digests(src["mamba"], [2])
        assert drv.digests(dst["swa"], [8, 9]) == drv.digests(src["swa"], [4, 6])
        assert drv.digests(dst["mamba"], [1]) == drv.digests(dst["mamba"], [0])  # untouched
    assert answers["kvtier"] == answers["file"], answers
    stored, hits, loaded, missed = answers["kvtier"]
    assert all(ok == [True] * len(ok) for s in stored for ok in s.values())
    # 4 KV pages held; Mamba state after 2 and 4 pages; the SWA window of 4 pages only.
    assert hits["mamba+swa"] == {"kv": 4, "pools": {"kv": 4, "mamba": 4, "swa": 4}, "restorable": [4]}
    assert hits["mamba"] == {"kv": 2 + 2, "pools": {"kv": 4, "mamba": 4}, "restorable": [2, 4]}
    assert hits["swa-all"] == {"kv": 0, "pools": {"kv": 4}, "restorable": []}
    assert hits["kv-only"] == {"kv": 4, "pools": {"kv": 4}, "restorable": [1, 2, 3, 4]}
    assert loaded == {"kv": [True] * 4, "mamba": [True], "swa": [True, True]}
    assert missed == {"mamba": [False]}


LONG_PROMPT_PAGES = 4160  # past 4,096: more pages than four of the client's lookup batches


def test_v2_hit_of_a_long_prompt_agrees_with_sglang_file_backend(
    drv: Driver, shared_daemon: DaemonProcess, workdir: Path
) -> None:
    """SGLang's hybrid controller asks for every page of a prompt in one ``batch_exists_v2``:
    a 4,160-page prompt held whole, with its Mamba state on the last page, is a hit of 4,160
    pages on kvtier as on SGLang's own HiCacheFile (kvtier answered 4,096 pages, and 0 with
    the Mamba state)."""
    k = keys("long", *range(LONG_PROMPT_PAGES))
    mamba_query = [{"name": "mamba", "keys": [k[-1]], "policy": "trailing_pages"}]
    answers = {}
    for impl in ("file", "kvtier"):
        kv, mamba = f"long/{impl}/kv", f"long/{impl}/mamba"
        drv.ask("pool", name=kv, seed=90, **dict(KV, pages=LONG_PROMPT_PAGES))
        drv.ask("pool", name=mamba, seed=91, **MAMBA)
        kw: dict[str, Any] = {"file": str(workdir / "hicache-long")} if impl == "file" else {}
        drv.backend(f"long/{impl}", kv, shared_daemon.unix, sides={"mamba": mamba}, **kw)
        store = [
            {"name": "kv", "keys": k, "pages": list(range(LONG_PROMPT_PAGES))},
            {"name": "mamba", "keys": [k[-1]], "pages": [3], "policy": "trailing_pages"},
        ]
        stored = _v2(drv, f"long/{impl}", "batch_set_v2", transfers=store)
        with_mamba = _v2(drv, f"long/{impl}", "batch_exists_v2", k, mamba_query)
        kv_only = _v2(drv, f"long/{impl}", "batch_exists_v2", k)
        answers[impl] = (stored, with_mamba, kv_only)
    assert answers["kvtier"] == answers["file"]
    stored, with_mamba, kv_only = answers["kvtier"]
    assert stored == {"kv": [True] * LONG_PROMPT_PAGES, "mamba": [True]}
    n = LONG_PROMPT_PAGES
    assert with_mamba == {"kv": n, "pools": {"kv": n, "mamba": n}, "restorable": [n]}
    assert kv_only == {"kv": n, "pools": {"kv": n}, "restorable": list(range(1, n + 1))}


def test_v2_over_tcp_moves_the_same_bytes(drv: Driver, shared_daemon: DaemonProcess) -> None:
    src, dst = _hybrid(drv, "v2tcp/src", seed=65), _hybrid(drv, "v2tcp/dst", seed=None)
    addr = shared_daemon.address("tcp")
    for role, pools in (("w", src), ("r", dst)):
        drv.backend(
            f"v2tcp/{role}",
            pools["kv"],
            addr,
            extra={"transport": "tcp"},
            sides={"mamba": pools["mamba"], "swa": pools["swa"]},
        )
    k = keys("v2tcp", 0, 1)
    t = [
        {"name": "mamba", "keys": k[1:], "pages": [3], "policy": "trailing_pages"},
        {"name": "swa", "keys": k, "pages": [5, 6], "policy": "trailing_pages"},
    ]
    assert _v2(drv, "v2tcp/w", "batch_set_v2", transfers=t) == {"mamba": [True], "swa": [True, True]}
    assert _v2(
        drv, "v2tcp/r", "batch_get_v2", transfers=[dict(t[0], pages=[7]), dict(t[1], pages=[10, 11])]
    ) == {"mamba": [True], "swa": [True, True]}
    assert drv.digests(dst["mamba"], [7]) == drv.digests(src["mamba"], [3])
    assert drv.digests(dst["swa"], [10, 11]) == drv.digests(src["swa"], [5, 6])


def test_v2_pools_never_share_keys(drv: Driver, shared_daemon: DaemonProcess) -> None:
    """A page of one pool is never found as another pool's page under the same SGLang key,
    even where the pools' pages have the same size (SWA and draft-SWA here)."""
    src, dst = _hybrid(drv, "iso/src", seed=60), _hybrid(drv, "iso/dst", seed=None)
    drv.ask("pool", name="iso/src/draft", seed=61, **SWA)
    drv.ask("pool", name="iso/dst/draft", seed=None, **SWA)
    drv.backend(
        "iso/w",
        src["kv"],
        shared_daemon.unix,
        sides={"mamba": src["mamba"], "swa": src["swa"], "draft_swa": "iso/src/draft"},
    )
    drv.backend(
        "iso/r",
        dst["kv"],
        shared_daemon.unix,
        sides={"mamba": dst["mamba"], "swa": dst["swa"], "draft_swa": "iso/dst/draft"},
    )
    k = keys("iso", 0, 1)
    assert _v2(
        drv,
        "iso/w",
        "batch_set_v2",
        transfers=[
            {"name": "swa", "keys": k, "pages": [0, 1]},
            {"name": "mamba", "keys": k[1:], "pages": [3]},
        ],
    ) == {"swa": [True] * 2, "mamba": [True]}
    # Side pages are not KV pages, and the SWA pages are not draft-SWA pages.
    assert drv.call("iso/r", "batch_exists", k) == 0
    assert _v2(
        drv,
        "iso/r",
        "batch_get_v2",
        transfers=[
            {"name": "kv", "keys": k, "pages": [0, 1]},
            {"name": "draft_swa", "keys": k, "pages": [2, 3]},
            {"name": "swa", "keys": k, "pages": [4, 5]},
        ],
    ) == {"kv": [False, False], "draft_swa": [False, False], "swa": [True, True]}
    assert drv.digests(dst["swa"], [4, 5]) == drv.digests(src["swa"], [0, 1])
    # Storing the KV pages makes the KV prefix a hit; the draft-SWA pool still has none.
    assert drv.call("iso/w", "batch_set_v1", k, [0, 1]) == [True, True]
    assert _v2(
        drv,
        "iso/r",
        "batch_exists_v2",
        k,
        [
            {"name": "swa", "keys": k, "policy": "all_pages"},
            {"name": "draft_swa", "keys": k, "policy": "all_pages"},
        ],
    ) == {"kv": 0, "pools": {"kv": 2, "swa": 2}, "restorable": []}
    # A rank's Mamba state is its own (TP-sharded): rank 1 does not see rank 0's.
    other = _hybrid(drv, "iso/rank1", seed=None)
    drv.backend(
        "iso/r1",
        other["kv"],
        shared_daemon.unix,
        tp_rank=1,
        tp_size=2,
        sides={"mamba": other["mamba"], "swa": other["swa"]},
    )
    assert _v2(drv, "iso/r1", "batch_get_v2", transfers=[{"name": "mamba", "keys": k[1:], "pages": [0]}]) == {
        "mamba": [False]
    }


def test_v2_mla_model_shares_replicated_pools_and_not_mamba_state(
    drv: Driver, shared_daemon: DaemonProcess
) -> None:
    """An MLA hybrid model (MLA KV, a DSA indexer, Mamba state): SGLang writes the replicated
    pools (the KV latent, SGLang's DSAIndexerPoolHost) on TP rank 0 only and every rank reads that
    copy; Mamba state is TP-sharded and written by every rank, so rank 1 never reads rank 0's."""
    mla_side = dict(kind="dsa_indexer", layout="page_first", pages=16, page_size=4, layers=2, page_stride=12)
    for role, seed in (("src", 90), ("dst", None)):
        drv.ask("pool", name=f"mlah/{role}/kv", seed=seed, **SHAPES["mla-page_first"])
        drv.ask("pool", name=f"mlah/{role}/mamba", seed=seed, **MAMBA)
        drv.ask("pool", name=f"mlah/{role}/idx", seed=seed, **mla_side)
    for rank, role in ((0, "src"), (1, "dst")):
        drv.backend(
            f"mlah/{role}",
            f"mlah/{role}/kv",
            shared_daemon.unix,
            tp_rank=rank,
            tp_size=2,
            sides={"mamba": f"mlah/{role}/mamba", "indexer": f"mlah/{role}/idx"},
        )
    k = keys("mlah", 0, 1)
    assert _v2(
        drv,
        "mlah/src",
        "batch_set_v2",
        transfers=[
            {"name": "kv", "keys": k, "pages": [1, 2]},
            {"name": "indexer", "keys": k, "pages": [1, 2]},
            {"name": "mamba", "keys": k[1:], "pages": [4], "policy": "trailing_pages"},
        ],
    ) == {"kv": [True] * 2, "indexer": [True] * 2, "mamba": [True]}
    assert _v2(
        drv,
        "mlah/dst",
        "batch_exists_v2",
        k,
        [
            {"name": "indexer", "keys": k, "policy": "all_pages"},
            {"name": "mamba", "keys": k[1:], "policy": "trailing_pages"},
        ],
    ) == {"kv": 0, "pools": {"kv": 2, "indexer": 2}, "restorable": []}
    assert _v2(
        drv,
        "mlah/dst",
        "batch_get_v2",
        transfers=[
            {"name": "kv", "keys": k, "pages": [5, 6]},
            {"name": "indexer", "keys": k, "pages": [5, 6]},
            {"name": "mamba", "keys": k[1:], "pages": [0]},
        ],
    ) == {"kv": [True] * 2, "indexer": [True] * 2, "mamba": [False]}
    assert drv.digests("mlah/dst/idx", [5, 6]) == drv.digests("mlah/src/idx", [1, 2])


def test_v2_without_daemon_answers_misses(drv: Driver, workdir: Path) -> None:
    pools = _hybrid(drv, "v2none", seed=70)
    drv.backend(
        "v2none/A",
        pools["kv"],
        f"unix:{workdir}/no-daemon.sock",
        sides={"mamba": pools["mamba"], "swa": pools["swa"]},
    )
    k = keys("v2none", 0, 1)
    t = [
        {"name": "kv", "keys": k, "pages": [0, 1]},
        {"name": "mamba", "keys": k[1:], "pages": [1], "policy": "trailing_pages"},
        {"name": "swa", "keys": k, "pages": [2, 3]},
    ]
    for method in ("batch_set_v2", "batch_get_v2"):
        r = drv.ask("call", backend="v2none/A", method=method, transfers=t, keys=[], pages=[])
        assert r["raised"] is None and r["seconds"] < 2 * REQUEST_TIMEOUT_MS / 1000, r
        assert r["result"] == {"kv": [False] * 2, "mamba": [False], "swa": [False] * 2}, r
    r = drv.ask(
        "call",
        backend="v2none/A",
        method="batch_exists_v2",
        keys=k,
        pages=[],
        transfers=[t[1] | {"keys": k[1:]}],
    )
    assert r["raised"] is None and r["result"] == {"kv": 0, "pools": {}, "restorable": []}, r
    # Transfers SGLang could not have meant: misses too, never an exception.
    bad = [{"name": "mamba", "keys": k, "pages": [1]}, {"name": "indexer", "keys": k, "pages": [0, 1]}]
    r = drv.ask("call", backend="v2none/A", method="batch_set_v2", transfers=bad, keys=[], pages=[])
    assert r["raised"] is None and r["result"] == {"mamba": [False] * 2, "indexer": [False] * 2}, r


def test_v2_daemon_killed_mid_run_answers_misses_then_recovers(drv: Driver, workdir: Path) -> None:
    d = DaemonProcess(workdir / "v2dies", "--host-bytes", "64MiB").start()
    try:
        pools = _hybrid(drv, "v2dies", seed=75)
        drv.backend("v2dies/A", pools["kv"], d.unix, sides={"mamba": pools["mamba"], "swa": pools["swa"]})
        k = keys("v2dies", 0, 1)
        t = [
            {"name": "mamba", "keys": k[1:], "pages": [1], "policy": "trailing_pages"},
            {"name": "swa", "keys": k, "pages": [2, 3], "policy": "trailing_pages"},
        ]
        query = [{k_: v for k_, v in x.items() if k_ != "pages"} for x in t]
        assert drv.call("v2dies/A", "batch_set_v1", k, [0, 1]) == [True, True]
        assert _v2(drv, "v2dies/A", "batch_set_v2", transfers=t) == {"mamba": [True], "swa": [True, True]}
        assert _v2(drv, "v2dies/A", "batch_exists_v2", k, query)["kv"] == 2
        d.kill()
        for method, args, want in (
            ("batch_exists_v2", {"keys": k, "transfers": query}, {"kv": 0, "pools": {}, "restorable": []}),
            ("batch_get_v2", {"transfers": t}, {"mamba": [False], "swa": [False, False]}),
            ("batch_set_v2", {"transfers": t}, {"mamba": [False], "swa": [False, False]}),
        ):
            r = drv.ask("call", backend="v2dies/A", method=method, pages=[], **{"keys": [], **args})
            assert r["raised"] is None and r["result"] == want, (method, r)
            assert r["seconds"] < 3 * REQUEST_TIMEOUT_MS / 1000, (method, r)
        d = DaemonProcess(workdir / "v2dies", "--host-bytes", "64MiB").start()  # same socket
        deadline = time.monotonic() + 20
        while _v2(drv, "v2dies/A", "batch_set_v2", transfers=t) != {"mamba": [True], "swa": [True, True]}:
            assert time.monotonic() < deadline, "the backend never came back to the daemon"
            time.sleep(0.2)  # poll: the breaker's probe reopens the session by itself
        assert drv.call("v2dies/A", "batch_set_v1", k, [0, 1]) == [True, True]
        assert _v2(drv, "v2dies/A", "batch_exists_v2", k, query)["restorable"] == [2]
    finally:
        d.kill()


# -- the reference backend's contract (SGLang's HiCacheFile) ---------------------------------------


def test_empty_plain_batch_set_is_true_as_in_sglang_file_backend(
    drv: Driver, shared_daemon: DaemonProcess, workdir: Path
) -> None:
    """A plain ``batch_set`` of no pages stores everything it was given: True on SGLang's
    HiCacheFile, and on kvtier."""
    drv.ask("pool", name="empty/p", seed=81, **SHAPES["mha-page_first"])
    answers = {}
    for impl in ("file", "kvtier"):
        kw: dict[str, Any] = {"file": str(workdir / "hicache-empty")} if impl == "file" else {}
        drv.backend(f"empty/{impl}", "empty/p", shared_daemon.unix, **kw)
        answers[impl] = (
            drv.call(f"empty/{impl}", "batch_set", [], []),
            drv.call(f"empty/{impl}", "batch_set", keys("empty", 0), [1]),
        )
    assert answers["kvtier"] == answers["file"] == (True, True), answers


def test_clear_answers_true_only_when_it_cleared_as_sglang_file_backend(
    drv: Driver, shared_daemon: DaemonProcess, workdir: Path
) -> None:
    """``clear()`` answers True only when the backend holds nothing afterwards: HiCacheFile
    clears and says True; kvtier cannot clear a daemon whose pages other engines share, and
    says False (with one warning that says why, not one per call)."""
    drv.ask("pool", name="clr/p", seed=80, **SHAPES["mha-page_first"])
    k = keys("clr", 0)
    for impl in ("file", "kvtier"):
        kw: dict[str, Any] = {"file": str(workdir / "hicache-clear")} if impl == "file" else {}
        b = f"clr/{impl}"
        drv.backend(b, "clr/p", shared_daemon.unix, **kw)
        assert drv.call(b, "set_page", k, [2]) is True, impl
        assert drv.call(b, "exists", k) is True, impl
        cleared = drv.call(b, "clear", [])
        assert cleared is (not drv.call(b, "exists", k)), (impl, cleared)
        assert cleared is (impl == "file")
        assert drv.call(b, "clear", []) is (impl == "file")
    log = (workdir / "driver.log").read_text()
    assert log.count("kvtier HiCache clear: nothing cleared") == 1, log


# -- throughput -----------------------------------------------------------------------------------


def test_128_pages_round_trip(drv: Driver, shared_daemon: DaemonProcess) -> None:
    """128 pages of 64 tokens (K and V x 4 layers x 4 KV heads x 128 x bf16: 512 KiB a page, 64 MiB)."""
    geo = dict(kind="mha", layout="page_first", pages=128, page_size=64, layers=4, heads=4, head_dim=128)
    drv.ask("pool", name="bench/src", seed=40, **geo)
    drv.ask("pool", name="bench/dst", seed=None, **geo)
    drv.backend("bench/w", "bench/src", shared_daemon.unix, extra={"op_timeout_ms": 30000})
    drv.backend("bench/r", "bench/dst", shared_daemon.unix, extra={"op_timeout_ms": 30000})
    r = drv.ask("bench", backend="bench/w", reader="bench/r", pages=128, rounds=2)
    assert r.get("same") is True, r
    gb = r["bytes"] / 1e9
    print(
        f"\nsglang 128 pages ({r['bytes'] >> 20} MiB): batch_set_v1 {gb / r['put_s']:.2f} GB/s, "
        f"batch_get_v1 {gb / r['get_s']:.2f} GB/s"
    )


# -- without SGLang -------------------------------------------------------------------------------


def test_page_keys_bind_the_namespace_and_tenant() -> None:
    ns_a, ns_b = bytes(32), bytes([1]) + bytes(31)
    key = "ab" * 32
    k = page_key(ns_a, key)
    assert (
        k
        == hashlib.sha256(
            b"kvtier/sglang/page/v1" + ns_a + (64).to_bytes(4, "little") + key.encode()
        ).digest()
    )
    assert len({k, page_key(ns_b, key), page_key(ns_a, key, b"tenant-secret"), page_key(ns_a, key[:-1])}) == 4


def test_import_without_sglang_is_cheap_and_clear() -> None:
    code = (
        "import sys, kvtier.integrations.sglang as m\n"
        "assert 'torch' not in sys.modules and 'sglang' not in sys.modules\n"
        "try:\n    m.KvtierHiCacheStorage\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "needs SGLang" in out

"""kvtier behind LMCache's L1: a real LMCache multi-process server (lmcache==0.5.6, CPU, its own
environment built by ``make test``) with ``KvtierL2Adapter`` loaded as its plugin L2 adapter, a
real ``kvtier serve`` daemon, and LMCache's own SDK as the client (``lmcache_driver.py``).

* chunks stored through LMCache land in kvtier under the keys and namespace docs/lmcache.md
  states, byte for byte; after LMCache's L1 drops them (CLEAR) a retrieve is served from kvtier,
  byte-exact, and every L2 lock (kvtier pin) is returned;
* the daemon killed: stores still succeed in LMCache, a retrieve after L1 drops is a miss,
  quickly, and the server stays healthy; a new daemon on the same socket is used again;
* a missing identity field stops the server at start, naming the field;
* the adapter called as LMCache's controllers call it, with LMCache's own classes and 32 store
  tasks in flight while finished ones are popped (``lmcache_adapter_calls.py``);
* the plain-Python parts (settings, key mapping, lock bookkeeping) without LMCache.

The LMCache environment is found at ``$KVTIER_LMCACHE_PYTHON`` (set by ``make test``) or
``.venv-lmcache/bin/python``; without it the tests that need it fail (run ``make lmcache-env``)
unless ``KVTIER_SKIP_LMCACHE=1`` says to skip them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, DaemonProcess, make_namespace
from driver_process import DriverProcess, require_env

import kvtier
from kvtier.integrations.lmcache.config import AdapterConfig, ConfigError
from kvtier.integrations.lmcache.keys import KeyMapper, block_key, decode_kv_rank
from kvtier.integrations.lmcache.locks import PinTable

HERE = Path(__file__).resolve().parent
LMCACHE_PYTHON = os.environ.get("KVTIER_LMCACHE_PYTHON") or str(ROOT / ".venv-lmcache" / "bin" / "python")
MODEL = "test/model"
CHUNK = 16  # tokens per LMCache chunk: 16 x 2 layers x 2 heads x 64 x bf16 x K,V = 16 KiB
IDENTITY = {
    "model_revision": "rev1",
    "tokenizer_digest": "none",
    "kv_dtype": "bfloat16",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
}
ENV = {
    "LMCACHE_DISABLE_BANNER": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "OMP_NUM_THREADS": "1",
}


def params(daemon: DaemonProcess, **over: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "address": daemon.unix,
        "chunk_tokens": CHUNK,
        "hash_algorithm": "blake3",
        "models": {MODEL: dict(IDENTITY)},
        "request_timeout_ms": 500,
        "op_timeout_ms": 5000,
    }
    p.update(over)
    return p


def need_lmcache() -> str:
    """The LMCache environment's python; fails (or skips, when told to) without one."""
    return require_env(LMCACHE_PYTHON, "LMCache", "lmcache-env", "KVTIER_SKIP_LMCACHE")


@pytest.fixture
def lmcache_env() -> str:
    return need_lmcache()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class LMCacheServer:
    """``lmcache server`` with kvtier as its plugin L2 adapter; ``status()`` is its /status."""

    def __init__(self, python: str, adapter_params: dict[str, Any], log: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        spec = {
            "type": "plugin",
            "module_path": "kvtier.integrations.lmcache",
            "class_name": "KvtierL2Adapter",
            "adapter_params": adapter_params,
        }
        cmd = [
            str(Path(python).parent / "lmcache"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(CHUNK),
            "--l1-size-gb",
            "0.05",
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
            "--l2-adapter",
            json.dumps(spec),
        ]
        self.log = log
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ, **ENV), cwd=log.parent
        )

    def wait_ready(self, timeout_s: float = 150.0) -> LMCacheServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"LMCache server exited ({self.proc.returncode}):\n{self.tail()}"
            try:
                self.status()
                return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"LMCache server not up in {timeout_s} s:\n{self.tail()}")

    def status(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.http_port}/status"
        with urllib.request.urlopen(url, timeout=5) as r:
            return dict(json.loads(r.read()))

    def adapter(self) -> dict[str, Any]:
        return dict(self.status()["storage_manager"]["l2_adapters"][0])

    def l1_objects(self) -> int:
        return int(self.status()["storage_manager"]["l1_managers"]["_default"]["total_object_count"])

    def tail(self) -> str:
        self._log.flush()
        return self.log.read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Driver(DriverProcess):
    """LMCache's SDK in the LMCache environment, driven over stdin/stdout (lmcache_driver.py)."""

    def __init__(self, python: str, server: LMCacheServer, log: Path) -> None:
        spec = {
            "url": f"tcp://127.0.0.1:{server.port}",
            "http_url": f"http://127.0.0.1:{server.http_port}",
            "model": MODEL,
            "layers": 2,
            "heads": 2,
            "head_dim": 64,
            "dtype": "bfloat16",
            "block": CHUNK,
            "chunk": CHUNK,
            "hash_algorithm": "blake3",
        }
        super().__init__(
            [python, str(HERE / "lmcache_driver.py"), json.dumps(spec)],
            log,
            env=dict(os.environ, **ENV),
            ready_timeout_s=120,
        )

    def __call__(self, op: str, timeout_s: float = 60, **args: Any) -> dict[str, Any]:
        return self.request({"op": op, **args}, timeout_s)


class Stack:
    """A daemon, an LMCache server whose L2 is that daemon, and a driver."""

    def __init__(self, python: str, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.daemon = self.start_daemon()
        self.params = params(self.daemon)
        self.server = LMCacheServer(python, self.params, run_dir / "lmcache.log")
        try:
            self.server.wait_ready()
            self.driver = Driver(python, self.server, run_dir / "driver.log")
        except BaseException:
            self.server.stop()
            self.daemon.kill()
            raise

    def start_daemon(self) -> DaemonProcess:
        return DaemonProcess(
            self.run_dir / "daemon", "--host-bytes", "64MiB", "--slab-bytes", "1MiB", "--lease-ttl-s", "5"
        ).start()

    def close(self) -> None:
        self.driver.close()
        self.server.stop()
        self.daemon.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(need_lmcache(), tmp_path_factory.mktemp("lmcache"))
    yield s
    s.close()


def kvtier_namespace(p: dict[str, Any]) -> kvtier.Namespace:
    """The namespace docs/lmcache.md states for world size 1, rank 0, group 0, no salt."""
    return (
        AdapterConfig.from_params(p)
        .models[MODEL]
        .namespace(
            model_id=MODEL, chunk_tokens=CHUNK, world_size=1, rank=0, group=0, cache_salt=None, tenant=None
        )
    )


# -- with a real LMCache server --------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_chunks_land_in_kvtier_and_come_back_after_l1_drops_them(stack: Stack) -> None:
    d, server = stack.driver, stack.server
    assert d("store", seed=1, chunks=4) == {"ok": True}
    until("the 4 chunks to reach kvtier", lambda: server.adapter()["stored"] == 4)

    # Under the documented namespace and keys, kvtier holds exactly LMCache's bytes.
    want = d("keys", seed=1, chunks=4)
    ns = kvtier_namespace(stack.params)
    keys = [block_key(ns.digest, "blake3", bytes.fromhex(h)) for h in want["hashes"]]
    with kvtier.Client.connect(stack.daemon.unix) as client:
        blocks = client.register(ns).get(keys)
        assert [hashlib.sha256(b).hexdigest() if b is not None else None for b in blocks] == want["sha256"]
        stores_before = client.stats()["total"]["stores_accepted"]

    # LMCache's L1 drops everything; the retrieve can only be served from kvtier.
    assert d("clear") == {"ok": True}
    assert server.l1_objects() == 0
    assert d("retrieve", seed=1, chunks=4) == {"tokens": 4 * CHUNK, "exact": True}
    status = server.adapter()
    assert status["loaded"] == 4 and status["load_missed"] == 0
    until("every L2 lock to be returned", lambda: server.adapter()["locked_keys"] == 0)
    with kvtier.Client.connect(stack.daemon.unix) as client:
        until("the daemon to unpin", lambda: client.stats()["pinned_blocks"] == 0)
        assert client.stats()["total"]["stores_accepted"] == stores_before  # nothing new

    # Stores back to back: every L2 store task's result reaches LMCache, none stays in flight.
    for seed in range(10, 18):
        assert d("store", seed=seed, chunks=1) == {"ok": True}
    until(
        "every store task to complete",
        lambda: (
            server.status()["storage_manager"]["store_controllers"]["_default"]["in_flight_task_count"] == 0
        ),
    )
    assert server.adapter()["stored"] == 4 + 8

    # A prefix never stored is a miss in both tiers.
    assert d("retrieve", seed=2, chunks=2) == {"tokens": 0, "exact": False}
    assert server.adapter()["errors"] == 0


@pytest.mark.timeout(300)
def test_daemon_down_is_a_miss_and_a_new_daemon_is_used_again(stack: Stack) -> None:
    d, server = stack.driver, stack.server
    assert d("store", seed=3, chunks=2) == {"ok": True}
    until("seed 3 to reach kvtier", lambda: server.adapter()["stored"] >= 2)
    stack.daemon.kill()

    # Stores still succeed in LMCache (its L1 keeps them; kvtier drops them).
    dropped = server.adapter()["store_dropped"]
    assert d("store", seed=4, chunks=2) == {"ok": True}
    until("the stores to be dropped", lambda: server.adapter()["store_dropped"] >= dropped + 2)

    # L1 dropped: what only kvtier held is a miss now, answered within the deadlines.
    assert d("clear") == {"ok": True}
    t0 = time.monotonic()
    assert d("retrieve", seed=3, chunks=2) == {"tokens": 0, "exact": False}
    assert d("retrieve", seed=4, chunks=2) == {"tokens": 0, "exact": False}
    assert time.monotonic() - t0 < 10
    assert server.proc.poll() is None and server.status()["is_healthy"]
    status = server.adapter()  # healthy (it serves misses), its daemon away
    assert status["is_healthy"] and not status["daemon_connected"] and status["errors"] == 0

    # A new daemon on the same socket: the adapter's client finds it and stores land again.
    stack.daemon = stack.start_daemon()
    until("the adapter to reconnect", lambda: server.adapter()["daemon_connected"], 30)
    stored = server.adapter()["stored"]
    assert d("store", seed=5, chunks=2) == {"ok": True}
    until("seed 5 to reach the new daemon", lambda: server.adapter()["stored"] >= stored + 2)
    assert d("clear") == {"ok": True}
    assert d("retrieve", seed=5, chunks=2) == {"tokens": 2 * CHUNK, "exact": True}


@pytest.mark.timeout(120)
def test_many_tasks_in_flight_as_lmcache_calls_them(lmcache_env: str, daemon: DaemonProcess) -> None:
    """LMCache's classes and call pattern, without the server: 32 store tasks in flight while
    another thread pops finished ones, then lookup-and-lock, load, unlock in two parts."""
    out = subprocess.run(
        [lmcache_env, str(HERE / "lmcache_adapter_calls.py"), json.dumps(params(daemon))],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, **ENV),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "submitted": 32,
        "results": 32,
        "all_succeeded": True,
        "hits": list(range(32)),  # not the 33rd key, never stored
        "locked_after_lookup": 32,
        "loaded": 32,
        "exact": True,
        "locked_after_unlock": 0,
    }
    with kvtier.Client.connect(daemon.unix) as client:
        until("the daemon to unpin", lambda: client.stats()["pinned_blocks"] == 0)


@pytest.mark.timeout(120)
def test_an_adapter_built_without_its_daemon_starts_and_says_why_once(
    lmcache_env: str, tmp_path: Path
) -> None:
    """The server must not fail: an adapter whose daemon is not there (yet) is built, reports
    itself healthy with its daemon away, and its client says why once at WARNING."""
    address = f"unix:{tmp_path}/none.sock"
    code = (
        "import json, sys\nfrom kvtier.integrations.lmcache import KvtierL2Adapter\n"
        "a = KvtierL2Adapter(json.loads(sys.argv[1]))\n"
        "print(json.dumps(a.report_status()))\na.close()\n"
    )
    out = subprocess.run(
        [lmcache_env, "-c", code, json.dumps(params_at(address))],
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, **ENV),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status["is_healthy"] and not status["daemon_connected"], status
    assert out.stderr.count(f"no socket file {tmp_path}/none.sock: is kvtierd running?") == 1, out.stderr[
        -3000:
    ]


# -- LMCache's own conformance tool and contract (issue 28's peer findings) -------------------------

CONFORMANCE_MODEL = "test/conformance"
# basic_check's objects: 1,024 bfloat16 values = one 16-token chunk of 1 layer, 1 head of 32.
CONFORMANCE_IDENTITY = dict(IDENTITY, num_layers=1, num_kv_heads=1, head_dim=32)
SHORT_HASH_REFUSED = (
    "chunk refused (a miss or a failed store; said once per reason, counted "
    "in 'refused'): chunk_hash of 4 bytes, shorter than "
    "adapter_params.min_chunk_hash_bytes 16"
)


def conformance_run(python: str, daemon: DaemonProcess, **over: Any) -> str:
    """``python -m lmcache.v1.basic_check --mode test_l2_adapter`` (LMCache's conformance tool
    for L2 adapters) against kvtier's adapter: stdout and stderr together."""
    spec = {
        "type": "plugin",
        "module_path": "kvtier.integrations.lmcache",
        "class_name": "KvtierL2Adapter",
        "adapter_params": params(daemon, models={CONFORMANCE_MODEL: CONFORMANCE_IDENTITY}, **over),
    }
    out = subprocess.run(
        [
            python,
            "-m",
            "lmcache.v1.basic_check",
            "--mode",
            "test_l2_adapter",
            "--model",
            CONFORMANCE_MODEL,
            "--num-keys",
            "5",
            "--obj-size",
            "1024",
            "--kv-dtype",
            "bfloat16",
            "--l2-adapter",
            json.dumps(spec),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=200,
        env=dict(os.environ, **ENV),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "Test Failed" not in out.stdout, out.stdout[-3000:]
    return out.stdout


@pytest.mark.timeout(300)
def test_lmcache_conformance_tool_passes_against_kvtier(lmcache_env: str, daemon: DaemonProcess) -> None:
    """The tool's keys: 4-byte test hashes (``ObjectKey.IntHash2Bytes``) and ``kv_rank=0``.
    Rank 0 is the unsharded slice; a 4-byte hash is accepted only when the operator says so
    (``min_chunk_hash_bytes``: 4 is for this tool, never for serving)."""
    out = conformance_run(lmcache_env, daemon, min_chunk_hash_bytes=4)
    for line in (
        "Validation: 5/5 correctly absent",
        "Batch store OK",
        "Validation: 5/5 found",
        "Validation (loaded): 5/5",
        "Validation (content): 5/5",
    ):
        assert line in out, out[-3000:]
    assert SHORT_HASH_REFUSED not in out
    with kvtier.Client.connect(daemon.unix) as client:
        until("the daemon to unpin", lambda: client.stats()["pinned_blocks"] == 0)


@pytest.mark.timeout(300)
def test_lmcache_bench_l2_runs_against_kvtier(lmcache_env: str, daemon: DaemonProcess) -> None:
    """``lmcache bench l2`` numbers its keys' ``kv_rank`` 0, 1, 2, ... (opaque ranks) and gives
    them 16-byte hashes: every key is stored, found and loaded back byte-exact (kvtier refused
    every rank but 0 as malformed)."""
    identity = dict(IDENTITY, num_layers=1, num_kv_heads=1)  # 16 tokens x 64 x bf16 x K,V: 4 KiB
    spec = {
        "type": "plugin",
        "module_path": "kvtier.integrations.lmcache",
        "class_name": "KvtierL2Adapter",
        "adapter_params": params(daemon, models={"bench-model": identity}),
    }
    out = subprocess.run(
        [str(Path(lmcache_env).parent / "lmcache"), "bench", "l2", "--l2-adapter", json.dumps(spec)]
        + ["--num-keys", "8", "--in-flight", "2", "--data-size-kb", "4", "--warmup-rounds", "0"]
        + ["--lookup-max-hit-rate", "1", "--no-skip-verify"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=200,
        env=dict(os.environ, **ENV),
    )
    assert out.returncode == 0, out.stdout[-3000:]
    for line in ("success_keys=16/16", "found=16/16", "loaded=16/16", "All 16 keys data verified OK"):
        assert line in out.stdout, out.stdout[-3000:]
    assert "chunk refused" not in out.stdout, out.stdout[-3000:]


@pytest.mark.timeout(300)
def test_lmcache_conformance_tool_keys_are_refused_by_default_and_said_once(
    lmcache_env: str, daemon: DaemonProcess
) -> None:
    """By default a 4-byte hash is refused (two prompts could share it): every phase's 20
    refusals are one WARNING naming the reason and the setting, and nothing is stored."""
    out = conformance_run(lmcache_env, daemon)
    assert out.count(SHORT_HASH_REFUSED) == 1, out[-3000:]
    assert "Batch store FAIL" in out and "Validation: 0/5 found" in out, out[-3000:]
    with kvtier.Client.connect(daemon.unix) as client:
        assert client.stats()["total"]["stores_accepted"] == 0


@pytest.mark.timeout(200)
def test_lookup_and_lock_answers_each_key_as_lmcaches_own_adapter_does(
    lmcache_env: str, daemon: DaemonProcess
) -> None:
    """LMCache's contract: one answer per key. Chunks 1, 2 and 4 of six are stored (chunk 0 is
    held by LMCache's L1 or another L2): LMCache's own mock adapter answers 1, 2, 4, and so must
    kvtier's, locking (pinning) exactly those three until they are unlocked."""
    script = str(HERE / "lmcache_per_key_lookup.py")
    mock = {"type": "mock", "max_size_gb": 0.1, "mock_bandwidth_gb": 100}
    kv = {
        "type": "plugin",
        "module_path": "kvtier.integrations.lmcache",
        "class_name": "KvtierL2Adapter",
        "adapter_params": params(daemon),
    }
    got = []
    for spec, address in ((mock, []), (kv, [daemon.unix])):
        out = subprocess.run(
            [lmcache_env, script, json.dumps(spec), *address],
            capture_output=True,
            text=True,
            timeout=150,
            env=dict(os.environ, **ENV),
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert got[0] == {
        "stored": True,
        "found": [1, 2, 4],
        "pinned_while_locked": None,
        "pinned_after_unlock": None,
    }  # LMCache's reference answer
    assert got[1] == {"stored": True, "found": [1, 2, 4], "pinned_while_locked": 3, "pinned_after_unlock": 0}


def test_the_per_key_pinned_lookup_answers_past_a_gap_and_pins_only_what_it_found(
    daemon: DaemonProcess,
) -> None:
    """``NamespaceHandle.lookup_each_pinned`` (the daemon's PrepareLoad, no bytes moved): what
    the adapter asks about the keys after a missing one. Releasing it counts as a load in the
    daemon's figures (docs/lmcache.md section 7 says so)."""
    with kvtier.Client.connect(daemon.unix) as client:
        handle = client.register(make_namespace())
        keys = [bytes([i]) * 32 for i in range(6)]
        block = bytes(handle.block_bytes)
        assert handle.put([keys[i] for i in (1, 2, 4)], [block] * 3).stored == 3
        assert handle.lookup_pinned(keys).hits == 0  # a prefix lookup sees nothing
        each = handle.lookup_each_pinned(keys)
        assert each.found == [False, True, True, False, True, False] and each.pin
        assert client.stats()["pinned_blocks"] == 3
        loads = client.stats()["total"]["loads"]
        assert client.release(each.pin, each.epoch)
        assert client.stats()["pinned_blocks"] == 0
        assert client.stats()["total"]["loads"] == loads + 3
        nothing = handle.lookup_each_pinned([keys[0], keys[3]])
        assert nothing.found == [False, False] and nothing.pin == 0


def params_at(address: str) -> dict[str, Any]:
    return {
        "address": address,
        "chunk_tokens": CHUNK,
        "hash_algorithm": "blake3",
        "models": {MODEL: dict(IDENTITY)},
        "request_timeout_ms": 500,
    }


@pytest.mark.timeout(300)
def test_missing_identity_field_stops_the_server(
    lmcache_env: str, daemon: DaemonProcess, tmp_path: Path
) -> None:
    identity = {k: v for k, v in IDENTITY.items() if k != "model_revision"}
    server = LMCacheServer(lmcache_env, params(daemon, models={MODEL: identity}), tmp_path / "lmcache.log")
    try:
        assert server.proc.wait(150) != 0
    finally:
        server.stop()
    assert f"adapter_params.models.{MODEL}.model_revision: required" in server.log.read_text()


# -- the plain-Python parts (no LMCache needed) -----------------------------------------------------


class Key:
    """Stands in for lmcache's ObjectKey: the same five fields (a frozen, hashable record)."""

    def __init__(
        self,
        chunk_hash: bytes,
        model_name: str = MODEL,
        kv_rank: int = 1 << 24,
        object_group_id: int = 0,
        cache_salt: str = "",
    ) -> None:
        self.chunk_hash, self.model_name, self.kv_rank = chunk_hash, model_name, kv_rank
        self.object_group_id, self.cache_salt = object_group_id, cache_salt


def base_params(**over: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "socket": "/run/kvtier.sock",
        "chunk_tokens": CHUNK,
        "hash_algorithm": "blake3",
        "models": {MODEL: dict(IDENTITY)},
    }
    p.update(over)
    return p


@pytest.mark.parametrize("field", sorted(IDENTITY))
def test_every_identity_field_is_required(field: str) -> None:
    identity = {k: v for k, v in IDENTITY.items() if k != field}
    with pytest.raises(ConfigError) as e:
        AdapterConfig.from_params(base_params(models={MODEL: identity}))
    assert e.value.field == f"adapter_params.models.{MODEL}.{field}"


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"models": {}}, "adapter_params.models"),
        ({"hash_algorithm": "builtin"}, "adapter_params.hash_algorithm"),
        ({"chunk_tokens": 0}, "adapter_params.chunk_tokens"),
        ({"transport": "cuda_ipc"}, "adapter_params.transport"),
        ({"min_chunk_hash_bytes": 0}, "adapter_params.min_chunk_hash_bytes"),
        ({"min_chunk_hash_bytes": 33}, "adapter_params.min_chunk_hash_bytes"),
        ({"colour": "blue"}, "adapter_params.colour"),
        ({"models": {MODEL: dict(IDENTITY, kv_dtype="float64")}}, f"adapter_params.models.{MODEL}.kv_dtype"),
    ],
)
def test_bad_settings_are_refused_by_name(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        AdapterConfig.from_params(base_params(**over))
    assert e.value.field == field


def test_keys_separate_every_identity_field_and_refuse_what_fits_none() -> None:
    mapper = KeyMapper(
        AdapterConfig.from_params(base_params(models={MODEL: dict(IDENTITY), "other/model": dict(IDENTITY)}))
    )
    h = bytes(range(32))
    variants = [
        Key(h),
        Key(h, model_name="other/model"),
        Key(h, kv_rank=2 << 24),
        Key(h, kv_rank=2 << 24 | 1 << 16),
        Key(h, object_group_id=1),
        Key(h, cache_salt="alice"),
        Key(bytes(reversed(h))),
    ]
    resolved = [mapper.resolve(k) for k in variants]
    assert all(r is not None for r in resolved)
    assert len({r[1] for r in resolved if r is not None}) == len(variants)  # all distinct
    again = mapper.resolve(Key(h))
    assert again is not None and resolved[0] is not None and again[1] == resolved[0][1]
    # Unknown model, a 64-bit (builtin) hash, a rank outside its world size: refused, and
    # each says why (the adapter logs each reason once).
    for bad, why in (
        (Key(h, model_name="x"), "model_name 'x' is not in adapter_params.models"),
        (Key(h[:8]), "chunk_hash of 8 bytes, shorter than adapter_params.min_chunk_hash_bytes 16"),
        (Key(h, kv_rank=1 << 24 | 1 << 16), "kv_rank: rank 1 of world size 1"),
    ):
        assert mapper.resolve(bad) is None
        assert str(mapper.resolve_or_why(bad)).startswith(why), mapper.resolve_or_why(bad)
    assert decode_kv_rank(4 << 24 | 3 << 16 | 4 << 8 | 3) == (4, 3)
    # kv_rank 0 (LMCache's tests and conformance tool): the unsharded slice, world size 1.
    assert decode_kv_rank(0) == (1, 0)
    assert mapper.resolve(Key(h, kv_rank=0)) == mapper.resolve(Key(h, kv_rank=1 << 24))
    short = KeyMapper(AdapterConfig.from_params(base_params(min_chunk_hash_bytes=4)))
    four = short.resolve(Key(h[:4], kv_rank=0))
    assert four is not None and four[1] not in {r[1] for r in resolved if r is not None}


def test_a_kv_rank_that_packs_no_world_size_is_kept_whole_as_an_opaque_rank() -> None:
    """``lmcache bench l2`` numbers its keys' ``kv_rank`` 0, 1, 2, ... (no world size packed,
    no parallel slice named): each is accepted, never read as a slice nor defaulted to one.
    Every opaque rank shares one namespace (the daemon's namespaces do not grow with the
    ranks), apart from every packed rank's, and the raw rank is in the key: two ranks never
    share a block."""
    mapper = KeyMapper(AdapterConfig.from_params(base_params()))
    h = bytes(range(16))  # the bench's hashes: 16 bytes
    opaque = [mapper.resolve(Key(h, kv_rank=r)) for r in (1, 2, 77, (1 << 24) - 1)]
    assert all(r is not None for r in opaque), [mapper.resolve_or_why(Key(h, kv_rank=r)) for r in (1, 2)]
    namespaces = {r[0] for r in opaque if r is not None}
    assert len(namespaces) == 1 and next(iter(namespaces)).layout.endswith("/opaque-rank")
    packed = [mapper.resolve(Key(h, kv_rank=r)) for r in (0, 2 << 24, 2 << 24 | 1 << 16)]
    assert all(p is not None and p[0] not in namespaces for p in packed)
    all_keys = {r[1] for r in opaque + packed if r is not None}
    assert len(all_keys) == 7  # no two ranks name the same block
    again = mapper.resolve(Key(h, kv_rank=77))
    assert again is not None and again == opaque[2]  # the same rank: the same block
    # A rank that claims a world size still has to fit it.
    assert str(mapper.resolve_or_why(Key(h, kv_rank=1 << 24 | 1 << 16))).startswith("kv_rank: rank 1")


def test_a_pin_is_released_when_the_last_of_its_keys_is_unlocked() -> None:
    pins = PinTable()
    pins.add(7, 1, ["a", "b", "c"])  # one lookup locked a, b, c under pin 7
    pins.add(8, 1, ["b"])  # a second lookup locked b again, under pin 8
    assert pins.unlock(["a", "b"]) == []  # b's older lock (pin 7) goes first
    assert pins.unlock(["zzz"]) == []  # never locked: ignored
    assert pins.unlock(["c"]) == [(7, 1)]
    assert pins.unlock(["b"]) == [(8, 1)]
    assert len(pins) == 0
    pins.add(9, 2, ["d"])
    assert pins.drain() == [(9, 2)] and len(pins) == 0


@pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is not None, reason="LMCache is installed in this environment"
)
def test_without_lmcache_the_package_imports_and_the_adapter_says_what_is_missing() -> None:
    import kvtier.integrations.lmcache as integration  # no LMCache import at all

    with pytest.raises(ImportError, match=r"lmcache==0\.5\.6"):
        _ = integration.KvtierL2Adapter

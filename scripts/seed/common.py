"""What every scenario of the seed experiment shares: the model directory, a ``kvtierd`` process,
engine processes spoken to in JSON lines, the daemon's counters, statistics and logging."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "seed_experiment.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROTO = "SEED "  # prefix of the engine's protocol lines on stdout (vLLM logs there too)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCK_TOKENS = 128  # vLLM's CPU block size
# The Qwen3-0.6B shape (Qwen/Qwen3-0.6B config.json) except the vocabulary (see --vocab).
QWEN3_06B = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_config(layers: int, vocab: int, dtype: str) -> dict[str, Any]:
    """config.json of a Qwen3-0.6B-shaped model with ``layers`` layers (weights are dummy)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **QWEN3_06B,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }


def write_model(directory: Path, layers: int, vocab: int, dtype: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(layers, vocab, dtype)))
    return directory


def kv_bytes_per_token(layers: int, dtype: str) -> int:
    """K and V of every layer for one token."""
    return int(layers * 2 * QWEN3_06B["num_key_value_heads"] * QWEN3_06B["head_dim"] * DTYPE_BYTES[dtype])


def random_ids(rng: random.Random, n: int, vocab: int, first: int | None = None) -> list[int]:
    """``n`` random token ids (3..vocab-1; 0-2 are left to special tokens)."""
    head = [first] if first is not None else []
    return head + [rng.randrange(3, vocab) for _ in range(n - len(head))]


def make_docs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` documents of random token ids, lengths uniform in [lo, hi]; distinct first tokens
    make every document's block hashes distinct from the first block on."""
    rng = random.Random(seed)
    firsts = rng.sample(range(3, vocab), n)
    return [random_ids(rng, rng.randint(lo, hi), vocab, first) for first in firsts]


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def cr_ids(text: str) -> list[int]:
    """CPU ids of a list like '0-1,4'."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics; nan if none."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def code_state() -> str:
    """The commit, and a digest of the Python files under client/ and server/ as they are now
    (kvtier is installed editable: a change during the run would mix two versions)."""
    h = hashlib.sha256()
    for path in sorted([*ROOT.glob("client/kvtier/**/*.py"), *ROOT.glob("server/**/*.py")]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "client", "server"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head, dirty = "unknown", ""
    return f"commit {head}{' + local changes' if dirty else ''}, client+server digest {h.hexdigest()[:12]}"


# -- processes ---------------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """End ``proc`` and its process group (started with start_new_session): TERM, then KILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            # the group may still hold children (vLLM's EngineCore) after the leader exits
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def daemon(
    workdir: Path, host_bytes: str, *extra: str, launcher: tuple[str, ...] = ("kvtier.cli",)
) -> Iterator[dict[str, Any]]:
    """A fresh ``kvtierd`` on a Unix socket in ``workdir``; yields its KVTIERD_READY record.
    ``extra``: more ``serve`` flags; ``launcher``: the module and its own flags before ``serve``
    (``("kvtierd.testing.serve", "--read-latency-file", PATH)``: a slow NVMe tier, test-only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock = workdir / "kv.sock"
    log_path = workdir / "kvtierd.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [
                str(VLLM_PYTHON),
                "-m",
                *launcher,
                "serve",
                "--socket",
                str(sock),
                "--listen",
                "",
                "--metrics-port",
                "-1",
                "--host-bytes",
                host_bytes,
                *extra,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            for line in log_path.read_text().splitlines():
                if line.startswith("KVTIERD_READY "):
                    ready = json.loads(line.split(" ", 1)[1])
                    ready["address"] = f"unix:{sock}"
                    yield ready
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtierd did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
    finally:
        stop_process(proc)


COUNTERS = ("bytes_out_shm", "loads", "stores_accepted")
# Why check 2 (daemon bytes out = vLLM's loaded tokens) can fail while kvtier did nothing wrong.
CHECK2_HINT = (
    " (vLLM counts a hit in external_kv_transfer when it schedules the request; blocks whose "
    "load then fails, e.g. past step_budget_ms, are recomputed but stay counted: see "
    "load_failed_blocks and budget_exhausted in the engine log's 'KV Transfer metrics' lines)"
)


def daemon_counters(address: str, revision: str) -> dict[str, Any]:
    """The counters and block size of the namespaces of ``revision`` (summed), from Stats."""
    from kvtier.client import Client

    client = Client(address, "tcp", timeout_s=10.0, heartbeat=False)
    try:
        stats = client.stats()
    finally:
        client.close()
    out: dict[str, Any] = dict.fromkeys((*COUNTERS, "block_bytes"), 0)
    for ns in stats.get("namespaces", []):
        if ns.get("model_revision") != revision:
            continue
        counters = ns.get("counters", {})
        for key in COUNTERS:
            out[key] += int(counters.get(key, 0))
        out["block_bytes"] = int(ns.get("block_bytes", 0))
    return out


def connector_config(address: str, revision: str, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for these runs (docs/vllm.md §2 lists the keys)."""
    return {"address": address, "model_revision": revision, **extra}


class Engine:
    """One engine process (the seed script with ``--engine``), spoken to in JSON lines. The
    constructor only starts the process: build several, then ``wait_ready`` each, and they start
    side by side."""

    def __init__(self, spec: dict[str, Any], log_path: Path, kv_cache_gib: int, cpus: str) -> None:
        # The same OpenMP binding for every arm: vLLM's automatic one reserves one core fewer for
        # the worker when a kv_transfer_config is set, which on 2 cores means 2 cores vs 1.
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=cpus,
            OMP_NUM_THREADS=str(len(cr_ids(cpus))),
            PYTHONUNBUFFERED="1",
        )
        self.log_path = log_path
        self.log: TextIO = open(log_path, "w")
        self.t_start = time.perf_counter()
        self.startup_s = 0.0
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(SCRIPT), "--engine", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self) -> float:
        """Wait for the engine's ready line; returns seconds since the process started."""
        self.read()
        self.startup_s = time.perf_counter() - self.t_start
        return self.startup_s

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTO):
                reply: dict[str, Any] = json.loads(line[len(PROTO) :])
                return reply
            self.log.write(line)
            self.log.flush()
        self.log.flush()
        tail = self.log_path.read_text()[-4000:]
        raise RuntimeError(f"engine exited (rc={self.proc.poll()}); log tail:\n{tail}")

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kv_capacity_tokens(self) -> int | None:
        """From the engine log line 'CPU KV cache size: N tokens'."""
        self.log.flush()
        for line in self.log_path.read_text().splitlines():
            if "KV cache size:" in line:
                return int(line.split("KV cache size:")[1].split("tokens")[0].replace(",", ""))
        return None

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call({"op": "quit"})
                self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a dead or stuck engine is ended below either way
            pass
        stop_process(self.proc)
        self.log.close()


def engine_spec(
    model: Path,
    dtype: str,
    max_model_len: int,
    num_blocks: int | None,
    connector: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "connector": connector,
        "num_blocks": num_blocks,
    }


def fmt_s(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x * 1000:.0f} ms"


# The engines of the chats, fleet and mix scenarios: one set, started side by side once and
# shared by whichever of those scenarios run (an engine start costs 30-60 s of both cores here).
# name -> (kvtier connector or None, load_mode, revision suffix, more connector settings)
SMALL_ENGINES: dict[str, tuple[bool, str, str, dict[str, Any]]] = {
    "alone": (False, "", "", {}),
    "sync": (True, "sync", "-small", {}),  # fleet's engine A
    "sync-b": (True, "sync", "-small", {}),  # fleet's engine B: same namespace as A
    "async": (True, "async", "-small-async", {}),  # its own namespace (mix compares it with sync)
    # the interference scenario: the default budget, none, and a tight one (2 % of a step)
    "budget": (True, "sync", "-small-budget", {"interference_budget": 0.25}),
    "nobudget": (True, "sync", "-small-nobudget", {"interference_budget": None}),
    "tight": (True, "sync", "-small-tight", {"interference_budget": 0.02}),
}


class EngineSet:
    """The small scenarios' daemon and engines. ``start(names)`` starts those not yet running, all
    at once; ``close`` ends them. Owned by the driver thread; no locks."""

    def __init__(self, args: Any, workdir: Path, stack: Any) -> None:
        self.args = args
        self.workdir = workdir
        self.stack = stack
        self.model = write_model(workdir / "model", args.small_layers, args.vocab, args.dtype)
        self.bpt = kv_bytes_per_token(args.small_layers, args.dtype)
        self.address: str | None = None
        self.engines: dict[str, Engine] = {}
        self.startup_s: dict[str, float] = {}
        self.max_model_len = (args.small_blocks - 1) * BLOCK_TOKENS

    def revision(self, name: str) -> str:
        return str(self.args.revision) + SMALL_ENGINES[name][2]

    def start(self, names: list[str]) -> dict[str, Engine]:
        if self.address is None:
            self.address = self.stack.enter_context(daemon(self.workdir / "daemon", self.args.host_bytes))[
                "address"
            ]
        new = {}
        for name in names:
            if name not in self.engines:
                kvtier, mode, _, more = SMALL_ENGINES[name]
                new[name] = (
                    connector_config(self.address, self.revision(name), load_mode=mode, **more)
                    if kvtier
                    else None
                )
        return self.start_with(names, new)

    def start_with(self, names: list[str], connectors: dict[str, dict[str, Any] | None]) -> dict[str, Engine]:
        """Start an engine per entry of ``connectors`` (name -> its ``kv_connector_extra_config``,
        None: no connector) not yet running, side by side; returns those of ``names``."""
        new = [n for n in connectors if n not in self.engines]
        for name in new:
            spec = engine_spec(
                self.model, self.args.dtype, self.max_model_len, self.args.small_blocks, connectors[name]
            )
            engine = Engine(spec, self.workdir / f"engine-{name}.log", self.args.kv_cache_gib, self.args.cpus)
            self.stack.callback(engine.close)
            self.engines[name] = engine
        if new:
            log(f"starting engines {', '.join(new)} side by side")
        warm = random_ids(random.Random(self.args.seed + 1000), self.args.warmup_tokens, self.args.vocab)
        for name in new:
            self.startup_s[name] = self.engines[name].wait_ready()
            self.engines[name].call({"op": "generate", "ids": warm})  # first-step costs
            log(f"  engine {name} ready after {self.startup_s[name]:.0f} s")
        return {n: self.engines[n] for n in names}

    def counters(self, name: str) -> dict[str, Any]:
        assert self.address is not None
        return daemon_counters(self.address, self.revision(name))

    def model_desc(self) -> str:
        return (
            f"Qwen3-0.6B shape with {self.args.small_layers} layers ({self.args.dtype}), "
            f"{self.bpt:,} KV bytes/token ({self.bpt * BLOCK_TOKENS / 2**20:g} MiB per block), "
            f"engine KV cache {self.args.small_blocks} blocks "
            f"({self.args.small_blocks * BLOCK_TOKENS:,} tokens), max_model_len {self.max_model_len:,}"
        )

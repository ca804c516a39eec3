"""The engine role: runs inside the vLLM environment's interpreter (``seed_experiment.py --engine
SPEC``), builds one ``vllm.LLM`` and answers one ``SEED {json}`` line per JSON command on stdin:

* ``{"op": "generate", "ids": [...], "max_tokens": 1, "cache_salt": "t1"}`` (``cache_salt``
  optional: vLLM's per-request salt, on the prompt dict) -> ``ttft_s`` (vLLM's
  ``first_token_latency``: arrival to first token), ``wall_s``, ``admit_s`` and ``run_s`` (vLLM's
  engine-core stamps: queued to first scheduled, and on to the first token), ``num_cached_tokens``,
  ``prompt_tokens``, ``sources`` (deltas of ``vllm:prompt_tokens_by_source`` over the request) and
  ``output`` (the generated ids), and with a connector ``kvtier`` (the request's deltas of the
  counters ``metrics`` reads: tokens loaded, blocks whose load failed...); one request at a time.
* ``{"op": "metrics"}`` -> ``kvtier``: every vLLM counter whose name has ``kvtier`` in it (the
  connector's decisions and budget: docs/vllm.md), summed over labels.
* ``{"op": "clients", "clients": [[ids, ...], ...], "max_tokens": n}``: closed-loop clients in
  one engine. Each client sends its prompts one after the other, the next as soon as the previous
  finished; all clients start together, so several requests are in flight and vLLM batches them
  (``LLMEngine.add_request`` / ``step``, the loop under ``LLM.generate``). -> per request
  ``client``, ``index``, ``ttft_s`` (from ``add_request`` to the ``step`` that returned its first
  token), ``itl_s`` (the gaps between its later tokens, as the steps returned them),
  ``num_cached_tokens``; and the phase's ``sources`` and ``wall_s``. ``"max_tokens_each": [n, ...]``
  (optional): one answer length per client instead.
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from seed.common import PROTO, SOURCES


def engine_main(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Counter

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=spec["dtype"],
        seed=0,
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    if spec.get("num_blocks"):  # a KV cache of exactly this many blocks
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("max_num_batched_tokens"):  # e.g. a long prompt in one prefill step
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    llm = LLM(**kwargs)
    with_kvtier = spec.get("connector") is not None

    def params(n: int) -> Any:
        return SamplingParams(temperature=0, max_tokens=n, detokenize=False, ignore_eos=True)

    def by_source() -> dict[str, int]:
        out = dict.fromkeys(SOURCES, 0)
        for m in llm.get_metrics():
            if m.name == "vllm:prompt_tokens_by_source" and isinstance(m, Counter):
                out[m.labels["source"]] += int(m.value)
        return out

    def kvtier_counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if "kvtier" in m.name and isinstance(m, Counter):
                out[m.name] = out.get(m.name, 0.0) + float(m.value)
        # get_metrics rounds counters down to integers: kvtier's seconds from the registry
        from prometheus_client import REGISTRY

        for fam in REGISTRY.collect():
            if fam.type == "counter" and "kvtier" in fam.name and "seconds" in fam.name:
                total = sum(x.value for x in fam.samples if x.name.endswith("_total"))
                out[fam.name] = total
        return out

    def changed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}

    def answer(obj: dict[str, Any]) -> None:
        print(PROTO + json.dumps(obj), flush=True)

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        before = by_source()
        k0 = kvtier_counters() if with_kvtier and cmd["op"] == "generate" else {}
        t0 = time.perf_counter()
        if cmd["op"] == "generate":
            prompt: dict[str, Any] = {"prompt_token_ids": cmd["ids"]}
            if cmd.get("cache_salt"):
                prompt["cache_salt"] = cmd["cache_salt"]
            (out,) = llm.generate([prompt], params(cmd.get("max_tokens", 1)), use_tqdm=False)
            wall = time.perf_counter() - t0
            after = by_source()
            ttft = getattr(out.metrics, "first_token_latency", 0.0) or wall
            stamps = [getattr(out.metrics, k, 0.0) for k in ("queued_ts", "scheduled_ts", "first_token_ts")]
            answer(
                {
                    "ttft_s": ttft,
                    "wall_s": wall,
                    "num_cached_tokens": out.num_cached_tokens or 0,
                    "prompt_tokens": len(cmd["ids"]),
                    # vLLM's engine-core stamps: queued -> first scheduled -> first token
                    "admit_s": stamps[1] - stamps[0] if all(stamps) else None,
                    "run_s": stamps[2] - stamps[1] if all(stamps) else None,
                    "output": list(out.outputs[0].token_ids),
                    "sources": {s: after[s] - before[s] for s in SOURCES},
                    "kvtier": changed(k0, kvtier_counters()) if with_kvtier else {},
                }
            )
        elif cmd["op"] == "metrics":
            answer({"kvtier": kvtier_counters()})
        elif cmd["op"] == "clients":
            each = cmd.get("max_tokens_each") or [cmd["max_tokens"]] * len(cmd["clients"])
            reqs = run_clients(llm.llm_engine, cmd["clients"], [params(n) for n in each])
            after = by_source()
            answer(
                {
                    "requests": reqs,
                    "wall_s": time.perf_counter() - t0,
                    "sources": {s: after[s] - before[s] for s in SOURCES},
                }
            )
    answer({"bye": True})


def run_clients(engine: Any, clients: list[list[list[int]]], params: list[Any]) -> list[dict[str, Any]]:
    """Closed-loop clients (see the module docstring); returns one record per request."""
    recs: dict[str, dict[str, Any]] = {}
    last_tok: dict[str, float] = {}
    got: dict[str, int] = {}
    nxt = [0] * len(clients)

    def submit(c: int) -> None:
        if nxt[c] >= len(clients[c]):
            return
        rid = f"c{c}-{nxt[c]}"
        ids = clients[c][nxt[c]]
        recs[rid] = {
            "client": c,
            "index": nxt[c],
            "prompt_tokens": len(ids),
            "ttft_s": None,
            "itl_s": [],
            "t_add": time.perf_counter(),
        }
        nxt[c] += 1
        got[rid] = 0
        engine.add_request(rid, {"prompt_token_ids": ids}, params[c])

    for c in range(len(clients)):
        submit(c)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            rec = recs[rid]
            n = len(out.outputs[0].token_ids)
            if n > got[rid]:
                if rec["ttft_s"] is None:
                    rec["ttft_s"] = now - rec["t_add"]
                else:
                    rec["itl_s"].append((now - last_tok[rid]) / (n - got[rid]))
                last_tok[rid] = now
                got[rid] = n
            if out.finished:
                rec["num_cached_tokens"] = out.num_cached_tokens or 0
                rec["done_s"] = now - rec["t_add"]
                submit(rec["client"])
    for rec in recs.values():
        rec["t_add"] -= t0
    return list(recs.values())

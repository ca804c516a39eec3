"""Multi-turn chats (``--chats``): each next prompt is the chat's history (every earlier message and
answer) plus a new message, as token ids (no chat template: the ids of the model's answer are
resent exactly as generated, which a text client goes through a template to do; docs/vllm.md §4,
"Generated blocks", says what a template changes).

``--chat-count`` chats run ``--chat-turns`` turns each, interleaved (turn 1 of every chat, then
turn 2, ...), one request at a time, so between two turns of one chat the others' requests pass
through the engine's small KV cache (``--chat-blocks``). Two engines run side by side, the engine
alone and the engine + kvtier (``store_generated`` at its default, on); every request goes to
both, alternating which one goes first, and each engine keeps its own histories (its own
answers). Per request: TTFT, and the prompt tokens by source split by what the tokens are:
history (earlier messages) or earlier answers (generated), from the positions vLLM reports (its
own cache hit is the prompt's first tokens, kvtier's loaded tokens the next ones).
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from seed.common import CHECK2_HINT, EngineSet, log, random_ids

ARMS = ("alone", "kvtier")


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per chat, the ids of each turn's new message (the first one longer: a system prompt and a
    question, or a pasted document)."""
    rng = random.Random(args.seed + 2000)
    firsts = rng.sample(range(3, args.vocab), args.chat_count)
    out = []
    for first in firsts:
        msgs = [random_ids(rng, rng.randint(*args.chat_first), args.vocab, first)]
        msgs += [
            random_ids(rng, rng.randint(*args.chat_message), args.vocab) for _ in range(args.chat_turns - 1)
        ]
        out.append(msgs)
    return out


def split(origin: str, lo: int, hi: int) -> tuple[int, int]:
    """(history tokens, generated tokens) among prompt positions [lo, hi)."""
    part = origin[lo:hi]
    return part.count("u"), part.count("g")


def run(args: argparse.Namespace, es: EngineSet) -> tuple[str, dict[str, Any], bool]:
    bpt = es.bpt
    chats = conversations(args)
    records: list[dict[str, Any]] = []
    started = es.start(["alone", "sync"])
    engines = {"alone": started["alone"], "kvtier": started["sync"]}
    d0 = es.counters("sync")
    hist: dict[str, list[list[int]]] = {arm: [[] for _ in chats] for arm in ARMS}
    origin = {arm: ["" for _ in chats] for arm in ARMS}  # "u" history, "g" generated
    k = 0
    for turn in range(args.chat_turns):
        for c, msgs in enumerate(chats):
            for arm in ARMS if k % 2 == 0 else ARMS[::-1]:
                prompt = hist[arm][c] + msgs[turn]
                org = origin[arm][c] + "u" * len(msgs[turn])
                rec = engines[arm].call({"op": "generate", "ids": prompt, "max_tokens": args.chat_answer})
                src = rec["sources"]
                h, n = src["local_cache_hit"], src["external_kv_transfer"]
                rec.update(arm=arm, turn=turn + 1, chat=c, earlier_answers=org.count("g"))
                rec["engine_hit_history"], rec["engine_hit_generated"] = split(org, 0, h)
                rec["loaded_history"], rec["loaded_generated"] = split(org, h, h + n)
                records.append(rec)
                hist[arm][c] = prompt + rec["output"]
                origin[arm][c] = org + "g" * len(rec["output"])
                log(
                    f"  chats {arm} turn {turn + 1} chat {c}: {len(prompt)} tokens, TTFT "
                    f"{rec['ttft_s']:.2f}s, computed {src['local_compute']}, cache {h}, "
                    f"kvtier {n} ({rec['loaded_generated']} generated)"
                )
            k += 1
    d1 = es.counters("sync")
    out_bytes = d1["bytes_out_shm"] - d0["bytes_out_shm"]
    loaded = sum(r["sources"]["external_kv_transfer"] for r in records)
    check1 = all(sum(r["sources"].values()) == r["prompt_tokens"] for r in records)
    check2 = out_bytes % bpt == 0 and out_bytes // bpt == loaded
    same = sum(1 for a, b in zip(records[0::2], records[1::2], strict=True) if a["output"] == b["output"])
    table = markdown(records, args)
    report = (
        f"{args.chat_count} chats × {args.chat_turns} turns; first message "
        f"{'-'.join(map(str, args.chat_first))} tokens, later messages "
        f"{'-'.join(map(str, args.chat_message))}, answers {args.chat_answer} tokens "
        f"(ignore_eos); engines 'alone' and 'sync' of the small set.\n\n"
        f"{table}\n\nCheck 1 (computed + engine cache hit + loaded = prompt, every request): "
        f"{'ok' if check1 else 'FAIL'}. Check 2 (daemon bytes out {out_bytes:,} ÷ {bpt:,} = "
        f"{out_bytes / bpt:,.2f} = loaded tokens {loaded:,}): "
        f"{'ok' if check2 else 'FAIL' + CHECK2_HINT}. "
        f"Answers identical in both engines: {same} of {len(records) // 2} turns. Daemon stores "
        f"accepted: {d1['stores_accepted'] - d0['stores_accepted']:,} blocks."
    )
    return report, {"records": records, "bytes_out": out_bytes}, check1 and check2


def markdown(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        "| turn | chats | prompt tokens | of them earlier answers | kvtier: engine cache hit "
        "| kvtier: loaded history | kvtier: loaded generated | kvtier: computed "
        "| alone: engine cache hit | alone: computed | median TTFT kvtier s | median TTFT alone s "
        "| kvtier / alone |"
    )
    lines = [head, "|" + " --- |" * 13]
    for turn in range(1, args.chat_turns + 1):
        by = {arm: [r for r in records if r["turn"] == turn and r["arm"] == arm] for arm in ARMS}
        kv, al = by["kvtier"], by["alone"]

        def tot(rs: list[dict[str, Any]], key: str) -> int:
            return sum(r[key] if key in r else r["sources"][key] for r in rs)

        t_kv = statistics.median(r["ttft_s"] for r in kv)
        t_al = statistics.median(r["ttft_s"] for r in al)
        lines.append(
            f"| {turn} | {len(kv)} | {tot(kv, 'prompt_tokens'):,} | {tot(kv, 'earlier_answers'):,} "
            f"| {tot(kv, 'local_cache_hit'):,} | {tot(kv, 'loaded_history'):,} "
            f"| {tot(kv, 'loaded_generated'):,} | {tot(kv, 'local_compute'):,} "
            f"| {tot(al, 'local_cache_hit'):,} | {tot(al, 'local_compute'):,} "
            f"| {t_kv:.3f} | {t_al:.3f} | {t_kv / t_al:.2f}× |"
        )
    return "\n".join(lines)

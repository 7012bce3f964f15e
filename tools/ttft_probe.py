"""Time to first token of one request at a time, with the prefill graphs and without them,
in one process (alternating, so both see the same GPU state).

    python3 tools/ttft_probe.py --shape 0.5B --lengths 16,128,500 --reps 10 [--attention-backend B]

Each request is a fresh random prompt (nothing cached) with max_tokens=1: what generate()
takes from the call to the returned token, the prefill step and the host work around it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from nanoqwen import LLM, SamplingParams


def ttft_ms(llm: LLM, length: int, rng: random.Random) -> float:
    prompt = [rng.randrange(1, 30000) for _ in range(length)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--lengths", default="16,128,500")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--attention-backend", default="auto")
    a = ap.parse_args()
    llm = LLM(
        random_shape=a.shape, device="cuda", dtype="bfloat16", progress=False,
        attention_backend=a.attention_backend,
    )  # fmt: skip
    graphs = llm.runner.prefill_graphs
    rng = random.Random(0)
    for length in map(int, a.lengths.split(",")):
        times: dict[str, list[float]] = {"graph": [], "eager": []}
        for rep in range(a.reps + 1):  # the first round warms both up
            for mode in ("graph", "eager"):
                llm.runner.prefill_graphs = graphs if mode == "graph" else None
                ms = ttft_ms(llm, length, rng)
                if rep:
                    times[mode].append(ms)
        med = {m: round(statistics.median(v), 2) for m, v in times.items()}
        ratio = round(med["eager"] / med["graph"], 2)
        row = {"shape": a.shape, "backend": a.attention_backend, "prompt": length}
        print(json.dumps(row | {"ttft_ms": med, "x": ratio}))


if __name__ == "__main__":
    main()

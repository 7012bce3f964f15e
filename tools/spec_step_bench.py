"""The cost of a speculative verify step against a plain decode step, at batch 1, on random
weights of a real shape: what decides how far an acceptance rate turns into speed.

    python3 tools/spec_step_bench.py --shape 7B [--k 4] [--context 512] [--steps 200]

Plain: steps of the engine decoding one sequence (CUDA graphs, one step ahead). Verify: the
runner's verify step of the same sequence with k proposed tokens (eager), which waits for
its tokens. Prints both medians and their ratio, and the ratio each acceptance rate would
need to pay off: a verify step gains 1 + the accepted tokens."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.scheduler import Batch


def timed(fn, steps: int) -> float:
    """Median milliseconds of fn over steps calls, after 10 unmeasured ones."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    llm = LLM(random_shape=a.shape, device="cuda", max_num_seqs=8, progress=False)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    seq = llm.add_request(list(range(1, a.context + 1)), params)
    while seq.num_output_tokens < 2:
        llm.step()
    plain = timed(llm.step, a.steps)
    llm.drain()
    proposal = [7] * a.k
    llm.scheduler.blocks.grow(seq, len(seq) + a.k)
    batch = Batch([seq], False, [1], [proposal])
    verify = timed(lambda: llm.runner.verify(batch), a.steps)
    print(json.dumps({
        "shape": a.shape, "k": a.k, "context": len(seq), "plain_step_ms": round(plain, 4),
        "verify_step_ms": round(verify, 4), "verify_over_plain": round(verify / plain, 3),
        # Tokens per verify step needed to beat plain decoding: verify / plain.
        "break_even_tokens_per_step": round(verify / plain, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

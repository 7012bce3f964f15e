"""The cost of a speculative verify step against a plain decode step, at batch 1, on random
weights of a real shape: what decides how far an acceptance rate turns into speed.

    python3 tools/spec_step_bench.py --shape 7B [--k 4] [--context 512] [--steps 200]

Plain: steps of the engine decoding one sequence (CUDA graphs, one step ahead). Verify: the
runner's verify step of the same sequence with k proposed tokens, which waits for its
tokens: replayed as a CUDA graph (runtime/spec/verify_graph.py), and eagerly. Prints the
medians and the ratios: a verify step pays off once it gains that many tokens (1 + the
accepted ones)."""

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
    spec = {"method": "ngram", "num_speculative_tokens": a.k}
    llm = LLM(random_shape=a.shape, device="cuda", max_num_seqs=8, speculative_config=spec,
              progress=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    seq = llm.add_request(list(range(1, a.context + 1)), params)
    while seq.num_output_tokens < 2:
        llm.step()
    # Plain steps, pipelined as without speculation.
    speculator, propose = llm.speculator, llm.scheduler.propose
    llm.speculator, llm.scheduler.propose = None, None
    plain = timed(llm.step, a.steps)
    llm.drain()
    llm.speculator, llm.scheduler.propose = speculator, propose
    proposal = [7] * a.k
    llm.scheduler.blocks.grow(seq, len(seq) + a.k)
    batch = Batch([seq], False, [1], [proposal])
    graphed = timed(lambda: llm.runner.verify(batch), a.steps)
    llm.runner.verify_graphs = None
    eager = timed(lambda: llm.runner.verify(batch), a.steps)
    print(json.dumps({
        "shape": a.shape, "k": a.k, "context": len(seq), "plain_step_ms": round(plain, 4),
        "verify_graph_ms": round(graphed, 4), "verify_eager_ms": round(eager, 4),
        # Tokens a verify step must gain to beat plain decoding.
        "verify_over_plain": round(graphed / plain, 3),
        "eager_verify_over_plain": round(eager / plain, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

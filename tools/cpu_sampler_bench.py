"""The CPU sampler's C passes against its torch passes, same process, same tokens checked.

    python3 tools/cpu_sampler_bench.py            # one row of 151,936 random logits
    python3 tools/cpu_sampler_bench.py --engine   # the default model, 64 new tokens a run

Without --engine: ms a step over random logits (N(0, 3^2); real logits are more peaked,
which the C draw's pruning favours). With --engine: generate() tok/s of the default model
(best of two alternating runs each), prompt of 64 tokens, prefill included.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.sampling.passes import NativePasses, TorchPasses
from nanoqwen.runtime.sampling.sampler import Sampler
from nanoqwen.runtime.sequence import Sequence

SETTINGS = {
    "greedy": dict(temperature=0),
    "CLI default": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "top-k 200": dict(temperature=1.0, top_k=200),
    "temperature 1": dict(temperature=1.0),
}
PASSES = {"torch": TorchPasses, "C": NativePasses}


def step_ms(settings: dict, passes, vocab: int = 151936, steps: int = 30) -> tuple[float, list]:
    sampler = Sampler(frozenset([0]), vocab, 4, torch.device("cpu"))
    sampler.passes = passes()
    seq = Sequence(list(range(100, 164)), SamplingParams(**settings))
    seq.sampling_seed = 7
    sampler.admit([seq])
    slots = torch.tensor(sampler.slots([seq]))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    tokens = [int(sampler(logits, slots, sampler.filtering)) for _ in range(20)]
    t = time.perf_counter()
    for _ in range(steps):
        sampler(logits, slots, sampler.filtering)
    return (time.perf_counter() - t) / steps * 1e3, tokens


def engine_tok_s(llm: LLM, settings: dict, passes) -> tuple[float, list]:
    llm.runner.sampler.passes = passes()
    params = SamplingParams(max_tokens=64, ignore_eos=True, seed=3, **settings)
    t = time.perf_counter()
    out = llm.generate([list(range(100, 164))], params)
    return 64 / (time.perf_counter() - t), out[0].token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true")
    a = ap.parse_args()
    llm = LLM(progress=False) if a.engine else None
    unit = "tok/s" if a.engine else "ms a step"
    print(f"| settings | torch {unit} | C {unit} | same tokens |\n|---|---|---|---|")
    for name, settings in SETTINGS.items():
        found = {}
        for which in ("torch", "C", "torch", "C"):
            if a.engine:
                value, tokens = engine_tok_s(llm, settings, PASSES[which])
            else:
                value, tokens = step_ms(settings, PASSES[which])
            best = max if a.engine else min
            old = found.get(which)
            found[which] = (best(value, old[0]) if old else value, tokens)
        same = found["torch"][1] == found["C"][1]
        print(f"| {name} | {found['torch'][0]:.3f} | {found['C'][0]:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()

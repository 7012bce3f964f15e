"""Decode speed with and without structured output, in one process: a batch of JSON-schema
requests against the same batch unconstrained, at batch 64 and batch 1.

    python3 tools/structured_bench.py --model DIR [--batch-sizes 1,64] [--new-tokens 256]

DIR is a checkpoint with a tokenizer (the grammar is compiled against its vocabulary); on
the GPU machine, random weights of a real shape with Qwen2.5's tokenizer, as .peer/pair.py
prepares them (`python3 .peer/pair.py --run prepare --shape 7B` -> /tmp/pair-model-7B).

The schema is an array of at least 1,000 records, so no request ends before --new-tokens
whatever the weights: both sides decode the same number of tokens at the same batch size.
Each figure is the median of --reps timed runs after one warm-up (which also compiles the
grammar)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from nanoqwen import LLM, SamplingParams

SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number"},
        },
        "required": ["id", "name", "tags", "score"],
    },
}


def tokens_per_second(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(o.finish_reason == "length" for o in outs), [o.text[-80:] for o in outs]
    return sum(len(o.token_ids) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(a.model, device="cuda", dtype="bfloat16", progress=False)
    rng = random.Random(0)
    free = SamplingParams(temperature=0.6, max_tokens=a.new_tokens, ignore_eos=True, seed=0)
    constrained = SamplingParams(
        temperature=0.6, max_tokens=a.new_tokens, seed=0, structured_output={"json": SCHEMA}
    )
    for batch in map(int, a.batch_sizes.split(",")):
        prompts = [[rng.randrange(1, 30000) for _ in range(128)] for _ in range(batch)]
        figures = {}
        for name, params in (("free", free), ("json_schema", constrained)):
            tokens_per_second(llm, prompts, params)  # warm-up
            runs = [tokens_per_second(llm, prompts, params) for _ in range(a.reps)]
            figures[name] = round(statistics.median(runs), 1)
        ratio = figures["json_schema"] / figures["free"]
        print(json.dumps({"model": a.model, "batch": batch, "new_tokens": a.new_tokens,
                          "tok_s": figures, "ratio": round(ratio, 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

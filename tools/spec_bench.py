"""Speculative decoding on a code-editing workload: the plain engine against each
--speculative-config, all loaded in one process and taking turns request by request, greedy,
one request at a time.

    python3 tools/spec_bench.py [--model PATH] [--device cpu] [--quantization none] \
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' ...

The workload (tools/data/code_edit.json): 8 Python files of 300-600 tokens, each sent as a
chat message asking for the whole file back with one change, which is where prompt lookup
pays: most of the answer is in the prompt. Each engine answers one short request unmeasured
(warm-up); then, --reps times over the prompts, every engine answers each prompt in turn
(the order rotating from prompt to prompt), so that a machine whose speed drifts (a shared
CI machine) slows every engine alike. tok/s is an engine's output tokens over its time
(prefill included); decode tok/s counts the tokens after each request's first over the time
after it (the prefill left out). Every speculative answer must equal the plain one, token
for token: the run fails otherwise."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from nanoqwen import LLM, SamplingParams
from nanoqwen.bench.runs import speculation

WORKLOAD = Path(__file__).with_name("data") / "code_edit.json"


def conversations() -> list[list[dict]]:
    items = json.loads(WORKLOAD.read_text())
    return [
        [{"role": "user", "content": f"{it['instruction']}. Answer with the whole changed file "
          f"in one Python code block and nothing else.\n\n```python\n{it['code']}```"}]
        for it in items
    ]  # fmt: skip


@dataclass
class Tally:
    """One engine's requests so far: tokens, seconds, and the same after the first token."""

    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def add(self, out, seconds: float) -> None:
        self.tokens += len(out.token_ids)
        self.seconds += seconds
        self.decode_tokens += len(out.token_ids) - 1
        self.decode_seconds += out.metrics["latency_s"] - out.metrics["ttft_s"]


def run(engines: list[LLM], prompts, params: SamplingParams, reps: int):
    """Each engine's Tally, its last outputs and its stats() before and after."""
    for engine in engines:
        engine.chat(prompts[0], SamplingParams(temperature=0, max_tokens=16))  # warm-up
    before = [engine.stats() for engine in engines]
    tallies = [Tally() for _ in engines]
    outputs: list[list] = [[None] * len(prompts) for _ in engines]
    turn = 0
    for _ in range(reps):
        for i, p in enumerate(prompts):
            for e in [(turn + j) % len(engines) for j in range(len(engines))]:
                start = time.perf_counter()
                out = engines[e].chat(p, params)[0].output
                tallies[e].add(out, time.perf_counter() - start)
                outputs[e][i] = out.token_ids
            turn += 1
    return tallies, outputs, before, [engine.stats() for engine in engines]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the CLI's default model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default="auto", help="the target's (none: bf16 weights)")
    ap.add_argument("--spec", action="append", default=[], help="a speculative_config (JSON)")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json", dest="json_path", default=None)
    a = ap.parse_args()
    prompts = conversations()
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    specs = [None, *a.spec]
    engines = [LLM(a.model, device=a.device, quantization=a.quantization,
                   speculative_config=spec, progress=False) for spec in specs]  # fmt: skip
    tallies, outputs, before, after = run(engines, prompts, params, a.reps)
    plain = tallies[0]
    rows = []
    for spec, tally, out, b, f in zip(specs, tallies, outputs, before, after):
        counts = ("spec_verified", "spec_proposed_tokens", "spec_accepted_tokens")
        rate, decode = tally.tokens / tally.seconds, tally.decode_tokens / tally.decode_seconds
        row = {"speculative_config": spec, "tok_s": round(rate, 2),
               "x_plain": round(rate / (plain.tokens / plain.seconds), 3),
               "decode_tok_s": round(decode, 2),
               "x_plain_decode": round(decode / (plain.decode_tokens / plain.decode_seconds), 3),
               "same_output": out == outputs[0], "output_tokens": sum(map(len, out)),
               **{k: f[k] - b[k] for k in counts if k in f}, **speculation(b, f)}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not all(row["same_output"] for row in rows):
        raise SystemExit("speculative output differs from plain output")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

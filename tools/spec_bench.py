"""Speculative decoding on a code-editing workload: the plain engine against each
--speculative-config, one after the other in one process, greedy, one request at a time.

    python3 tools/spec_bench.py [--model PATH] [--device cpu] [--quantization none] \
        --spec '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' ...

The workload (tools/data/code_edit.json): 8 Python files of 300-600 tokens, each sent as a
chat message asking for the whole file back with one change, which is where prompt lookup
pays: most of the answer is in the prompt. Each engine answers one short request unmeasured
(warm-up), then makes --reps timed passes over the prompts; a figure is output tokens over
the wall time of a pass (prefill included), the median pass. Every speculative answer must
equal the plain one, token for token: the run fails otherwise."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
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


def run(engine: LLM, prompts, params: SamplingParams, reps: int) -> tuple[float, list, dict]:
    engine.chat(prompts[0], SamplingParams(temperature=0, max_tokens=16))  # warm-up
    before = engine.stats()
    rates = []
    for _ in range(reps):
        start, outputs = time.perf_counter(), []
        for p in prompts:
            outputs.append(engine.chat(p, params)[0].output.token_ids)
        rates.append(sum(map(len, outputs)) / (time.perf_counter() - start))
    after = engine.stats()
    counts = ("spec_verified", "spec_proposed_tokens", "spec_accepted_tokens")
    stats = {k: after[k] - before[k] for k in counts if k in after}
    return statistics.median(rates), outputs, stats | speculation(before, after)


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
    rows, plain = [], None
    for spec in [None, *a.spec]:
        engine = LLM(a.model, device=a.device, quantization=a.quantization,
                     speculative_config=spec, progress=False)  # fmt: skip
        rate, outputs, stats = run(engine, prompts, params, a.reps)
        del engine
        gc.collect()
        if plain is None:
            plain = (rate, outputs)
        same = outputs == plain[1]
        row = {"speculative_config": spec, "tok_s": round(rate, 2),
               "x_plain": round(rate / plain[0], 3), "same_output": same,
               "output_tokens": sum(len(o) for o in outputs), **stats}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not same:
            raise SystemExit("speculative output differs from plain output")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

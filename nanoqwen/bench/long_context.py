"""The long-context benchmark: time to first token of one long prompt, decode speed at that
context, and the inter-token latency of running streams while such a prompt arrives (which
mixed steps keep near a decode step's: runtime/scheduler.py)."""

from __future__ import annotations

import random
import time

from nanoqwen.bench.runs import pct
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams
from nanoqwen.runtime.sequence import Sequence

STREAM_PROMPT = 128
WARM_TOKENS = 8  # each stream's tokens before the latency before the prompt is measured
BEFORE_STEPS = 32  # steps measured before the long prompt arrives


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(min(10000, vocab)) for _ in range(n)]


def _run_until(llm: LLM, done, on_step=None) -> None:
    while not done():
        resolved = llm.step()
        if on_step is not None:
            on_step(time.perf_counter(), resolved)


def long_context_run(
    llm: LLM, prompt_len: int, streams: int, new_tokens: int, rng: random.Random, sampling: dict
) -> dict:
    vocab = llm.config.vocab_size
    # 1. Streams decode; a long prompt arrives; their token gaps before and during its prefill.
    forever = SamplingParams(max_tokens=llm.max_model_len - STREAM_PROMPT, ignore_eos=True,
                             **sampling)  # fmt: skip
    running = [llm.add_request(_prompt(rng, STREAM_PROMPT, vocab), forever) for _ in range(streams)]
    _run_until(llm, lambda: min(s.num_output_tokens for s in running) >= WARM_TOKENS)
    last: dict[int, float] = {}
    gaps: dict[str, list[float]] = {"before": [], "during": []}
    phase = "before"

    def record(now: float, resolved: list[tuple[Sequence, int]]) -> None:
        for seq, _ in resolved:
            if seq.seq_id in last:
                gaps[phase].append((now - last[seq.seq_id]) * 1e3)
            last[seq.seq_id] = now

    ids = {s.seq_id for s in running}
    _run_until(llm, lambda: len(gaps["before"]) >= BEFORE_STEPS * streams,
               lambda now, r: record(now, [x for x in r if x[0].seq_id in ids]))  # fmt: skip
    phase = "during"
    arrived = time.perf_counter()
    long = llm.add_request(_prompt(rng, prompt_len, vocab), SamplingParams(max_tokens=1))
    _run_until(llm, lambda: long.first_token_time is not None,
               lambda now, r: record(now, [x for x in r if x[0].seq_id in ids]))  # fmt: skip
    ttft_loaded = time.perf_counter() - arrived
    llm.abort(running)
    _run_until(llm, lambda: not llm.scheduler.has_unfinished())
    llm.drain()
    # 2. The long prompt alone: its time to first token, then decode at that context.
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **sampling)
    start = time.perf_counter()
    alone = llm.add_request(_prompt(rng, prompt_len, vocab), params)
    _run_until(llm, lambda: alone.first_token_time is not None)
    first = time.perf_counter()
    _run_until(llm, lambda: alone.is_finished)
    llm.drain()
    decode_s = time.perf_counter() - first
    before, during = gaps["before"], gaps["during"]
    return {
        "prompt_len": prompt_len,
        "streams": streams,
        "ttft_ms": (first - start) * 1e3,
        "decode_tok_s": (alone.num_output_tokens - 1) / decode_s,
        "ttft_ms_with_streams": ttft_loaded * 1e3,
        "itl_ms_p50_before": pct(before, 50),
        "itl_ms_p50_during": pct(during, 50),
        "itl_ms_p99_during": pct(during, 99),
        "itl_ms_max_during": max(during) if during else float("nan"),
        "itl_p99_during_over_p50_before": pct(during, 99) / pct(before, 50),
        "stream_tokens_during": len(during),
    }

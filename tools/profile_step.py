"""Where the GPU time of one kind of step goes, on random weights of a real shape: a
decode step, a speculative verify step, or a mixed step (running streams' tokens beside a
chunk of a long prompt).

    python3 tools/profile_step.py --shape 7B --step mixed --streams 64 --prompt-len 30000 \
        --budget 256 [--at 0.85]
    python3 tools/profile_step.py --shape 0.5B --step verify --k 4
    python3 tools/profile_step.py --shape 0.5B --step decode --streams 64 --context 8192 \
        --kv-cache-dtype fp8

Prints the wall time of a step (median after 10 unmeasured, each between two
synchronisations), the GPU time
of its kernels (summed, per step) and the kernels that take most of it."""

from __future__ import annotations

import argparse

import torch
from spec_step_bench import timed  # tools/, beside this script

from nanoqwen import LLM, SamplingParams
from nanoqwen.runtime.scheduler import Batch

GREEDY = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)


def profile(fn, steps: int, rows: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / steps / 1e3
    print(f"GPU kernel time per step: {total:.3f} ms")
    print(events.table(sort_by="device_time_total", row_limit=rows))


def decode_setup(llm: LLM, a) -> tuple:
    vocab = min(10_000, llm.config.vocab_size)
    for i in range(a.streams):
        llm.add_request([(i * 31 + j) % vocab for j in range(a.context)], GREEDY)
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(5):
        llm.step()
    return llm.step, 50


def verify_setup(llm: LLM, a) -> tuple:
    vocab = min(10_000, llm.config.vocab_size)
    seq = llm.add_request([(j + 1) % vocab for j in range(a.context)], GREEDY)
    while seq.num_output_tokens < 2:
        llm.step()
    llm.drain()
    llm.scheduler.blocks.grow(seq, len(seq) + a.k)
    batch = Batch([seq], False, [1], [[7] * a.k])
    return (lambda: llm.runner.verify(batch)), 50


def mixed_setup(llm: LLM, a) -> tuple:
    """Streams decoding, then a long prompt: each step until it is in is a mixed step."""
    step, _ = decode_setup(llm, argparse.Namespace(streams=a.streams, context=128))
    vocab = min(10_000, llm.config.vocab_size)
    long = llm.add_request([(7 * j + 1) % vocab for j in range(a.prompt_len)], GREEDY)
    for _ in range(3):  # warm: the first mixed steps compile and tune
        step()
    if long.num_computed_tokens == 0:
        raise SystemExit("the long prompt was not admitted beside the streams")
    while long.num_computed_tokens < a.at * len(long):  # later chunks see a longer context
        step()
    left = (len(long) - long.num_computed_tokens) // max(1, a.budget - a.streams)
    # Profiled, then timed after 10 more: all of them while the prompt still has chunks.
    steps = min(20, (left - 13) // 2)
    if steps < 1:
        raise SystemExit(f"--prompt-len {a.prompt_len} gives too few mixed steps to measure")
    return step, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.5B")
    ap.add_argument("--step", choices=("decode", "verify", "mixed"), default="decode")
    ap.add_argument("--streams", type=int, default=1, help="decode and mixed: sequences")
    ap.add_argument("--context", type=int, default=512, help="decode and verify: prompt tokens")
    ap.add_argument("--k", type=int, default=4, help="verify: proposed tokens")
    ap.add_argument("--prompt-len", type=int, default=32768, help="mixed: the long prompt")
    ap.add_argument("--budget", type=int, default=256, help="mixed: max_num_batched_tokens")
    ap.add_argument("--at", type=float, default=0.0,
                    help="mixed: profile once this fraction of the prompt is in")  # fmt: skip
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rows", type=int, default=20, help="kernels to list")
    a = ap.parse_args()
    # mixed: the streams and the long prompt run together.
    options = dict(random_shape=a.shape, device="cuda", kv_cache_dtype=a.kv_cache_dtype,
                   max_num_seqs=max(8, a.streams + 1), progress=False)  # fmt: skip
    if a.step == "verify":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": a.k}
    if a.step == "mixed":
        options |= {"max_num_batched_tokens": a.budget, "max_model_len": a.prompt_len + 1024}
    llm = LLM(**options)
    fn, steps = {"decode": decode_setup, "verify": verify_setup, "mixed": mixed_setup}[a.step](
        llm, a
    )
    if a.step == "mixed":  # each mixed step happens once: profile them, time them alike
        profile(fn, steps, a.rows)
        print(f"mixed step wall time: {timed(fn, steps):.3f} ms (median of {steps})")
        return
    print(f"{a.step} step wall time: {timed(fn, steps):.3f} ms (median of {steps})")
    profile(fn, 10, a.rows)


if __name__ == "__main__":
    main()

"""What `nanoqwen bench` runs: its request workloads and its sampling presets."""

from __future__ import annotations

import random

from nanoqwen.errors import InvalidInputError

PRESETS = {
    "greedy": dict(temperature=0.0),
    # The CLI's defaults for Qwen2.5 checkpoints (their generation_config.json).
    "cli": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "t0.6": dict(temperature=0.6),
    "t1-p0.9": dict(temperature=1.0, top_p=0.9),
}
PRESET_HELP = {k: ", ".join(f"{n}={v}" for n, v in d.items()) for k, d in PRESETS.items()}
PRESET_HELP["custom"] = "the flags below"


def preset(name: str, args) -> dict:
    if name == "custom":
        return dict(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, logprobs=args.logprobs,
        )  # fmt: skip
    if name not in PRESETS:
        raise InvalidInputError(f"--sampling {name} is unknown: allowed {', '.join(PRESET_HELP)}")
    return PRESETS[name]


def throughput_workload(num_requests: int, seed: int, vocab: int = 10001):
    """nano-vllm's benchmark workload: all prompts drawn first, then all output lengths."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, min(10000, vocab - 1)) for _ in range(rng.randint(100, 1024))]
        for _ in range(num_requests)
    ]
    out_lens = [rng.randint(100, 1024) for _ in range(num_requests)]
    return prompts, out_lens


def prefix_workload(num_requests: int, seed: int, vocab: int, num_prefixes: int,
                    prefix_len: int, suffix_len: int, output_len: int):  # fmt: skip
    """Every request: one of num_prefixes shared prefixes, then suffix_len tokens of its own;
    requests of one prefix are spread over the run, as a chat service's system prompts are."""
    rng = random.Random(seed)
    top = min(10000, vocab - 1)
    prefixes = [[rng.randint(0, top) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [
        prefixes[i % num_prefixes] + [rng.randint(0, top) for _ in range(suffix_len)]
        for i in range(num_requests)
    ]
    return prompts, [output_len] * num_requests

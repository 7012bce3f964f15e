"""`nanoqwen bench`'s flags, and the checks of their values that need no model."""

from __future__ import annotations

import argparse

from nanoqwen.bench.workloads import PRESET_HELP, preset
from nanoqwen.errors import InvalidInputError
from nanoqwen.model.shapes import SHAPES
from nanoqwen.runtime.config_flags import add_engine_flags
from nanoqwen.runtime.device_choice import resolve_device


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(
        p.add_argument_group("model and engine"),
        defaults={
            "device": "cuda",
            "dtype": "bfloat16",
            "max_num_batched_tokens": 16384,
            "gpu_memory_utilization": None,
        },
        helps={
            "model": "checkpoint dir, .gguf file or hub id (default: random weights of --shape)",
            "gpu_memory_utilization": "fraction of GPU memory (default: 0.9, or 0.45 with "
            "--compare hf)",
        },
    )
    p.add_argument("--shape", choices=SHAPES, default="0.5B", help="random-weight Qwen2.5 shape")
    p.add_argument(
        "--mode",
        choices=("latency", "throughput", "all", "long"),
        default="all",
        help="which benchmark to run (all: latency and throughput; long: the long-context "
        "benchmark, run on its own)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default="1,8,32,128",
        help="latency mode, comma-separated",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="latency mode prompt tokens")
    p.add_argument("--new-tokens", type=int, default=256, help="latency mode new tokens")
    p.add_argument("--num-requests", type=int, default=256, help="throughput mode requests")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and output lengths")
    p.add_argument("--workload", choices=("random", "prefix"), default="random",
                   help="throughput mode: random prompts and outputs in [100, 1024], or "
                   "prompts that share one of --num-prefixes prefixes")  # fmt: skip
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix workload: shared prefixes")
    p.add_argument("--prefix-len", type=int, default=2048, help="prefix workload: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="prefix workload: own tokens")
    p.add_argument("--output-len", type=int, default=256, help="prefix workload: new tokens")
    p.add_argument(
        "--compare",
        choices=("hf",),
        help="also run HF transformers on the same weights (default: no)",
    )
    p.add_argument(
        "--hf-num-requests",
        type=int,
        default=None,
        help="throughput requests given to HF (default: all of --num-requests)",
    )
    p.add_argument("--long-prompt-len", type=int, default=32768,
                   help="long mode: tokens of the long prompt")  # fmt: skip
    p.add_argument("--streams", type=int, default=64,
                   help="long mode: streams decoding when the long prompt arrives")  # fmt: skip
    p.add_argument("--long-new-tokens", type=int, default=128,
                   help="long mode: tokens decoded after the long prompt, alone")  # fmt: skip
    p.add_argument("--json", dest="json_path",
                   help="write all results to this JSON file (default: none)")  # fmt: skip
    g = p.add_argument_group("sampling")
    g.add_argument("--sampling", default="greedy,cli",
                   help="latency mode: comma-separated presets, each a row per batch size: "
                   + ", ".join(f"{k} ({v})" for k, v in PRESET_HELP.items()))  # fmt: skip
    g.add_argument("--throughput-sampling", default="t0.6",
                   help="throughput mode preset (t0.6 is nano-vllm's workload)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=1.0, help="the custom preset")
    g.add_argument("--top-p", type=float, default=1.0, help="the custom preset")
    g.add_argument("--top-k", type=int, default=-1, help="the custom preset")
    g.add_argument("--min-p", type=float, default=0.0, help="the custom preset")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="the custom preset")
    g.add_argument("--logprobs", type=int, default=None, help="the custom preset")


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid batch sizes {text!r}: allowed comma-separated integers >= 1"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"invalid batch sizes {text!r}: allowed integers >= 1")
    return sizes


def check_args(args: argparse.Namespace) -> None:
    """Every value that needs no model, checked before the model loads."""
    for flag, value, minimum in (
        ("--prompt-len", args.prompt_len, 1),
        ("--new-tokens", args.new_tokens, 2),  # a decode step after the first token
        ("--num-requests", args.num_requests, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
        ("--num-prefixes", args.num_prefixes, 1),
        ("--prefix-len", args.prefix_len, 0),
        ("--suffix-len", args.suffix_len, 1),
        ("--output-len", args.output_len, 1),
        ("--long-prompt-len", args.long_prompt_len, 1),
        ("--streams", args.streams, 1),
        ("--long-new-tokens", args.long_new_tokens, 2),
    ):
        if value < minimum:
            raise InvalidInputError(f"{flag} {value} is out of range: allowed >= {minimum}")
    if args.hf_num_requests is not None and args.hf_num_requests < 1:
        raise InvalidInputError(
            f"--hf-num-requests {args.hf_num_requests} is out of range: allowed >= 1"
        )
    if args.compare and args.tensor_parallel_size > 1:
        raise InvalidInputError("--compare hf needs --tensor-parallel-size 1")
    if args.hf_num_requests is not None and args.compare is None:
        raise InvalidInputError("--hf-num-requests is unused without --compare hf")
    util = args.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise InvalidInputError(f"--gpu-memory-utilization {util} is out of range: allowed (0, 1]")
    if args.mode in ("latency", "all") and max(args.batch_sizes) > args.max_num_seqs:
        raise InvalidInputError(
            f"--batch-sizes {max(args.batch_sizes)} is more than --max-num-seqs "
            f"{args.max_num_seqs}: allowed batch sizes up to --max-num-seqs"
        )
    if args.mode == "long" and args.streams + 1 > args.max_num_seqs:
        raise InvalidInputError(
            f"--streams {args.streams} needs --max-num-seqs {args.streams + 1} or more: the "
            "streams and the long prompt run together"
        )
    for name in args.sampling.split(",") + [args.throughput_sampling]:
        preset(name, args)
    resolve_device(args.device)

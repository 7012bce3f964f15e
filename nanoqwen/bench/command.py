"""`nanoqwen bench`: runs the measurements (runs.py) that the flags (args.py) ask for, in
order, and prints their tables (report.py)."""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from nanoqwen.bench.args import check_args
from nanoqwen.bench.long_context import long_context_run
from nanoqwen.bench.report import (
    LONG_CONTEXT_COLUMNS,
    THROUGHPUT_COLUMNS,
    latency_columns,
    print_table,
)
from nanoqwen.bench.runs import (
    copy_ceiling_gbps,
    latency_run,
    throughput_run,
    weight_bytes,
)
from nanoqwen.bench.workloads import prefix_workload, preset, throughput_workload
from nanoqwen.runtime.config_flags import engine_config
from nanoqwen.runtime.engine import LLM


def _engine(args: argparse.Namespace) -> LLM:
    util = args.gpu_memory_utilization or (0.45 if args.compare else 0.9)
    shape = None if args.model else args.shape
    return LLM(config=engine_config(args, random_shape=shape, gpu_memory_utilization=util))


def _setup(args: argparse.Namespace, llm: LLM) -> dict:
    """What was measured, as printed first and written to --json."""
    return {
        "model": args.model or f"random Qwen2.5-{args.shape} shape",
        "dtype": str(llm.runner.model.norm.weight.dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "device": torch.cuda.get_device_name() if llm.runner.device.type == "cuda" else "cpu",
        "attention_backend": llm.runner.model.layers[0].self_attn.backend.name,
        "block_size": args.block_size,
        "cuda_graphs": llm.runner.graphs is not None,
        "num_kv_blocks": llm.scheduler.blocks.num_blocks,
        "prefix_caching": args.enable_prefix_caching,
        "preemption_mode": args.preemption_mode,
        "swap_space_gib": args.swap_space,
        "tensor_parallel_size": args.tensor_parallel_size,
        "weight_gb": weight_bytes(llm) / 1e9,
    }


def _latency(args, llm: LLM, setup: dict, hf, rng: random.Random, results: dict) -> None:
    from nanoqwen.bench.hf import hf_latency

    presets = args.sampling.split(",")
    for name in presets:
        latency_run(llm, 1, 16, 8, rng, preset(name, args))  # warm-up
    rows = []
    for bs in args.batch_sizes:
        first = None
        for name in presets:
            row = {"sampling": name}
            row |= latency_run(llm, bs, args.prompt_len, args.new_tokens, rng, preset(name, args))
            first = first or row
            row["x_first"] = row["decode_tok_s"] / first["decode_tok_s"]
            if hf is not None and name == presets[0]:
                row["hf_tok_s"] = hf_latency(hf, bs, args.prompt_len, args.new_tokens, rng)
                row["x_hf"] = row["e2e_tok_s"] / row["hf_tok_s"]
            rows.append(row)
    results["latency"] = rows
    print_table(
        f"latency: {setup['model']}, {setup['dtype']}, quantization {args.quantization}, "
        f"{setup['attention_backend']}, graphs={setup['cuda_graphs']}",
        rows,
        latency_columns(presets[0]),
    )
    ceiling = copy_ceiling_gbps(llm.runner.device)
    results["copy_ceiling_gb_s"] = ceiling
    print(f"(weight-read ceiling: ~{ceiling:,.0f} GB/s, a copy measured on {setup['device']})")


def _throughput(args, llm: LLM, hf, results: dict) -> None:
    from nanoqwen.bench.hf import hf_throughput

    workload, title = None, "prompts and outputs uniform in [100, 1024]"
    if args.workload == "prefix":
        workload = prefix_workload(
            args.num_requests, args.seed, llm.config.vocab_size, args.num_prefixes,
            args.prefix_len, args.suffix_len, args.output_len,
        )  # fmt: skip
        title = (
            f"{args.num_prefixes} shared prefixes of {args.prefix_len} tokens, "
            f"{args.suffix_len} own tokens, {args.output_len} new"
        )
    row = throughput_run(
        llm, args.num_requests, args.seed, preset(args.throughput_sampling, args), workload
    )
    if hf is not None and workload is None:
        n = args.hf_num_requests or args.num_requests
        row["hf_output_tok_s"] = hf_throughput(
            hf, *throughput_workload(n, args.seed, llm.config.vocab_size)
        )
        row["x_hf"] = row["output_tok_s"] / row["hf_output_tok_s"]
    results["throughput"] = row
    print_table(
        f"throughput: {args.num_requests} requests, {title}, sampling {args.throughput_sampling}",
        [row],
        THROUGHPUT_COLUMNS,
    )


def _long_context(args, llm: LLM, rng: random.Random, results: dict) -> None:
    sampling = preset(args.throughput_sampling, args)
    row = long_context_run(
        llm, args.long_prompt_len, args.streams, args.long_new_tokens, rng, sampling
    )
    results["long_context"] = row
    print_table(
        f"long context: {args.long_prompt_len}-token prompt, {args.streams} streams decoding "
        f"when it arrives, --max-num-batched-tokens {args.max_num_batched_tokens}",
        [row],
        LONG_CONTEXT_COLUMNS,
    )


def run(args) -> int:
    from nanoqwen.bench.hf import hf_model_from

    check_args(args)
    llm = _engine(args)
    setup = _setup(args, llm)
    print(json.dumps(setup), file=sys.stderr)
    hf = hf_model_from(llm) if args.compare == "hf" else None
    results: dict = {"setup": setup}
    rng = random.Random(args.seed)
    if args.mode in ("latency", "all"):
        _latency(args, llm, setup, hf, rng, results)
    if args.mode in ("throughput", "all"):
        _throughput(args, llm, hf, results)
    if args.mode == "long":
        _long_context(args, llm, rng, results)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0

"""`nanoqwen bench`: decode latency and serving throughput, optionally side by side with HF."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from tqdm import tqdm

from nanoqwen.errors import InvalidInputError
from nanoqwen.model.shapes import SHAPES
from nanoqwen.quant.apply import quantized_bytes
from nanoqwen.quant.scheme import QUANTIZATIONS
from nanoqwen.runtime.attention import BACKENDS
from nanoqwen.runtime.bench_workloads import (
    PRESET_HELP,
    prefix_workload,
    preset,
    throughput_workload,
)
from nanoqwen.runtime.builder import DTYPES, resolve_device
from nanoqwen.runtime.engine import LLM
from nanoqwen.runtime.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="checkpoint dir, .gguf file or hub id (default: random weights of --shape)"
    )
    p.add_argument("--shape", choices=SHAPES, default="0.5B", help="random-weight Qwen2.5 shape")
    p.add_argument(
        "--mode",
        choices=("latency", "throughput", "all"),
        default="all",
        help="which benchmark to run",
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument(
        "--dtype", choices=("auto", *DTYPES), default="bfloat16", help="activations and KV"
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="auto",
        help="weight-only quantized linear layers (auto: a GGUF stays quantized, else none)",
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
    p.add_argument("--attention-backend", choices=BACKENDS, default="auto", help="as for generate")
    p.add_argument("--block-size", type=int, default=256, help="KV cache block size (tokens)")
    p.add_argument("--workload", choices=("random", "prefix"), default="random",
                   help="throughput mode: random prompts and outputs in [100, 1024], or "
                   "prompts that share one of --num-prefixes prefixes")  # fmt: skip
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix workload: shared prefixes")
    p.add_argument("--prefix-len", type=int, default=2048, help="prefix workload: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=128, help="prefix workload: own tokens")
    p.add_argument("--output-len", type=int, default=256, help="prefix workload: new tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized to memory")
    p.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt")
    p.add_argument("--preemption-mode", choices=("swap", "recompute"), default="swap",
                   help="as for generate")  # fmt: skip
    p.add_argument("--swap-space", type=float, default=4.0, help="host KV pool, GiB; 0 = none")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens in one step")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory (default: 0.9, or 0.45 with --compare hf)",
    )
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
    if args.mode != "throughput" and max(args.batch_sizes) > args.max_num_seqs:
        raise InvalidInputError(
            f"--batch-sizes {max(args.batch_sizes)} is more than --max-num-seqs "
            f"{args.max_num_seqs}: allowed batch sizes up to --max-num-seqs"
        )
    for name in args.sampling.split(",") + [args.throughput_sampling]:
        preset(name, args)
    resolve_device(args.device)


def copy_ceiling_gbps(device: torch.device) -> float:
    """The device's memory bandwidth as a copy measures it (bytes read + written per second):
    what one decode step, which reads every weight once, cannot beat."""
    n = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        _sync_device(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync_device(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * n / statistics.median(times[1:]) / 1e9


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes(llm: LLM) -> int:
    """Bytes one decode step reads: every weight, minus the embedding table when the
    lm_head is separate (decode gathers only a few embedding rows)."""
    if quantized_bytes(llm.runner.model):
        return quantized_bytes(llm.runner.model)
    cfg = llm.config
    params = cfg.num_parameters()
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size
    return params * llm.runner.model.embed_tokens.element_size()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _sync(llm: LLM) -> None:
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize()


def latency_run(
    llm: LLM, bs: int, prompt_len: int, new_tokens: int, rng: random.Random, sampling: dict
):
    vocab = min(10000, llm.config.vocab_size)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(bs)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **sampling)
    seqs = [llm._add(p, params, detokenize=False) for p in prompts]
    _sync(llm)
    start = time.perf_counter()
    step_ms: list[float] = []
    first_token_s = None
    with tqdm(total=new_tokens - 1, desc=f"bs={bs}", leave=False, file=sys.stderr) as bar:
        while any(not s.is_finished for s in seqs):
            t0 = time.perf_counter()
            batch_was_prefill = bool(llm.scheduler.waiting)
            llm.step()
            dt = time.perf_counter() - t0
            if first_token_s is None and all(s.first_token_time for s in seqs):
                first_token_s = time.perf_counter() - start
            elif not batch_was_prefill:
                step_ms.append(dt * 1e3)
                bar.update()
    total = time.perf_counter() - start
    decode_s = sum(step_ms) / 1e3
    return {
        "batch_size": bs,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ttft_ms": first_token_s * 1e3,
        "prefill_tok_s": bs * prompt_len / first_token_s,
        "step_ms_p50": statistics.median(step_ms),
        "step_ms_p99": pct(step_ms, 99),
        "decode_tok_s": bs * len(step_ms) / decode_s,
        "e2e_tok_s": bs * new_tokens / total,
        "weight_gb_s": weight_bytes(llm) / (statistics.median(step_ms) / 1e3) / 1e9,
    }


def throughput_run(llm: LLM, num_requests: int, seed: int, sampling: dict, workload=None):
    prompts, out_lens = workload or throughput_workload(num_requests, seed, llm.config.vocab_size)
    params = [SamplingParams(ignore_eos=True, max_tokens=n, **sampling) for n in out_lens]
    llm.generate([[1] * 16], SamplingParams(max_tokens=4))  # warm-up call
    if llm.runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(llm)
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    total = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    ttft = [o.metrics["ttft_s"] * 1e3 for o in outputs]
    tpot = [
        (o.metrics["latency_s"] - o.metrics["ttft_s"]) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs
    ]
    out_tokens = sum(len(o.token_ids) for o in outputs)
    peak = torch.cuda.max_memory_allocated() if llm.runner.device.type == "cuda" else 0
    return {
        "requests": num_requests,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "total_s": total,
        "output_tok_s": out_tokens / total,
        **{f"ttft_ms_p{q}": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_ms_p{q}": pct(tpot, q) for q in (50, 90, 99)},
        "peak_gpu_mem_gib": peak / 2**30,
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "swaps": after["num_swaps"] - before["num_swaps"],
        "host_tier_hit_tokens": after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"],
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


def _print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print(f"\n{title}")
    print(" | ".join(h for h, _, _ in columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        cells = [format(row[k], f) if k in row else "-" for _, k, f in columns]
        print(" | ".join(cells))


def run(args) -> int:
    from nanoqwen.runtime.bench_hf import hf_latency, hf_model_from, hf_throughput

    check_args(args)
    util = args.gpu_memory_utilization or (0.45 if args.compare else 0.9)
    llm = LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        random_shape=None if args.model else args.shape,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=util,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
    )
    backend = llm.runner.model.layers[0].self_attn.backend.name
    setup = {
        "model": args.model or f"random Qwen2.5-{args.shape} shape",
        "dtype": str(llm.runner.model.norm.weight.dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "device": torch.cuda.get_device_name() if llm.runner.device.type == "cuda" else "cpu",
        "attention_backend": backend,
        "block_size": args.block_size,
        "cuda_graphs": llm.runner.graphs is not None,
        "num_kv_blocks": llm.scheduler.blocks.num_blocks,
        "prefix_caching": not args.no_prefix_caching,
        "preemption_mode": args.preemption_mode,
        "swap_space_gib": args.swap_space,
        "tensor_parallel_size": args.tensor_parallel_size,
        "weight_gb": weight_bytes(llm) / 1e9,
    }
    print(json.dumps(setup), file=sys.stderr)
    hf = hf_model_from(llm) if args.compare == "hf" else None
    results: dict = {"setup": setup}
    rng = random.Random(args.seed)
    if args.mode in ("latency", "all"):
        presets = args.sampling.split(",")
        for name in presets:
            latency_run(llm, 1, 16, 8, rng, preset(name, args))  # warm-up
        rows = []
        for bs in args.batch_sizes:
            first = None
            for name in presets:
                row = {"sampling": name}
                row |= latency_run(
                    llm, bs, args.prompt_len, args.new_tokens, rng, preset(name, args)
                )
                first = first or row
                row["x_first"] = row["decode_tok_s"] / first["decode_tok_s"]
                if hf is not None and name == presets[0]:
                    row["hf_tok_s"] = hf_latency(hf, bs, args.prompt_len, args.new_tokens, rng)
                    row["x_hf"] = row["e2e_tok_s"] / row["hf_tok_s"]
                rows.append(row)
        results["latency"] = rows
        _print_table(
            f"latency: {setup['model']}, {setup['dtype']}, quantization {args.quantization}, "
            f"{backend}, graphs={setup['cuda_graphs']}",
            rows,
            [
                ("bs", "batch_size", "d"), ("sampling", "sampling", "s"),
                (f"x {presets[0]}", "x_first", ".3f"), ("TTFT ms", "ttft_ms", ".1f"),
                ("prefill tok/s", "prefill_tok_s", ",.0f"),
                ("step ms p50", "step_ms_p50", ".3f"), ("p99", "step_ms_p99", ".3f"),
                ("decode tok/s", "decode_tok_s", ",.0f"), ("e2e tok/s", "e2e_tok_s", ",.0f"),
                ("weights GB/s", "weight_gb_s", ",.0f"), ("HF tok/s", "hf_tok_s", ",.1f"),
                ("x HF", "x_hf", ".1f"),
            ],
        )  # fmt: skip
        ceiling = copy_ceiling_gbps(llm.runner.device)
        results["copy_ceiling_gb_s"] = ceiling
        print(f"(weight-read ceiling: ~{ceiling:,.0f} GB/s, a copy measured on {setup['device']})")
    if args.mode in ("throughput", "all"):
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
        _print_table(
            f"throughput: {args.num_requests} requests, {title}, sampling "
            f"{args.throughput_sampling}",
            [row],
            [
                ("output tok/s", "output_tok_s", ",.0f"), ("total s", "total_s", ".2f"),
                ("TTFT p50/p90/p99 ms", "ttft_ms_p50", ".0f"), ("", "ttft_ms_p90", ".0f"),
                ("", "ttft_ms_p99", ".0f"), ("TPOT p50/p90/p99 ms", "tpot_ms_p50", ".2f"),
                ("", "tpot_ms_p90", ".2f"), ("", "tpot_ms_p99", ".2f"),
                ("peak GiB", "peak_gpu_mem_gib", ".1f"), ("preemptions", "preemptions", "d"),
                ("swaps", "swaps", "d"), ("host-tier hit tokens", "host_tier_hit_tokens", "d"),
                ("prefix hit rate", "prefix_cache_hit_rate", ".1%"),
                ("HF tok/s", "hf_output_tok_s", ",.0f"),
                ("x HF", "x_hf", ".1f"),
            ],
        )  # fmt: skip
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m nanoqwen.runtime.bench")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
